"""PNG plots of a sweep table: throughput, peak memory, throughput-vs-memory Pareto frontier.

Shared by `moe_exp.report` and notebooks/results.ipynb."""
from __future__ import annotations

from pathlib import Path

DPI = 110  # laid out and saved at the same dpi (text does not scale linearly with it)


def ok_rows(df):
    """Finished rows with a throughput, each named by its combination.

    The name carries the model too where the sweep has several."""
    out = df[(df["status"] == "ok") & df["tokens_per_s"].notna()].copy()
    models = out["model"].nunique() > 1

    def name(m, label):
        if not models:
            return label
        rest = " ".join(w for w in str(label).split() if not w.startswith(("model=", "+model=")))
        return f"{m} · {rest}" if rest else m
    out["name"] = [name(m, lb) for m, lb in zip(out["model"], out["label"])]
    return out


def pareto_mask(df):
    """Rows that no other row beats on both higher throughput and lower peak memory."""
    import numpy as np

    pts = list(zip(df["tokens_per_s"], df["peak_mem_gib"]))
    keep = []
    for i, (t, m) in enumerate(pts):
        if m != m or t != t:  # NaN memory or throughput: not comparable
            keep.append(False)
            continue
        dominated = any(t2 >= t and m2 <= m and (t2 > t or m2 < m)
                        for j, (t2, m2) in enumerate(pts) if j != i and m2 == m2)
        keep.append(not dominated)
    return np.array(keep, dtype=bool)  # a row mask also when empty (a [] picks columns)


def frontier_mask(df):
    """pareto_mask within each model.

    Trading throughput for memory means something only between combinations of one model."""
    import numpy as np

    keep = np.zeros(len(df), dtype=bool)
    for _, idx in df.groupby("model", sort=False).indices.items():
        keep[idx] = pareto_mask(df.iloc[idx])
    return keep


def _empty(ax, title: str) -> bool:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no finished (status ok) rows to plot", ha="center", va="center",
            transform=ax.transAxes)
    ax.set_axis_off()
    return True


def _bars(ax, names, values, colors, xlabel, texts):
    if not len(values):
        return _empty(ax, xlabel)
    y = list(range(len(names)))
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    for i, (v, text) in enumerate(zip(values, texts)):
        ax.text(v, i, " " + text, va="center", fontsize=7)
    ax.set_xlim(0, 1.25 * max(values))  # room for the value texts
    ax.xaxis.set_major_formatter(_si)
    ax.grid(axis="x", alpha=0.3)


def _si(v, _pos=None) -> str:
    """Axis numbers short: 12k, 1.5M."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= div:
            return f"{v / div:g}{unit}"
    return f"{v:g}"


def throughput(ax, df):
    d = ok_rows(df)
    colors = ["tab:gray" if b else "tab:blue" for b in d["baseline"]]
    texts = [f"{v:,.0f}" + (f" ({s:.2f}×)" if s is not None and s == s else "")
             for v, s in zip(d["tokens_per_s"], d["speedup"])]
    _bars(ax, list(d["name"]), list(d["tokens_per_s"]), colors, "tokens/s (median step)", texts)
    ax.set_title("Throughput by combination (grey: baseline)")


def memory(ax, df):
    d = ok_rows(df)
    d = d[d["peak_mem_gib"].notna()]
    colors = ["tab:gray" if b else "tab:orange" for b in d["baseline"]]
    _bars(ax, list(d["name"]), list(d["peak_mem_gib"]), colors, "peak memory (GiB)",
          [f"{v:.3f}" for v in d["peak_mem_gib"]])
    ax.set_title("Peak memory by combination (grey: baseline)")


def pareto(ax, df):
    d = ok_rows(df)
    d = d[d["peak_mem_gib"].notna()]
    title = "Throughput vs memory (filled: no other combination is faster and smaller)"
    if d.empty:
        return _empty(ax, title)
    front = frontier_mask(d)
    models = list(dict.fromkeys(d["model"]))
    one = len(models) == 1
    for i, m in enumerate(models):  # one frontier per model
        sel = (d["model"] == m).to_numpy()
        color = "tab:red" if one else f"C{i % 10}"
        dm, fm = d[sel], front[sel]
        ax.scatter(dm["peak_mem_gib"][fm], dm["tokens_per_s"][fm], color=color, zorder=3)
        ax.scatter(dm["peak_mem_gib"][~fm], dm["tokens_per_s"][~fm], zorder=3,
                   facecolors="none", edgecolors="tab:blue" if one else color)
        fd = dm[fm].sort_values("peak_mem_gib")
        ax.step(fd["peak_mem_gib"], fd["tokens_per_s"], where="post", color=color, alpha=0.6,
                label="Pareto frontier" if one else f"{m}: Pareto frontier")
    mid = (d["peak_mem_gib"].min() + d["peak_mem_gib"].max()) / 2
    for name, x, y in zip(d["name"], d["peak_mem_gib"], d["tokens_per_s"]):
        right = x > mid  # labels of the right half point left, so none runs off the axes
        ax.annotate(name, (x, y), fontsize=6, xytext=(-3 if right else 3, 3),
                    textcoords="offset points", ha="right" if right else "left")
    ax.yaxis.set_major_formatter(_si)
    ax.margins(x=0.08, y=0.08)
    ax.set_xlabel("peak memory (GiB)")
    ax.set_ylabel("tokens/s")
    ax.set_title(title if one else title.replace("combination", "combination of its model"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


PLOTS = {"throughput": throughput, "memory": memory, "pareto": pareto}


def figure(name: str, df):
    """The named plot of the table as a laid-out matplotlib figure, as write_plots saves it.

    It is a Figure of its own on an Agg canvas: pyplot and its backend are left alone, so a
    notebook's inline plots keep working."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    size = (9, 6) if name == "pareto" else (9, 1.2 + 0.35 * len(ok_rows(df)))
    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    PLOTS[name](fig.subplots(), df)
    fig.tight_layout()
    return fig


def write_plots(df, out_dir: Path) -> dict[str, Path]:
    """Write throughput.png, memory.png and pareto.png in out_dir, those with data only."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = ok_rows(df)
    paths = {}
    if d.empty:
        return paths
    for name in PLOTS:
        if name != "throughput" and d["peak_mem_gib"].isna().all():
            continue
        paths[name] = out_dir / f"{name}.png"
        figure(name, df).savefig(paths[name], dpi=DPI)
    return paths
