"""A fake process group of the configured world size for a traced step, and DDP on it.

One rank is traced, in this process (rank 0, or each pipeline stage's in turn)."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """A fake process group of `world` ranks, for this process's trace of rank `rank`.

    torch's "fake" backend's collectives and sends move nothing. Device meshes are made
    outside fake mode."""
    import torch.distributed as dist

    if world == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("a plan of several ranks makes its own (fake) process group: "
                           "run it outside one")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch.nn.parallel.distributed as ddp

    from ..optimizations import parallel

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:  # (DDP's check that the ranks' shapes agree reads values: one rank traced)
        with mock.patch.object(ddp, "_verify_param_shape_across_processes", _skip), \
                mock.patch.object(parallel, "register_comm_hook", _fake_comm_hook), \
                _python_reducer():
            yield
    finally:
        dist.destroy_process_group()
        _forget_shardings()


def _forget_shardings() -> None:
    """Clears DTensor's caches of each op's sharding. They key an op by its meshes' layout,
    not their process groups: the next plan's op on an equal mesh would take this world's
    groups, gone ("Could not resolve the process group registered under the name 7")."""
    from torch.distributed.tensor import debug

    for clear in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):
        if hasattr(debug, clear):
            getattr(debug, clear)()


def ddp_buckets(ddp) -> None:
    """Adds DDP's buckets, which _python_reducer leaves out, to the traced step's memory.

    DDP's C++ reducer holds one flat bucket tensor a dtype, made as the step's first gradient
    is reduced, since DDP rebuilds its buckets inside the run, and held through the step.
    Each reduced gradient is copied into its place, as DDP does on a synced backward; with
    gradient_as_bucket_view the gradient then is that place."""
    params = [p for p in ddp.parameters() if p.requires_grad]
    places: dict = {}

    def into_bucket(p) -> None:
        if not ddp.require_backward_grad_sync:  # (no_sync: gradients accumulate apart)
            return
        if not places:
            for dtype in dict.fromkeys(q.dtype for q in params):
                mine = [q for q in params if q.dtype == dtype]
                flat = torch.empty(sum(q.numel() for q in mine), dtype=dtype, device=p.device)
                for q, part in zip(mine, flat.split([q.numel() for q in mine])):
                    places[id(q)] = part.view_as(q)
        place = places[id(p)]
        place.copy_(p.grad)
        if ddp.gradient_as_bucket_view:
            p.grad = place

    for p in params:
        p.register_post_accumulate_grad_hook(into_bucket)


def ddp_calls(got, ddp) -> None:
    """Counts DDP's all-reduces one a bucket, not the python reducer's one a gradient.

    The buckets are torch's own assignment of the parameters as rebuilt after the first
    step, bucket_cap_mb each."""
    import torch.distributed as dist

    params = [p for p in ddp.parameters() if p.requires_grad]
    buckets, _ = dist._compute_bucket_assignment_by_size(params[::-1], [ddp.bucket_bytes_cap])
    if reduce := got.comm.get("all_reduce"):  # (per synced backward)
        reduce["calls"] = reduce["calls"] * len(buckets) // len(params)


def _skip(*_) -> None:
    """Skips DDP's shape check: with one rank traced, no other ranks' shapes exist."""


def _fake_comm_hook(model, cfg) -> None:
    """parallel.comm_hook on the fake group, where _python_reducer's hooks take a gradient."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.parallel.comm_hook)
    if dtype is not None:
        model.register_comm_hook(dtype, _fake_reduce)


def _fake_reduce(state, bucket):
    """parallel.comm_hook=fp16|bf16 under the python reducer: cast, all-reduce, cast back.

    It is torch's fp16/bf16_compress_hook on one parameter's gradient."""
    import torch.distributed as dist

    grad = bucket[0]  # (grad, param)
    low = grad.to(state).div_(dist.get_world_size())
    dist.all_reduce(low)
    grad.copy_(low)


@contextlib.contextmanager
def _python_reducer():
    """DDP on torch's python reducer, made for compiled autograd, for a fake step.

    Each gradient is all-reduced by a post-accumulate hook on the same process group. DDP's
    C++ reducer reads its buckets' values as it rebuilds them, which fake tensors lack. The
    gradients, their sum and the bytes reduced are the same; the calls are one a parameter,
    not one a bucket, until ddp_calls counts them. The global settings DDP changes for it
    are put back."""
    import torch._dynamo.config as dynamo
    import torch._inductor.config as inductor
    from torch._dynamo import trace_rules

    inline = trace_rules.LEGACY_MOD_INLINELIST
    had = "torch.nn.parallel.distributed" in inline
    try:
        with dynamo.patch(optimize_ddp="python_reducer"), inductor.patch(
                _fuse_ddp_communication=inductor._fuse_ddp_communication,
                _fuse_ddp_bucket_size=inductor._fuse_ddp_bucket_size):
            yield
    finally:
        if not had:
            inline.discard("torch.nn.parallel.distributed")
            trace_rules.get_legacy_mod_inlinelist.cache_clear()
