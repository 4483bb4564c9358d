"""+sweep=layouts: every layout of hardware.devices GPUs for a model, as sweep jobs.

A layout is tp x pp x cp x (dp_replicate x dp_shard) with expert parallel over the data ranks,
a micro-batch and a checkpointing choice, all at one global batch (sequences a step).
Each size divides what it splits (the checks validate runs too).

The micro-batch and the checkpointing trade memory for time, each one way: a larger
micro-batch (fewer accumulation steps, so fewer FSDP gathers) and lighter checkpointing
(less recompute) are faster and need more memory. So each data mesh is planned at its
fastest corner, the largest micro-batch without checkpointing; then, best first, the
layouts one step slower than one that did not fit, while one of them could still beat the
fastest that fits (Frontier), as hydra_plugins/moe_exp_search/layout_sweeper.py runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

# the keys a layout sets: the command line's values of them are the search's to choose
KEYS = ("parallel", "parallel.tp", "parallel.etp", "parallel.expert_parallel_size",
        "parallel.replicate", "parallel.cp", "parallel.pp", "parallel.pp_schedule",
        "parallel.pp_microbatches", "parallel.pp_balance", "parallel.reshard_after_forward",
        "parallel.accum_no_sync", "train.micro_batch_size", "train.grad_accum_steps",
        "train.activation_checkpointing")
AC_LADDER = ("none", "selective", "full")  # lightest (fastest) first
MAX_PP = 8  # a pipeline's plan traces every block of every micro-batch (pp x blocks at one
# sequence each): pp 16 of mixtral_8x7b would take ~8 minutes here
MAX_TRACED = 300  # blocks x micro-batches a pipeline's plan may trace in the search
# (mixtral_8x7b's EP 8 x PP 8 interleaved: 256, 60 s here; DeepSeek-V3's: 512, ~8 minutes)
MIN_CP_TOKENS = 4096  # context parallel where each rank keeps at least these of a sequence
SCHEDULES = ("1f1b", "interleaved_1f1b")  # gpipe: 1f1b's bubble with more memory held;
# zero_bubble: its checkpointed stages hold more than its plain ones (docs/distributed.md),
# and searched, it doubled mixtral_8x7b's search on 64 GPUs (9 min 57 s)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # experts' ranks (1: experts FSDP-sharded like the rest)
    replicate: int = 1  # HSDP's replicas (1: FSDP over every data rank)
    micro: int = 1  # sequences a micro-batch
    accum: int = 1  # micro-batches accumulated a step (pp = 1)
    pp_micro: int = 1  # pipeline micro-batches a step (pp > 1)
    schedule: str = "1f1b"
    ac: str = "none"

    @property
    def option(self) -> str:
        return "expert_fsdp" if self.ep > 1 else "hsdp" if self.replicate > 1 else "fsdp"

    def mesh(self) -> "Layout":
        """The layout less its micro-batch and checkpointing."""
        return replace(self, ac="", micro=0, accum=0)

    def slower(self) -> list["Layout"]:
        """The layouts a step slower and leaner: half the micro-batch (twice the
        accumulation; not under pp, whose micro-batches are of one sequence), the next
        heavier checkpointing, and full checkpointing (the leanest: where it fits, its
        time bounds the search early)."""
        out = []
        if self.pp == 1 and self.micro % 2 == 0:
            out.append(replace(self, micro=self.micro // 2, accum=self.accum * 2))
        for ac in dict.fromkeys(AC_LADDER[AC_LADDER.index(self.ac) + 1:][:1] +
                                AC_LADDER[-1:]):
            if ac != self.ac:
                out.append(replace(self, ac=ac))
        return out

    def leanness(self) -> tuple:
        """Heavier checkpointing, then smaller micro-batches: likelier to fit."""
        return AC_LADDER.index(self.ac), -self.micro

    def covers(self, other: "Layout") -> bool:
        """Whether self is at least as fast as `other` by construction: the same mesh, a
        micro-batch as large and checkpointing as light."""
        return self.mesh() == other.mesh() and self.micro >= other.micro and \
            AC_LADDER.index(self.ac) <= AC_LADDER.index(other.ac)

    def name(self) -> str:
        """In short, as layout_name writes it."""
        return layout_name(" ".join(self.overrides()))

    def overrides(self) -> list[str]:
        o = [f"parallel={self.option}", f"parallel.tp={self.tp}",
             f"train.activation_checkpointing={self.ac}"] + (
            [f"parallel.cp={self.cp}"] if self.cp > 1 else [])
        if self.ep > 1:
            o += [f"parallel.expert_parallel_size={self.ep}"]
            if self.tp > 1:
                o += ["parallel.etp=1"]
        if self.replicate > 1:
            o += [f"parallel.replicate={self.replicate}"]
        if self.pp > 1:
            # (the stages' parameters kept gathered from forward to backward: torchtitan's
            # default under pp, a gather less a micro-batch, and expert_fsdp's selective
            # recompute needs it)
            o += [f"parallel.pp={self.pp}", f"parallel.pp_schedule={self.schedule}",
                  f"parallel.pp_microbatches={self.pp_micro}", "parallel.pp_balance=flops",
                  "parallel.reshard_after_forward=false",
                  f"train.micro_batch_size={self.micro * self.pp_micro}",
                  "train.grad_accum_steps=1"]
        else:  # (accumulating, each micro-batch's gradients reduce-scattered: held
            # unsharded to the step's end, as no_sync does, they would be the model's size)
            o += [f"train.micro_batch_size={self.micro}",
                  f"train.grad_accum_steps={self.accum}"] + (
                ["parallel.accum_no_sync=false"] if self.accum > 1 else [])
        return o


def layout_name(label: str) -> str | None:
    """A plan's layout in short ("EP 8 x PP 4 (1f1b, 8 micro-batches), selective, micro-batch
    2 x 4") from its sweep label (the overrides that vary); None where it sets no parallel
    option."""
    o = dict(t.split("=", 1) for t in str(label).split() if "=" in t)
    if "parallel" not in o:
        return None
    ep, rep = o.get("parallel.expert_parallel_size"), o.get("parallel.replicate")
    tp, pp = int(o.get("parallel.tp", 1)), int(o.get("parallel.pp", 1))
    cp = int(o.get("parallel.cp", 1))
    parts = [f"EP {ep}" if ep else f"HSDP ({rep} replicas)" if rep else
             "FSDP"] + ([f"CP {cp}"] if cp > 1 else []) + ([f"TP {tp}"] if tp > 1 else [])
    if pp > 1:
        parts.append(f"PP {pp} ({o.get('parallel.pp_schedule', '1f1b')}, "
                     f"{o.get('parallel.pp_microbatches')} micro-batches)")
    out = " x ".join(parts)
    if "train.activation_checkpointing" in o:
        ac = o["train.activation_checkpointing"]
        out += ", no checkpointing" if ac == "none" else f", {ac} checkpointing"
    if pp == 1 and "train.micro_batch_size" in o:
        accum = int(o.get("train.grad_accum_steps", 1))
        out += f", micro-batch {o['train.micro_batch_size']}" + (f" x {accum}" if accum > 1
                                                                else "")
    return out


class Frontier:
    """The search's state: every planned layout's verdict (planned_fits: True, False, or
    None where it was not planned or its state alone does not fit) and planned tokens/s,
    and the layouts left to plan, each with a bound on its tokens/s: the least of its
    planned faster neighbours' (it is slower than each).

    next() is the unplanned layout of the highest bound that could still win: a step
    slower than a planned layout that did not fit, not covered by a planned layout that
    fits, its bound above the fastest that fits; of equal bounds the leanest, so that a
    fit is found early. Best first, the search stops as soon as no layout left can beat
    the fastest found."""

    def __init__(self) -> None:
        self.planned: dict[Layout, tuple[bool | None, float | None]] = {}
        self.bound: dict[Layout, float] = {}

    def add(self, lay: Layout, fits: bool | None, speed: float | None) -> None:
        self.planned[lay] = (fits, speed)
        self.bound.pop(lay, None)
        if fits is False and speed is not None:
            for s in lay.slower():
                if s not in self.planned:
                    self.bound[s] = min(self.bound.get(s, speed), speed)

    def best(self) -> float:
        return max((v or 0.0 for ok, v in self.planned.values() if ok), default=0.0)

    def next(self) -> tuple[Layout, float] | None:
        return next(iter(self.take(1)), None)

    def take(self, n: int, skip=frozenset()) -> list[tuple[Layout, float]]:
        """The n unplanned layouts next() would give in turn were none of them planned (the
        highest bounds; of equal bounds the leanest), with their bounds; none of `skip`
        (being planned)."""
        best = self.best()
        fits = [t for t, (ok, _) in self.planned.items() if ok]
        live = [(b, t) for t, b in self.bound.items()
                if b > best and t not in skip and not any(f.covers(t) for f in fits)]
        live.sort(key=lambda x: (x[0], x[1].leanness()), reverse=True)
        return [(t, b) for b, t in live[:n]]


def _pow2(upto: int) -> list[int]:
    out, v = [], 1
    while v <= upto:
        out.append(v)
        v *= 2
    return out


def global_batch(cfg) -> int:
    """Sequences a step every layout keeps: sweep.global_batch, else hardware.devices x
    train.micro_batch_size x train.grad_accum_steps (the base config's, as plain data
    parallel)."""
    t = cfg.train
    return cfg.sweep.global_batch or \
        cfg.hardware.devices * t.micro_batch_size * t.grad_accum_steps


def _tps(cfg) -> list[int]:
    """The tensor-parallel sizes of cfg's model on its devices (a node's at most)."""
    from ..config import tp_splits

    m, hw = cfg.model, cfg.hardware
    n = hw.devices
    return [tp for tp in _pow2(min(hw.devices_per_node or n, n)) if n % tp == 0 and not any(
        size % tp for _, size in tp_splits(m, tp)) and cfg.train.seq_len % tp == 0]


def _cps(cfg, tp: int) -> list[int]:
    """The context-parallel sizes at tp: 1, and each power of two leaving every rank at
    least MIN_CP_TOKENS of a sequence, that divides the ranks and the sequence into 2 x cp
    x tp chunks."""
    n, seq = cfg.hardware.devices, cfg.train.seq_len
    return [cp for cp in _pow2(n // tp) if cp == 1 or (
        seq // cp >= MIN_CP_TOKENS and n % (tp * cp) == 0 and seq % (2 * cp * tp) == 0)]


def no_layout(cfg) -> str | None:
    """One line where no layout splits the global batch, else None."""
    if layouts(cfg):
        return None
    n, ranks = cfg.hardware.devices, [cfg.hardware.devices // tp for tp in _tps(cfg)]
    return (f"sweep.global_batch: no layout of hardware.devices={n} splits "
            f"{global_batch(cfg)} sequences a step (a multiple of the data ranks: "
            f"{' or '.join(map(str, ranks))})")


def layouts(cfg) -> list[Layout]:
    """Every data mesh without a pipeline of cfg's hardware.devices for cfg's model, at its
    fastest corner (Frontier gives the slower ones where it does not fit)."""
    m, hw = cfg.model, cfg.hardware
    n, node, batch = hw.devices, hw.devices_per_node or hw.devices, global_batch(cfg)
    out = []
    for tp in _tps(cfg):
        for cp in _cps(cfg, tp):
            dp = n // tp // cp
            if batch % dp == 0:
                for mesh in _meshes(m, dp, tp, node, cp):
                    out += _batches(mesh, 1, batch // dp, m.num_layers)
    return out


def pipelines(cfg, best: Layout) -> list[Layout]:
    """The pipelines of `best`'s data mesh (the search's: the fastest planned at tp 1,
    fitting or not): pp of each power of two up to half the blocks and MAX_PP, each
    schedule; its tp and cp, its expert-parallel size or the ranks it can span, the fewer
    (the data ranks, x tp where the experts are whole under TP), and its HSDP replicas
    where they divide the data ranks."""
    from math import gcd

    m, n, batch = cfg.model, cfg.hardware.devices, global_batch(cfg)
    out = []
    for pp in _pow2(min(MAX_PP, m.num_layers // 2))[1:]:
        dp = n // pp // best.cp // best.tp
        if n % (pp * best.cp * best.tp) or dp == 0 or batch % dp:
            continue
        rep = best.replicate if best.replicate > 1 and dp % best.replicate == 0 and \
            dp > best.replicate else 1
        mesh = Layout(tp=best.tp, ep=gcd(best.ep, dp * best.tp), replicate=rep, cp=best.cp)
        out += _batches(mesh, pp, batch // dp, m.num_layers)
    return out


def too_long(cfg, lays: list[Layout]) -> tuple[list[Layout], list[str]]:
    """The pipelines whose plans trace at most MAX_TRACED blocks x micro-batches, and a
    line for each left out."""
    keep, why = [], []
    for lay in lays:
        n = traced_blocks(cfg.model, lay)
        if n <= MAX_TRACED:
            keep.append(lay)
        else:
            why.append(f"{lay.name()}: its plan would trace "
                       f"{n:,} blocks x micro-batches (over {MAX_TRACED}); plan it alone "
                       "with task=plan")
    return keep, why


def traced_blocks(m, lay: Layout) -> int:
    """Blocks x micro-batches a pipeline's plan traces (plan/predict.py: each stage at two
    depths where it gains, else every block; the first two and the last two pp ranks
    where the ranks between hold alike stages, else every rank)."""
    layers, lead = m.num_layers, (m.first_k_dense if m.num_experts else 0)
    v = 1 if lay.schedule == "1f1b" else 2
    stages = lay.pp * v
    if 2 * lead + stages * 5 < layers:  # (plan/depth.py: stage_depths, 2 and 3 a stage)
        return min(lay.pp, 4) * lay.pp_micro * v * 5 + 2 * lead * lay.pp_micro
    size, extra = divmod(layers, stages)
    held = [[size + (s < extra) for s in range(r, stages, lay.pp)] for r in range(lay.pp)]
    alike = lay.pp >= 5 and all(h == held[1] for h in held[1:-1])
    return (4 if alike else lay.pp) * lay.pp_micro * -(-layers // lay.pp)


def _meshes(m, dp: int, tp: int, node: int, cp: int = 1) -> list[Layout]:
    """The data dims: FSDP over all dp (x cp) ranks, HSDP with a node's ranks a shard
    group, expert parallel of each size dividing the experts and the ranks it spans (dp x
    tp: experts whole under TP, etp = 1, which context parallel does not take yet)."""
    out = [Layout(tp=tp, cp=cp)]
    shard = node // tp // cp
    if shard > 1 and dp > shard and dp % shard == 0:
        out.append(Layout(tp=tp, cp=cp, replicate=dp // shard))
    if m.num_experts and (cp == 1 or tp == 1):
        span = dp * tp
        out += [Layout(tp=tp, cp=cp, ep=e) for e in _pow2(min(span, m.num_experts))[1:]
                if m.num_experts % e == 0 and span % e == 0 and e % tp == 0]
    return out


def _batches(mesh: Layout, pp: int, per: int, layers: int) -> list[Layout]:
    """The fastest corner of a data rank's `per` sequences a step: the largest power of
    two dividing them (Layout.slower halves it); under pp, micro-batches of one sequence (the
    most: the smallest bubble, and 1F1B holds at most pp of them whatever their number)
    under each schedule that splits the blocks."""
    if pp == 1:
        micro = max(m for m in _pow2(per) if per % m == 0)
        return [replace(mesh, micro=micro, accum=per // micro, ac=AC_LADDER[0])]
    return [replace(mesh, pp=pp, pp_micro=per, schedule=s, ac=AC_LADDER[0])
            for s in SCHEDULES if per >= pp and (
                s == "1f1b" or (2 * pp <= layers and per % pp == 0))]
