"""Context parallel, parallel.cp: each sequence split over the cp ranks of the mesh.

Load-balanced as torch's context_parallel shards causal attention: the sequence in 2 x cp
chunks, cp rank r holding chunks r and 2cp - 1 - r, so every rank attends over as many
keys. Attention gathers the keys and values of the whole sequence once (an all-gather over
the cp group; its backward a reduce-scatter), as torch's default all-gather rotation does
(MLA: its latent and shared RoPE key, each rank expanding the whole sequence's keys);
each local chunk then attends causally over the keys up to its own end (lower-right causal:
flash or memory-efficient attention on CUDA, a boolean mask elsewhere). RoPE's tables are
this rank's positions. Every other op runs on the rank's tokens alone, as on a data rank;
FSDP2 averages the gradients over dp x cp.

torch's own context_parallel handles the CUDA flash, memory-efficient and cuDNN SDPA ops
only (not CPU's, nor the math kernel MLA's unequal head sizes take), through private
dispatch tables; this is the same algorithm on public ops, on any device.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# funcol's all-gather whose backward reduce-scatters (torch 2.11: all_gather_tensor_autograd)
_gather = getattr(funcol, "all_gather_single_autograd", None) or \
    funcol.all_gather_tensor_autograd


def chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 x cp sequence chunks cp rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def mine(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's two chunks of x's sequence dim `dim`, in the order it holds them."""
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunks(cp, rank)], dim=dim)


def apply_context(model: nn.Module, mesh, seq: int) -> None:
    """Split `model` (a plain Transformer) over the 1-D cp mesh for sequences of `seq`.

    Its inputs are cut to this rank's chunks (a hook: parallel.shard_inputs), its RoPE
    tables taken at their positions and each attention layer's `attend` gathers the keys
    and values."""
    cp, rank = mesh.size(), mesh.get_local_rank()
    model.rope_cos = mine(model.rope_cos[:seq], 0, cp, rank)
    model.rope_sin = mine(model.rope_sin[:seq], 0, cp, rank)
    group = mesh.get_group()
    for mod in model.modules():
        if hasattr(mod, "latents"):  # MLA: the latent gathered, each rank expanding the
            mod.attend = GatherAttend(group, cp, rank, whole=True)  # whole sequence's keys
            mod.latents = mod.attend.latents
        elif hasattr(mod, "attend"):
            mod.attend = GatherAttend(group, cp, rank)


def shard_inputs(model: nn.Module, cp: int, rank: int) -> None:
    """Cut (tokens, targets) to this cp rank's chunks before each forward of `model`."""
    def cut(_m, args):
        tokens, targets, *rest = args
        return (mine(tokens, 1, cp, rank), mine(targets, 1, cp, rank), *rest)

    model.register_forward_pre_hook(cut)


class GatherAttend:
    """Causal attention of this rank's two query chunks over the whole sequence's keys.

    whole: the keys and values come whole (MLA's, expanded from the gathered latent:
    `latents`); else each is gathered here."""

    def __init__(self, group, cp: int, rank: int, whole: bool = False):
        self.group, self.cp, self.rank, self.whole = group, cp, rank, whole
        held = [i for r in range(cp) for i in chunks(cp, r)]  # the gathered chunks' order
        self.order = [held.index(i) for i in range(2 * cp)]  # where chunk i was gathered

    def gathered(self, t, dim: int):
        """t's sequence dim `dim` gathered over the cp ranks, in sequence order."""
        c = t.shape[dim] // 2  # every rank's (chunk r, chunk 2cp-1-r), in rank order
        t = _gather(t.contiguous(), dim, self.group)
        return torch.cat([t.narrow(dim, j * c, c) for j in self.order], dim=dim)

    def latents(self, latent, k_rope):
        """MLA's normed latent (b, s, rank) and roped shared key part (b, 1, s, rope), the
        whole sequence's: 576 values a token for DeepSeek-V3, not its 128 heads' 40,960."""
        return self.gathered(latent, 1), self.gathered(k_rope, 2)

    def __call__(self, q, k, v):
        c = q.shape[2] // 2
        if not self.whole:
            k, v = self.gathered(k, 2), self.gathered(v, 2)
        out = [_causal_over_prefix(qi, k[:, :, :(i + 1) * c], v[:, :, :(i + 1) * c])
               for qi, i in zip(q.split(c, dim=2), chunks(self.cp, self.rank))]
        return torch.cat(out, dim=2)


def _causal_over_prefix(q, k, v):
    """SDPA of q, the last q.shape[2] positions of k's, over k and v: lower-right causal."""
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        if gqa:  # (torch's lower-right bias: the fused kernels without enable_gqa)
            r = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
        mask = causal_lower_right(q.shape[2], k.shape[2])
    else:
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
