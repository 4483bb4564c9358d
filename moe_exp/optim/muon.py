"""Muon on the hidden matrices and torch's AdamW on the rest, as one optimizer.

Muon is momentum, then Newton-Schulz orthogonalization of the update. AdamW takes the
embeddings, the output head and the norms. torch.optim.Muon takes 2-D plain tensors only;
here the update also runs on
- stacked expert weights (E, in, out): one orthogonalization per expert, batched;
- FSDP2 shards, DTensors: matrices split across ranks are orthogonalized round-robin, each
  on one rank (sharded_ns.py); expert stacks sharded on the expert dim hold whole experts,
  so they stay local.
The learning rate is scaled by 0.2 * sqrt(max(rows, cols)), torch's "match_rms_adamw" as
Moonlight's, so the update's RMS matches AdamW's and lr and weight_decay carry over from
adamw.
"""
from __future__ import annotations

import math
import sys

import torch
from torch import Tensor, nn

from .sharded_ns import orthogonalize_round_robin, round_robin_ok, shard_dim

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon


def newton_schulz(g: Tensor, steps: int, eps: float = 1e-7) -> Tensor:
    """Orthogonalize each matrix in g (..., m, n): approximately U V^T, in bf16, as torch's Muon."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16().reshape(-1, *g.shape[-2:])
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(g.shape)


def _dtensor(u):
    """torch's DTensor module if u is a DTensor, else None.

    The module is not imported where no DTensor can exist: a run's CPU memory would count
    the import.
    """
    mod = sys.modules.get("torch.distributed.tensor")
    return mod if mod is not None and isinstance(u, mod.DTensor) else None


def _whole_per_rank(u) -> bool:
    """Whether each rank holds whole matrices of u.

    True for a plain tensor, or an expert stack sharded on the expert dim; under HSDP it may
    also be replicated over its replicate dim.
    """
    return _dtensor(u) is None or (u.ndim == 3 and all(p.is_shard(0) or p.is_replicate()
                                                       for p in u.placements))


def _orthogonalize(u: Tensor, steps: int, eps: float) -> Tensor:
    """Newton-Schulz of one update outside the round-robin.

    Local where each rank holds whole matrices. Otherwise, on a mesh round_robin_ok does not
    take, the matrix is gathered whole and every rank repeats the work.
    """
    dt = _dtensor(u)
    if dt is None:
        return newton_schulz(u, steps, eps)
    if _whole_per_rank(u):
        local = newton_schulz(u.to_local(), steps, eps)
        return dt.DTensor.from_local(local, u.device_mesh, u.placements, shape=u.shape,
                                     stride=u.stride())
    full = newton_schulz(u.full_tensor(), steps, eps)
    return dt.distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)


def hidden_matrices(model: nn.Module) -> set:
    """The ids of Muon's parameters: every >=2-D weight but the embeddings and output head."""
    from ..model.transformer import Transformer

    skip = set()
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            skip.update(id(p) for p in m.parameters())
        if isinstance(m, Transformer):
            skip.update(id(p) for p in m.head.parameters())
    return {id(p) for p in model.parameters() if p.requires_grad and p.dim() >= 2
            and id(p) not in skip}


class Muon(torch.optim.Optimizer):
    """Muon and AdamW as one optimizer over both kinds of parameter group.

    One optimizer, so that GradScaler, clipping and the lr schedule see every parameter.
    Groups flagged "muon" get Muon's update; the others are a torch AdamW's own group dicts,
    shared, so a schedule's lr reaches it.
    """

    def __init__(self, matrices, adamw: torch.optim.AdamW, lr: float, weight_decay: float,
                 momentum: float, nesterov: bool, ns_steps: int, eps: float = 1e-7):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, eps=eps, muon=True)
        super().__init__([{"params": list(matrices)}], defaults)
        self.adamw = adamw
        self._link_adamw()

    def _link_adamw(self) -> None:
        self.param_groups = [g for g in self.param_groups if g["muon"]]
        for group in self.adamw.param_groups:
            group["muon"] = False
            self.add_param_group(group)
        self.state.update(self.adamw.state)
        self.adamw.state = self.state  # one state of every parameter: torch's state_dict
        # format (which torch.distributed.checkpoint reads) holds both kinds

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # (new group dicts and state: linked again)
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
        self.adamw.step()
        return loss

    def _muon_group(self, group) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        steps, eps = group["ns_steps"], group["eps"]
        pending: dict = {}  # mesh -> [(p, u)]: sharded matrices, NS'd a mesh-size at a time

        def update(p, o):
            p.mul_(1 - lr * wd)
            p.add_(o.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))

        def flush(mesh):
            todo = pending.pop(mesh)
            outs = orthogonalize_round_robin([u for _, u in todo],
                                             lambda x: newton_schulz(x, steps, eps))
            for (p, _), o in zip(todo, outs):
                update(p, o)

        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - mu)  # as torch.optim.Muon (an EMA of the gradients)
            u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
            if _whole_per_rank(u) or not round_robin_ok(u):
                update(p, _orthogonalize(u, steps, eps))
                continue
            pending.setdefault(u.device_mesh, []).append((p, u))
            if len(pending[u.device_mesh]) == u.device_mesh.size(shard_dim(u)):
                flush(u.device_mesh)
        for mesh in list(pending):  # (every rank holds the same matrices in the same order)
            flush(mesh)
