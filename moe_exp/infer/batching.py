"""infer.batching: a simulated request stream served by static, dynamic or continuous batching.

The clock advances by costs timed on the real model: Cost, the prefill and a decode step at
each batch size. The same seed gives the same stream, so the policies differ only in how
they batch it."""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    arrival: float  # seconds
    prompt: int  # tokens
    output: int  # tokens to generate
    first: float | None = None  # when its first token was out
    done: float | None = None


def stream(n: int, rate: float, prompt_len: int, new_tokens: int, spread: float,
           seed: int) -> list[Request]:
    """A stream of n requests with Poisson arrivals at `rate` a second.

    Prompt and output lengths are uniform in [ceil(L * (1 - spread)), L], L being prompt_len
    or new_tokens."""
    g = torch.Generator().manual_seed(seed)
    gaps = -torch.log1p(-torch.rand(n, generator=g, dtype=torch.float64)) / rate
    arrivals = gaps.cumsum(0).tolist()

    def lengths(top: int) -> list[int]:
        low = max(1, math.ceil(top * (1 - spread)))
        return torch.randint(low, top + 1, (n,), generator=g).tolist()

    return [Request(a, p, o) for a, p, o in zip(arrivals, lengths(prompt_len),
                                                 lengths(new_tokens))]


@dataclass
class Cost:
    """Measured seconds of a prefill and of a decode step, by batch size.

    prefill_s: a prefill of `batch` prompts of prompt_len tokens; step_s: one decode step of
    `batch` sequences; both at the batch sizes in `sizes`, interpolated between them. A
    prefill scales with its tokens."""
    sizes: list
    prefill_s: list
    step_s: list
    prompt_len: int

    def _at(self, values: list, b: int) -> float:
        i = bisect.bisect_left(self.sizes, b)
        if i < len(self.sizes) and self.sizes[i] == b:
            return values[i]
        if i == 0:
            return values[0] * b / self.sizes[0]
        if i == len(self.sizes):
            return values[-1] * b / self.sizes[-1]
        lo, hi = self.sizes[i - 1], self.sizes[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (b - lo) / (hi - lo)

    def prefill(self, batch: int, tokens: int) -> float:
        """Seconds to prefill `batch` prompts padded to `tokens`."""
        return self._at(self.prefill_s, batch) * tokens / self.prompt_len

    def step(self, batch: int) -> float:
        return self._at(self.step_s, batch)


@dataclass
class Served:
    requests: list
    batches: list = field(default_factory=list)  # (start, sequences) of each batch formed
    # (continuous: of each group of joiners' prefill)
    steps: list = field(default_factory=list)  # sequences in each decode step
    held: list = field(default_factory=list)  # each batch's wait past the server being free
    end: float = 0.0


def _to_completion(batch: list, now: float, cost: Cost, steps: list) -> float:
    """Runs a static or dynamic batch to completion; returns the clock after it.

    Prompts are padded to the longest and decoded until the longest output is done; finished
    sequences still fill their slots."""
    now += cost.prefill(len(batch), max(r.prompt for r in batch))
    for r in batch:
        r.first = now
    for t in range(1, max(r.output for r in batch) + 1):
        for r in batch:
            if r.output == t:
                r.done = now
        if t < max(r.output for r in batch):
            now += cost.step(len(batch))
            steps.append(len(batch))
    return now


def _admit(pending: list, i: int, now: float, queue: list) -> int:
    """Queue the requests of pending[i:], in arrival order, that arrived by `now`; next index."""
    while i < len(pending) and pending[i].arrival <= now:
        queue.append(pending[i])
        i += 1
    return i


def serve(requests: list, policy: str, max_batch: int, timeout_s: float, cost: Cost) -> Served:
    """Serve the stream on one device with the batching `policy`.

    static: a batch waits for max_batch requests or the stream's end. dynamic: for
    max_batch, or until its oldest request has waited timeout_s. Both run a batch to
    completion. continuous: at every decode step finished sequences leave and waiting ones
    join, up to max_batch; the joiners' prefill is a step of its own."""
    out = Served(requests)
    queue, now, i = [], 0.0, 0
    pending = sorted(requests, key=lambda r: r.arrival)
    if policy == "continuous":
        return _continuous(pending, max_batch, cost, out)
    while i < len(pending) or queue:
        if not queue:  # idle: the next arrival
            now = max(now, pending[i].arrival)
        i = _admit(pending, i, now, queue)
        free = now
        if len(queue) < max_batch and i < len(pending):  # wait for more: until the batch
            # is full (or the stream's end), or (dynamic) the oldest request's timeout
            k = i + max_batch - len(queue) - 1
            fill = pending[k].arrival if k < len(pending) else None
            if policy == "dynamic":
                now = max(now, min(math.inf if fill is None else fill,
                                   queue[0].arrival + timeout_s))
            else:
                now = max(now, pending[-1].arrival if fill is None else fill)
            i = _admit(pending, i, now, queue)
        batch, queue = queue[:max_batch], queue[max_batch:]
        out.batches.append((now, len(batch)))
        out.held.append(now - max(free, batch[0].arrival))
        now = _to_completion(batch, now, cost, out.steps)
    out.end = now
    return out


def _continuous(pending: list, max_batch: int, cost: Cost, out: Served) -> Served:
    running, queue, now, i, left = [], [], 0.0, 0, {}
    while i < len(pending) or queue or running:
        if not queue and not running:
            now = max(now, pending[i].arrival)
        i = _admit(pending, i, now, queue)
        join, queue = queue[:max_batch - len(running)], queue[max_batch - len(running):]
        if join:  # their prefill, a step of its own: each joins with its first token
            out.batches.append((now, len(join)))
            out.held.append(0.0)
            now += cost.prefill(len(join), max(r.prompt for r in join))
            for r in join:
                r.first, left[id(r)] = now, r.output - 1
                if not left[id(r)]:
                    r.done = now
            running += [r for r in join if left[id(r)]]
        if running:
            now += cost.step(len(running))
            out.steps.append(len(running))
            for r in running:
                left[id(r)] -= 1
                if not left[id(r)]:
                    r.done = now
            running = [r for r in running if left[id(r)]]
    out.end = now
    return out


def figures(s: Served) -> dict:
    """The record's figures of a served stream: latencies in ms, tokens per clock second."""
    def q(xs):
        return torch.quantile(torch.tensor(xs, dtype=torch.float64),
                              torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()

    lat = q([(r.done - r.arrival) * 1e3 for r in s.requests])
    ttft = q([(r.first - r.arrival) * 1e3 for r in s.requests])
    tokens = sum(r.output for r in s.requests)
    return {"request_latency_ms_p50": lat[0], "request_latency_ms_p90": lat[1],
            "request_latency_ms_p99": lat[2], "request_ttft_ms_p50": ttft[0],
            "request_ttft_ms_p99": ttft[2], "served_tokens_per_s": tokens / s.end,
            "batch_size_mean": sum(s.steps) / len(s.steps) if s.steps else None,
            "batch_size_max": max(s.steps, default=None),
            "requests": len(s.requests)}
