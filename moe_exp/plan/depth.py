"""A deep model's plan from two shallow traces (train.plan_depth=auto).

A model's blocks past its first_k_dense are alike, and each adds the same ops, the same
collectives and the same memory to every phase of a step: a plan's figures are linear in
the number of blocks. So a model of many blocks is traced at two depths, a and a + 1, and
each figure taken on the line through them at the model's depth. Memory is extrapolated
phase by phase (the first optimizer step, the micro-steps, the optimizer step), whose peaks
grow at different rates, and the peak is the largest."""
from __future__ import annotations

import copy

MIN_BLOCKS = 8  # models of fewer blocks are traced whole


def traced_depths(cfg) -> tuple[int, int] | None:
    """The two depths traced for cfg's model, or None where it is traced whole."""
    from ..config import pp_size

    m = cfg.model
    if cfg.train.plan_depth == "full" or m.num_layers < MIN_BLOCKS or pp_size(cfg.parallel) > 1:
        return None  # (a pipeline's stages: stage_depths)
    lead = m.first_k_dense if m.num_experts else 0
    # (FSDP2's explicit prefetch reaches parallel.prefetch blocks ahead: past its window)
    a = lead + max(2, cfg.parallel.prefetch + 1)
    return (a, a + 1) if a + 1 < m.num_layers else None


def stage_depths(cfg) -> tuple[int, int] | None:
    """A pipeline's two traced depths a stage (its MoE blocks; the first stage holds the
    dense ones too), or None where tracing every block costs less."""
    from ..config import pp_size, stages_per_rank

    m, p = cfg.model, cfg.parallel
    if cfg.train.plan_depth == "full" or pp_size(p) == 1:
        return None
    lead = m.first_k_dense if m.num_experts else 0
    a, stages = max(2, p.prefetch + 1), p.pp * stages_per_rank(p)
    return (a, a + 1) if 2 * lead + stages * (2 * a + 1) < m.num_layers else None


def at_stage_depth(cfg, a: int):
    """cfg's pipeline with `a` MoE blocks a stage (the first stage's dense blocks before
    them)."""
    from ..config import pp_size, stages_per_rank

    m, p = cfg.model, cfg.parallel
    lead, stages = (m.first_k_dense if m.num_experts else 0), pp_size(p) * stages_per_rank(p)
    out = at_depth(cfg, lead + stages * a)
    out.parallel.pp_split = [lead + a * s for s in range(1, stages)]
    return out


def stage_moe_blocks(cfg) -> list[int]:
    """Each stage's MoE blocks (the first stage's less the dense ones), as the run splits."""
    from ..config import pp_stages

    m = cfg.model
    first = pp_stages(cfg) + [m.num_layers]
    lead = m.first_k_dense if m.num_experts else 0
    return [b - a - (lead if i == 0 else 0) for i, (a, b) in enumerate(zip(first, first[1:]))]


def at_depth(cfg, layers: int):
    """cfg with `layers` blocks."""
    out = copy.deepcopy(cfg)
    out.model.num_layers = layers
    return out


def extrapolate(cfg, depths: tuple[int, int], recs: list[dict], steps: list):
    """cfg's plan at its model's depth on the line through the plans made at `depths`:
    (their records' figures, the peak's bytes, its bytes by kind). Memory goes phase by
    phase (StepMemory.phases): the peak is the largest phase's at the model's depth."""
    (a, b), n = depths, cfg.model.num_layers
    return on_line((n - a) / (b - a), recs, [st.phases for st in steps])


def on_line(f: float, recs: list[dict], phases: list[list]):
    """The figures f of the way from recs[0] to recs[1] (f = 1: recs[1]), the peak's
    bytes and its bytes by kind, phase by phase."""
    peak = max(reversed(phases_on_line(f, *phases)), key=lambda p: p[0])  # (a tie: the
    return _line(recs[0], recs[1], f), peak[0], dict(peak[1])  # later phase's, as traced)


def phases_on_line(f: float, pa: list, pb: list) -> list[tuple]:
    """StepMemory.phases f of the way from pa to pb: (peak, bytes by kind) each."""
    out = []
    for x, y in zip(pa, pb):
        d = _line({"peak": x[0], **x[1]}, {"peak": y[0], **y[1]}, f)
        out.append((d.pop("peak"), d))
    return out


def _line(x, y, f: float):
    """x + f (y - x) for every number in x and y, nested dicts too; else y's value."""
    if isinstance(x, dict) and isinstance(y, dict):
        return {k: _line(x.get(k), v, f) for k, v in y.items()}
    if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) \
            or not isinstance(y, (int, float)):
        return y
    v = x + f * (y - x)
    return round(v) if isinstance(x, int) and isinstance(y, int) else v
