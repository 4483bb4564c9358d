"""Pipeline parallel, parallel.pp, on torch.distributed.pipelining.

The blocks are split into stages (config.pp_stages); rank r of the pp group holds stages r,
r + pp, ... (looped, as the interleaved schedules place them). A stage is a range of blocks;
the first also holds the embedding, the last the norm, head and loss. Each stage is then
optimized as a whole model would be (expert parallel, checkpointing, FSDP2 as its own root,
compile per block), and the rank's stages are gathered into one PipelineModel under the
whole model's parameter names.

The schedule's micro-batches are gradient accumulation: the update equals one process's
over the same micro-batches, each its mean loss. The MoE layers' aux losses never travel
down the pipeline: each MoE block's output passes through AuxGrad, whose backward gives the
block's aux losses the gradient the whole model's loss gives them (Megatron's
MoEAuxLossAutoScaler)."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

from ...config import pp_microbatches, pp_stages, seq_part, stages_per_rank, tp_size
from ...model import Output


class AuxGrad(torch.autograd.Function):
    """x unchanged; in backward, the aux loss gets `scale` as its gradient."""

    @staticmethod
    def forward(ctx, x, aux, scale: float):
        ctx.scale, ctx.shape = scale, aux.shape
        return x

    @staticmethod
    def backward(ctx, grad):
        aux = grad.new_full(ctx.shape, ctx.scale) if ctx.needs_input_grad[1] else None
        return grad, aux, None


class Stage(nn.Module):
    """Blocks [lo, hi) of the model, under their names in it; the embedding on the first
    stage, the norm and head on the last. Each forward keeps its MoE layers' figures in
    `stats` (one entry a call) and the bytes it takes and gives in `io_bytes`."""

    def __init__(self, model: nn.Module, lo: int, hi: int, last: bool):
        super().__init__()
        self.embed = model.embed if lo == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        self.norm, self.head = (model.norm, model.head) if last else (None, None)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.coefs = (model.aux_loss_coef, model.seq_aux_loss_coef, model.z_loss_coef)
        self.aux_scale = 0.0  # the gradient each MoE layer's aux loss gets (PipelineModel's)
        self.stats: list = []
        self.io_bytes = (0, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_in = x.numel() * x.element_size() if self.embed is None else 0
        if self.embed is not None:
            x = self.embed(x)
        a, s, zc = self.coefs
        stats = []
        for block in self.layers.values():
            x, balance, seq, z, counts, routed = block(x, self.rope_cos, self.rope_sin)
            if block.is_moe:
                if torch.is_grad_enabled() and (a or s or zc):
                    x = AuxGrad.apply(x, a * balance + s * seq + zc * z, self.aux_scale)
                stats.append((balance.detach(), seq.detach(), z.detach(), counts, routed))
        self.stats.append(stats)
        if self.head is not None:
            x = self.head(self.norm(x))
        self.io_bytes = (x_in, 0 if self.head is not None else x.numel() * x.element_size())
        # (zero bubble's split backward detaches each stage's output in place: not a view)
        return x.clone() if x._base is not None else x


def split_stages(model: nn.Module, cfg, mesh) -> list[Stage]:
    """This rank's stages of the model, in order: rank r of the pp group holds stages r,
    r + pp, ..."""
    p, layers = cfg.parallel, len(model.layers)
    first = [*pp_stages(cfg), layers]
    rank = mesh["pp"].get_local_rank()
    mine = [rank + k * p.pp for k in range(stages_per_rank(p))]
    return [Stage(model, first[i], first[i + 1], i == len(first) - 2) for i in mine]


def _shapes(cfg, stage: int, n_stages: int, device) -> dict:
    """A stage's example input and output, one micro-batch's: torch's static metadata,
    so no stage runs a forward to infer them or sends them as objects (which a plan's fake
    process group cannot). The blocks run in FSDP2's parameter dtype (the embedding's);
    under tensor parallel each rank sends its sequence shard (sequence parallel) and the
    last stage ends on its vocab shard."""
    from ..precision import DTYPES

    m, t, tp = cfg.model, cfg.train, tp_size(cfg.parallel)
    rows = t.micro_batch_size // pp_microbatches(cfg.parallel)
    seq = seq_part(cfg)
    dtype = DTYPES.get(cfg.precision.autocast_dtype, torch.float32)
    shard = seq // tp if cfg.parallel.sequence_parallel else seq
    hidden = torch.empty(rows, shard, m.hidden_size, dtype=dtype, device=device,
                         requires_grad=True)
    tokens = torch.empty(rows, seq, dtype=torch.long, device=device)
    out = torch.empty(rows, seq, m.vocab_size // tp, dtype=dtype, device=device,
                      requires_grad=True) if stage == n_stages - 1 else hidden
    return {"input_args": tokens if stage == 0 else hidden, "output_args": out}


ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
           "perform_reduce_grad")  # (the last: a stage's gradients' reduction (FSDP2's),
# once its last backward is done: work, not idle)


class ActionClock:
    """Each schedule step's time in its actions on this rank (a stage's forward or backward
    of a micro-batch, the last stage's loss, which the schedule computes between them, and
    a stage's gradients' reduction after its last backward) and its bubble: the share of
    its span it waits on other ranks. On a GPU (CUDA events, each step's read once its
    events are done, never waited for in a step) that is the span less its actions: the
    host's work between them (posting hand-offs, the schedule's bookkeeping) runs ahead of
    the device. On a CPU, host and device at once, it is the time in the schedule's waits
    for its hand-offs (torch's _wait_batch_p2p) and in the step's closing all-reduce, where
    the ranks meet (the host's clock); the rest outside actions is the step's overhead. A
    step's events are dropped once read: a step keeps three numbers."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.timed_steps: list = []  # per step: (bubble, seconds in actions, overhead share;
        # None on a GPU), or None while its events run
        self._open = None  # the running step: [start, end, [(start, end) of each action],
        # [(start, end) of each wait (CPU)]]
        self._pending: dict = {}  # step index -> its events, not yet done (CUDA)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _timing(self, t0, t1, acts, waits) -> tuple:
        span = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        whole, busy = span(t0, t1), sum(span(a, b) for a, b in acts)
        if self.cuda:
            return 1 - busy / whole, busy, None
        bubble = sum(b - a for a, b in waits) / whole
        return bubble, busy, 1 - busy / whole - bubble

    def wrap(self, stage) -> None:
        for name in ACTIONS:
            if hasattr(stage, name):  # (perform_reduce_grad: not in older torch)
                setattr(stage, name, self.timed(getattr(stage, name)))

    def timed(self, run, into: int = 2):
        """run, its time counted in the running step's actions (into=3: its waits)."""
        def timed(*args, **kwargs):
            t0 = self._now()
            try:
                return run(*args, **kwargs)
            finally:
                if self._open is not None:
                    self._open[into].append((t0, self._now()))
        return timed

    def waited(self, run):
        """run, its time counted in the running step's waits (on a CPU; on a GPU, run)."""
        return run if self.cuda else self.timed(run, into=3)

    @contextlib.contextmanager
    def step(self):
        """A schedule step on the clock, torch's waits for its hand-offs counted (CPU)."""
        from torch.distributed.pipelining import schedules

        self._read(wait=False)
        self._open = [self._now(), None, [], []]
        wait = schedules._wait_batch_p2p
        schedules._wait_batch_p2p = self.waited(wait)
        try:
            yield
            self._open[1] = self._now()
            self.timed_steps.append(None)
            self._pending[len(self.timed_steps) - 1] = self._open
        finally:  # (a step that raised is not timed)
            schedules._wait_batch_p2p, self._open = wait, None
        if not self.cuda:
            self._read(wait=False)

    def _read(self, wait: bool) -> None:
        if wait and self.cuda:
            torch.cuda.synchronize()
        for i, step in list(self._pending.items()):
            if not self.cuda or wait or step[1].query():
                self.timed_steps[i] = self._timing(*step)
                del self._pending[i]

    def steps(self, first: int, last: int) -> list[tuple]:
        """Steps first..last - 1's (bubble, seconds in actions, overhead share) (on a GPU,
        waits for their events)."""
        self._read(wait=True)
        return [x for x in self.timed_steps[first:last] if x is not None]


class PipelineModel(nn.Module):
    """A rank's stages as one module, their parameters under the whole model's names.

    Its forward runs one schedule step over the micro-batch: forward and backward of each of
    parallel.pp_microbatches parts. It returns the model's Output, the same on every rank of
    the pp group: the loss, and every MoE layer's counts (the other stages' summed in)."""

    pipelined = True  # (train.loop: its forward does the backward too)

    def __init__(self, stages: list[Stage], model: nn.Module, cfg, mesh, device):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble)

        super().__init__()
        p = cfg.parallel
        pm = mesh["pp"]
        self.group = pm.get_group()
        n_stages = p.pp * stages_per_rank(p)
        rank = pm.get_local_rank()
        ids = [rank + k * p.pp for k in range(len(stages))]
        self.is_first, self.is_last = ids[0] == 0, ids[-1] == n_stages - 1
        self.embed = stages[0].embed if self.is_first else None
        self.layers = nn.ModuleDict({k: b for s in stages for k, b in s.layers.items()})
        self.norm, self.head = (stages[-1].norm, stages[-1].head) if self.is_last else (None,
                                                                                         None)
        self.loss = getattr(stages[-1], "loss", model.loss) if self.is_last else None
        self.coefs = stages[0].coefs
        moe = [int(k) for k, b in model.layers.named_children() if b.is_moe]
        self.n_moe, self.num_experts = len(moe), cfg.model.num_experts
        # each stage's MoE layers' rows among the model's MoE layers; all the rank's
        self.stage_rows = [[moe.index(int(k)) for k, b in s.layers.items() if b.is_moe]
                           for s in stages]
        self.moe_rows = [r for rows in self.stage_rows for r in rows]
        self.n_micro = pp_microbatches(p)
        self.rows = cfg.train.micro_batch_size
        accum = cfg.train.grad_accum_steps
        self.scale = 1.0 / (self.n_micro * accum)  # (the schedule's own scaling is off)
        for s in stages:
            s.aux_scale = self.scale / max(1, self.n_moe)
        object.__setattr__(self, "stages", stages)  # (not registered: the names above are)
        self._ces: list = []
        piped = [PipelineStage(s, i, n_stages, device, group=self.group,
                               **_shapes(cfg, i, n_stages, device))
                 for s, i in zip(stages, ids)]
        self.clock = ActionClock(torch.device(device))
        for st in piped:
            self.clock.wrap(st)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
                "interleaved_1f1b": ScheduleInterleaved1F1B,
                "zero_bubble": ScheduleInterleavedZeroBubble}[p.pp_schedule]
        self.schedule = kind(piped[0] if p.pp_schedule in ("gpipe", "1f1b") else piped,
                             self.n_micro, loss_fn=self.clock.timed(self._loss),
                             scale_grads=False)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ce = self.loss(logits.flatten(0, 1).float(), targets.flatten())
        self._ces.append((ce.detach(), (targets != -100).sum()))
        return ce * self.scale

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> Output:
        """Forward and backward of the micro-batch; under no_grad, forward only (a smaller
        batch padded to train.micro_batch_size, the padding's targets ignored)."""
        for s in self.stages:
            s.stats.clear()
        self._ces.clear()
        grad = torch.is_grad_enabled()
        if not grad and len(tokens) < self.rows:
            pad = self.rows - len(tokens)
            tokens = torch.cat([tokens, tokens[:1].expand(pad, -1)])
            targets = torch.cat([targets, torch.full_like(targets[:1], -100).expand(pad, -1)])
        args = (tokens.contiguous(),) if self.is_first else ()  # (the stage's metadata)
        kw = {"target": targets, "losses": []} if self.is_last else {}
        kw["return_outputs"] = False  # (else the last stage keeps every micro-batch's
        # logits to the step's end, to merge them: m x (rows, seq, vocab))
        if not grad:
            self.schedule.eval(*args, **kw)
            flat = self._stacked(tokens.device)
            dist.all_reduce(flat, group=self.group)
            return self._gathered(flat)
        with self.clock.step():
            self.schedule.step(*args, **kw)
            flat = self.clock.timed(self._stacked)(tokens.device)
            self.clock.waited(dist.all_reduce)(flat, group=self.group)
        # (the step ends after the pp group's all-reduce, where its ranks meet: each rank's
        # span ends with the schedule's last action, on any rank; a last stage's own end, a
        # backward before the first stage's, hid 12 ms of 1F1B's drain a step)
        return self._gathered(flat)

    def _stacked(self, device) -> torch.Tensor:
        """This rank's stages' loss and MoE figures, flat, to sum over the pp group."""
        ce = torch.zeros((), dtype=torch.float64, device=device)
        ces = self._ces[-self.n_micro:]  # (a schedule inferring shapes runs one more)
        if ces:  # (the mean over the real tokens: a padded part may have none, its mean
            # NaN; torch.where, not `if`: no wait for the device in the step)
            ce = sum(torch.where(n > 0, c.double() * n, 0.0) for c, n in ces) / \
                sum(n for _, n in ces)
        n_exp = self.num_experts if self.n_moe else 0
        counts = torch.zeros(2, self.n_moe, n_exp, dtype=torch.float64, device=device)
        losses = torch.zeros(3, dtype=torch.float64, device=device)
        for s, rows in zip(self.stages, self.stage_rows):
            for part in s.stats[-self.n_micro:]:  # (the same)
                for row, (balance, seq, z, c, r) in zip(rows, part):
                    losses += torch.stack([balance, seq, z]).double() / self.n_micro
                    counts[0, row] += c
                    counts[1, row] += r
        return torch.cat([ce.reshape(1), losses, counts.flatten()])

    def _gathered(self, flat: torch.Tensor) -> Output:
        """The step's loss and MoE figures from _stacked's, summed over the pp group."""
        ce = flat[0].float()
        device, n_exp = flat.device, self.num_experts if self.n_moe else 0
        if not self.n_moe:
            zero = torch.zeros((), device=device)
            none = torch.zeros(0, 0, dtype=torch.long, device=device)
            return Output(ce, ce, zero, zero, none, zero, none)
        balance, seq, z = (flat[1:4] / self.n_moe).float()
        counts = flat[4:].view(2, self.n_moe, n_exp).long()
        a, sc, zc = self.coefs
        return Output(ce + a * balance + sc * seq + zc * z, ce, balance, z, counts[0], seq,
                      counts[1])

    def send_bytes(self) -> int:
        """The bytes this rank's stages send a step: each micro-batch's activations forward
        and their gradients backward (as large as the stage's input), from the last call."""
        return self.n_micro * sum(out + inp for inp, out in (s.io_bytes for s in self.stages))
