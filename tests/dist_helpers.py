"""Functions run on gloo ranks by tests/test_distributed.py (importable by spawned ranks)."""
import torch
import torch.distributed as dist


def _cfg(overrides):
    from omegaconf import OmegaConf

    from conftest import compose

    cfg = compose(["hardware=cpu", "logger=none", *overrides])
    OmegaConf.set_struct(cfg, False)
    return cfg


def _twins(cfg, world: int, rows: int):
    """The same weights twice, one as one process's model, one with the run's
    optimizations applied, and `rows` sequences of 16 tokens: (ref, applied, x, y)."""
    from moe_exp.model import build_model
    from moe_exp.optimizations import apply

    torch.manual_seed(0)
    ref = build_model(cfg.model)
    model = build_model(cfg.model)
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, 17), generator=g)
    return ref, apply(model, cfg, torch.device("cpu"), world), tokens[:, :-1], tokens[:, 1:]


def ep_grads_match(overrides, batch: int, per_rank: bool = False) -> dict:
    """One forward/backward of the global batch: EP on 2 ranks vs one process on rank 0.
    Returns rank 0's comparison (max abs differences, counts equal). per_rank: the one
    process runs each rank's micro-batch apart (the mean of their losses), as token
    capacity is each micro-batch's."""
    from moe_exp import distributed

    cfg = _cfg(overrides)
    d = distributed.init(cfg)
    try:
        ref, applied, x, y = _twins(cfg, d.world, batch * d.world)
        mine = slice(d.rank * batch, (d.rank + 1) * batch)
        out = applied.model(x[mine], y[mine])
        out.loss.backward()
        applied.before_step()
        loss = distributed.all_mean(out.loss.detach())
        counts = out.counts.clone()
        dist.all_reduce(counts)
        grads = {n: p.grad for n, p in applied.model.named_parameters()}
        gathered = [None] * d.world
        dist.all_gather_object(gathered, grads)
        if not d.main:
            return None
        if per_rank:
            outs = [ref(x[r * batch:(r + 1) * batch], y[r * batch:(r + 1) * batch])
                    for r in range(d.world)]
            ref_out = outs[0]._replace(loss=sum(o.loss for o in outs) / d.world,
                                       counts=sum(o.counts for o in outs))
        else:
            ref_out = ref(x, y)
        ref_out.loss.backward()
        diffs = {}
        for name, p in ref.named_parameters():
            if ".experts." in name:  # rank r holds experts [r*n, (r+1)*n) as experts.local
                local = name.replace(".experts.", ".experts.local.")
                ep = cfg.parallel.expert_parallel_size or d.world
                mine_g = torch.cat([gr[local] for gr in gathered[:ep]])  # ep ranks 0..ep-1
                for r in range(ep, d.world):  # dp replicas of a shard hold the same grads
                    assert torch.allclose(gathered[r][local], gathered[r % ep][local]), name
            else:
                mine_g = gathered[0][name]
                for other in gathered[1:]:  # replicated grads are identical on every rank
                    assert torch.equal(other[name], mine_g), name
            diffs[name] = (mine_g - p.grad).abs().max().item()
        return {"loss": loss.item(), "ref_loss": ref_out.loss.item(), "grad_diffs": diffs,
                "counts_equal": torch.equal(counts, ref_out.counts), "kept": int(counts.sum()),
                "choices": x.numel() * cfg.model.top_k * counts.shape[0]}
    finally:
        distributed.finish()


def tp_grads_match(overrides, batch: int) -> dict | None:
    """One forward/backward under parallel.tp or cp (dp = world / tp / cp) vs one process
    running each dp rank's micro-batch apart (the mean of their losses). Rank 0's
    comparison: each gradient's largest difference relative to its largest entry, and the
    losses."""
    from torch.distributed.tensor import DTensor

    from moe_exp import distributed
    from moe_exp.config import data_rank, data_ranks, ep_size, experts_whole

    cfg = _cfg(overrides)
    d = distributed.init(cfg)
    try:
        dp = data_ranks(cfg.parallel, d.world)
        ref, applied, x, y = _twins(cfg, d.world, batch * dp)
        r = data_rank(cfg.parallel, d.world, d.rank)
        mine = slice(r * batch, (r + 1) * batch)
        out = applied.model(x[mine], y[mine])
        out.loss.backward()
        if applied.before_step:  # (tp's DTensor grad sync; FSDP2 reduces its own)
            applied.before_step()
        loss = distributed.all_mean(out.loss.detach())
        grads = [q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
                 for q in applied.model.parameters()]  # (collectives: on every rank)
        expert = [getattr(q, "_expert_parallel", False) for q in applied.model.parameters()]
        every = [None] * d.world
        dist.all_gather_object(every, grads)
        if not d.main:
            return None
        ep = ep_size(cfg.parallel, d.world)
        # rank 0's ep group on mesh (dp, ep, tp): ranks i * tp (etp=1: ep x tp, ranks i)
        step = 1 if experts_whole(cfg.parallel) else cfg.parallel.tp
        grads = [torch.cat([every[i * step][k] for i in range(ep)]) if e else gr
                 for k, (gr, e) in enumerate(zip(grads, expert))]
        outs = [ref(x[r * batch:(r + 1) * batch], y[r * batch:(r + 1) * batch])
                for r in range(dp)]
        ref_loss = sum(o.loss for o in outs) / dp
        ref_loss.backward()
        names = [n for n, _ in ref.named_parameters()]
        diffs = {n: ((mine_g - p.grad).abs().max() / p.grad.abs().max()).item()
                 for n, p, mine_g in zip(names, ref.parameters(), grads)}
        return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diffs": diffs}
    finally:
        distributed.finish()


def fail_on_rank_1(overrides) -> str:
    """Rank 1 raises; rank 0 waits in a collective that would never finish on its own."""
    from moe_exp import distributed

    d = distributed.init(_cfg(overrides))
    if d.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()
    return "rank 0 was not stopped"


def ddp_reductions_per_step(overrides) -> int:
    """Gradient buckets DDP reduces over one accumulated step (a comm hook counts them),
    run through the loop's own per-micro-step contexts (Applied.micro_contexts)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from moe_exp import distributed
    from moe_exp.train.loop import micro_step
    from moe_exp.model import build_model
    from moe_exp.optimizations import apply

    cfg = _cfg(["parallel=ddp", "hardware.devices=2", *overrides])
    d = distributed.init(cfg)
    try:
        torch.manual_seed(0)
        applied = apply(build_model(cfg.model), cfg, torch.device("cpu"), d.world)
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        applied.model.register_comm_hook(None, hook)
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
        for _ in range(2):  # the first step settles DDP's buckets (it rebuilds them after
            calls.clear()   # its first synced backward); count the second
            for ctx in applied.micro_contexts(cfg.train.grad_accum_steps):
                with ctx:
                    micro_step(applied.model, tokens[:, :-1], tokens[:, 1:],
                               applied.autocast, None, cfg.train.grad_accum_steps)
        return len(calls)
    finally:
        distributed.finish()


def grad_norm_matches(overrides, batch: int) -> dict:
    """The global gradient norm the strategy's clipping computes vs one process's on the
    global batch (rank 0 compares)."""
    from moe_exp import distributed
    from moe_exp.model import build_model
    from moe_exp.optimizations import apply

    cfg = _cfg(overrides)
    d = distributed.init(cfg)
    try:
        torch.manual_seed(0)
        ref = build_model(cfg.model)
        model = build_model(cfg.model)
        model.load_state_dict(ref.state_dict())
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg.model.vocab_size, (batch * d.world, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        applied = apply(model, cfg, torch.device("cpu"), d.world)
        mine = slice(d.rank * batch, (d.rank + 1) * batch)
        applied.model(x[mine], y[mine]).loss.backward()
        if applied.before_step:
            applied.before_step()
        norm = applied.clip(list(applied.model.parameters()), 1e9).item()
        placements = {str(getattr(p, "placements", None)) for p in applied.model.parameters()}
        if not d.main:
            return None
        ref(x, y).loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).item()
        return {"norm": norm, "ref_norm": ref_norm, "placements": sorted(placements)}
    finally:
        distributed.finish()


def max_with_nulls(overrides) -> list:
    """distributed.all_max where the ranks' nulls differ: rank 0 lacks the first value,
    rank 1 the second, neither has the third."""
    from moe_exp import distributed

    d = distributed.init(_cfg(["parallel=ddp", "hardware.devices=2", *overrides]))
    try:
        mine = [None, 2.0, None] if d.rank == 0 else [5.0, None, None]
        return distributed.all_max(mine, torch.device("cpu"))
    finally:
        distributed.finish()


def muon_round_robin(overrides, parallel="fsdp") -> dict:
    """One Muon step under FSDP (or HSDP) on 2 ranks, round-robin NS against every rank gathering
    every matrix (the previous way), from the same weights and gradients. Returns rank 0's
    largest parameter difference and both ranks' NS call counts per way."""
    import moe_exp.optim.muon as muon
    from moe_exp import distributed
    from moe_exp.model import build_model
    from moe_exp.optim import build_optimizer
    from moe_exp.optimizations import apply

    cfg = _cfg([f"parallel={parallel}", "hardware.devices=2", "optim=muon", *overrides])
    d = distributed.init(cfg)
    cpu = torch.device("cpu")
    try:
        params, calls = {}, {}
        for way in ("round_robin", "gathered"):
            torch.manual_seed(0)
            applied = apply(build_model(cfg.model), cfg, cpu, d.world)
            opt = build_optimizer(applied.model, cfg, cpu)[0]
            g = torch.Generator().manual_seed(1 + d.rank)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=g)
            applied.model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
            seen, real_ns, real_ok = [], muon.newton_schulz, muon.round_robin_ok
            muon.newton_schulz = lambda x, *a: (seen.append(tuple(x.shape)), real_ns(x, *a))[1]
            if way == "gathered":
                muon.round_robin_ok = lambda u: False
            try:
                opt.step()
            finally:
                muon.newton_schulz, muon.round_robin_ok = real_ns, real_ok
            params[way] = [p.full_tensor() for p in applied.model.parameters()]
            counts = torch.tensor([len(seen), 0])
            counts[1] = counts[0]
            dist.all_reduce(counts[1:], op=dist.ReduceOp.MAX)  # (the busier rank's)
            calls[way] = counts.tolist()
        diff = max((a - b).abs().max().item()
                   for a, b in zip(params["round_robin"], params["gathered"]))
        return {"diff": diff, "calls": calls}
    finally:
        distributed.finish()


def measured_step(overrides) -> dict | None:
    """plan.trace.measure_step on these ranks: rank 0's peak of live tensor memory over two
    real steps, and its split (what task=plan predicts for rank 0)."""
    every = measured_stages(overrides)
    return every and every[0]


def run_rank(cfg_dict: dict, out_dir: str) -> dict | None:
    """One run's rank body as the app's own launch runs it (pipeline.rank_main): its record
    on rank 0 (the cfg prepared by the parent, as pipeline.run does)."""
    from moe_exp.pipeline import rank_main

    return rank_main(cfg_dict, out_dir, [], {}, False, True)


def several(calls) -> list:
    """Each (helper name, args) of this module in turn on the same ranks and process group
    (its first helper joins it, the last leaves it): one launch (the ranks' start, ~5 s of
    a 2-core CPU) for several. Rank 0's results, in order."""
    import os
    import sys
    import time

    from moe_exp import distributed

    log = os.environ.get("SEVERAL_LOG")  # a file: each call's seconds, appended
    helpers, leave = sys.modules[__name__], distributed.finish
    distributed.finish = lambda: None  # (a process group left and joined again hung)
    try:
        results = []
        for name, args in calls:
            t0 = time.perf_counter()
            results.append(getattr(helpers, name)(*args))
            dist.barrier()
            if log and dist.get_rank() == 0:  # (where the suite's time goes)
                with open(log, "a") as f:
                    f.write(f"{time.perf_counter() - t0:.1f} s, {dist.get_world_size()} "
                            f"ranks: {name} {str(args)[:150]}\n")
    finally:
        distributed.finish = leave
        leave()
    return results  # (the launch returns rank 0's)


def pp_grads_match(overrides, batch: int) -> dict | None:
    """One schedule step under parallel.pp (every rank's micro-batch of `batch` rows, in
    parallel.pp_microbatches parts) vs one process running every part apart, the mean of
    their losses: gradient accumulation. Rank 0's comparison: the losses, expert counts, and
    each gradient's largest difference relative to its largest entry."""
    from torch.distributed.tensor import DTensor

    from moe_exp import distributed
    from moe_exp.config import (data_rank, data_ranks, ep_size, experts_whole,
                                pp_microbatches, tp_size)

    cfg = _cfg(["train.seq_len=16", f"train.micro_batch_size={batch}", *overrides])
    d = distributed.init(cfg)
    try:
        dp = data_ranks(cfg.parallel, d.world)
        ref, applied, x, y = _twins(cfg, d.world, batch * dp)
        r = data_rank(cfg.parallel, d.world, d.rank)
        out = applied.model(x[r * batch:(r + 1) * batch], y[r * batch:(r + 1) * batch])
        if applied.before_step:  # (tp's DTensor grad sync; FSDP2 reduces its own)
            applied.before_step()
        loss = distributed.all_mean(out.loss.detach())
        counts = out.counts.clone()
        dist.all_reduce(counts)
        # (every stage holds them; every tp rank too, but where each routes its shard)
        counts //= cfg.parallel.pp * (1 if experts_whole(cfg.parallel) else tp_size(cfg.parallel))
        grads = {n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
                 .replace(".inner.", "."):  # (tp's split experts)
                 q.grad.full_tensor() if isinstance(q.grad, DTensor) else q.grad
                 for n, q in applied.model.named_parameters()}  # (collectives: every rank)
        every = [None] * d.world
        dist.all_gather_object(every, grads)
        if not d.main:
            return None
        parts = dp * pp_microbatches(cfg.parallel)
        rows = batch * dp // parts
        outs = [ref(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
                for i in range(parts)]
        ref_loss = sum(o.loss for o in outs) / parts
        ref_loss.backward()
        ep = ep_size(cfg.parallel, d.world) if cfg.parallel.name.startswith("expert") else 1
        diffs, held = {}, {}
        for name, p in ref.named_parameters():
            local = name.replace(".experts.", ".experts.local.")
            have = [g[name] for g in every if name in g] or [g[local] for g in every
                                                             if local in g]
            held[name] = len(have)
            mine = torch.cat(have[:ep]) if name != local and ep > 1 else have[0]
            if mine is None:
                diffs[name] = float("inf")
                continue
            diffs[name] = ((mine - p.grad).abs().max() / p.grad.abs().max()).item()
        return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_diffs": diffs,
                "held": held, "counts_equal": bool(
                    not counts.numel() or torch.equal(counts, sum(o.counts for o in outs)))}
    finally:
        distributed.finish()


def measured_stages(overrides) -> list | None:
    """measured_step on every rank (a pipeline's stages): each rank's peak of live tensor
    memory over two real steps, its split and its collectives, gathered on rank 0."""
    from moe_exp import distributed
    from moe_exp.plan.trace import measure_step

    cfg = _cfg(overrides)
    d = distributed.init(cfg)
    try:
        got = measure_step(cfg)
        every = [None] * d.world
        dist.all_gather_object(every, {"peak": got.peak_bytes, "at_peak": got.at_peak,
                                       "comm": got.comm})
        return every if d.main else None
    finally:
        distributed.finish()
