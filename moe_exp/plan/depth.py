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
        return None  # (a pipeline's ranks each trace their stages' blocks alone)
    lead = m.first_k_dense if m.num_experts else 0
    # (FSDP2's explicit prefetch reaches parallel.prefetch blocks ahead: past its window)
    a = lead + max(2, cfg.parallel.prefetch + 1)
    return (a, a + 1) if a + 1 < m.num_layers else None


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
    f = (n - a) / (b - a)
    phases = [_line({"peak": pa[0], **pa[1]}, {"peak": pb[0], **pb[1]}, f)
              for pa, pb in zip(steps[0].phases, steps[1].phases)]
    peak = max(phases, key=lambda p: p["peak"])
    return _line(recs[0], recs[1], f), peak.pop("peak"), peak


def _line(x, y, f: float):
    """x + f (y - x) for every number in x and y, nested dicts too; else y's value."""
    if isinstance(x, dict) and isinstance(y, dict):
        return {k: _line(x.get(k), v, f) for k, v in y.items()}
    if isinstance(x, bool) or isinstance(y, bool) or not isinstance(x, (int, float)) \
            or not isinstance(y, (int, float)):
        return y
    v = x + f * (y - x)
    return round(v) if isinstance(x, int) and isinstance(y, int) else v
