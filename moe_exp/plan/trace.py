"""One training step of the configured run traced on fake tensors (torch's FakeTensorMode:
shapes and dtypes, no memory), its live tensor memory tracked by torch's MemTracker
(torch.distributed._tools) and its FLOPs counted by FlopCounterMode. The model, the
optimizations, the optimizer and the step are the real code's, so any architecture is
planned without a formula of its own. `measure_step` runs the same step on real tensors
under the same tracker: what the plan is checked against on CPU."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

# MemTracker's categories (its _MemRefType values) -> the plan's names
KINDS = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads",
         "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer",
         "Other": "other"}


@dataclass
class StepMemory:
    peak_bytes: int  # live tensor memory at the step's peak (one device)
    at_peak: dict = field(default_factory=dict)  # KINDS' names -> bytes at the peak
    flops: float | None = None  # the step's FLOPs (fake traces only)


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


def _steps(cfg, micro_batch: int, device: torch.device, tracker, steps: int = 2) -> None:
    """Build, optimize and run full steps (forward, backward, optimizer) as the bench loop
    does, inside whatever modes are active: the second has the optimizer's state, the
    steady state's peak."""
    from ..bench.loop import micro_step, optimizer_step
    from ..model import build_model
    from ..optim import build_optimizer
    from ..optimizations import apply

    with torch.device(device):
        model = build_model(cfg.model)
    applied = apply(model, cfg, device)
    optimizer, scheduler, _ = build_optimizer(applied.model, cfg, device)
    params = [p for p in applied.model.parameters() if p.requires_grad]
    seq = cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq + 1), device=device)
    for _ in range(steps):
        for _ in range(cfg.train.grad_accum_steps):
            micro_step(applied.model, tokens[:, :-1], tokens[:, 1:], applied.autocast,
                       applied.scaler, cfg.train.grad_accum_steps)
            if tracker is not None:
                tracker.reset_mod_stats()  # (its per-module figures: one pass's)
        optimizer_step(cfg, applied, optimizer, scheduler, applied.scaler, params, None)


def _tracked(cfg, micro_batch: int, device: torch.device, modes=()) -> StepMemory:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker, contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        _steps(cfg, micro_batch, device, tracker)
    snap = tracker.get_tracker_snapshot("peak").get(device, {})
    at_peak = {KINDS[str(getattr(k, "value", k))]: int(v) for k, v in snap.items()
               if str(getattr(k, "value", k)) in KINDS}
    return StepMemory(int(snap.get("Total", 0)), at_peak)


FAKE_DEVICE = torch.device("cpu")  # where fake tensors "live": any profile is traced here
# (CPU kernels' shapes: SDPA's flash kernel saves what CUDA's does, autocast casts the same
# matmuls), so a plan needs no GPU


def planned_config(cfg):
    """The traced step's config: balanced routing, no compile (dynamo does not trace under
    an outer fake mode; the plan is of the eager step), the model's dispatch resolved."""
    from ..bench.runner import resolve_model_dispatch

    cfg = copy.deepcopy(cfg)
    cfg.train.compile = "off"
    if cfg.model.num_experts:
        cfg.model.routing = "balanced"
    resolve_model_dispatch(cfg, FAKE_DEVICE)
    if cfg.model.dispatch == "grouped" and cfg.precision.autocast_dtype != "bf16":
        cfg.model.dispatch = "loop"  # (grouped_mm's shape function takes bf16 only; the
        # loop's memory is the grouped kernel's: the same rows, the same saved inputs)
    return cfg


def trace_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The plan of one step of `cfg` on one device, traced on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from ..model.capacity import capacity
    from ..model.transformer import Transformer

    b = micro_batch or cfg.train.micro_batch_size
    cfg = planned_config(cfg)
    device = FAKE_DEVICE
    m = cfg.model
    rows = b * cfg.train.seq_len * max(m.top_k, 1)  # a MoE call's (token, choice) pairs
    experts = m.num_experts or 1
    if m.num_experts and m.capacity_factor:  # (balanced: every expert at its capacity or
        rows = min(rows, experts * capacity(b * cfg.train.seq_len, m.top_k, experts,
                                            m.capacity_factor))  # below it)
    with mock.patch.object(Transformer, "reset_parameters", _no_init):
        with FakeTensorMode():
            got = _tracked(cfg, b, device, [BalancedCounts(rows, experts)])
        # (FLOPs in a pass of their own: FlopCounterMode's module hooks keep tensors alive)
        counter = FlopCounterMode(display=False)
        with FakeTensorMode(), counter, BalancedCounts(rows, experts):
            _steps(cfg, b, device, None, steps=1)
    got.flops = float(counter.get_total_flops())
    return got


def _no_init(self) -> None:
    """(fake weights have no values to initialize)"""


def measure_step(cfg, micro_batch: int | None = None) -> StepMemory:
    """The same step on real tensors (the configured routing), its live tensor memory
    tracked the same way: the plan's check on a machine that can run it."""
    from ..bench.runner import resolve_model_dispatch

    cfg = copy.deepcopy(cfg)
    cfg.train.compile = "off"
    device = torch.device(cfg.hardware.device)
    resolve_model_dispatch(cfg, device)
    torch.manual_seed(cfg.train.seed)
    return _tracked(cfg, micro_batch or cfg.train.micro_batch_size, device)
