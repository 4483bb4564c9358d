"""One training step of the configured run traced on fake tensors (torch's FakeTensorMode:
shapes and dtypes, no memory), its live tensor memory tracked by torch's MemTracker or, under
FSDP, FSDPMemTracker (torch.distributed._tools), and its FLOPs counted by FlopCounterMode.
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

# the trackers' categories (their _MemRefType / _FSDPRefType values) -> the plan's names;
# "collective": FSDP's all-gathered (unsharded) parameters and gradients and its collectives'
# buffers
KINDS = {"Parameter": "params", "Sharded Param": "params", "Buffer": "buffers",
         "Gradient": "grads", "Sharded Grad": "grads", "Activation": "activations",
         "Temp": "temporaries", "Optstate": "optimizer", "OptState": "optimizer",
         "Other": "other", "Inputs": "other", "Unsharded Param": "collective", "Unsharded Grad": "collective",
         "All Gather": "collective", "Reduce Scatter": "collective"}
PLANNED = ("none", "fsdp", "hsdp")  # parallel strategies a plan traces (DDP's reducer and
# expert parallelism's all-to-all do not run on fake tensors yet)


@dataclass
class StepMemory:
    peak_bytes: int  # live tensor memory at the step's peak (one device)
    at_peak: dict = field(default_factory=dict)  # KINDS' names -> bytes at the peak
    flops: float | None = None  # the step's FLOPs (fake traces only)
    comm: dict = field(default_factory=dict)  # collective -> {"calls", "bytes"} a step


class Collectives(TorchDispatchMode):
    """Each c10d collective a step calls (FSDP's all-gathers and reduce-scatters, the
    clip's all-reduce), and its message: the largest tensor it takes (an all-gather's
    output, a reduce-scatter's input, an all-reduce's tensors)."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            from torch.utils._pytree import tree_leaves

            name = func.overloadpacket.__name__.strip("_").replace("allgather", "all_gather") \
                .replace("allreduce", "all_reduce").removesuffix("_base")
            sizes = [t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                     if isinstance(t, torch.Tensor)]
            got = self.seen.setdefault(name, {"calls": 0, "bytes": 0})
            got["calls"] += 1
            got["bytes"] += sum(sizes) if name == "all_reduce" else max(sizes, default=0)
        return func(*args, **(kwargs or {}))


class BalancedCounts(TorchDispatchMode):
    """Answers the dispatch's data-dependent reads on fake tensors, which hold no values, as
    balanced routing (model.routing=balanced) makes them. A sum's read (the rows a token
    capacity kept) is `kept`; any other read is a count of tokens per expert (.tolist(),
    .max()), read in expert order: expert e gets kept // E, one more for the first
    kept % E."""

    def __init__(self, kept: int, experts: int):
        super().__init__()
        self.kept, self.experts, self.reads = kept, experts, 0
        self.sums = WeakIdKeyDictionary()  # (by identity: == on a fake tensor has no value)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0] in self.sums:
                return self.kept
            e = self.reads % self.experts
            self.reads += 1
            return self.kept // self.experts + (e < self.kept % self.experts)
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.sum:
            self.sums[out] = True
        return out


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


class _PeakOnly:
    """A tracker that keeps the step's peak only: MemTracker updates every module's own peak
    at every op (a loop over the modules: mixtral_8x7b's plan spent 40% of its time there),
    which a plan does not read. Where torch's tracker lacks these internals, its own."""

    def _update_peak_stats(self, peak_state) -> None:
        if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            return super()._update_peak_stats(peak_state)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


def _tracker(cfg, applied, optimizer, tokens):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if cfg.parallel.name in ("fsdp", "hsdp"):
        tracker = type("Tracker", (_PeakOnly, FSDPMemTracker), {})(applied.model, optimizer)
        tracker.track_inputs((tokens,))
    else:
        tracker = type("Tracker", (_PeakOnly, MemTracker), {})()
        tracker.track_external(applied.model, optimizer, tokens)
    return tracker


def _steps(cfg, built, tracker, steps: int = 2) -> None:
    """Full steps (forward, backward, optimizer) as the bench loop runs them, inside
    whatever modes are active: the second holds the optimizer's state, the steady state's
    peak."""
    from ..bench.loop import micro_step, optimizer_step

    applied, optimizer, scheduler, tokens = built
    params = [p for p in applied.model.parameters() if p.requires_grad]
    for _ in range(steps):
        for _ in range(cfg.train.grad_accum_steps):
            micro_step(applied.model, tokens[:, :-1], tokens[:, 1:], applied.autocast,
                       applied.scaler, cfg.train.grad_accum_steps)
            if tracker is not None:
                tracker.reset_mod_stats()  # (its per-module figures: one pass's)
        optimizer_step(cfg, applied, optimizer, scheduler, applied.scaler, params, None)


def _tracked(cfg, built, device: torch.device, modes=()) -> StepMemory:
    tracker = _tracker(cfg, *built[:2], built[3])
    with tracker, contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _steps(cfg, built, tracker)
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
    if cfg.model.num_experts:
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

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with mock.patch.object(device_mesh, "init_device_mesh", init_device_mesh):
            yield
    finally:
        dist.destroy_process_group()


def trace_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The plan of one step of `cfg` on one device (rank 0 of hardware.devices under FSDP),
    traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

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
    with mock.patch.object(Transformer, "reset_parameters", _no_init), _fake_world(world):
        with FakeTensorMode():
            got = _tracked(cfg, _build(cfg, b, FAKE_DEVICE, world), FAKE_DEVICE,
                           [BalancedCounts(rows, experts)])
        # (FLOPs in a pass of their own: FlopCounterMode's module hooks keep tensors alive)
        counter, comm = FlopCounterMode(display=False), Collectives()
        with FakeTensorMode():
            built = _build(cfg, b, FAKE_DEVICE, world)
            with counter, comm, BalancedCounts(rows, experts):
                _steps(cfg, built, None, steps=1)
    got.flops, got.comm = float(counter.get_total_flops()), comm.seen
    return got


def _no_init(self) -> None:
    """(fake weights have no values to initialize)"""


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
    comm = Collectives()
    got = _tracked(cfg, built, device, [comm])
    got.comm = {k: {n: v // 2 for n, v in c.items()} for k, c in comm.seen.items()}  # (a
    return got  # step's: two ran)
