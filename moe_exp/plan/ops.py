"""The ops of a traced step (plan.trace): each compute op's FLOPs, bytes and dtype, and each
collective's message and group: what plan/roofline.py turns into time."""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that move no tensor data (new storage, views and metadata)
NO_DATA = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
            torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
            torch.ops.aten._local_scalar_dense, torch.ops.aten.lift_fresh, torch.ops.aten.set_,
            torch.ops.aten.resize_, torch.ops.aten._unsafe_view}


@functools.cache
def _formulas() -> dict:
    """torch's flop_registry with the project's formulas for what it lacks (grouped_mm, the
    CPU and every SDPA kernel: bench/formulas.py), as FlopCounterMode's custom_mapping."""
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    from ..bench.formulas import flop_formulas

    return {**flop_registry, **{k: shape_wrapper(v) for k, v in flop_formulas().items()}}


class StepOps(TorchDispatchMode):
    """The ops of the steps run while `on`: each compute op's FLOPs (torch's flop_registry,
    as bench/flop_check.py counts them), bytes read and written (its tensors', views none) and
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

        kwargs = kwargs or {}
        packet = func.overloadpacket
        out = func(*args, **kwargs)
        if not self.on or func.is_view or func.namespace == "prim" or packet in NO_DATA:
            return out
        name = packet.__name__.strip("_")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            if name not in ("wait_tensor", "wrap_tensor_autograd"):
                name = name.replace("allgather", "all_gather").replace("allreduce", "all_reduce") \
                    .replace("alltoall", "all_to_all").removesuffix("_base").removesuffix("_single")
                sizes = [t.numel() * t.element_size() for t in tensors]
                self.calls.append((name, sum(sizes) if name == "all_reduce" else
                                   max(sizes, default=0), group_ranks(args, kwargs)))
            return out
        moved = sum(t.numel() * t.element_size() for t in tensors + [
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        formulas = _formulas()
        flops = formulas[packet](*args, **kwargs, out_val=out) if packet in formulas else 0
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


def process_group(a):
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


def group_ranks(args, kwargs) -> tuple:
    """The global ranks of a collective's group."""
    import torch.distributed as dist

    for a in [*args, *kwargs.values()]:
        if (group := process_group(a)) is not None:
            return tuple(dist.get_process_group_ranks(group))
    return ()
