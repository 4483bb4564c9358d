"""Measures the held-out loss, eval_loss, at the end and every train.eval_every steps.

Its batches are ones no run trains on, the same for every configuration of a model and data
source. It is measured outside the timed steps."""
from __future__ import annotations

import time

import torch

from ..config import cp_size
from ..data import heldout


class Evaluator:
    """eval_loss over train.eval_sequences held-out sequences, at the steps `due` says.

    It runs in micro-batches of train.micro_batch_size; a call returns its wall time."""

    def __init__(self, cfg, applied, device: torch.device):
        t = cfg.train
        self.every, self.target = t.eval_every, t.target_loss
        self.data = heldout(cfg)  # (tokens, targets) on the CPU, or None: no held-out set
        self.model = getattr(applied.model, "_orig_mod", applied.model)  # (compile: eager)
        self.autocast, self.device, self.b = applied.autocast, device, t.micro_batch_size
        self.parts = cp_size(cfg.parallel) > 1  # (context parallel: each rank's part's loss)
        self.curve: list[list] = []  # [step, eval loss] (steps: optimizer steps done)
        self.reached: int | None = None  # the first step whose eval loss <= target_loss

    def due(self, steps_done: int, last: bool) -> bool:
        return self.data is not None and (last or self.every > 0 and steps_done % self.every == 0)

    @torch.no_grad()
    def __call__(self, steps_done: int) -> float:
        """Measure at steps_done; returns the seconds it took."""
        t0 = time.perf_counter()
        tokens, targets = self.data
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        try:
            for i in range(0, len(tokens), self.b):
                x = tokens[i: i + self.b].to(self.device)
                y = targets[i: i + self.b].to(self.device)
                with self.autocast():
                    total += self.model(x, y).ce.double() * len(x)
        finally:
            self.model.train()
        if self.parts:  # (every rank evaluates the same sequences)
            from ..distributed import all_mean

            total = all_mean(total)
        loss = total.item() / len(tokens)
        self.curve.append([steps_done, loss])
        if self.target is not None and self.reached is None and loss <= self.target:
            self.reached = steps_done
        return time.perf_counter() - t0
