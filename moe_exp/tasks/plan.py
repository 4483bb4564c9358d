"""task=plan: predicts a training step's memory and time on the hardware named.

plan/predict.py traces the step on fake tensors; nothing is allocated or measured."""
from __future__ import annotations

from ..config import FSDP2, ConfigError
from ..plan.predict import HEADROOM, KINDS, plan_step
from ..record import Plan
from .protocol import Task
from .summary import layout, run_line


class PlanTask(Task):
    name = "plan"
    noun = "plan"
    section = Plan
    title = "moe_exp plan"
    here = False  # (planned for the hardware named: this machine need not have it)

    @staticmethod
    def check(cfg) -> None:
        """Check the step can be traced and the memory to fit known.

        plan.trace.unplannable says what the trace cannot follow."""
        from ..plan.predict import plan_memory_gib
        from ..plan.trace import unplannable

        if why := unplannable(cfg):
            raise ConfigError(*why)
        if plan_memory_gib(cfg.hardware) is None:
            raise ConfigError("hardware.memory_gib", f"hardware={cfg.hardware.name} reads its "
                              "memory from the device, which is not here: a plan needs it (set "
                              "hardware.memory_gib=<GiB per device>)")

    @staticmethod
    def summary_rows(rec: dict) -> list[tuple[str, str]]:
        return summary_rows(rec)

    def run(self, rec: dict) -> None:
        cfg = self.ctx.cfg
        rec.update(task="plan", device_name=f"{cfg.hardware.name} (planned)")
        if cfg.hardware.devices >= 1024 and cfg.parallel.name in FSDP2:
            import sys

            print(f"[plan] tracing rank 0 of {cfg.hardware.devices:,} ranks: FSDP2 makes a "
                  "chunk per rank of each parameter (about a minute per 4,096 ranks for "
                  "tiny_moe on 2 CPU cores)", file=sys.stderr, flush=True)
        plan_step(cfg, rec)


def size_text(gib: float) -> str:
    """A size given in GiB, in the unit that reads best: 1,350 GiB, 2.5 GiB, 12 KiB."""
    x, unit = gib, "GiB"
    for nxt in ("MiB", "KiB", "bytes"):
        if x >= 1 or x == 0:
            break
        x, unit = x * 1024, nxt
    return f"{x:,.0f} {unit}" if x >= 100 or unit == "bytes" else f"{x:.3g} {unit}"


def summary_rows(r: dict) -> list[tuple[str, str]]:
    """The plan's headline figures as (label, text) rows, for the terminal's table and run.log."""
    mem, ok = r.get("planned_memory_gib"), r.get("planned_fits")
    if ok is None:
        fits = f"null: {r['null_reasons'].get('planned_fits', '')}"
    else:
        fits = f"{'yes' if ok else 'NO'}: {r['planned_peak_gib']:.3g} of {mem:.3g} GiB less " \
               f"{HEADROOM:.0%} headroom ({mem * (1 - HEADROOM):.3g} GiB)" + \
            ("" if ok else _what_to_change(r))
    split = ", ".join(f"{k} {r[f'planned_{k}_gib']:,.3f}" for k in KINDS
                      if r.get(f"planned_{k}_gib"))
    step, world = r.get("planned_step_ms"), r.get("world_size") or 1
    peaks = r.get("planned_pp_stage_peaks_gib")
    who = f"the largest peak's rank of {world}" if peaks else f"rank 0 of {world}"
    where = "one device" if world == 1 else f"{who} ({layout(r)})"
    depths = r.get("planned_from_blocks")
    traced = f"{depths[0]} and {depths[1]} blocks traced, the rest extrapolated, in " \
        if depths else "traced in "
    return [
        ("plan", f"{run_line(r)} micro-batch {r['micro_batch_size']} on {r['hardware']}, "
                 f"{where} ({traced}{r['plan_s']:.1f} s)"),
        ("peak memory", f"{r['planned_peak_gib']:,.3f} GiB per device: {split}"
                        + _memory_basis(r.get("planned_memory_basis"))),
        ("fits", fits),
        *([("collectives", _collectives(r))] if r.get("planned_comm") else []),
        *([("pipeline", _pipeline(r))] if peaks else []),
        ("step", f"{r['planned_flops_per_step']:.3g} FLOPs" + (
            f"; {step:,.1f} ms ({r['planned_compute_ms']:,.1f} computing {_basis(r)}, "
            f"{r['planned_comm_ms']:,.1f} communicating{_exposed(r)}), "
            f"{r['planned_tokens_per_s']:,.0f} tokens/s"
            + (f", MFU {r['planned_mfu']:.0%}" if r.get("planned_mfu") is not None else "")
            if step is not None else f"; time: null ({r['null_reasons']['planned_step_ms']})")),
    ]


def _pipeline(r: dict) -> str:
    """A pipeline's stages' peaks and times, its sends and its simulated bubble."""
    bubble, busy = r.get("planned_pp_bubble_share"), r.get("planned_pp_stage_ms")
    return "stages' peaks " + " / ".join(f"{p:,.3g}" for p in r["planned_pp_stage_peaks_gib"]) \
        + " GiB" + (", in their actions " + " / ".join(f"{t:,.3g}" for t in busy) + " ms"
                    if busy else "") \
        + f"; sends {size_text(r['planned_pp_send_gib'])} a step (the most of a rank); " \
        + (f"bubble {bubble:.0%} of the step (its schedule simulated)" if bubble is not None
           else f"bubble null ({r['null_reasons'].get('planned_pp_bubble_share')})")


def _basis(r: dict) -> str:
    """What the compute's time rests on, as the summary says it."""
    basis = r.get("planned_time_basis") or "datasheet"
    if basis == "datasheet":
        return "at the datasheet's peaks: a floor, hardware.calibration for a prediction"
    kernels = r.get("planned_kernel_ms")
    return f"at the rates of {basis.removeprefix('calibration ')}" + (
        f", kernels {kernels:,.1f} of it" if kernels is not None else "")


def _collectives(r: dict) -> str:
    """Each collective's bytes and calls a step, by the mesh dim its groups span where
    there are several (tp: ...; dp_shard: ...)."""
    def kinds(comm):
        return ", ".join(f"{k} {size_text(v['gib'])} in {v['calls']} call"
                         f"{'s' * (v['calls'] != 1)}" for k, v in comm.items())

    groups = r.get("planned_comm_groups") or {}
    text = "; ".join(f"{g}: {kinds(c)}" for g, c in groups.items()) if len(groups) > 1 \
        else kinds(r["planned_comm"])
    return text + " a step (each rank)"


def _exposed(r: dict) -> str:
    """How much of the collectives' time the step waits for."""
    comm, exposed = r.get("planned_comm_ms"), r.get("planned_comm_exposed_ms")
    if not comm or exposed is None:
        return ""
    if r.get("planned_time_basis") == "datasheet":
        return ", no overlap"
    return f", {exposed:,.1f} of it exposed"


# the knobs that shrink each kind of memory at the peak, as the fits line names them
SHRINK = {"activations": "train.seq_len={seq}: a shorter sequence, a smaller "
                         "train.micro_batch_size or train.activation_checkpointing",
          "temporaries": "a shorter train.seq_len or a smaller train.micro_batch_size",
          "optimizer": "more sharding (parallel=fsdp, hardware.devices) or optim=muon",
          "params": "more sharding (parallel=fsdp or expert_fsdp, hardware.devices)",
          "grads": "more sharding (parallel=fsdp, hardware.devices)",
          "collective": "smaller FSDP units or fewer prefetched"}


def _what_to_change(r: dict) -> str:
    """Where a plan does not fit: its largest kind of memory and what shrinks it."""
    kind = max(KINDS, key=lambda k: r.get(f"planned_{k}_gib") or 0)
    gib = r.get(f"planned_{kind}_gib") or 0
    if kind not in SHRINK or not gib:
        return ""
    return f"; {kind} {gib:,.3g} GiB of it: " + SHRINK[kind].format(seq=r.get("seq_len"))


def _memory_basis(basis: str | None) -> str:
    """The peak's step where it is not plainly the eager one (train.compile)."""
    if not basis or basis == "eager step":
        return ""
    return " (the compiled step's)" if basis.startswith("compiled") else f" ({basis})"
