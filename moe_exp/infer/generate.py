"""Greedy generation with a KV cache, timed: the prompt's prefill, then each further token.

The prefill gives the first new token."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..bench.timer import device_sync
from ..model.cache import KVCache
from ..model.transformer import decode


@dataclass
class Generated:
    tokens: torch.Tensor  # (batch, new_tokens)
    prefill_s: float  # the prompt's forward and the first token (time to first token)
    token_s: list  # each further token's step, seconds
    counts: torch.Tensor | None  # (MoE layers, experts) tokens routed in those steps
    kv_bytes: int  # the KV cache's buffers


def _next(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def generate(model, prompts: torch.Tensor, new_tokens: int, autocast, device,
             on_step=None, step=decode) -> Generated:
    """Generates new_tokens greedy tokens after each prompt, timing each step.

    prompts: (batch, prompt_len); the KV cache is sized for them and the new tokens. Each
    step waits for the device, so a token's latency is its own. on_step is called with each
    step's (MoE layers, experts) counts, the prefill's first, after the step is timed.
    step: the decode function, or a compiled one from optimizations.compile_decode."""
    cache = KVCache(len(model.layers), prompts.shape[1] + new_tokens)
    device_sync(device)
    t0 = time.perf_counter()
    with autocast():
        logits, c = step(model, prompts, cache)
    out = [_next(logits)]
    device_sync(device)
    prefill, steps, counts = time.perf_counter() - t0, [], None
    if on_step and c.numel():
        on_step(c)
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        with autocast():
            logits, c = step(model, out[-1], cache)
        out.append(_next(logits))
        device_sync(device)
        steps.append(time.perf_counter() - t)
        if c.numel():
            counts = c if counts is None else counts + c
            if on_step:
                on_step(c)
    return Generated(torch.cat(out, 1), prefill, steps, counts, cache.nbytes())

