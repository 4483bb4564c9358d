"""A pipeline's plan (parallel.pp): each stage's rank traced, then its schedule simulated.

Every rank of the pp group is traced as the run builds it (its stages, the real schedule on
the fake process group), each op tagged with the pipeline action it runs in. The actions'
times then run through the schedule's own order (torch's), each rank one action at a time,
an action waiting for the one it needs from another stage and its hand-off: the step's time
and each rank's idle share, the bubble."""
from __future__ import annotations

import contextlib
import inspect
from unittest import mock


def traced_ranks(cfg) -> list[int]:
    """One rank a stage of the pp group: rank i x (world / pp) holds pp index i."""
    from ..config import pp_size

    pp, world = pp_size(cfg.parallel), cfg.hardware.devices
    return [i * (world // pp) for i in range(pp)]


@contextlib.contextmanager
def tagged(ops):
    """Tag each op StepOps records with the pipeline action that runs it: (stage, kind).

    The stages' vote on their metadata, whose sum a fake process group does not carry, is
    taken as its real outcome: every stage has its shapes (PipelineModel's), STATIC."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import _PipelineStageBase as Stage

    def static(self, stages, *_):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    full = inspect.signature(Stage.backward_one_chunk)

    def wrap(fn, kind):
        def run(self, *args, **kwargs):
            k = kind if kind != "B" or full.bind(self, *args, **kwargs).arguments.get(
                "full_backward", True) else "I"
            ops.tag = (self.stage_index, k)
            try:
                return fn(self, *args, **kwargs)
            finally:
                ops.tag = None
        return run

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(_PipelineSchedule, "_warmup_p2p", static))
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                           ("backward_weight_one_chunk", "W"), ("perform_reduce_grad", "R")):
            if hasattr(Stage, name):  # (perform_reduce_grad: not in older torch)
                stack.enter_context(mock.patch.object(Stage, name,
                                                      wrap(getattr(Stage, name), kind)))
        yield


def schedule_order(p, microbatches: int) -> list[list]:
    """Each pp rank's actions in the schedule's order (torch's), as (stage, kind, micro-batch):
    kind F forward, B backward, I and W its input and weight halves, R the stage's gradient
    reduction (FSDP2's, once a schedule step), after its last backward, where torch runs it."""
    from torch.distributed.pipelining import (ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from ..config import stages_per_rank

    m = microbatches
    if p.pp_schedule in ("gpipe", "1f1b"):
        return [_with_reductions(rank, m) for rank in _single_order(p, m)]
    kind = {"interleaved_1f1b": ScheduleInterleaved1F1B,
            "zero_bubble": ScheduleInterleavedZeroBubble}[p.pp_schedule]
    try:  # (torch's own lowering: its REDUCE_GRAD actions where it runs them)
        ops = get_schedule_ops(kind, p.pp, m, stages_per_rank(p), with_comms=True)
    except TypeError:  # (a torch whose visualizer has no comms: its compute alone)
        ops = get_schedule_ops(kind, p.pp, m, stages_per_rank(p))
    short = {"REDUCE_GRAD": "R", **{k: k for k in ("F", "B", "I", "W")}}
    order = [[(a.stage_index, short[a.computation_type.value], a.microbatch_index)
              for a in rank if a is not None and a.computation_type.value in short]
             for rank in ops]
    if any(k == "R" for rank in order for _, k, _ in rank):
        return order
    return [_with_reductions(rank, m) for rank in order]


def _with_reductions(actions: list, m: int) -> list:
    """actions, each stage's R after its m-th full or weight backward (torch's
    _add_reduce_grad; GPipe and 1F1B run it after their last backward)."""
    out, done = [], {}
    for s, k, i in actions:
        out.append((s, k, i))
        if k in ("B", "W"):
            done[s] = done.get(s, 0) + 1
            if done[s] == m:
                out.append((s, "R", None))
    return out


def _single_order(p, m: int) -> list[list]:
    """GPipe's and 1F1B's actions, each rank's, as they run them."""
    if p.pp_schedule == "gpipe":  # (the single-stage schedules' own order, as they run it:
        # torch's IR of them is for display and shifts later ranks' micro-batches)
        return [[(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)]
                for s in range(p.pp)]
    out = []  # 1F1B, stage s: pp - s forwards, then a backward and a forward
    for s in range(p.pp):
        w = min(m, p.pp - s)
        acts = [(s, "F", i) for i in range(w)]
        for i in range(m):
            acts += [(s, "B", i)] + ([(s, "F", w + i)] if w + i < m else [])
        out.append(acts)
    return out


def each_action(totals: dict, m: int) -> dict:
    """A rank's traced actions' seconds, (stage, kind) -> the step's total, as one action's:
    a micro-batch's (the total / m); a gradient reduction (R), once a schedule step, whole."""
    return {k: v if k[1] == "R" else v / m for k, v in totals.items()}


def simulate(order: list[list], seconds: dict, hop_s: float,
             post_s: float = 0.0) -> tuple[float, list[float], list[float]]:
    """The schedule's makespan, each rank's busy seconds and its seconds posting sends.

    order: schedule_order's. seconds: (stage, kind) -> one action's time (each_action).
    hop_s: one micro-batch's hand-off between ranks; post_s: its sender's time posting it
    (after the action, before its next). A forward waits for the previous stage's; a
    backward (full or input) for its forward and the next stage's; a weight backward for
    its input's; a gradient reduction for nothing but its rank's order. What another rank
    sends is a rendezvous, as NCCL's and gloo's sends are: the hand-off starts
    once the sender has posted it and the receiver is ready for it."""
    pp = len(order)
    last = max(s for rank in order for s, _, _ in rank)
    owner = {s: r for r, rank in enumerate(order) for s, _, _ in rank}
    end: dict = {}
    clock, busy, posted, at = [0.0] * pp, [0.0] * pp, [0.0] * pp, [0] * pp
    back = "B" if any(k == "B" for rank in order for _, k, _ in rank) else "I"

    def ready(s: int, k: str, m: int) -> float | None:
        need = []
        if k == "F" and s > 0:
            need.append((s - 1, "F", m))
        if k in ("B", "I"):
            need.append((s, "F", m))
            if s < last:
                need.append((s + 1, back, m))
        if k == "W":
            need.append((s, "I", m))
        if any(d not in end for d in need):
            return None
        r = owner[s]
        return max([end[d] if owner[d[0]] == r else max(end[d] + post_s, clock[r]) + hop_s
                    for d in need], default=0.0)

    def sends(s: int, k: str) -> bool:  # (to another rank)
        to = s + 1 if k == "F" else s - 1 if k in ("B", "I") else -1
        return 0 <= to <= last and owner[to] != owner[s]

    left = sum(map(len, order))
    while left:
        moved = False
        for r in range(pp):
            if at[r] < len(order[r]):
                s, k, m = order[r][at[r]]
                t = ready(s, k, m)
                if t is not None:
                    d = seconds.get((s, k), 0.0)
                    end[s, k, m] = clock[r] = max(clock[r], t) + d
                    if sends(s, k):
                        clock[r] += post_s
                        posted[r] += post_s
                    busy[r] += d
                    at[r] += 1
                    left -= 1
                    moved = True
        if not moved:
            raise RuntimeError(f"the {pp}-rank schedule's order waits on itself")
    return max(clock), busy, posted
