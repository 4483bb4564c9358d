"""Every optimization, applied to a plain model in one place: `apply`."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from ..config import FSDP2, cp_size, pp_size, tp_size
from .attention import apply_attention
from .checkpointing import apply_checkpointing
from .compile import apply_compile, compile_decode
from .precision import (apply_fp8, autocast_factory, grad_scaler, router_fp32,
                        set_matmul_precision)


MESHED = FSDP2 + ("expert",)  # the options that run on a device mesh


@dataclass
class Applied:
    model: nn.Module  # what the loop calls (maybe compiled or wrapped)
    autocast: Callable[[], ContextManager]
    scaler: Optional[torch.amp.GradScaler]
    before_step: Optional[Callable[[], None]] = None  # gradient sync the wrapper doesn't do
    clip: Optional[Callable[[Any, float], Any]] = None  # grad-norm clipping across ranks
    no_sync: Optional[Callable[[], ContextManager]] = None  # micro-steps before the last
    reduce_bytes: Any = None  # DDP: parallel.hooks.ReduceBytes (grad bytes reduced a step)

    def micro_contexts(self, n: int):
        """One context per micro-step of an accumulated step: no gradient sync but on the last.

        Only where the strategy allows it; parallel.accum_no_sync decides.
        """
        for i in range(n):
            yield self.no_sync() if self.no_sync and i < n - 1 else contextlib.nullcontext()


def apply_inference(model: nn.Module, cfg, device: torch.device) -> tuple[Callable, Callable]:
    """task=infer: apply the run's optimizations that suit generation.

    Those are the matmul precision, the router's dtype and train.compile on the decode step.
    Returns the precision's autocast and the decode step, which has
    model.transformer.decode's signature.
    """
    set_matmul_precision(device, cfg.precision.tf32)
    if cfg.precision.router_dtype == "fp32":
        router_fp32(model)
    return autocast_factory(cfg.precision, device), compile_decode(cfg.train.compile)


def apply(model: nn.Module, cfg, device: torch.device, world: int = 1) -> Applied:
    """Apply the run's optimizations to a plain model, in torchtitan's order.

    attention kernel -> precision -> [context parallel: RoPE tables, attention] ->
    [pipeline stages: each stage then as a model] ->
    tensor parallel -> expert parallel -> activation checkpointing -> data parallel (DDP and
    its comm hook, FSDP2 or HSDP) -> compile.

    Gradient accumulation, train.grad_accum_steps, is the loop's: train/loop.py.
    """
    if cfg.train.compile != "off":  # a run compiles as in a process of its own: another
        torch._dynamo.reset()  # in-process run's graphs left an unbacked size undefined
    set_matmul_precision(device, cfg.precision.tf32)
    apply_attention(model, cfg.train.attention)
    if cfg.precision.name == "fp8":
        model = apply_fp8(model, cfg.precision)
    if cfg.precision.router_dtype == "fp32":
        router_fp32(model)
    par, mesh = cfg.parallel.name, None
    if par in MESHED:
        from .parallel import device_mesh

        mesh = device_mesh(cfg, world)
    if cp_size(cfg.parallel) > 1:  # (before the stages: they take its RoPE tables)
        from .parallel.context import apply_context

        apply_context(model, mesh["cp"], cfg.train.seq_len)
    if pp_size(cfg.parallel) > 1:  # each stage optimized as a model, then the rank's joined
        from .parallel.pipeline import PipelineModel, split_stages

        parts = [_parallelize(s, cfg, device, world, mesh)
                 for s in split_stages(model, cfg, mesh)]
        piped = PipelineModel([m for m, _ in parts], model, cfg, mesh, device)
        (_, wrapped), model = parts[0], piped  # (its clip: every stage's ranks alike)
        syncs = [w["before_step"] for _, w in parts if w.get("before_step")]
        if len(syncs) > 1:  # (each stage's own: tensor parallel's replicated weights)
            def every_stage():
                for sync in syncs:
                    sync()
            wrapped = {**wrapped, "before_step": every_stage}
    else:
        model, wrapped = _parallelize(model, cfg, device, world, mesh)
    if cp_size(cfg.parallel) > 1:
        from .parallel.context import shard_inputs

        # (on the module compile wraps: the evaluator calls that one)
        shard_inputs(getattr(model, "_orig_mod", model), mesh["cp"].size(),
                     mesh["cp"].get_local_rank())
    return Applied(model, autocast_factory(cfg.precision, device),
                   grad_scaler(cfg.precision, device), **(wrapped if par != "none" else {}))


def _parallelize(model: nn.Module, cfg, device, world: int, mesh):
    """Tensor and expert parallel, checkpointing, data parallel and compile, applied to the
    model or a pipeline's stage. Returns it and Applied's fields for its data parallel."""
    par, tp, ep_group, dp_group = cfg.parallel.name, tp_size(cfg.parallel), None, None
    if tp > 1:
        from .parallel import apply_tensor

        apply_tensor(model, cfg, mesh)
    if par in ("expert", "expert_fsdp"):
        from .parallel import apply_expert

        ep_group, dp_group = apply_expert(model, cfg, mesh)
    model = apply_checkpointing(model, cfg.train.activation_checkpointing)
    wrapped = {}
    if par != "none":
        from .parallel import (accum_no_sync, apply_data_parallel, clip_grad_norm, grad_sync,
                               tp_sync)

        model = apply_data_parallel(model, cfg, device, world, mesh)
        if par == "ddp":
            from .parallel import register_comm_hook

            wrapped["reduce_bytes"] = register_comm_hook(model, cfg)
        wrapped["before_step"] = grad_sync(model, cfg, world, dp_group) or tp_sync(model, tp)
        pp = mesh["pp"].get_group() if pp_size(cfg.parallel) > 1 else None
        # (a pipeline's schedule syncs its own micro-batches)
        wrapped["no_sync"] = None if pp else accum_no_sync(model, cfg)
        wrapped["clip"] = lambda params, max_norm: clip_grad_norm(  # noqa: E731
            params, max_norm, ep_group, pp)
    if cfg.parallel.async_tp and tp > 1:
        from .parallel import enable_async_tp

        enable_async_tp(mesh)
    per_block = tp > 1 or pp_size(cfg.parallel) > 1  # (a pipeline's stage: FSDP2's root)
    return apply_compile(model, cfg.train.compile, per_block=per_block), wrapped

