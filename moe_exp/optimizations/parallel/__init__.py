"""Parallelism, parallel=none|ddp|fsdp|expert|expert_fsdp|hsdp, applied to a plain model,
and parallel.tp (tensor.py) under fsdp and expert_fsdp.

optimizations.apply uses torchtitan's order: tensor parallel, expert parallel, activation
checkpointing, data parallel, compile.

Gradient semantics: every rank's loss is the mean over its own micro-batch; the update
equals the single-process one on the concatenated global batch."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ...config import FSDP2, cp_size, data_ranks
from .expert import shard_experts
from .hooks import record_reduce_bytes, register_comm_hook  # noqa: F401 (the API)


def device_mesh(cfg, world: int):
    """The run's one device mesh, its dims and sizes config.mesh_dims's: ([pp, ]dp_shard[,
    cp][, tp]) for fsdp, (dp[, cp], ep[, tp]) for expert parallel, (dp_replicate, dp_shard
    [, cp][, tp]) for hsdp."""
    from torch.distributed.device_mesh import init_device_mesh

    from ...config import mesh_dims

    dims = mesh_dims(cfg.parallel, cfg.hardware.devices, world)
    return init_device_mesh(cfg.hardware.device, tuple(n for _, n in dims),
                            mesh_dim_names=tuple(d for d, _ in dims))


def expert_groups(cfg, mesh):
    """Expert parallel's (ep, dp) process groups on the run's mesh: ep x tp is the ep group
    where the experts stay whole under tensor parallel (parallel.etp=1)."""
    from ...config import experts_whole

    ep_mesh = mesh["ep", "tp"]._flatten("ep_tp") if experts_whole(cfg.parallel) else mesh["ep"]
    return ep_mesh.get_group(), mesh["dp"].get_group()


def apply_tensor(model: nn.Module, cfg, mesh) -> None:
    """parallel.tp: split the model over the tp dim of the run's mesh; under expert_fsdp
    the experts are split (or sharded whole over ep x tp) in apply_expert."""
    from ...config import experts_whole
    from .tensor import apply_tensor_parallel

    p, whole = cfg.parallel, experts_whole(cfg.parallel)
    apply_tensor_parallel(model, mesh["tp"], p.sequence_parallel,
                          experts="whole" if whole else p.name != "expert_fsdp")


def enable_async_tp(mesh) -> None:
    """parallel.async_tp, as torchtitan enables it: inductor's micro-pipelined TP splits
    each all-gather and reduce-scatter of the tp group and overlaps the pieces with the
    matmul that uses them, on the group's symmetric memory (CUDA)."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(mesh["tp"].get_group().group_name)


def tp_sync(model: nn.Module, tp: int):
    """With tensor parallel, each gradient in its parameter's placements before the step."""
    if tp <= 1:
        return None
    from .tensor import sync_grads

    params = list(model.parameters())
    return lambda: sync_grads(params)


def apply_expert(model: nn.Module, cfg, mesh):
    """Shard the experts over the ep group; under tensor parallel, split each rank's
    experts over the tp group too (etp = tp), or with parallel.etp=1 shard them over ep x
    tp, whole."""
    from ...config import experts_whole

    ep_group, dp_group = expert_groups(cfg, mesh)
    shard_experts(model, ep_group)
    if "tp" in (mesh.mesh_dim_names or ()) and not experts_whole(cfg.parallel):
        from .expert import ExpertParallel
        from .tensor import split_experts

        for m in model.modules():
            if isinstance(m, ExpertParallel):
                m.local = split_experts(m.local, mesh["tp"])
                for prm in m.local.parameters():
                    prm._expert_parallel = True
    return ep_group, dp_group


def apply_data_parallel(model: nn.Module, cfg, device, world: int, mesh):
    """Wrap the model for ddp, fsdp, expert_fsdp or hsdp; after AC, before compile."""
    p = cfg.parallel
    if p.name == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   bucket_cap_mb=p.bucket_cap_mb, gradient_as_bucket_view=p.gradient_as_bucket_view,
                   static_graph=p.static_graph)
    if p.name in FSDP2:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from ..precision import DTYPES

        dtype = DTYPES.get(cfg.precision.autocast_dtype)
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
              "reshard_after_forward": p.reshard_after_forward}
        if p.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        world_mesh, expert_mesh = _fsdp_meshes(p, mesh)
        units = []  # per block: [block, its FSDP-sharded experts (expert_fsdp)]
        shards = world_mesh.size(world_mesh.ndim - 1)  # (HSDP: its shard dim's ranks)
        for block in _blocks(model):
            units.append([block])
            if p.name == "expert_fsdp" and hasattr(block.ffn, "experts"):
                experts = block.ffn.experts.local  # EP shard: FSDP over dp only
                fully_shard(experts, mesh=expert_mesh, **kw,
                            shard_placement_fn=expert_placement(experts, expert_mesh.size()))
                for prm in experts.parameters():  # fully_shard made new ones: mark them again
                    prm._expert_parallel = True
                # sum over ep, mean over the data and cp ranks (tensor-parallel ones share
                # theirs)
                experts.set_gradient_divide_factor(float(data_ranks(p, world) * cp_size(p)))
                if dist.get_backend() == "gloo" and expert_mesh.size() > 1:
                    # gloo has no PREMUL_SUM: sum, then divide (not over one rank: there
                    # FSDP2 skips the reduce-scatter, divides, and forced to sum, divides again)
                    experts.set_force_sum_reduction_for_comms(True)
                units[-1].append(experts)
            experts = getattr(block.ffn, "experts", None)  # (expert_fsdp's: sharded above)
            fully_shard(block, mesh=world_mesh, **kw, shard_placement_fn=None if experts is None
                        or p.name == "expert_fsdp" else expert_placement(experts, shards))
        fully_shard(model, mesh=world_mesh, **kw)
        if p.prefetch:
            _prefetch(model, units, p.prefetch)
    return model


def _fsdp_meshes(p, mesh):
    """FSDP2's mesh for the dense parameters, the data ranks x cp (expert_fsdp: dp x cp x
    ep; hsdp: replicate x (shard x cp)), and expert_fsdp's for its experts (dp x cp)."""
    cp = cp_size(p) > 1
    if p.name == "hsdp":
        if cp:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        return mesh["dp_replicate", "dp_shard_cp" if cp else "dp_shard"], None
    if p.name == "fsdp":
        return (mesh["dp_shard", "cp"]._flatten("dp_shard_cp") if cp else mesh["dp_shard"]), None
    dims = ("dp", "cp", "ep") if cp else ("dp", "ep")
    return mesh[dims]._flatten("dp_shard_cp" if cp else "dp_shard"), \
        (mesh["dp", "cp"]._flatten("dp_cp") if cp else mesh["dp"])


def expert_placement(experts: nn.Module, shards: int):
    """FSDP2's shard_placement_fn for a block's stacked experts (experts x in x out):
    where `shards` ranks do not split the experts evenly, the first of dims 1 and 2 they
    split evenly (FSDP2 pads dim 0 only), as torchtitan shards on dim 1.

    Sharded on dim 0, fewer experts than ranks leave a rank whole experts and the others
    none (mixtral's 8 over 64 ranks: 21.1 GiB on rank 0 against 2.7); where no dim
    splits evenly, and for other params, FSDP2's Shard(0)."""
    from torch.distributed.tensor import Shard

    mine = {id(q) for q in experts.parameters()}

    def placement(param):
        if id(param) not in mine or param.ndim != 3 or param.shape[0] % shards == 0:
            return None
        return next((Shard(d) for d in (1, 2) if param.shape[d] % shards == 0), None)

    return placement


def _prefetch(root, units: list, n: int) -> None:
    """Set up FSDP2's explicit prefetching, as torchtitan's.

    In forward each block issues the all-gathers of its own experts and of the next n blocks
    with theirs; in backward, of the previous n. The root issues the first n in forward and
    the last n in backward. An explicit list replaces FSDP2's default, so every sharded
    module is listed.
    """
    def flat(us):
        return [m for u in us for m in u]

    for i, (block, *own) in enumerate(units):
        if fwd := own + flat(units[i + 1: i + 1 + n]):
            block.set_modules_to_forward_prefetch(fwd)
        if bwd := own + flat(units[max(0, i - n): i][::-1]):
            block.set_modules_to_backward_prefetch(bwd)
    root.set_modules_to_forward_prefetch(flat(units[:n]))
    root.set_modules_to_backward_prefetch(flat(units[::-1][:n]))


def accum_no_sync(model: nn.Module, cfg):
    """The context that skips gradient reduction on a micro-step; None to sync every time.

    ddp: DDP.no_sync. fsdp, expert_fsdp and hsdp: FSDP2's set_requires_gradient_sync(False);
    grads stay unsharded until the last micro-step, trading memory for less communication.
    expert: None, as its grad sync, before_step, runs once per step anyway.
    """
    p = cfg.parallel
    if cfg.train.grad_accum_steps <= 1 or not p.accum_no_sync:
        return None
    if p.name == "ddp":
        return model.no_sync
    if p.name in FSDP2:
        @contextlib.contextmanager
        def no_sync():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return no_sync
    return None


def _blocks(model: nn.Module):
    from ...model.transformer import block_items

    inner = getattr(model, "_checkpoint_wrapped_module", model)
    for _, block in block_items(inner.layers):
        yield block


def grad_sync(model: nn.Module, cfg, world: int, dp_group):
    """parallel=expert: average replicated grads over all ranks; expert grads are summed
    over the EP group by the all_to_all backward, so sum over dp and divide by world."""
    if cfg.parallel.name != "expert":
        return None
    params = [p for p in model.parameters()]

    def sync():
        rep = [p.grad for p in params if p.grad is not None and not _is_expert(p)]
        exp = [p.grad for p in params if p.grad is not None and _is_expert(p)]
        for grads, group in ((rep, None), (exp, dp_group)):
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            if group is None or dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
    return sync


def _is_expert(p) -> bool:
    return getattr(p, "_expert_parallel", False)


def clip_grad_norm(params, max_norm: float, ep_group, pp_group=None) -> torch.Tensor:
    """Global grad-norm clipping across ranks; returns the norm before clipping.

    Each parameter's local squares are summed over the groups it is split over: the mesh
    dims with a Shard placement, so not HSDP's replicate dim, and the EP group for expert
    shards; then over a pipeline's stages (pp_group), each holding its own parameters.
    """
    from torch.distributed.tensor import DTensor

    sums: dict = {}
    grads = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        grads.append(local)
        groups = []
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            groups += [mesh.get_group(d) for d, pl in enumerate(g.placements)
                       if pl.is_shard() and mesh.size(d) > 1]
        if _is_expert(p) and ep_group is not None:
            groups.append(ep_group)
        key = tuple(groups)
        sums[key] = sums.get(key, 0) + local.detach().float().pow(2).sum()
    total = torch.zeros((), device=grads[0].device) if grads else torch.zeros(())
    for groups, sq in sums.items():
        for grp in groups:
            dist.all_reduce(sq, group=grp)
        total = total + sq
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


_COMM_KEYS = ("nccl", "gloo", "c10d::", "all_to_all", "allreduce", "all_reduce",
              "all_gather", "allgather", "reduce_scatter", "alltoall")
_NOT_COMPUTE = ("wait", "record_param_comms")  # (a wait on a collective; c10d's marker)


def _is_comm(ev) -> bool:
    return any(k in ev.name.lower() for k in _COMM_KEYS)


def _on_cuda(ev) -> bool:
    return str(getattr(ev, "device_type", "")).endswith("CUDA")


# a collective's kind from its event's name, lowercased without "_" (c10d's ops, gloo's
# and NCCL's kernels: ncclDevKernel_AllGather_RING_LL; an all-to-all is NCCL's SendRecv)
_KINDS = (("all_gather", ("allgather",)), ("reduce_scatter", ("reducescatter",)),
          ("all_reduce", ("allreduce",)), ("all_to_all", ("alltoall", "sendrecv")),
          ("broadcast", ("broadcast",)),
          # a pipeline's sends and receives (on CUDA NCCL's p2p kernels are SendRecv: all_to_all)
          ("send_recv", ("gloo:send", "gloo:recv", "nccl:send", "nccl:recv")))
COMM_KINDS = tuple(k for k, _ in _KINDS)


def _kind(ev) -> str | None:
    name = ev.name.lower().replace("_", "")
    return next((k for k, words in _KINDS if any(w in name for w in words)), None)


def comm_times(prof, steps: int) -> tuple[float | None, float | None, dict]:
    """Communication time per step from a torch.profiler trace: (comm_ms, comm_exposed_ms,
    by kind: {"all_gather": {"ms", "exposed_ms"}, ...}).

    The trace's events are read once.

    comm_ms: the time during which any collective is in flight, the union of their
    intervals; a sum would count the same time twice. On a GPU the collectives are NCCL
    kernels: FSDP's all-gathers and reduce-scatters run on separate streams and may
    overlap. On CPU they are gloo and c10d events: gloo runs them on several threads at
    once, and the caller's c10d event encloses its worker's.

    comm_exposed_ms: of that, the time no compute runs. Compute on a GPU is every kernel
    on any stream that is not NCCL's; on CPU, the innermost ops, those with no child op,
    that are neither a collective nor a wait on one. gloo runs a collective on its own
    threads while the caller waits, as in expert parallel's all_to_all, or computes on, as
    with DDP's gradient all-reduce during the backward: the first is exposed, the second
    is not.

    By kind, the same for each kind's events alone (kinds in flight at once each count it)."""
    if steps <= 0:
        return None, None, {}
    events = list(prof.events())
    comm = [ev for ev in events if _is_comm(ev)]
    kernels = [ev for ev in comm if "nccl" in ev.name.lower() and _on_cuda(ev)]
    spans = [(ev.time_range.start, ev.time_range.end) for ev in (kernels or comm)]
    if kernels:
        compute = [ev for ev in events if _on_cuda(ev) and "nccl" not in ev.name.lower()]
    else:
        compute = [ev for ev in events if not getattr(ev, "cpu_children", None)
                   and not _is_comm(ev) and not any(w in ev.name.lower() for w in _NOT_COMPUTE)]
    busy = [(ev.time_range.start, ev.time_range.end) for ev in compute]

    def times(evs):
        spans = [(ev.time_range.start, ev.time_range.end) for ev in evs]
        total = union_us(spans)
        return total / 1e3 / steps, (total - overlap_us(spans, busy)) / 1e3 / steps

    kinds: dict = {}
    for ev in kernels or comm:
        if (k := _kind(ev)) is not None:
            kinds.setdefault(k, []).append(ev)
    by_kind = {k: dict(zip(("ms", "exposed_ms"), times(evs))) for k, evs in sorted(kinds.items())}
    return (*times(kernels or comm), by_kind)


def _merged(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def overlap_us(a, b) -> float:
    """Length of the intersection of the union of intervals a with that of b."""
    a, b, i, j, total = _merged(a), _merged(b), 0, 0, 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def union_us(spans) -> float:
    """Total length of the union of (start, end) intervals."""
    return sum(e - s for s, e in _merged(spans))
