"""Expert load balance from tokens-per-expert counts summed over the measured steps."""
from __future__ import annotations

import torch


QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


def load_stats(counts: torch.Tensor, choices: int | None = None) -> dict:
    """The record's expert-load figures: spread, hottest expert, dead experts, drop rate.

    counts: (layers, experts), the tokens computed, summed over the window. choices: the
    (token, choice) pairs each layer routed over the window, kept or dropped. CV is the
    population std over the mean; max/mean is the hottest expert's.

    Overall: expert_load_cv is the mean of the layers' CVs; expert_load_max_over_mean the
    largest layer's, as the slowest expert sets an expert-parallel step's pace; drop_rate
    the share of choices over an expert's capacity; dead_experts those no token reached.
    """
    c = counts.double()
    mean = c.mean(dim=1)
    cv = (c.std(dim=1, unbiased=False) / mean).tolist()
    mx = (c.max(dim=1).values / mean).tolist()
    q = torch.quantile(c / mean[:, None], c.new_tensor(QUANTILES), dim=1)
    return {
        "expert_load_cv": sum(cv) / len(cv),
        "expert_load_max_over_mean": max(mx),
        "expert_load_cv_per_layer": cv,
        "expert_load_max_over_mean_per_layer": mx,
        "expert_load_quantiles_per_layer": [[round(v, 4) for v in row] for row in q.T.tolist()],
        "dead_experts": int((counts == 0).sum()),
        "drop_rate": 1 - c.sum().item() / (choices * c.shape[0]) if choices else None,
        "tokens_per_expert": counts.tolist(),
    }
