"""One training step of the configured run traced on fake tensors (torch's FakeTensorMode:
shapes and dtypes, no memory), its live tensor memory tracked by torch's MemTracker or, under
FSDP, FSDPMemTracker (torch.distributed._tools), its ops' FLOPs (torch's flop_registry) and bytes.
The model, the optimizations, the optimizer and the step are the real code's, so any
architecture is planned without a formula of its own; FSDP's sharding is its own on a fake
process group of the configured world size (one rank traced). `measure_step` runs the same
steps on real tensors under the same tracker: what the plan is checked against on CPU."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .tracker import step_tracker

# the trackers' categories (their _MemRefType / _FSDPRefType values) -> the plan's names;
# "collective": FSDP's all-gathered (unsharded) parameters and gradients and its collectives'
# buffers
KINDS = {"Parameter": "params", "Sharded Param": "params", "Buffer": "buffers",
         "Gradient": "grads", "Sharded Grad": "grads", "Activation": "activations",
         "Temp": "temporaries", "Optstate": "optimizer", "OptState": "optimizer",
         "Other": "other", "Inputs": "other", "Unsharded Param": "collective", "Unsharded Grad": "collective",
         "All Gather": "collective", "Reduce Scatter": "collective"}
def unplannable(cfg) -> tuple[str, str] | None:
    """(key, why) where the trace cannot follow the configuration, else None."""
    if cfg.precision.name == "fp8":
        return "precision", "task=plan does not trace torchao's float8 training yet: fp32, " \
                            "tf32, fp16 or bf16"
    if cfg.parallel.name == "ddp" and cfg.parallel.comm_hook == "powersgd":
        return "parallel.comm_hook", "task=plan traces DDP's comm_hook none|fp16|bf16, not " \
                                     "powersgd (its low-rank factors read values)"
    return None


@dataclass
class StepMemory:
    peak_bytes: int  # live tensor memory at the step's peak (one device)
    at_peak: dict = field(default_factory=dict)  # KINDS' names -> bytes at the peak
    flops: float | None = None  # the step's FLOPs
    comm: dict = field(default_factory=dict)  # collective -> {"calls", "bytes"} a step
    ops: object = None  # the step's StepOps (its ops and collectives, for the roofline)


_NO_DATA = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
            torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
            torch.ops.aten._local_scalar_dense, torch.ops.aten.lift_fresh, torch.ops.aten.set_,
            torch.ops.aten.resize_}  # (ops that move no tensor data)


class StepOps(TorchDispatchMode):
    """The ops of the steps run while `on`: each compute op's FLOPs (torch's flop_registry,
    as FlopCounterMode counts them), bytes read and written (its tensors', views none) and
    dtype, for a roofline; each c10d collective's message (the largest tensor it takes: an
    all-gather's output, a reduce-scatter's input; an all-reduce's tensors) and the global
    ranks of its group."""

    def __init__(self):
        super().__init__()
        self.on = False  # (_steps turns it on)
        self.ops: list[tuple[float, int, torch.dtype | None]] = []
        self.calls: list[tuple[str, int, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        packet = func.overloadpacket
        out = func(*args, **kwargs)
        if not self.on or func.is_view or func.namespace == "prim" or packet in _NO_DATA:
            return out
        name = packet.__name__.strip("_")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            if name not in ("wait_tensor", "wrap_tensor_autograd"):
                name = name.replace("allgather", "all_gather").replace("allreduce", "all_reduce") \
                    .replace("alltoall", "all_to_all").removesuffix("_base").removesuffix("_single")
                sizes = [t.numel() * t.element_size() for t in tensors]
                self.calls.append((name, sum(sizes) if name == "all_reduce" else
                                   max(sizes, default=0), _group_ranks(args, kwargs)))
            return out
        moved = sum(t.numel() * t.element_size() for t in tensors + [
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry \
            else 0
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
        self.ops.append((float(flops), moved, dtype))
        return out

    @property
    def flops(self) -> float:
        return sum(f for f, _, _ in self.ops)

    @property
    def comm(self) -> dict:
        """collective -> {"calls", "bytes"}."""
        seen = {}
        for name, nbytes, _ in self.calls:
            got = seen.setdefault(name, {"calls": 0, "bytes": 0})
            got["calls"] += 1
            got["bytes"] += nbytes
        return seen


def _group(a):
    """A c10d op's process group argument (boxed as a ScriptObject) or a functional one's
    group name as a ProcessGroup; None for any other argument."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(a, dist.ProcessGroup):
        return a
    if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
        return dist.ProcessGroup.unbox(a)
    if isinstance(a, str):
        with contextlib.suppress(Exception):
            return _resolve_process_group(a)
    return None


def _group_ranks(args, kwargs) -> tuple:
    """The global ranks of a collective's group."""
    import torch.distributed as dist

    for a in [*args, *kwargs.values()]:
        if (group := _group(a)) is not None:
            return tuple(dist.get_process_group_ranks(group))
    return ()


class BalancedCounts(TorchDispatchMode):
    """Answers the dispatch's data-dependent reads on fake tensors, which hold no values, as
    balanced routing (model.routing=balanced) makes them. A call's counts of tokens per
    expert (.tolist(), .max()) are read in expert order: expert e gets kept // E, one more
    for the first kept % E. A sum of counts splits `kept` evenly over its elements (the
    rows a token capacity kept: one sum, all of it; expert parallelism's rows per rank and
    per local expert: kept / ranks and kept / local experts)."""

    def __init__(self, kept: int, experts: int):
        super().__init__()
        self.kept, self.experts, self.reads = kept, experts, 0
        self.sums = WeakIdKeyDictionary()  # a sum's output (by identity: == on a fake
        # tensor has no value) -> [its elements, its elements read so far]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if (base := self._sum_of(args[0])) is not None:
                got = self.sums[base]
                got[1] += 1
                return self._share(got[1] - 1, got[0])
            self.reads += 1
            return self._share((self.reads - 1) % self.experts, self.experts)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.sum:
            self.sums[out] = [max(out.numel(), 1), 0]
        return out

    def _share(self, i: int, k: int) -> int:
        return self.kept // k + (i % k < self.kept % k)

    def _sum_of(self, t):
        """The sum whose element `t` is (tolist reads a view of each element)."""
        while t is not None:
            if t in self.sums:
                return t
            t = t._base if t._is_view() else None
        return None


class Shadows(BalancedCounts):
    """Real values beside the fake integer tensors (and float scalars) whose values follow
    from shapes alone: the routing's choices (model.routing=balanced or skewed: by
    position) and what is computed from them only (counts per expert, sorts, sums, a token
    capacity's drops by position; expert parallelism's exchange of counts, every rank
    routing as rank 0 does), an optimizer's step count. A read of one is its value; a read
    of any other integer (a capacity's drops by routing weight) is BalancedCounts', of any
    other float 0 (a flag: GradScaler's found_inf, no inf)."""

    LIMIT = 1 << 22  # elements: a shadow is a real tensor

    def __init__(self, kept: int, experts: int):
        super().__init__(kept, experts)
        self.real = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            from torch.utils._python_dispatch import _disable_current_modes

            if args[0] in self.real:
                with _disable_current_modes():
                    return self.real[args[0]].item()
            if args[0].is_floating_point():  # (a flag: GradScaler's found_inf, none)
                return 0.0
        out = super().__torch_dispatch__(func, types, args, kwargs)
        try:
            self._follow(func, args, kwargs, out)
        except Exception:  # noqa: BLE001 - a value not followed is read as balanced
            for t in _written(func, args):
                self.real.pop(t, None)
        return out

    def _follow(self, func, args, kwargs, out) -> None:
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_leaves, tree_map_only

        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func.namespace == "c10d":
            return self._exchange(func, args)
        if func.overloadpacket in LIFTS and ins[0].numel() <= self.LIMIT:  # a real tensor
            with _disable_current_modes():  # made fake (torch.tensor(0.0)): its value
                self.real[out] = ins[0].clone()
            return
        if not outs or any(t.is_complex() or t.numel() > (1 if t.is_floating_point() else
                                                          self.LIMIT) for t in outs) or torch.Tag.nondeterministic_seeded in func.tags \
                or func.overloadpacket in _NO_DATA or any(t not in self.real for t in ins):
            for t in _written(func, args):
                self.real.pop(t, None)
            return
        real = tree_map_only(torch.Tensor, lambda t: self.real[t], (args, kwargs))
        with _disable_current_modes():
            got = func(*real[0], **real[1])
        for fake, value in zip(outs, [t for t in tree_leaves(got) if isinstance(t, torch.Tensor)]):
            self.real[fake] = value

    def _exchange(self, func, args) -> None:
        """A collective on the counts: an all-to-all hands rank 0 each rank's chunk for
        rank 0 (every rank's own counts are rank 0's); any other leaves its tensors
        without values."""
        from torch.utils._python_dispatch import _disable_current_modes

        if func.overloadpacket.__name__ == "alltoall_base_" and args[1] in self.real:
            out, src, group, _, in_splits = args[:5]
            n = _group(group).size()
            chunk = in_splits[0] if in_splits else src.shape[0] // n
            with _disable_current_modes():
                self.real[out] = self.real[src][:chunk].repeat(n, *[1] * (src.dim() - 1))
            return
        for t in _written(func, args):
            self.real.pop(t, None)


LIFTS = {torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy}


def _written(func, args) -> list:
    """The tensors an op writes in place (its schema's mutable arguments)."""
    return [a for a, s in zip(args, func._schema.arguments) if isinstance(a, torch.Tensor)
            and s.alias_info is not None and s.alias_info.is_write]


def _build(cfg, micro_batch: int, device: torch.device, world: int):
    """The model as a run builds and wraps it, its optimizer, and a micro-batch."""
    from ..model import build_model
    from ..optim import build_optimizer
    from ..optimizations import apply

    with torch.device(device):
        model = build_model(cfg.model)
    applied = apply(model, cfg, device, world)
    optimizer, scheduler, _ = build_optimizer(applied.model, cfg, device)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.train.seq_len + 1),
                           device=device)
    return applied, optimizer, scheduler, tokens


def _steps(cfg, built, tracker, last=None) -> None:
    """The optimizer's state made as a first step makes it (its update on zero gradients,
    as big as a step's), then a full step (forward, backward, optimizer) as the bench loop
    runs it, inside whatever modes are active: the steady state's peak, in one step's
    time, not two. last: a StepOps that records the full step only."""
    from ..bench.loop import micro_step, optimizer_step

    applied, optimizer, scheduler, tokens = built
    params = [p for p in applied.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if last is not None:
        last.on = True
    for sync in applied.micro_contexts(cfg.train.grad_accum_steps):
        with sync:
            micro_step(applied.model, tokens[:, :-1], tokens[:, 1:], applied.autocast,
                       applied.scaler, cfg.train.grad_accum_steps)
        if tracker is not None:
            tracker.reset_mod_stats()  # (its per-module figures: one pass's)
    optimizer_step(cfg, applied, optimizer, scheduler, applied.scaler, params, None)


def _tracked(cfg, built, device: torch.device, modes=(), last=None) -> StepMemory:
    tracker = step_tracker(cfg, *built[:2], built[3])
    with tracker, contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _steps(cfg, built, tracker, last=last)
    snap = tracker.get_tracker_snapshot("peak").get(device, {})
    at_peak = {}
    for k, v in snap.items():
        name = KINDS.get(str(getattr(k, "value", k)))
        if name:
            at_peak[name] = at_peak.get(name, 0) + int(v)
    return StepMemory(int(snap.get("Total", 0)), at_peak)


FAKE_DEVICE = torch.device("cpu")  # where fake tensors "live": any profile is traced here
# (CPU kernels' shapes: SDPA's flash kernel saves what CUDA's does, autocast casts the same
# matmuls), so a plan needs no GPU


def _eager(cfg, device: torch.device | None = None):
    """A copy of cfg for a traced or tracked step (on `device` where given): compile off
    (dynamo does not trace under an outer fake mode, and the tracker follows eager ops), the
    model's dispatch resolved for its device."""
    from ..bench.runner import resolve_model_dispatch

    cfg = copy.deepcopy(cfg)
    cfg.train.compile = "off"
    if device is not None:
        cfg.hardware.device = device.type
    resolve_model_dispatch(cfg, torch.device(cfg.hardware.device))
    return cfg


def planned_config(cfg):
    """The traced step's config: balanced routing, no compile (dynamo does not trace under
    an outer fake mode; the plan is of the eager step), the trace's device, the model's
    dispatch resolved."""
    cfg = _eager(cfg, FAKE_DEVICE)
    if cfg.model.num_experts and cfg.model.routing != "skewed":
        cfg.model.routing = "balanced"
    if cfg.parallel.name != "none":  # (AdamW's fused and foreach kernels on fake DTensors
        cfg.optim.impl = "for-loop"  # held 4.5x the optimizer's state at the step, which
        # real ones do not: the loop's temporaries are one parameter's at a time)
    if cfg.model.dispatch == "grouped" and cfg.precision.autocast_dtype != "bf16":
        cfg.model.dispatch = "loop"  # (grouped_mm's shape function takes bf16 only; the
        # loop's memory is the grouped kernel's: the same rows, the same saved inputs)
    return cfg


@contextlib.contextmanager
def _fake_world(world: int):
    """A fake process group of `world` ranks (torch's "fake" backend: collectives that move
    nothing), for this process's trace of rank 0; device meshes made outside fake mode."""
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if world == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a plan of several ranks makes its own (fake) process group: "
                           "run it outside one")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    real = device_mesh.init_device_mesh

    def init_device_mesh(*args, **kwargs):  # (a mesh's ranks are a real tensor)
        with unset_fake_temporarily():
            return real(*args, **kwargs)

    import torch.nn.parallel.distributed as ddp

    from ..optimizations import parallel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:  # (DDP's check that the ranks' shapes agree reads values: one rank traced)
        with mock.patch.object(device_mesh, "init_device_mesh", init_device_mesh), \
                mock.patch.object(ddp, "_verify_param_shape_across_processes", _no_init), \
                mock.patch.object(parallel, "register_comm_hook", _fake_comm_hook), \
                _python_reducer():
            yield
    finally:
        dist.destroy_process_group()


def trace_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The plan of one step of `cfg` on one device (rank 0 of hardware.devices under FSDP),
    traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..model.capacity import capacity
    from ..model.transformer import Transformer

    b = micro_batch or cfg.train.micro_batch_size
    cfg = planned_config(cfg)
    world = cfg.hardware.devices  # (1 under parallel=none: validate sees to it)
    m = cfg.model
    rows = b * cfg.train.seq_len * max(m.top_k, 1)  # a MoE call's (token, choice) pairs
    experts = m.num_experts or 1
    if m.num_experts and m.capacity_factor:  # (balanced: every expert at its capacity or
        rows = min(rows, experts * capacity(b * cfg.train.seq_len, m.top_k, experts,
                                            m.capacity_factor))  # below it)
    ops = StepOps()
    with mock.patch.object(Transformer, "reset_parameters", _no_init), _fake_world(world):
        with FakeTensorMode():
            built = _build(cfg, b, FAKE_DEVICE, world)
            got = _tracked(cfg, built, FAKE_DEVICE, [Shadows(rows, experts), ops], ops)
            got.flops, got.comm, got.ops = ops.flops, ops.comm, ops
            if cfg.parallel.name == "ddp":
                _ddp_buckets(got, built[0].model)
    return got


def _ddp_buckets(got: StepMemory, ddp) -> None:
    """What _python_reducer leaves out of DDP: its C++ reducer's buckets, which hold every
    gradient (or, with gradient_as_bucket_view, are them) through the step, and its
    all-reduces, one a bucket (torch's own assignment of the parameters, as rebuilt after
    the first step: bucket_cap_mb each), not one a gradient."""
    import torch.distributed as dist

    params = [p for p in ddp.parameters() if p.requires_grad]
    held = sum(p.numel() * p.element_size() for p in params)
    got.peak_bytes += held
    got.at_peak["grads"] = got.at_peak.get("grads", 0) + held
    buckets, _ = dist._compute_bucket_assignment_by_size(params[::-1], [ddp.bucket_bytes_cap])
    if reduce := got.comm.get("all_reduce"):  # (per synced backward: a parameter's call ->
        reduce["calls"] = reduce["calls"] * len(buckets) // len(params)  # its bucket's)


def _no_init(*_) -> None:
    """(fake weights have no values to initialize, nor ranks to compare)"""


def _fake_comm_hook(model, cfg) -> None:
    """parallel.comm_hook on the fake group (_python_reducer's hooks take a gradient)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.parallel.comm_hook)
    if dtype is not None:
        model.register_comm_hook(dtype, _fake_reduce)


def _fake_reduce(state, bucket):
    """parallel.comm_hook=fp16|bf16 under the python reducer: the gradient cast, reduced,
    cast back (torch's fp16/bf16_compress_hook on one parameter's gradient)."""
    import torch.distributed as dist

    grad = bucket[0]  # (grad, param)
    low = grad.to(state).div_(dist.get_world_size())
    dist.all_reduce(low)
    grad.copy_(low)


@contextlib.contextmanager
def _python_reducer():
    """DDP's python reducer (torch's, for compiled autograd): each gradient all-reduced by
    a post-accumulate hook on the same process group. DDP's C++ reducer reads its buckets'
    values as it rebuilds them, which fake tensors lack; the gradients, their sum and the
    bytes reduced are the same (the calls: one a parameter, not one a bucket). The global
    settings DDP changes for it are put back."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor
    from torch._dynamo import trace_rules

    inline = trace_rules.LEGACY_MOD_INLINELIST
    had = "torch.nn.parallel.distributed" in inline
    try:
        with dynamo.patch(optimize_ddp="python_reducer"), inductor.patch(
                _fuse_ddp_communication=inductor._fuse_ddp_communication,
                _fuse_ddp_bucket_size=inductor._fuse_ddp_bucket_size):
            yield
    finally:
        if not had:
            inline.discard("torch.nn.parallel.distributed")
            trace_rules.get_legacy_mod_inlinelist.cache_clear()


def measure_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The same steps on real tensors (the configured routing; under a parallel strategy,
    in the ranks' process group), their live tensor memory tracked the same way: the plan's
    check on a machine that can run it."""
    import torch.distributed as dist

    cfg = _eager(cfg)
    device = torch.device(cfg.hardware.device)
    torch.manual_seed(cfg.train.seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    built = _build(cfg, micro_batch or cfg.train.micro_batch_size, device, world)
    ops = StepOps()
    got = _tracked(cfg, built, device, [ops], ops)
    got.flops, got.comm, got.ops = ops.flops, ops.comm, ops
    return got
