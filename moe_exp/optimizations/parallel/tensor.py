"""Tensor parallel (parallel.tp) with sequence parallel (parallel.sequence_parallel) on
torch's DTensor API, as torchtitan and Megatron-Core split a block.

Attention: q/k/v column-wise (each rank its heads), o row-wise; dense FFN: w1/w3
column-wise, w2 row-wise; embedding vocab-sharded, head column-wise, its logits left on
their vocab shards for a vocab-parallel loss (Megatron's); norms replicated. With sequence
parallel the residual stream between the split regions is sharded on the sequence: each
region all-gathers its input and reduce-scatters its output (one all-reduce's bytes, norms
on 1/tp of the tokens). Without it the stream is replicated and each region all-reduces
its output.

The MoE (experts split over the TP group, etp = tp): the router runs replicated on the
gathered tokens; each expert's w1/w3 columns and w2 rows are split, as are the shared
experts'; the routed and shared outputs are partial sums, reduced once at the layer's end.
Gradients inside follow Megatron's rule that a tensor feeding split weights gets a partial
gradient: the layer's input gradient is reduce-scattered (or all-reduced) once; the
router's share is divided by tp so the sum comes out whole, and the routing weights,
which multiply partial outputs, have theirs all-reduced (T x k numbers).

Every parameter becomes a DTensor on the TP mesh (Shard or Replicate), so FSDP2 composes on
a 2-D (dp, tp) mesh; `sync_grads` turns the Partial gradients of replicated weights (norms
under sequence parallel) into their parameters' placements where no FSDP2 does it."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from ...model.moe import MoE
from ...model.transformer import block_items


def apply_tensor_parallel(model: nn.Module, mesh, sequence_parallel: bool,
                          experts: bool | str = True) -> None:
    """Split `model` (a model.transformer.Transformer, or a pipeline's Stage: its embedding,
    norm and head where it has them) over the 1-D TP mesh, in place.

    experts=False leaves the routed experts whole, for expert parallel to shard first
    (parallel.apply_expert then splits each rank's with split_experts); "whole"
    (parallel.etp=1) runs each MoE on the rank's sequence shard, unsplit."""
    seq = Shard(1) if sequence_parallel else Replicate()
    ends = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "head": ColwiseParallel(input_layouts=seq)}  # (local logits, this rank's vocab)
    parallelize_module(model, mesh, {k: v for k, v in ends.items()
                                     if getattr(model, k, None) is not None})
    if getattr(model, "head", None) is not None:
        model.loss = VocabParallelLoss(mesh)
        _norm(model.norm, mesh, sequence_parallel)
    for _, block in block_items(model.layers):
        _norm(block.attn_norm, mesh, sequence_parallel)
        _norm(block.ffn_norm, mesh, sequence_parallel)
        _attention(block.attn, mesh, seq)
        if isinstance(block.ffn, MoE) and experts == "whole":
            _moe_on_shard(block.ffn, mesh)
        elif isinstance(block.ffn, MoE):
            _moe(block.ffn, mesh, seq, experts)
        else:
            _dense(block.ffn, mesh, seq)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross entropy of (N, V/tp) logits, this rank's vocab shard from `start`: a max
    and one (N, 2) sum all-reduced, so no rank holds whole logits; the backward is local."""

    @staticmethod
    def forward(ctx, logits, targets, group, start: int):
        v = logits.shape[-1]
        m = logits.detach().amax(-1)
        dist.all_reduce(m, dist.ReduceOp.MAX, group=group)
        e = (logits - m.unsqueeze(-1)).exp_()
        local = targets - start
        hit = (local >= 0) & (local < v)
        idx = local.clamp(0, v - 1).unsqueeze(-1)
        picked = (logits.gather(-1, idx).squeeze(-1) - m).masked_fill(~hit, 0)
        sums = torch.stack([e.sum(-1), picked])
        dist.all_reduce(sums, group=group)
        valid = targets != -100  # (F.cross_entropy's ignore_index)
        n = valid.sum()
        loss = ((sums[0].log() - sums[1]) * valid).sum() / n
        ctx.save_for_backward(e.div_(sums[0].unsqueeze(-1)), idx, hit & valid, valid, n)
        return loss

    @staticmethod
    def backward(ctx, g):
        p, idx, hit, valid, n = ctx.saved_tensors  # p: softmax, changed in place
        p.scatter_add_(-1, idx, -hit.unsqueeze(-1).to(p.dtype))
        return p.mul_((valid * g / n).unsqueeze(-1).to(p.dtype)), None, None, None


class VocabParallelLoss(nn.Module):
    """The model's loss on the head's vocab-sharded logits (N, V/tp)."""

    def __init__(self, mesh):
        super().__init__()
        self.group, self.rank = mesh.get_group(), mesh.get_local_rank()

    def forward(self, logits, targets):
        return _VocabParallelCE.apply(logits, targets, self.group, self.rank * logits.shape[-1])


def _norm(norm: nn.Module, mesh, sequence_parallel: bool) -> None:
    if sequence_parallel:  # (on the sequence shard; its weight's gradient Partial)
        parallelize_module(norm, mesh, SequenceParallel(use_local_output=True))
    else:
        _replicated(norm, mesh)


def _replicated(module: nn.Module, mesh) -> None:
    """Weights replicated (Replicate DTensors) and run on the local tensors it is given."""
    def inp(_m, args, _mesh):
        return tuple(DTensor.from_local(a, mesh, (Replicate(),), run_check=False)
                     if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                     for a in args)

    def out(_m, y, _mesh):
        return y.to_local() if isinstance(y, DTensor) else y

    distribute_module(module, mesh, input_fn=inp, output_fn=out)


def _attention(attn: nn.Module, mesh, seq) -> None:
    """Heads split: GQA's q/k/v, or MLA's q (after its low-rank part) and latent expansion
    column-wise; o row-wise."""
    tp = mesh.size()
    parallelize_module(attn, mesh, {
        "": PrepareModuleInput(input_layouts=(seq, None, None),
                               desired_input_layouts=(Replicate(), None, None),
                               use_local_output=False),  # (x, cos, sin)
        "wo": RowwiseParallel(output_layouts=seq)})
    attn.n_heads //= tp  # the views take this rank's heads
    if hasattr(attn, "wkv_a"):
        return _latent(attn, mesh)
    parallelize_module(attn, mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                    "wv": ColwiseParallel()})
    for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms, on this rank's heads
        norm = getattr(attn, name)
        if not isinstance(norm, nn.Identity):  # (x: batch, sequence, heads, head dim)
            parallelize_module(norm, mesh, SequenceParallel(sequence_dim=2,
                                                            use_local_output=True))
    attn.n_kv //= tp


def _latent(attn: nn.Module, mesh) -> None:
    """MLA: q's low-rank part and the shared latent (wkv_a, kv_norm) replicated.

    The latent's RoPE key, shared by every head, reaches this rank's heads only: its
    gradient is partial and summed over the group; the rest of wkv_a's is whole."""
    if isinstance(attn.wq, nn.Sequential):  # (q_lora_rank: down, norm, up)
        distribute_module(attn.wq[0], mesh)
        distribute_module(attn.wq[1], mesh)
        parallelize_module(attn.wq[2], mesh, ColwiseParallel())
    else:
        parallelize_module(attn.wq, mesh, ColwiseParallel())
    parallelize_module(attn.wkv_b, mesh, ColwiseParallel())
    _replicated(attn.kv_norm, mesh)
    distribute_module(attn.wkv_a, mesh)
    rank = attn.kv_rank

    def local(_m, _args, out):
        latent, rope = out.split([rank, out.shape[-1] - rank], dim=-1)
        return torch.cat([latent.to_local(), rope.to_local(grad_placements=(Partial(),))], -1)

    attn.wkv_a.register_forward_hook(local)


def _dense(ffn: nn.Module, mesh, seq) -> None:
    parallelize_module(ffn, mesh, {
        "": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                               use_local_output=False),
        "w1": ColwiseParallel(), "w3": ColwiseParallel(),
        "w2": RowwiseParallel(output_layouts=seq)})


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: float):
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


def _partial_grad(x, mesh, placement):
    """x (local, `placement` on the mesh) gathered whole; its gradient is taken as partial
    sums: reduce-scattered (Shard) or all-reduced (Replicate) back."""
    d = DTensor.from_local(x, mesh, (placement,), run_check=False)
    return d.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))


class _SplitFFN(nn.Module):
    """Holds a module's weights split over the TP group as DTensors and runs it on the local
    shards: its output is this rank's partial sum. `dims`: weight name -> split dim."""

    def __init__(self, inner: nn.Module, mesh, dims: dict):
        super().__init__()
        rank, tp = mesh.get_local_rank(), mesh.size()
        for name, dim in dims.items():
            local = inner.get_parameter(name).detach().chunk(tp, dim)[rank].clone()
            shard = nn.Parameter(DTensor.from_local(local, mesh, (Shard(dim),), run_check=False))
            _set(inner, name, shard)
        self.inner, self.names = inner, tuple(dims)

    def forward(self, *args):
        local = {n: self.inner.get_parameter(n).to_local() for n in self.names}
        return torch.func.functional_call(self.inner, local, args)


def _set(module: nn.Module, name: str, value) -> None:
    *path, last = name.split(".")
    for p in path:
        module = getattr(module, p)
    setattr(module, last, value)


def split_experts(experts: nn.Module, mesh) -> nn.Module:
    """Stacked experts (E, in, out) with each expert's w1/w3 columns and w2 rows split."""
    return _SplitFFN(experts, mesh, {"w1": 2, "w3": 2, "w2": 1})


def _moe(moe: MoE, mesh, seq, experts: bool) -> None:
    tp = mesh.size()
    if experts:
        moe.experts = split_experts(moe.experts, mesh)
    if moe.shared_experts is not None:
        moe.shared_experts = _SplitFFN(moe.shared_experts, mesh,
                                       {"w1.weight": 0, "w3.weight": 0, "w2.weight": 1})
    _replicated(moe.router.gate, mesh)
    moe.router.register_forward_pre_hook(lambda _m, args: (_ScaleGrad.apply(args[0], 1 / tp),))

    def whole_weight_grads(_m, _args, out):  # they multiply partial outputs
        logits, probs, weights, experts = out
        w = DTensor.from_local(weights, mesh, (Replicate(),), run_check=False)
        return logits, probs, w.to_local(grad_placements=(Partial(),)), experts

    moe.router.register_forward_hook(whole_weight_grads)
    moe.register_forward_pre_hook(lambda _m, args: (_partial_grad(args[0], mesh, seq),))

    def reduce(_m, _args, out):
        y = DTensor.from_local(out[0], mesh, (Partial(),), run_check=False)
        return (y.redistribute(mesh, (seq,)).to_local(),) + tuple(out[1:])

    moe.register_forward_hook(reduce)


def sync_grads(params) -> None:
    """Each DTensor gradient in its parameter's placements (a replicated weight's Partial
    gradient all-reduced); where FSDP2 shards, its reduce does this."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _moe_on_shard(moe: MoE, mesh) -> None:
    """parallel.etp=1: the MoE on this rank's sequence shard, as on a data rank of its own.

    Its tokens, (T, H) flattened, are the shard's: the router and shared experts run
    sequence-parallel (replicated weights, Partial gradients), and expert parallel's
    all-to-all spans the tp ranks. The aux losses are each shard's; their gradients are
    divided by tp, so the ranks' sum is their mean, as one loss per data rank."""
    tp = mesh.size()
    shared = moe.shared_experts
    for linear in [moe.router.gate] + ([shared.w1, shared.w3, shared.w2] if shared else []):
        parallelize_module(linear, mesh, SequenceParallel(sequence_dim=0, use_local_output=True))

    def mean_aux(_m, _args, out):  # (output, balance, seq balance, z, counts, chosen)
        return (out[0], *(_ScaleGrad.apply(v, 1 / tp) for v in out[1:4]), *out[4:])

    moe.register_forward_hook(mean_aux)

