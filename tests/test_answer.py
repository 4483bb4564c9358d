"""The report leads with the answer: the fastest row that fits with its loss ok, then the
Pareto frontier among loss-ok rows; rows whose loss is not ok are named, never the answer."""
import json

from moe_exp.sweep.report import report
from moe_exp.results import FIELDS
from moe_exp.sweep.answer import answer_text
from moe_exp.sweep.table import build_table


def rec(job, tps, mem, loss=None, status="ok", **opts):
    """A record of `opts` (its overrides); loss = (median, min, max) of eval_loss."""
    r = dict.fromkeys(FIELDS)
    r.update(job=job, status=status, model="m", precision="fp32", parallel="none",
             activation_checkpointing="none", compile="off", grad_accum_steps=1,
             tokens_per_s=tps, peak_mem_gib=mem, config_hash=f"h{job}",
             overrides=["model=m", *(f"{k}={v}" for k, v in opts.items())])
    r.update({k.split(".")[-1]: v for k, v in opts.items()})
    if loss:
        r.update(eval_loss=loss[0], eval_loss_min=loss[1], eval_loss_max=loss[2], repeats=3)
    return r


PLANTED = [
    rec(0, 100.0, 2.0, (3.00, 2.99, 3.01)),  # the baseline (fewest optimizations on)
    rec(1, 150.0, 1.5, (3.005, 2.995, 3.015), precision="bf16"),  # the answer
    rec(2, 200.0, 1.4, (3.20, 3.19, 3.21), precision="bf16", compile="default"),  # loss bad
    rec(3, 90.0, 1.0, (3.00, 2.99, 3.01), **{"train.activation_checkpointing": "full"}),
    rec(4, None, None, status="oom", precision="bf16", **{"train.micro_batch_size": 64}),
    rec(5, 120.0, 1.8, (3.0, 2.99, 3.01), **{"train.micro_batch_size": 16}),  # dominated
]


def test_report_opens_with_the_fastest_fitting_loss_ok_row_and_its_frontier(tmp_path, capsys):
    for r in PLANTED:
        (tmp_path / str(r["job"])).mkdir()
        (tmp_path / str(r["job"]) / "metrics.json").write_text(json.dumps(r))
    report(tmp_path, plots=False)
    text = (tmp_path / "report.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines[1] == "## The answer"
    first = lines[2]
    assert first.startswith("the fastest configuration that fits with its loss ok is job 1 "
                            "(precision=bf16"), first
    assert "150 tokens/s, 1.50× the baseline's tokens/s" in first
    assert "25% less memory" in first and "+0.0050 vs the baseline" in first and "loss ok" in first
    assert lines[3].strip() == "python -m moe_exp.run model=m precision=bf16"
    assert lines[4].startswith("Faster, but the loss is not ok: job 2 (")
    assert "2.00×" in lines[4]
    assert lines[5].startswith("Did not run to the end: 1 oom")
    front = [ln for ln in lines if ln.startswith("- job ")]
    assert [ln.split()[2] for ln in front] == ["3", "1"]  # by memory; 0 and 5 dominated
    assert text.index("## The answer") < text.index("| combination")  # then the table
    assert "| NO " in text  # the not-ok row is in the table, marked
    out = capsys.readouterr().out
    assert out.index("## The answer") < out.index("job 1 (precision=bf16")


def test_answer_without_judged_loss_or_any_finished_row():
    unjudged = answer_text(build_table([rec(0, 100.0, 2.0), rec(1, 130.0, 2.5, precision="bf16")]))
    assert "fits (its loss not judged) is job 1 (precision=bf16)" in unjudged
    assert "loss not judged (one initialization" in unjudged
    none = answer_text(build_table([rec(0, None, None, status="oom")]))
    assert "none: no row finished." in none and "1 oom" in none


def test_answer_reads_numpy_bools_and_nan_as_verdicts():
    """A table whose every row was judged holds numpy's bools (a file read back: NaN for
    null): a NOT-ok row stays out of the answer."""
    df = build_table([r for r in PLANTED if r["status"] == "ok"])
    df["loss_ok"] = df["loss_ok"].astype(bool)
    text = answer_text(df)
    assert "fits with its loss ok is job 1 (precision=bf16)" in text
    assert "Faster, but the loss is not ok: job 2 (" in text
    df["loss_ok"] = df["loss_ok"].astype(object).where(df["job"] != 1, float("nan"))
    assert "fits (its loss not judged) is job 1 (" in answer_text(df)


def test_a_plan_sweep_names_its_fastest_layout_that_fits():
    """A sweep of task=plan rows: the answer is read from the planned columns, the fastest
    plan that fits (not "no row finished": plans have no measured tokens/s)."""
    def plan(job, tps, peak, fits, **opts):
        r = rec(job, None, None, **opts)
        r.update(task="plan", planned_tokens_per_s=tps, planned_peak_gib=peak,
                 planned_fits=fits, planned_memory_gib=79.1)
        return r

    rows = [plan(0, 9_000.0, 40.0, True, **{"parallel.expert_parallel_size": 1}),
            plan(1, 12_000.0, 30.0, True, **{"parallel.expert_parallel_size": 2}),
            plan(2, 20_000.0, 90.0, False, **{"parallel.expert_parallel_size": 4}),
            plan(3, 11_000.0, 20.0, True, **{"parallel.expert_parallel_size": 8})]
    text = answer_text(build_table(rows))
    assert "the fastest planned layout that fits is job 1 (parallel.expert_parallel_size=2): " \
        "12,000 tokens/s planned, peak 30.0 of 79.1 GiB a device (predicted" in text, text
    assert "python -m moe_exp.run model=m parallel.expert_parallel_size=2" in text
    none = answer_text(build_table([plan(0, 5.0, 90.0, False), plan(1, 6.0, 95.0, False)]))
    assert "none: no plan fits in memory; the lowest planned peak is job 0" in none, none


def test_an_answer_measured_under_load_says_so_first():
    """Rows measured while other processes used the CPU: the answer opens with that."""
    rows = [rec(0, 100.0, 2.0), rec(1, 130.0, 2.5, precision="bf16")]
    for r in rows:
        r["cpu_other_load"] = 0.7
    lines = [ln for ln in answer_text(build_table(rows)).splitlines() if ln.strip()]
    assert lines[1].startswith("**Measured while the machine was busy**: measured while other "
                               "processes used over"), lines
    assert "job 0 (70%); job 1 (70%)" in lines[1]
    assert lines[2].startswith("the fastest configuration that fits")
    quiet = [rec(0, 100.0, 2.0), rec(1, 130.0, 2.5, precision="bf16")]
    assert "busy" not in answer_text(build_table(quiet))
