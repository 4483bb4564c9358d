"""Traces one training step of the configured run on fake tensors, for its plan.

torch's FakeTensorMode keeps shapes and dtypes but no memory. The step's live tensor memory
is tracked by torch's MemTracker (plan/tracker.py), its ops and collectives are recorded
(plan/ops.py) and the routing's reads answered (plan/values.py). The model, the
optimizations, the optimizer and the step are the real code's, so any architecture is
planned without a formula of its own. A parallel strategy shards it as it would on a fake
process group of the configured world size, with rank 0 traced (plan/fake_world.py).
`measure_step` runs the same steps on real tensors under the same tracker: on CPU, the plan
is checked against it."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from unittest import mock

import torch

from ..config import pp_size, seq_part
from ..screen import phase
from .fake_world import ddp_buckets, ddp_calls, fake_world
from .ops import StepOps
from .tracker import step_tracker
from .values import Shadows

# the trackers' categories (their _MemRefType / _FSDPRefType values) -> the plan's names;
# "collective": FSDP's all-gathered (unsharded) parameters and gradients and its collectives'
# buffers
KINDS = {"Parameter": "params", "Sharded Param": "params", "Buffer": "buffers",
         "Gradient": "grads", "Sharded Grad": "grads", "Activation": "activations",
         "Temp": "temporaries", "Optstate": "optimizer", "OptState": "optimizer",
         "Other": "other", "Inputs": "other", "Unsharded Param": "collective",
         "Unsharded Grad": "collective", "All Gather": "collective",
         "Reduce Scatter": "collective"}


def unplannable(cfg) -> tuple[str, str] | None:
    """The key and why, where the trace cannot follow the configuration; else None."""
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
    # each phase's own peak, (bytes, at_peak): the first optimizer step, the micro-steps
    # and the optimizer step (plan/depth.py extrapolates each over the model's depth)
    phases: list = field(default_factory=list)


def build_step(cfg, micro_batch: int, device: torch.device, world: int):
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


def _steps(cfg, built, tracker, last=None, mark=lambda: None) -> None:
    """Runs a first optimizer step, then a full step as train/loop.py runs it.

    The first makes the optimizer's state with an update on zero gradients, as big as a
    real step's; the full step (forward, backward, optimizer) then reaches the steady
    state's peak in one step's time, not two. Both run inside whatever modes are active.
    `last` is a StepOps that records the full step only; `mark` is called where each of
    the three phases ends."""
    from ..train.loop import micro_step, optimizer_step

    applied, optimizer, scheduler, tokens = built
    phase("the optimizer's state")
    params = [p for p in applied.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    if last is not None:
        last.on = True
    for sync in applied.micro_contexts(cfg.train.grad_accum_steps):
        with sync:
            micro_step(applied.model, tokens[:, :-1], tokens[:, 1:], applied.autocast,
                       applied.scaler, cfg.train.grad_accum_steps)
        if tracker is not None:
            tracker.reset_mod_stats()  # (its per-module figures: one pass's)
    if last is not None:
        last.split = len(last.ops)  # (train.compile compiles the model, not the optimizer)
    mark()
    phase("the optimizer step")
    optimizer_step(cfg, applied, optimizer, scheduler, applied.scaler, params, None)
    mark()


def _tracked(cfg, built, device: torch.device, modes=(), last=None) -> StepMemory:
    tracker = step_tracker(cfg, *built[:2], built[3])
    phases = []

    def mark():  # this phase's peak; the next phase's starts from what is live now
        phases.append(_by_kind(tracker.get_tracker_snapshot("peak").get(device, {})))
        tracker.restart_peak()

    with tracker, contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _steps(cfg, built, tracker, last=last, mark=mark)
    peak = max(reversed(phases), key=lambda p: p[0])  # (a tie: the later phase's split)
    return StepMemory(*peak, phases=phases)


def _by_kind(snap: dict) -> tuple[int, dict]:
    """A tracker snapshot as (total bytes, KINDS' names -> bytes)."""
    at_peak = {}
    for k, v in snap.items():
        name = KINDS.get(str(getattr(k, "value", k)))
        if name:
            at_peak[name] = at_peak.get(name, 0) + int(v)
    return int(snap.get("Total", 0)), at_peak


FAKE_DEVICE = torch.device("cpu")  # where fake tensors "live": any profile is traced here
# (CPU kernels' shapes: SDPA's flash kernel saves what CUDA's does, autocast casts the same
# matmuls), so a plan needs no GPU


def _eager(cfg, device: torch.device | None = None):
    """A copy of cfg for a traced or tracked step, on `device` where given.

    Compile is off: dynamo does not trace under an outer fake mode, and the tracker follows
    eager ops (a compiled step's memory: _compiled_memory). The model's dispatch is the
    run's, compiled or not, on the device."""
    from ..optimizations.dispatch import resolve_model_dispatch

    cfg = copy.deepcopy(cfg)
    m = cfg.model
    if m.dispatch == "auto" and m.num_experts and cfg.hardware.device == "cuda":
        if torch.cuda.is_available():  # as the run picks it, compiled or not
            resolve_model_dispatch(cfg, torch.device("cuda"))
        else:  # a GPU's plan made without one: as CUDA would pick on the profile's part
            from ..model.moe import grouped_fast

            cc = cfg.hardware.compute_capability
            dtype = torch.bfloat16 if cfg.precision.autocast_dtype == "bfloat16" else None
            m.dispatch = "grouped" if cc is not None and grouped_fast("cuda", dtype, cc) \
                else "loop"
    elif cfg.hardware.device == "cpu":  # (compiled, fp32 runs the loop)
        resolve_model_dispatch(cfg, torch.device("cpu"))
    cfg.train.compile = "off"
    if device is not None:
        cfg.hardware.device = device.type
    resolve_model_dispatch(cfg, torch.device(cfg.hardware.device))
    return cfg


def planned_config(cfg):
    """The traced step's config: the eager step on the trace's device, routing balanced.

    Routing stays skewed where model.routing=skewed. Compile is off, since dynamo does not
    trace under an outer fake mode; the model's dispatch is resolved for the device."""
    cfg = _eager(cfg, FAKE_DEVICE)
    if cfg.model.num_experts and cfg.model.routing != "skewed":
        cfg.model.routing = "balanced"
    # AdamW's fused and foreach kernels on fake DTensors hold several times the optimizer's
    # state at the step, which real ones do not; the loop's temporaries are one parameter's
    if cfg.parallel.name != "none":
        cfg.optim.impl = "for-loop"
    return cfg


def trace_step(cfg, micro_batch: int | None = None, rank: int = 0) -> StepMemory:
    """The plan of one step of `cfg` on one device, traced on fake tensors.

    Under a parallel strategy the device is rank `rank` of hardware.devices; in a pipeline
    each op is tagged with its schedule's action (plan/pipeline.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..model.capacity import capacity
    from ..model.transformer import Transformer
    from .compiled import partitioned as compiled_memory
    from .pipeline import tagged

    b = micro_batch or cfg.train.micro_batch_size
    io = bool(cfg.hardware.calibration)  # (fused kernels, waits for collectives)
    gpu = cfg.hardware.device == "cuda"
    partitioned = compiled_memory(cfg)
    cfg = planned_config(cfg)
    world = cfg.hardware.devices  # (1 under parallel=none: validate sees to it)
    m = cfg.model
    seq = seq_part(cfg)
    rows = b * seq * max(m.top_k, 1)  # a MoE call's (token, choice) pairs
    experts = m.num_experts or 1
    if m.num_experts and m.capacity_factor:  # (balanced: every expert at its capacity or
        rows = min(rows, experts * capacity(b * seq, m.top_k, experts,
                                            m.capacity_factor))  # below it)
    ops = StepOps(io)
    sdpa = cuda_sdpa(cfg.train.attention) if gpu else \
        torch.nn.functional.scaled_dot_product_attention
    piped = tagged(ops) if pp_size(cfg.parallel) > 1 else contextlib.nullcontext()
    with mock.patch.object(Transformer, "reset_parameters", _no_init), \
            fake_world(world, rank), piped, \
            mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", sdpa):
        with FakeTensorMode(), _real_meshes():
            phase("building the model on fake tensors")
            built = build_step(cfg, b, FAKE_DEVICE, world)
            if cfg.parallel.name == "ddp":
                ddp_buckets(built[0].model)
            with _phases(built[0].model):
                got = _tracked(cfg, built, FAKE_DEVICE, [Shadows(rows, experts), ops], ops)
            got.flops, got.comm, got.ops = ops.flops, ops.comm, ops
            if partitioned:  # (its time: the eager ops', fused by the calibration)
                mem = _compiled_memory(cfg, build_step(cfg, b, FAKE_DEVICE, world), rows,
                                       experts, cpu=not gpu)
                got.peak_bytes, got.at_peak, got.phases = mem.peak_bytes, mem.at_peak, \
                    mem.phases
            if cfg.parallel.name == "ddp":
                ddp_calls(got, built[0].model)
    return got


def _compiled_memory(cfg, built, rows: int, experts: int, cpu: bool) -> StepMemory:
    """A compiled step's memory: the model's forward and backward as torch.compile
    partitions them (plan/compiled.py) for a CPU's inductor or a GPU's, traced once
    outside the tracker, then tracked."""
    from .compiled import Compiled

    applied, tokens = built[0], built[3]
    applied.model = Compiled(applied.model, cfg.train.activation_checkpointing, cpu)
    phase("partitioning the compiled step (AOTAutograd)")
    with Shadows(rows, experts), applied.autocast():
        applied.model(tokens[:, :-1], tokens[:, 1:])
    return _tracked(cfg, built, FAKE_DEVICE, [Shadows(rows, experts)])


@contextlib.contextmanager
def _real_meshes():
    """Device meshes built on real tensors in a fake trace, their ranks' coordinates being
    values: the run's (init_device_mesh) and those FSDP2 builds joining a tensor-parallel
    mesh with its own (DeviceMesh). FSDP2's chunks lazy."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def real(fn):
        def outside_fake(*args, **kwargs):
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return outside_fake

    mesh, init = device_mesh.DeviceMesh, device_mesh.init_device_mesh
    with mock.patch.object(mesh, "__init__", real(mesh.__init__)), \
            mock.patch.object(device_mesh, "init_device_mesh", real(init)), _lazy_chunks():
        yield


class _Chunks:
    """torch.chunk's pieces of a tensor, each made when first asked for: FSDP2 takes its
    rank's and the first; made all at once they were a third of a 256-rank plan's time."""

    def __init__(self, tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.shape[dim] // n) if n else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        start, total = i * self.size, self.tensor.shape[self.dim]
        if i and start >= total and total:  # (as _chunk_with_empty pads torch.chunk's list)
            return self[0].new_empty(0)
        return self.tensor.narrow(self.dim, min(start, total), max(0, min(self.size,
                                                                       total - start)))


@contextlib.contextmanager
def _lazy_chunks():
    """FSDP2's sharding of each parameter, its chunks made as they are asked for."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    with mock.patch.object(_fsdp_param, "_chunk_with_empty", _Chunks):
        yield


@contextlib.contextmanager
def _phases(model):
    """The trace's phase as it goes (screen.phase): forward and backward by block, where a
    checkpointed block's recompute shows the backward's progress; hooks on the blocks."""
    from ..model.transformer import block_items

    blocks = [b for _, b in block_items(getattr(model, "layers", []))]
    n, state = len(blocks), {"pass": "forward"}

    def at(i):
        def hook(*_):
            phase(f"{state['pass']}, block {i + 1} of {n}")
        return hook

    def backward(*_):
        state["pass"] = "backward (recomputing)"
        phase("backward")

    def forward(*_):
        state["pass"] = "forward"

    handles = [getattr(b, "_checkpoint_wrapped_module", b).register_forward_pre_hook(at(i))
               for i, b in enumerate(blocks)]  # (inside a checkpoint's wrapper: its
    # recompute in backward calls the block, not the wrapper)
    handles += [model.register_forward_pre_hook(forward), model.register_forward_hook(backward)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def cuda_sdpa(attention: str):
    """SDPA as a CUDA GPU runs it, for a plan traced on the CPU device: where CUDA takes
    the memory-efficient kernel (query/key and value heads of different sizes, as MLA's;
    or train.attention=efficient), that kernel, whose backward keeps the log-sum-exp, not
    the (S, S) scores the CPU's math kernel holds. Otherwise SDPA as it is: the CPU's flash
    kernel saves what CUDA's does. Context parallel's lower-right causal mask: for MLA the
    efficient kernel, with the mask as its bias."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
        if attn_mask is not None and q.shape[-1] != v.shape[-1]:  # (context parallel's
            # lower-right causal: CUDA's efficient kernel with its mask type, ~ this bias)
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device) \
                .masked_fill_(~attn_mask, float("-inf")).expand(*q.shape[:2], -1, -1)
        elif attn_mask is not None or (q.shape[-1] == v.shape[-1] and attention != "efficient"):
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if k.shape[1] != q.shape[1]:  # (the efficient kernel takes no grouped heads)
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, attn_mask, q.requires_grad or k.requires_grad, dropout_p, is_causal,
            scale=scale)[0]
    return run


def _no_init(self) -> None:
    """Skips weight init: fake weights have no values to initialize."""


def measure_compiled_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """A compiled step's real peak on this CPU, as a compiled bench run checks its plan:
    the CPU allocator's live bytes over its second step (the first compiles and makes the
    optimizer's state; plan.check.Allocations). The peak only: no split by kind."""
    from ..optimizations.dispatch import resolve_model_dispatch
    from .check import Allocations

    cfg = copy.deepcopy(cfg)
    resolve_model_dispatch(cfg, torch.device("cpu"))  # (as the compiled run picks it)
    torch.manual_seed(cfg.train.seed)
    built = build_step(cfg, micro_batch or cfg.train.micro_batch_size, torch.device("cpu"), 1)
    _steps(cfg, built, None)
    built[1].zero_grad(set_to_none=True)
    with Allocations(built[0].model, built[1]) as seen:
        _steps(cfg, built, None)
    return StepMemory(seen.peak)


def measure_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The plan's steps on real tensors, tracked the same way: its check where it can run.

    The routing is the configured one; under a parallel strategy the steps run in the
    ranks' process group."""
    import torch.distributed as dist

    cfg = _eager(cfg)
    device = torch.device(cfg.hardware.device)
    torch.manual_seed(cfg.train.seed)
    world = dist.get_world_size() if dist.is_initialized() else 1
    built = build_step(cfg, micro_batch or cfg.train.micro_batch_size, device, world)
    ops = StepOps()
    got = _tracked(cfg, built, device, [ops], ops)
    got.flops, got.comm, got.ops = ops.flops, ops.comm, ops
    return got
