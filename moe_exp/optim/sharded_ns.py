"""Newton-Schulz on FSDP-sharded matrices, each computed once, on one rank.

Round-robin, as Moonlight and Dion do: of every `world` consecutive matrices on a mesh,
rank i orthogonalizes the i-th. One all-to-all brings rank i the shards of its matrix, a
second sends every rank its rows of each result. Both move bf16, which loses nothing: NS
casts its input to bf16 first and returns bf16.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def shard_dim(u) -> int | None:
    """The mesh dim a DTensor's dim 0 is sharded over, where that is its only split; else None.

    The split must be over one mesh dim of several ranks: FSDP2's layout, or HSDP's "shard"
    dim with the tensor replicated over "replicate".
    """
    dims = [d for d, pl in enumerate(u.placements) if not pl.is_replicate()]
    ok = len(dims) == 1 and u.placements[dims[0]].is_shard(0) and u.device_mesh.size(dims[0]) > 1
    return dims[0] if ok else None


def round_robin_ok(u) -> bool:
    return shard_dim(u) is not None


def shard_rows(n: int, world: int) -> list[int]:
    """Rows in each rank's shard of n rows, as DTensor's Shard(0) splits them.

    As torch.chunk: ceil(n / world) each, the last ones shorter or empty.
    """
    per = -(-n // world)
    return [max(0, min(per, n - r * per)) for r in range(world)]


def orthogonalize_round_robin(us: list, ns) -> list:
    """Orthogonalize up to a shard dim's size of sharded matrices, each on one rank.

    us: DTensors on one mesh that round_robin_ok takes; ns: the NS function of a whole
    tensor. Returns their orthogonalized DTensors in bf16, in the same layout. Under HSDP
    each replica group does the same over its own shard group.
    """
    from torch.distributed.tensor import DTensor

    mesh, d = us[0].device_mesh, shard_dim(us[0])
    group, world, rank = mesh.get_group(d), mesh.size(d), mesh.get_local_rank(d)
    assert len(us) <= world
    rows = [shard_rows(u.shape[0], world) for u in us]
    inner = [math.prod(u.shape[1:]) for u in us]
    mine = [u.to_local().bfloat16().reshape(-1) for u in us]
    for j, m in enumerate(mine):  # the layout this relies on
        assert m.numel() == rows[j][rank] * inner[j], (us[j].shape, rows[j], m.numel())
    pad = [0] * (world - len(us))
    owns = rank < len(us)
    # 1: rank j gets every rank's shard of matrix j, in rank order (its rows in order)
    got = [rows[rank][k] * inner[rank] for k in range(world)] if owns else [0] * world
    whole = mine[0].new_empty(sum(got))
    dist.all_to_all_single(whole, torch.cat(mine), got, [m.numel() for m in mine] + pad,
                           group=group)
    # 2: rank j sends each rank its rows of the result
    result = ns(whole.view(us[rank].shape)).reshape(-1) if owns else whole
    back = [rows[j][rank] * inner[j] for j in range(len(us))] + pad
    local = whole.new_empty(sum(back))
    dist.all_to_all_single(local, result.contiguous(), back, got, group=group)
    return [DTensor.from_local(piece.view(rows[j][rank], *u.shape[1:]), mesh, u.placements,
                               shape=u.shape, stride=u.stride())
            for j, (u, piece) in enumerate(zip(us, local.split(back[:len(us)])))]
