"""The summary table printed at the end of a run."""
from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..bench.load import busy, load_warning


def _f(v, fmt: str, unit: str = "") -> str:
    return "—" if v is None else f"{v:{fmt}}{unit}"


def _fallbacks(share) -> str:
    if not share:
        return ""
    pct = f"{100 * share:.0f}%" if share >= 0.01 else "<1%"
    return f"; padded fell back on {pct} of layer calls"


def _padding_note(r: dict) -> str | None:
    """A note where compiled padded dispatch was costly: it pads every expert to the busiest.

    Compiled padded cannot fall back; the note shows where the per-step imbalance is above
    PAD_LIMIT."""
    from ..model.moe import PAD_LIMIT

    x = r.get("expert_load_step_max_over_mean")
    if r.get("moe_dispatch") != "padded" or r.get("compile") in (None, "off") or not x \
            or x <= PAD_LIMIT:
        return None
    return (f"compiled padded pads every expert to the busiest: its expert matmuls did "
            f"{x:.2f}x the routed rows' work (eager falls back above {PAD_LIMIT}x); "
            "model.dispatch=grouped computes only the routed rows")


def _reduced(r) -> str:
    """The text for DDP's gradient bytes a step, grad_reduce_bytes, and its comm hook."""
    if not r.get("grad_reduce_bytes"):
        return ""
    hook = r.get("comm_hook")
    return (f"; grads {r['grad_reduce_bytes'] / 2**20:,.2f} MiB/step/rank reduced"
            + (f" ({hook} hook)" if hook not in (None, "none") else ""))


def _plan_check(r: dict) -> str:
    """The run's plan, made where train.plan is on, against what the run measured."""
    why = r.get("null_reasons", {})

    def err(k: str, of: str = "") -> str:
        return f"error {r[k]:+.1%}{of}" if r.get(k) is not None else \
            f"not checked ({why.get(k) or 'no measured figure'})"

    got = "tracked" if r.get("tracked_peak_gib") is not None else "measured"
    text = f"peak {r['planned_peak_gib']:.3f} GiB planned, " \
        f"{err('planned_peak_error', f' of {got}')}"
    if r.get("planned_step_ms") is not None:
        text += f"; step {r['planned_step_ms']:,.1f} ms planned, {err('planned_step_error')}"
    return text + f" (traced in {r['plan_s']:.1f} s)"


def layout(r: dict) -> str:
    """The parallel option and its sizes: 'fsdp', 'fsdp x tp 2 (sequence parallel)',
    'fsdp x cp 2', 'fsdp x pp 2 (1f1b, 4 micro-batches)'."""
    tp, pp, cp = r.get("tp") or 1, r.get("pp") or 1, r.get("cp") or 1
    out = r["parallel"]
    if cp > 1:
        out += f" x cp {cp}"
    if tp > 1:
        out += f" x tp {tp}" + (" (sequence parallel)" if r.get("sp") else "")
    if pp > 1:
        out += f" x pp {pp} ({r.get('pp_schedule')}, {r.get('pp_microbatches') or pp} " \
               "micro-batches)"
    return out


def run_line(r: dict) -> str:
    """The run's knobs as label=value words, for a summary's first row.

    A knob is named where it has a Knob.summary label, the run's task reads it, and its
    value is not its `off` value; a knob with Knob.summary_off is named at `off` too."""
    from ..config import KNOBS

    task = r.get("task") or "bench"
    return " ".join(f"{k.summary}={r[k.column]}" for k in KNOBS.values()
                    if k.summary and k.records(task) and r.get(k.column) is not None
                    and (k.off is None or k.summary_off or r[k.column] != k.off))


def summary_rows(r: dict) -> list[tuple[str, str]]:
    why = r.get("null_reasons", {})
    # each phase's share of the phases' summed medians: the median of a sum is not the sum
    # of the medians, and under contention shares of the median step can pass 100%
    phases = [r.get(f"{p}_ms") for p in ("data", "forward", "backward", "optimizer")]
    step = sum(phases) if None not in phases else (r["step_time_ms"] or 0.0)
    share = lambda ms: "" if ms is None or not step else f" ({100 * ms / step:.0f}%)"  # noqa: E731
    mfu = (f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None
           else f"null: {why.get('mfu', 'unknown')}")
    rows = [
        ("run", f"{run_line(r)} on {r['device_name']}"),
        *([("parallel", f"{layout(r)} on {r['world_size']} "
                        f"rank{'s' * (r['world_size'] != 1)}; collectives "
                        + (f"{r['comm_ms']:.1f} ms/step" if r.get("comm_ms") is not None
                           else f"null: {why.get('comm_ms', 'unknown')}")
                        + (f" ({100 * r['comm_share']:.0f}%)" if r.get("comm_share") else "")
                        + (f", {r['comm_exposed_ms']:.1f} ms not overlapped"
                           if r.get("comm_exposed_ms") is not None else "")
                        + _reduced(r))]
          if (r.get("world_size") or 1) > 1 or r["parallel"] != "none" else []),
        *([("by kind", ", ".join(f"{k} {v['ms']:.1f} ms ({v['exposed_ms']:.1f} exposed)"
                                 for k, v in r["comm_kinds"].items()) + " (max over ranks)")]
          if len(r.get("comm_kinds") or {}) > 1 else []),
        ("params", f"{r['params_total'] / 1e6:,.2f}M total, {r['params_active'] / 1e6:,.2f}M active"),
        ("tokens/s", f"{r['tokens_per_s']:,.0f}  ({r['tokens_per_s_per_device']:,.0f} per device)"),
        ("step time", f"{_f(r['step_time_ms'], '.1f', ' ms')} median, "
                      f"IQR {_f(r['step_time_iqr_ms'], '.1f', ' ms')}"),
        ("breakdown", "  ".join(f"{p} {_f(r[p + '_ms'], '.1f', ' ms')}{share(r[p + '_ms'])}"
                                for p in ("data", "forward", "backward", "optimizer"))),
        ("TFLOP/s/device", f"{r['tflops_per_device']:.3f}  ({r['flops_per_token'] / 1e6:,.1f} "
                           "MFLOP/token)"),
        ("MFU", mfu),
        ("peak memory", (f"{r['peak_mem_gib']:.3f} GiB" if r["peak_mem_gib"] is not None
                         else f"null: {why.get('peak_mem_gib', 'unknown')}")
                        + (f" (reserved {r['peak_reserved_gib']:.3f} GiB)"
                           if r.get("peak_reserved_gib") is not None else "")),
    ]
    if r.get("planned_peak_gib") is not None:
        rows.append(("plan", _plan_check(r)))
    if r.get("gpu_util_pct") is not None:
        rows.append(("GPU (NVML)", f"{r['gpu_util_pct']:.0f}% busy, {r['gpu_mem_used_gib']:.1f} "
                                   f"GiB used, {r['gpu_power_w']:.0f} W"))
    if shares := r.get("profile_shares"):
        from ..bench.profile import top_shares

        rows.append(("profile", f"{top_shares(shares)} ({r['profile_trace']})"))
    if r.get("startup_s") is not None:
        rows.append(("startup", f"{r['startup_s']:.1f} s from process start to the first "
                                "measured step (compile excluded)"))
    if r.get("compile_s") is not None:
        share = r.get("compile_cache_hit_share")
        cache = ("" if share is None else ", cold inductor cache" if share == 0 else
                 f", warm inductor cache: {share:.0%} of graphs from it")
        rows.append(("compile", f"{r['compile_s']:.1f} s (first step beyond a steady step"
                                f"{cache})"))
        if r.get("cudagraph_skips"):
            rows.append(("NOTE", f"{r['cudagraph_skips']} compiled graph(s) ran without the "
                                 f"CUDA graphs train.compile={r['compile']} asks for "
                                 "(why: TORCH_LOGS=cudagraphs)"))
    if r.get("expert_load_cv") is not None:
        per_step = r.get("expert_load_step_max_over_mean")
        rows.append(("expert load", f"CV {r['expert_load_cv']:.3f}, max/mean "
                                    f"{r['expert_load_max_over_mean']:.2f}"
                                    + (f" (per step {per_step:.2f})" if per_step else "")
                                    + ", aux loss "
                                    f"{r['aux_loss']:.4f}"
                                    + (f", per sequence {r['seq_aux_loss']:.4f}"
                                       if r.get("seq_aux_loss") is not None else "")
                                    + _fallbacks(r.get("moe_padded_fallback_share"))))
        routed = [f"{r['drop_rate']:.1%} of choices dropped (over capacity)"
                  if r.get("drop_rate") else "",
                  f"{r['dead_experts']} expert(s) got no token" if r.get("dead_experts") else "",
                  f"routing bias spread {r['router_bias_spread']:.4f}"
                  if r.get("router_bias_spread") is not None else ""]
        if any(routed):
            rows.append(("routing", "; ".join(x for x in routed if x)))
        if note := _padding_note(r):
            rows.append(("NOTE", note))
    else:
        rows.append(("expert load", f"null: {why.get('expert_load_cv', '')}"))
    floor, held = r.get("loss_floor"), r.get("eval_loss")
    notes = ([f"held-out {held:.4f}"] if held is not None else []) + \
        ([f"the data's floor {floor:.4f}"] if floor is not None else [])
    if r.get("steps_to_target"):
        notes.append(f"target reached at step {r['steps_to_target']}, "
                     f"{r['seconds_to_target']:.1f} s")
    rows.append(("loss", f"{r['loss_first']:.4f} → {r['loss_last']:.4f}" +
                 (f" ({'; '.join(notes)})" if notes else "")))
    if spike := r.get("grad_norm_spike"):
        rows.append(("WARNING", f"gradient norm spiked at step {spike[0]}: {spike[1]:.0f}× the "
                                "median of the 20 steps before it"))
    if ckpt := _checkpoints(r):
        rows.append(("checkpoints", ckpt))
    load = r.get("cpu_other_load")
    if busy(load):
        rows.append(("WARNING", load_warning(load, "the measured steps")))
    return rows


def _checkpoints(r: dict) -> str:
    """train.checkpoint_every's saves and train.resume_from's load in one line; '' if none."""
    out = []
    if r.get("resumed_from_step") is not None:
        out.append(f"resumed at step {r['resumed_from_step']} (loaded in "
                   f"{r['checkpoint_load_s']:.2f} s)")
    if r.get("checkpoint_saves"):
        out.append(f"{r['checkpoint_saves']} saved, each {_gib(r['checkpoint_gib'])} in "
                   f"{r['checkpoint_save_s']:.2f} s blocking"
                   + (f" ({r['checkpoint_save_total_s']:.2f} s to disk)"
                      if r["checkpoint_save_total_s"] != r["checkpoint_save_s"] else "")
                   + (f", {r['checkpoint_share']:.0%} of the measured time"
                      if r.get("checkpoint_share") is not None else "")
                   + f"; latest {r['checkpoint_path']}")
    return "; ".join(out)


def _gib(x) -> str:
    return "? GiB" if x is None else f"{x:.3f} GiB"


def print_summary(r: dict, path: Path | None = None, rows=None,
                  title: str = "moe_exp result") -> None:
    """Print the record's rows as a table; without rows, a training run's summary_rows."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    for k, v in summary_rows(r) if rows is None else rows:
        table.add_row(k, v)
    from .. import screen

    console = screen.console()
    console.print(table)
    if path:
        print(f"record: {path}", flush=True)  # (whole: a path to copy)
