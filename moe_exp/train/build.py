"""Builds a training run's parts: the model, its optimizations, the optimizer, the loader.

The model's memory counts from a baseline taken just before it is built."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import total_steps


@dataclass
class Built:
    applied: object  # optimizations.Applied: the model as wrapped, its autocast, ...
    optimizer: object
    scheduler: object
    loader: object
    world: int
    optim_impl: str
    params: int  # the model's parameters as built, before any sharding

    @property
    def model(self):
        return self.applied.model


def build_run(cfg, device: torch.device, memory, d=None, start: int = 0,
              seed: int | None = None) -> Built:
    """Build the run's parts on device, memory's baseline taken just before the model.

    d is the rank's distributed.Dist, None for one process. start is the steps a resumed run
    has done: the loader leaves their sequences out. seed seeds the weights; None means
    train.seed."""
    from ..config import data_rank, data_ranks
    from ..data import build_loader
    from ..hardware import setup_backends
    from ..model import build_model
    from ..optim import build_optimizer
    from ..optimizations import apply

    t = cfg.train
    setup_backends(cfg)
    torch.manual_seed(t.seed if seed is None else seed)
    # modules the run imports anyway (torch.optim imports dynamo lazily), loaded before the
    # memory baseline: on CPU their RSS would count as the run's memory
    import torch._dynamo as _  # noqa: F401 (binds no local `torch`)

    memory.baseline()
    with torch.device(device):
        model = build_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    if d is not None:  # every rank starts from the same weights (the seed), as one process
        torch.manual_seed(t.seed + 1 + d.rank)
    rank, world = (d.rank, d.world) if d else (0, 1)
    applied = apply(model, cfg, device, world)
    optimizer, scheduler, impl = build_optimizer(applied.model, cfg, device)
    num_samples = total_steps(t) * t.grad_accum_steps * t.micro_batch_size
    ranks = data_ranks(cfg.parallel, world)  # (tensor-parallel ranks share their data, and
    # a pipeline's stages theirs)
    loader = build_loader(cfg, device, num_samples, data_rank(cfg.parallel, world, rank), ranks,
                          start * t.grad_accum_steps * t.micro_batch_size)
    return Built(applied, optimizer, scheduler, loader, world, impl, params)
