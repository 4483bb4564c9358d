"""Expert residency and selective loading for generation, accounted rather than made.

infer.experts_resident, infer.prefetch and infer.usage_threshold: which experts sit in
device memory, what moving the others costs, and what dropping the rarely used ones saves.
Hits, misses and bytes moved are exact; the moves' time is not measured."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.moe import MoE


class ExpertCache:
    """One MoE layer's resident experts, least recently used evicted first; it starts empty.

    fetch: experts a step computes with; prefetch: experts loaded ahead of it."""

    def __init__(self, capacity: int, expert_bytes: int):
        self.capacity, self.expert_bytes = capacity, expert_bytes
        self.resident: OrderedDict[int, bool] = OrderedDict()  # expert -> loaded by prefetch
        self.hits = self.misses = self.prefetched = self.prefetch_hits = 0

    def _load(self, e: int, ahead: bool) -> None:
        self.resident[e] = ahead
        if len(self.resident) > self.capacity:
            self.resident.popitem(last=False)

    def fetch(self, experts) -> None:
        for e in experts:
            if e in self.resident:
                self.hits += 1
                self.prefetch_hits += self.resident[e]
                self.resident[e] = False
                self.resident.move_to_end(e)
            else:
                self.misses += 1
                self._load(e, False)

    def prefetch(self, experts) -> None:
        for e in experts:
            if e in self.resident:
                self.resident.move_to_end(e)
            else:
                self.prefetched += 1
                self._load(e, True)

    def moved_bytes(self) -> int:
        return (self.misses + self.prefetched) * self.expert_bytes

    def reset_counts(self) -> None:
        self.hits = self.misses = self.prefetched = self.prefetch_hits = 0


def moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_bytes(moe: MoE) -> int:
    """Bytes of one expert's w1, w3 and w2 slices as stored; quantized, data and scales."""
    from ..optimizations.quantize import stored_bytes

    return sum(stored_bytes(p) for p in moe.experts.parameters()) // moe.num_experts


class Residency:
    """Keeps infer.experts_resident experts per MoE layer in device memory, a cache a layer.

    Each step's experts, from the MoE layers' counts, are fetched in layer order. With
    prefetch > 0, before layer l + 1 the `prefetch` experts its router picks most often from
    layer l's input are loaded ahead. A hook on each MoE layer computes that guess, so its
    time is in the step's."""

    def __init__(self, model, resident: int, prefetch: int):
        self.layers = moe_layers(model)
        self.caches = [ExpertCache(resident, expert_bytes(m)) for m in self.layers]
        self.prefetch, self.guesses, self.hooks = prefetch, {}, []
        if prefetch:
            for i, (m, nxt) in enumerate(zip(self.layers, self.layers[1:])):
                self.hooks.append(m.register_forward_pre_hook(self._guess(i + 1, nxt)))

    def _guess(self, i: int, nxt: MoE):
        def hook(module, args):
            x = args[0]
            experts = nxt.router(x.reshape(-1, x.shape[-1]))[3]
            top = torch.bincount(experts.flatten(), minlength=nxt.num_experts)
            self.guesses[i] = top.topk(min(self.prefetch, nxt.num_experts)).indices.tolist()
        return hook

    def step(self, counts: torch.Tensor) -> None:
        """Accounts one step from its counts, shaped (MoE layers, experts).

        Each layer's guessed experts are loaded ahead first, then the ones it used fetched."""
        for i, (cache, row) in enumerate(zip(self.caches, counts.tolist())):
            if i in self.guesses:
                cache.prefetch(self.guesses[i])
            cache.fetch(e for e, n in enumerate(row) if n)
        self.guesses = {}

    def reset_counts(self) -> None:
        for c in self.caches:
            c.reset_counts()

    def close(self) -> None:
        for h in self.hooks:
            h.remove()

    def figures(self, tokens: int) -> dict:
        """The record's figures over the steps since reset_counts; `tokens`: those generated."""
        hits = sum(c.hits for c in self.caches)
        fetched = hits + sum(c.misses for c in self.caches)
        pre = sum(c.prefetched for c in self.caches)
        return {"expert_hit_rate": hits / fetched if fetched else None,
                "expert_bytes_moved_per_token": sum(c.moved_bytes() for c in self.caches)
                / tokens,
                "expert_prefetch_hit_rate": sum(c.prefetch_hits for c in self.caches) / pre
                if pre else None}


def drop_rare(model, usage: torch.Tensor, threshold: float) -> tuple[list, int, list]:
    """Selective loading: drops each MoE layer's experts whose share of tokens is below threshold.

    `usage` holds the routed tokens' counts, shaped (MoE layers, experts). A dropped expert
    is never loaded; the top_k most used are always kept. The dropped experts' router logits
    become -inf through a hook on the gate, and their balancing biases are set to -inf.
    Returns the experts dropped per MoE layer, their bytes, and the hooks' handles."""
    dropped, saved, handles = [], 0, []
    for moe, row in zip(moe_layers(model), usage.float()):
        share = row / row.sum().clamp(min=1)
        keep = share >= threshold
        if int(keep.sum()) < moe.top_k:
            keep[share.topk(moe.top_k).indices] = True
        gone = ~keep.to(moe.router.gate.weight.device)
        dropped.append(int(gone.sum()))
        if not gone.any():
            continue
        saved += int(gone.sum()) * expert_bytes(moe)
        handles.append(moe.router.gate.register_forward_hook(
            lambda mod, args, out, gone=gone: out.masked_fill(gone, float("-inf"))))
        if getattr(moe.router, "expert_bias", None) is not None:
            handles.append(_BiasMask(moe.router.expert_bias, gone))
    return dropped, saved, handles


class _BiasMask:
    """A balancing bias at -inf for the dropped experts; remove() puts it back."""

    def __init__(self, bias: torch.Tensor, gone: torch.Tensor):
        self.bias, self.kept = bias, bias.clone()
        bias.masked_fill_(gone, float("-inf"))

    def remove(self) -> None:
        self.bias.copy_(self.kept)
