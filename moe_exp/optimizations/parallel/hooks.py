"""parallel.comm_hook: DDP's gradient all-reduce through torch's communication hooks.

The hooks are torch.distributed.algorithms.ddp_comm_hooks'. Also counts the bytes a rank
hands to the collectives per optimizer step, the record's grad_reduce_bytes."""
from __future__ import annotations

from collections import deque

# PowerSGD (Vogels et al. 2019, torch's powerSGD_hook). torch's default start_powerSGD_iter
# is 1,000 synced steps of plain all-reduce: a benchmark of tens of steps would never
# compress. 2 is the least torch allows with error feedback or warm start (DDP rebuilds its
# buckets after the first step; PowerSGD's per-bucket state needs the rebuilt ones), so all
# but the first 2 steps are compressed. Error feedback (the compression's error added to the
# next step's gradient) and warm start (last step's Q reused) are torch's defaults, which
# its authors found needed for the loss; min_compression_rate 2 (torch's): a matrix is
# compressed only where (rows + cols) x rank x 2 < rows x cols, the rest all-reduced whole.
POWERSGD = {"start_powerSGD_iter": 2, "min_compression_rate": 2, "use_error_feedback": True,
            "warm_start": True, "random_seed": 0}  # (the seed: the same Q on every rank)


class ReduceBytes:
    """Counts the bytes handed to the collectives per synced backward.

    Counted as each bucket goes to the hook; bucket.is_last() ends a backward. With
    comm_hook=none, DDP's own all-reduce of its whole buckets, the figure is fixed instead.
    """

    def __init__(self, syncs_per_step: int, fixed: int | None = None):
        self.syncs, self.fixed, self.current = syncs_per_step, fixed, 0
        self.done: deque = deque(maxlen=syncs_per_step)

    def add(self, nbytes: int, last: bool) -> None:
        self.current += nbytes
        if last:
            self.done.append(self.current)
            self.current = 0

    def per_step(self) -> int | None:
        """The last optimizer step's bytes; None until a whole step has been counted.

        The last step's is the steady figure: PowerSGD compresses from its third synced
        backward on.
        """
        if self.fixed is not None:
            return self.fixed * self.syncs
        return sum(self.done) if len(self.done) == self.syncs else None


def register_comm_hook(ddp, cfg) -> ReduceBytes:
    """Registers parallel.comm_hook on a DDP module; returns its byte counter."""
    hook, t = cfg.parallel.comm_hook, cfg.train
    syncs = t.grad_accum_steps if t.grad_accum_steps > 1 and not cfg.parallel.accum_no_sync \
        else 1
    if hook == "none":  # DDP's built-in all-reduce (no Python hook): its buckets, whole
        return ReduceBytes(syncs, sum(p.numel() * p.element_size() for p in ddp.parameters()
                                      if p.requires_grad))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    count = ReduceBytes(syncs)
    if hook in ("fp16", "bf16"):
        fn = default_hooks.fp16_compress_hook if hook == "fp16" else \
            default_hooks.bf16_compress_hook

        def cast(state, bucket):  # the bucket, cast to 2 bytes an element
            count.add(bucket.buffer().numel() * 2, bucket.is_last())
            return fn(state, bucket)

        ddp.register_comm_hook(None, cast)
        return count
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=cfg.parallel.
                                        powersgd_rank, **POWERSGD)

    def low_rank(st, bucket):
        # its own count: the tensors it all-reduces whole, plus the P and Q factors
        # (total_numel_after_compression); the whole bucket before start_powerSGD_iter
        buf, last, plain = bucket.buffer(), bucket.is_last(), st.iter < st.start_powerSGD_iter
        before = st.total_numel_after_compression
        fut = powerSGD_hook.powerSGD_hook(st, bucket)
        n = buf.numel() if plain else st.total_numel_after_compression - before
        count.add(n * buf.element_size(), last)
        return fut

    ddp.register_comm_hook(state, low_rank)
    return count


def record_reduce_bytes(cfg, rec: dict, count: ReduceBytes | None) -> None:
    """Set rec['grad_reduce_bytes'], a rank's bytes per optimizer step, or null with the reason."""
    key, p = "grad_reduce_bytes", cfg.parallel
    rec[key] = count.per_step() if count is not None else None
    if rec[key] is None:
        rec["null_reasons"][key] = (
            f"parallel={p.name}: counted for DDP's gradient buckets only" if p.name != "ddp"
            else "no synced step counted")
