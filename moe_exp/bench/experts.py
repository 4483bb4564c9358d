"""Expert load balance from tokens-per-expert counts summed over the measured steps."""
from __future__ import annotations

import torch


def load_stats(counts: torch.Tensor) -> dict:
    """counts: (layers, experts). CV = std/mean (population); max/mean: the hottest expert.

    Overall: expert_load_cv is the mean of the layers' CVs; expert_load_max_over_mean
    the largest layer's (the slowest expert sets an expert-parallel step's pace).
    """
    c = counts.double()
    mean = c.mean(dim=1)
    cv = (c.std(dim=1, unbiased=False) / mean).tolist()
    mx = (c.max(dim=1).values / mean).tolist()
    return {
        "expert_load_cv": sum(cv) / len(cv),
        "expert_load_max_over_mean": max(mx),
        "expert_load_cv_per_layer": cv,
        "expert_load_max_over_mean_per_layer": mx,
        "tokens_per_expert": counts.tolist(),
    }
