"""parallel.pp_balance=time: the pipeline's split by each block's planned time.

A dense block's, a MoE block's and the rest's time (embedding, final norm, LM head, loss,
all on the last stage as config.balanced takes them) from plans of a stage's rank (the
layout less its pipeline: its experts, shards and tensor parts as the run holds them) at
two or three small depths, each a difference of two: a block's forward, backward,
optimizer step and collectives (its all-gathers, all-to-alls) at the plan's basis
(hardware.calibration's rates, else the profile's roofline), at a pipeline micro-batch.
(Weighed by its compute alone, DeepSeek-V3's EP 64 x PP 4 planned 3% slower than split by
FLOPs, and 7% on one device holding every expert; as here, the FLOPs' split.)"""
from __future__ import annotations

from ..config import ConfigError, balanced, pp_microbatches, pp_size, stages_per_rank


def resolve_split(cfg) -> None:
    """parallel.pp_balance=time: its split into parallel.pp_split (the record's, as
    resolved); raises ConfigError where the plan cannot time a block."""
    p = cfg.parallel
    if p.pp_balance != "time" or pp_size(p) <= 1 or p.pp_split is not None:
        return
    weights, tail = block_ms(cfg)
    p.pp_split = list(balanced(tuple(weights), tail, p.pp * stages_per_rank(p))[1:])


def block_ms(cfg) -> tuple[list[float], float]:
    """Each block's planned ms, the dense first blocks' then the MoE blocks', and the
    rest's."""
    m = cfg.model
    dense = m.first_k_dense if m.num_experts else 0
    if not dense:  # (every block alike)
        one, two = _ms(cfg, 0, 1), _ms(cfg, 0, 2)
        return [two - one] * m.num_layers, 2 * one - two
    base, more_moe, more_dense = _ms(cfg, 1, 1), _ms(cfg, 1, 2), _ms(cfg, 2, 1)
    moe, first = more_moe - base, more_dense - base
    return [first] * dense + [moe] * (m.num_layers - dense), base - first - moe


def _ms(cfg, dense: int, moe: int) -> float:
    """The planned ms of a stage's rank's step with `dense` dense-first blocks and
    `moe` others, at a pipeline micro-batch: the layout without its pipeline, on world / pp
    devices."""
    from .depth import at_depth
    from .predict import plan_step

    one = at_depth(cfg, dense + moe)
    if cfg.model.num_experts:
        one.model.first_k_dense = dense
    p, one.hardware.devices = one.parallel, cfg.hardware.devices // pp_size(cfg.parallel)
    p.pp, p.pp_split = 1, None
    if one.hardware.devices == 1:  # (a stage of one rank: one device, no strategy)
        p.name, p.tp, p.cp, p.expert_parallel_size = "none", 1, 1, None
    one.train.micro_batch_size = max(
        cfg.train.micro_batch_size // pp_microbatches(cfg.parallel), 1)
    rec: dict = {"null_reasons": {}}
    plan_step(one, rec)
    if rec.get("planned_step_ms") is None:
        raise ConfigError("parallel.pp_balance", "time needs the plan's time of a block: "
                          f"{rec['null_reasons'].get('planned_step_ms')}")
    return rec["planned_step_ms"]
