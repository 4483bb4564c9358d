"""The answer a sweep is run for: per baseline group, the fastest configuration that fits.

A configuration fits where it ran to status ok; the answer's loss is ok too. The Pareto
frontier of tokens/s vs peak memory among such rows follows. A row whose loss was not
judged, with one repeat, can be the answer, and the answer says so; a row whose loss is not
ok never is, and the answer names the faster ones."""
from __future__ import annotations

import shlex

from .plots import pareto_mask
from .table import cell_text, contended, number_or_none, override_items


def _groups(df):
    """The table's rows per baseline group: the same baseline_job, as build_table sets it.

    A row without one, not finished and so never grouped by size, joins its model's first
    group."""
    has = [number_or_none(b) is not None or isinstance(b, str) for b in df["baseline_job"]]
    out: dict = {}
    for i, b in enumerate(df["baseline_job"]):
        if has[i]:
            out.setdefault(("job", str(b)), []).append(i)
    for i, m in enumerate(df["model"]):
        if not has[i]:
            key = next((k for k, idx in out.items() if df["model"].iloc[idx[0]] == m),
                       ("model", str(m)))
            out.setdefault(key, []).append(i)
    return [df.iloc[sorted(idx)] for idx in out.values()]


def verdict(v) -> bool | None:
    """A loss_ok cell as True, False or None, numpy's bools and NaN included."""
    return None if v is None or v != v else bool(v)


def _fits(g):
    """Rows that ran to the end with a throughput."""
    return g[(g["status"] == "ok") & g["tokens_per_s"].map(lambda v: number_or_none(v) is not None)]


def pick(g):
    """One group's answer row or None, its candidates, and the faster rows whose loss is not ok.

    The candidates are the rows that fit with their loss ok or not judged. On a tie the row
    with fewer optimizations wins, the baseline first."""
    fit = _fits(g)
    bad = fit["loss_ok"].map(lambda v: verdict(v) is False).astype(bool)
    cands = fit[~bad]
    if not len(cands):
        return None, cands, fit[bad]
    order = cands.assign(_base=~cands["baseline"].astype(bool)).sort_values(
        ["tokens_per_s", "_base"], ascending=[False, True])
    best = order.iloc[0]
    worse = fit[bad & (fit["tokens_per_s"] > best["tokens_per_s"])]
    return best, cands, worse.sort_values("tokens_per_s", ascending=False)


def command(row) -> str:
    """The command that runs the row's configuration alone."""
    items = override_items(row)
    return "python -m moe_exp.run" + "".join(f" {shlex.quote(f'{k}={v}')}"
                                             for k, v in items.items())


def _loss(row, base, hint: bool) -> str:
    """The row's held-out loss, against the baseline's and the data's floor, and its verdict."""
    ok = verdict(row.get("loss_ok"))
    said = {True: "loss ok", False: "loss NOT ok"}.get(ok, "loss not judged")
    if hint and ok is None:
        said += " (one initialization: sweep.repeats=3 sweep.vary_init=true judges it)"
    ev = number_or_none(row.get("eval_loss"))
    if ev is None:
        return f"no held-out loss, {said}"
    notes = []
    bev = None if base is None or bool(row.get("baseline")) else number_or_none(base.get("eval_loss"))
    if bev is not None:
        notes.append(f"{ev - bev:+.4f} vs the baseline")
    if (gap := number_or_none(row.get("eval_gap"))) is not None:
        notes.append(f"{gap:.4f} above the data's floor")
    return f"held-out loss {ev:.4f}" + (f" ({'; '.join(notes)})" if notes else "") + \
        f", {said}"


def _row_line(row, base, hint: bool = False) -> str:
    sp = number_or_none(row.get("speedup"))
    vs = "the baseline" if bool(row.get("baseline")) else \
        (f"{sp:.2f}× the baseline's tokens/s" if sp is not None else "no speedup")
    saved = number_or_none(row.get("mem_saved_pct"))
    mem = f"peak {cell_text(row.get('peak_mem_gib'), '.3f')} GiB" + \
        (f" ({abs(saved):.0f}% {'less' if saved >= 0 else 'more'} memory)"
         if saved is not None and not bool(row.get("baseline")) else "")
    return (f"job {row['job']} ({row['label']}): {cell_text(row['tokens_per_s'], ',.0f')} "
            f"tokens/s, {vs}, {mem}, {_loss(row, base, hint)}")


def plan_answer(df) -> list[str]:
    """A plan sweep's answer: the fastest planned layout that fits, from its planned columns.

    Plans are predictions, and the line says so. Where no plan has a time, the one that fits
    with the lowest planned peak is named; where none fits, the lowest peak of all."""
    import pandas as pd

    ok = df[df["status"] == "ok"]
    fit = ok[ok["planned_fits"].map(lambda v: verdict(v) is True)]
    peak = lambda g: pd.to_numeric(g["planned_peak_gib"], errors="coerce")  # noqa: E731
    if not len(fit):
        if not len(ok):
            return ["none: no plan was made (the table's status and error columns).", ""]
        low = ok.loc[peak(ok).idxmin()]
        return [f"none: no plan fits in memory; the lowest planned peak is job {low['job']} "
                f"({low['label']}), {cell_text(low['planned_peak_gib'], ',.1f')} GiB a device.",
                ""]
    fast = pd.to_numeric(fit["planned_tokens_per_s"], errors="coerce")
    if fast.notna().any():
        best = fit.loc[fast.idxmax()]
        what = (f"the fastest planned layout that fits is job {best['job']} ({_name(best)}): "
                f"{cell_text(best['planned_tokens_per_s'], ',.0f')} tokens/s planned")
    else:
        best = fit.loc[peak(fit).idxmin()]
        what = (f"no plan has a time (null_reasons.planned_step_ms says why); the one that "
                f"fits with the lowest peak is job {best['job']} ({best['label']})")
    lines = [f"{what}, peak {cell_text(best['planned_peak_gib'], ',.1f')} of "
             f"{cell_text(best['planned_memory_gib'], ',.1f')} GiB a device (predicted, not "
             "measured).", "", f"    {command(best)}", ""]
    if fast.notna().any():
        lines += _runners_up(ok, fit, best)
    return lines


RUNNERS_UP = 4  # the next fastest plans that fit, each with why it loses


def _name(row) -> str:
    """A plan's layout in short (a layout search's rows), else its label."""
    from .layouts import layout_name

    return layout_name(row["label"]) or row["label"]


def _runners_up(ok, fit, best) -> list[str]:
    """The next fastest plans that fit and why each loses to the best (the part of the step
    that grew most: exposed communication, computing, the pipeline's bubble); the plans
    faster than the best that do not fit, with their peaks."""
    import pandas as pd

    speed = lambda g: pd.to_numeric(g["planned_tokens_per_s"], errors="coerce")  # noqa: E731
    rest = fit[fit.index != best.name].assign(_v=speed).dropna(subset=["_v"])
    out = []
    if len(rest):
        out += ["Runners-up (planned), and why each loses:", ""]
        for _, r in rest.sort_values("_v", ascending=False).head(RUNNERS_UP).iterrows():
            out.append(f"- job {r['job']} ({_name(r)}): "
                       f"{cell_text(r['planned_tokens_per_s'], ',.0f')} tokens/s "
                       f"({r['_v'] / float(best['planned_tokens_per_s']) - 1:+.0%}): "
                       f"{_loses(r, best)}")
        out.append("")
    big = ok[ok["planned_fits"].map(lambda v: verdict(v) is False)].assign(_v=speed)
    big = big[big["_v"] > float(best["planned_tokens_per_s"])]
    if len(big):
        out += ["Faster, but planned not to fit: " + "; ".join(
            f"job {r['job']} ({_name(r)}, peak {cell_text(r['planned_peak_gib'], ',.1f')} "
            f"GiB)" for _, r in big.sort_values("_v", ascending=False).head(
                RUNNERS_UP).iterrows()) + ".", ""]
    return out


def _loses(row, best) -> str:
    """The part of row's planned step that grew most against best's, in words."""
    import pandas as pd

    def ms(r, key):
        v = pd.to_numeric(r.get(key), errors="coerce")
        return 0.0 if pd.isna(v) else float(v)

    def bubble(r):
        return ms(r, "planned_pp_bubble_share") * ms(r, "planned_step_ms")

    parts = {"exposed communication": ms(row, "planned_comm_exposed_ms") -
             ms(best, "planned_comm_exposed_ms"),
             "computing": ms(row, "planned_compute_ms") - ms(best, "planned_compute_ms"),
             "the pipeline's bubble": bubble(row) - bubble(best)}
    what, grew = max(parts.items(), key=lambda kv: kv[1])
    step = f"step {_ms(ms(row, 'planned_step_ms'))} against {_ms(ms(best, 'planned_step_ms'))}"
    return f"{step}; {what} +{_ms(grew)}" if grew > 0 else step


def _ms(v: float) -> str:
    return f"{v:,.0f} ms" if abs(v) >= 100 else f"{v:.3g} ms"


def answer_text(df) -> str:
    """The report's opening section, in markdown; '' for an empty or non-training table."""
    if not len(df) or ("task" in df and (df["task"] == "comm").all()):
        return ""
    if "task" in df and (df["task"] == "plan").all():
        return "\n".join(["## The answer", "", *plan_answer(df)])
    many = df["model"].nunique() > 1 or df["baseline_job"].nunique() > 1
    lines = ["## The answer", ""]
    if busy := contended(df):  # (said first: an answer from such rows is not firm)
        lines += [f"**Measured while the machine was busy**: {busy}. Re-measure them: a grid "
                  "sweep, the same command with sweep.resume=true sweep.remeasure_loaded=true; "
                  "a search, delete those jobs' dirs and run it again.", ""]
    for g in _groups(df):
        base = g[g["baseline"] == True]  # noqa: E712 - pandas mask
        base = base.iloc[0] if len(base) else None
        best, cands, worse = pick(g)
        head = f"**{g['model'].iloc[0]}**" + (f" (baseline job {base['job']})"
                                               if base is not None else "") + ": " if many \
            else ""
        missed = g[g["status"] != "ok"]["status"].value_counts().to_dict()
        if best is None:
            why = "no row finished" if not len(_fits(g)) else "no finished row has its loss ok"
            lines.append(f"{head}none: {why}.")
        else:
            judged = "with its loss ok" if verdict(best["loss_ok"]) is True else \
                "(its loss not judged)"
            lines += [f"{head}the fastest configuration that fits {judged} is "
                      f"{_row_line(best, base, hint=True)}.", "", f"    {command(best)}", ""]
        if len(worse):
            lines.append("Faster, but the loss is not ok: " + "; ".join(
                f"job {r['job']} ({r['label']}, {cell_text(r['speedup'], '.2f', '×')})"
                for _, r in worse.iterrows()) + ".")
        if missed:
            lines.append("Did not run to the end: " + ", ".join(
                f"{n} {s}" for s, n in sorted(missed.items())) + " (the table's status and "
                "error columns).")
        front = cands[pareto_mask(cands)].sort_values("peak_mem_gib") if len(cands) else cands
        if len(front) > 1:
            lines += ["", "Pareto frontier of tokens/s vs peak memory (among the rows that "
                      "fit whose loss is not NO: none of them is both faster and smaller):",
                      ""]
            lines += [f"- {_row_line(r, base)}" for _, r in front.iterrows()]
        lines.append("")
    return "\n".join(lines)
