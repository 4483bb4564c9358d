"""Records the ops of a traced step, which plan/roofline.py turns into time.

Each compute op's FLOPs, bytes and dtype; each collective's message size and group."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# ops that move no tensor data (new storage, views and metadata)
NO_DATA = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
            torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
            torch.ops.aten._local_scalar_dense, torch.ops.aten.lift_fresh, torch.ops.aten.set_,
            torch.ops.aten.resize_, torch.ops.aten._unsafe_view}


def _stored(tensors) -> tuple:
    """Each tensor's storage (a view shares its base's) and its bytes."""
    return tuple((t.untyped_storage()._cdata, t.numel() * t.element_size()) for t in tensors)


def is_kernel(op) -> bool:
    """Whether a StepOps entry is an op the device runs, not a sync or a collective's mark."""
    return op[3] is None or op[3][0] not in ("sync", "comm")


# ops whose result the host reads (a value), so it waits for the device's queue
SYNCS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero}


def layout(a: torch.Tensor, b: torch.Tensor) -> str:
    """A matmul's operands as stored: n (rows contiguous) or t (transposed), a's then b's.

    A linear's forward is nt, its input's gradient nn, its weight's gradient tn; a CPU's
    kernels differ by several times between them."""
    t = lambda x: "t" if x.shape[-1] > 1 and x.stride(-1) != 1 else "n"  # noqa: E731
    return t(a) + t(b)


def shape_key(name: str, args) -> tuple | None:
    """A compute op's shape for a calibration's rates: ("mm", M, N, K, layout, batch) for
    the matmuls (a bmm's batch folded into M), ("gmm", groups, rows, N, K) for grouped_mm
    (its weights' gradient: "gmm_w") and ("sdpa", op, query length, key length, head
    size) for attention's kernels; else None."""
    t = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        a, b = (t[1], t[2]) if name in ("addmm", "baddbmm") else (t[0], t[1])
        batch = a.numel() // (a.shape[-2] * a.shape[-1]) if a.dim() == 3 else 1
        return ("mm", a.numel() // a.shape[-1], b.shape[-1], a.shape[-1], layout(a, b), batch)
    if name == "grouped_mm":
        a, b = t[0], t[1]
        if a.dim() == 2 and b.dim() == 2:  # the weights' gradient: (M, rows) x (rows, N)
            return ("gmm_w", t[2].numel() if len(t) > 2 else 1, a.shape[0], b.shape[-1],
                    a.shape[-1])
        groups = b.shape[0] if b.dim() == 3 else a.shape[0]
        return ("gmm", groups, a.numel() // a.shape[-1], b.shape[-1], a.shape[-1])
    if "scaled_dot_product" in name:
        q, k = (t[1], t[2]) if name.endswith("backward") else (t[0], t[1])
        return ("sdpa", name, q.shape[-2], k.shape[-2], q.shape[-1])
    return None


@functools.cache
def _formulas() -> dict:
    """torch's flop_registry plus the project's formulas, as FlopCounterMode's custom_mapping.

    bench/formulas.py covers what the registry lacks: grouped_mm and every SDPA kernel, the
    CPU's included."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from ..bench.formulas import flop_formulas

    return {**flop_registry, **{k: shape_wrapper(v) for k, v in flop_formulas().items()}}


class StepOps(TorchDispatchMode):
    """Records the ops of the steps run while `on`, for a roofline.

    Each compute op's FLOPs, counted as flop_check.py counts them; the bytes of the tensors
    it reads and writes, none for views; its dtype. Each c10d collective's message and the
    global ranks of its group. The message is the largest tensor it takes, such as an
    all-gather's output or a reduce-scatter's input; for an all-reduce, all its tensors."""

    def __init__(self, io: bool = False):
        super().__init__()
        self.keep_io = io  # record each op's storages (a calibrated plan)
        self.on = False  # _steps turns it on
        # (FLOPs, bytes, dtype, shape): shape is shape_key's, ("sync",) where the host
        # waits for the device (a value read), ("comm", i) where calls[i] starts, else None
        self.ops: list[tuple[float, int, torch.dtype | None, tuple | None]] = []
        self.calls: list[tuple[str, int, tuple]] = []
        self.dispatched = 0  # every op dispatched while on, views and metadata included
        # each op's (inputs, outputs) as (storage, bytes) pairs: what a compiled step's
        # fused kernels read and write, and what waits for a collective
        # (plan/calibration.py); None for a sync
        self.io: list[tuple | None] = []
        self.split: int | None = None  # ops from here on are the optimizer's (eager)
        # a pipeline's action running while each op is recorded: (stage, "F" | "B" | "I" |
        # "W") or None (plan/pipeline.py tags them)
        self.tag: tuple | None = None
        self.tags: list[tuple | None] = []
        self._patch = contextlib.ExitStack()

    def __enter__(self):
        self._patch.enter_context(_propagation_unseen())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patch.close()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # (its local ops, collectives included, come back here)
        packet = func.overloadpacket
        out = func(*args, **kwargs)
        if not self.on:
            return out
        self.dispatched += func.namespace != "prim"  # (prim.device: a fake tensor's .device)
        if packet in SYNCS:
            self._add((0.0, 0, None, ("sync",)))
            if self.keep_io:
                self.io.append(None)
        if func.is_view or func.namespace == "prim" or packet in NO_DATA:
            return out
        name = packet.__name__.strip("_")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            if name not in ("wait_tensor", "wrap_tensor_autograd"):
                name = name.replace("allgather", "all_gather").replace("allreduce", "all_reduce") \
                    .replace("alltoall", "all_to_all")
                for end in ("_base", "_single", "_into_tensor", "_tensor"):  # (c10d, functional)
                    name = name.removesuffix(end)
                sizes = [t.numel() * t.element_size() for t in tensors]
                self.calls.append((name, sum(sizes) if name == "all_reduce" else
                                   max(sizes, default=0), group_ranks(args, kwargs)))
                self._add((0.0, 0, None, ("comm", len(self.calls) - 1)))
                if self.keep_io:  # (what it writes is ready when it ends)
                    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                    self.io.append((_stored(tensors), _stored(tensors + outs)))
            return out
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(t.numel() * t.element_size() for t in tensors + outs)
        formulas = _formulas()
        flops = formulas[packet](*args, **kwargs, out_val=out) if packet in formulas else 0
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
        self._add((float(flops), moved, dtype, shape_key(name, args) if flops else None))
        if self.keep_io:
            self.io.append((_stored(tensors), _stored(outs)))
        return out

    def _add(self, op: tuple) -> None:
        self.ops.append(op)
        self.tags.append(self.tag)

    @property
    def flops(self) -> float:
        return sum(op[0] for op in self.ops)

    @property
    def comm(self) -> dict:
        """Calls and bytes per collective: name -> {"calls", "bytes"}."""
        return _tally((name, nbytes) for name, nbytes, _ in self.calls)

    def comm_by_group(self, dims: list) -> dict:
        """comm per mesh dim the groups span (config.group_dim): dim -> name -> tally."""
        from ..config import group_dim

        out: dict = {}
        for name, nbytes, ranks in self.calls:
            out.setdefault(group_dim(ranks, dims), []).append((name, nbytes))
        return {g: _tally(calls) for g, calls in sorted(out.items())}


@contextlib.contextmanager
def _propagation_unseen():
    """DTensor's sharding propagation runs an op again on fake tensors of its global shape
    to learn the output's (once per op and shapes in a process): outside every dispatch
    mode, so that neither the op recorder nor the memory tracker takes it for the step's.
    (A process's first DeepSeek-V3 plan held 10 GiB of them at its first optimizer step.)"""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.utils._python_dispatch import _disable_current_modes

    real = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self, *args, **kwargs):
        with _disable_current_modes():
            return real(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = unseen
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = real


def _tally(calls) -> dict:
    seen: dict = {}
    for name, nbytes in calls:
        got = seen.setdefault(name, {"calls": 0, "bytes": 0})
        got["calls"] += 1
        got["bytes"] += nbytes
    return seen


def process_group(a):
    """An op's argument as a ProcessGroup, or None where it names no group.

    A c10d op passes its group boxed as a ScriptObject; a functional collective, its name."""
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


def group_ranks(args, kwargs) -> tuple:
    """The global ranks of a collective's group."""
    import torch.distributed as dist

    for a in [*args, *kwargs.values()]:
        if (group := process_group(a)) is not None:
            return tuple(dist.get_process_group_ranks(group))
    return ()
