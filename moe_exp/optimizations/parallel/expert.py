"""Expert parallelism: each rank of the expert-parallel group holds num_experts / ep experts.

The MoE layer hands its experts module the rows sorted by global expert and the count per
expert. This wrapper, which replaces `moe.experts`, sends each row to the rank that owns
its expert with an autograd-aware `all_to_all_single` of uneven splits, runs the local
experts and sends the results back. The model itself is unchanged."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ...model.moe import Experts, gather_rows, inverse_permutation


class ExpertParallel(nn.Module):
    def __init__(self, experts: Experts, group, timer=None):
        super().__init__()
        self.group, self.timer = group, timer
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        total = experts.w1.shape[0]
        self.num_local = total // self.ep
        lo = self.rank * self.num_local
        h, f = experts.w1.shape[1:]
        with torch.device(experts.w1.device):
            self.local = Experts(self.num_local, h, f)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(self.local, name).copy_(getattr(experts, name)[lo: lo + self.num_local])
        for p in self.local.parameters():
            p._expert_parallel = True  # sharded over the EP group (grad sync and clipping)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        ep, n = self.ep, self.num_local
        # counts[e] rows for global expert e; rank r owns experts [r*n, (r+1)*n)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (src rank, local e)
        send = counts.view(ep, n).sum(1).tolist()
        recv_by_src = recv_counts.view(ep, n)
        recv = recv_by_src.sum(1).tolist()
        x_recv = all_to_all_single_autograd(x, recv, send, self.group)
        # rows arrive grouped by source rank, then local expert: regroup by local expert
        local_e = torch.arange(n, device=x.device).repeat(ep)
        seg = torch.repeat_interleave(local_e, recv_by_src.reshape(-1),
                                      output_size=x_recv.shape[0])  # (no sync for its size)
        order = torch.argsort(seg, stable=True)
        inv = inverse_permutation(order)
        # gathers both ways (their backwards are gathers too: see moe._Gather)
        y = self.local(gather_rows(x_recv, order, inv), recv_by_src.sum(0), grouped)
        y_back = gather_rows(y, inv, order)
        return all_to_all_single_autograd(y_back, send, recv, self.group)


def shard_experts(model: nn.Module, group) -> int:
    """Replace every MoE layer's experts with this rank's shard; returns how many."""
    from ...model.moe import MoE

    n = 0
    for m in model.modules():
        if isinstance(m, MoE):
            m.experts = ExpertParallel(m.experts, group)
            n += 1
    return n
