"""Values for the data-dependent reads of a fake step, whose tensors hold none.

The routing's counts are exact where they follow from shapes alone (Shadows), else as
balanced routing makes them (BalancedCounts)."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from .ops import NO_DATA, process_group


class BalancedCounts(TorchDispatchMode):
    """Answers the dispatch's reads on fake tensors as model.routing=balanced makes them.

    A call's counts of tokens per expert, read by .tolist() or .max(), come in expert order:
    expert e gets kept // E, one more for the first kept % E. A sum of counts splits `kept`
    evenly over its elements: the rows a token capacity kept are one sum, all of it; expert
    parallelism's rows per rank and per local expert are kept / ranks and kept / local
    experts."""

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
        """The sum that `t` is an element of; tolist reads each element through a view."""
        while t is not None:
            if t in self.sums:
                return t
            t = t._base if t._is_view() else None
        return None


class Shadows(BalancedCounts):
    """Keeps real values beside the fake tensors whose values follow from shapes alone.

    These are integer tensors and float scalars: the routing's choices, which go by position
    under model.routing=balanced or skewed; what is computed from them only, such as counts
    per expert, sorts, sums, a token capacity's drops by position and expert parallelism's
    exchange of counts, every rank routing as rank 0 does; and an optimizer's step count.
    A read of one gives its value. A read of any other integer, such as a capacity's drops
    by routing weight, is answered as BalancedCounts does; of any other float, 0: that is
    a flag such as GradScaler's found_inf, and no inf is found."""

    LIMIT = 1 << 22  # elements: a shadow is a real tensor

    def __init__(self, kept: int, experts: int):
        super().__init__(kept, experts)
        self.real = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            return _grouped_out(args[0], args[1], offs, kwargs.get("out_dtype"))
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
        small = all(not t.is_complex() and t.numel() <= (1 if t.is_floating_point() else
                                                         self.LIMIT) for t in outs)
        if not outs or not small or torch.Tag.nondeterministic_seeded in func.tags \
                or func.overloadpacket in NO_DATA or any(t not in self.real for t in ins):
            for t in _written(func, args):
                self.real.pop(t, None)
            return
        real = tree_map_only(torch.Tensor, lambda t: self.real[t], (args, kwargs))
        with _disable_current_modes():
            got = func(*real[0], **real[1])
        for fake, value in zip(outs, [t for t in tree_leaves(got) if isinstance(t, torch.Tensor)]):
            self.real[fake] = value

    def _exchange(self, func, args) -> None:
        """Follows a collective on the counts, every rank's counts being rank 0's.

        An all-to-all hands rank 0 each rank's chunk for rank 0; any other collective leaves
        its tensors without values."""
        from torch.utils._python_dispatch import _disable_current_modes

        if func.overloadpacket.__name__ == "alltoall_base_" and args[1] in self.real:
            out, src, group, _, in_splits = args[:5]
            n = process_group(group).size()
            chunk = in_splits[0] if in_splits else src.shape[0] // n
            with _disable_current_modes():
                self.real[out] = self.real[src][:chunk].repeat(n, *[1] * (src.dim() - 1))
            return
        for t in _written(func, args):
            self.real.pop(t, None)


LIFTS = {torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy}


def _written(func, args) -> list:
    """The tensors an op writes in place: its schema's mutable arguments."""
    return [a for a, s in zip(args, func._schema.arguments) if isinstance(a, torch.Tensor)
            and s.alias_info is not None and s.alias_info.is_write]


def _grouped_out(a, b, offs, out_dtype=None):
    """grouped_mm's output in another dtype than bf16, which its shape function refuses: a
    new tensor of its shape, as the kernel (the CPU's, or CUDA's fp32 one) allocates."""
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 2:
        shape = (a.shape[1], b.shape[-1])
    elif a.dim() == 2:  # 2D x 2D, the weights' gradient: a group per offs element
        shape = (offs.numel(), a.shape[0], b.shape[-1])
    else:
        shape = (b.shape[0], a.shape[-2], b.shape[-1])
    return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)
