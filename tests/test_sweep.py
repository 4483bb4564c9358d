"""Sweeps: each job in its own process, one table, nothing lost (see tests/sweep_cases)."""
import json
import os
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import ROOT, cli_inproc, off_contract, python, run_cli

CASES = f"hydra.searchpath=[file://{ROOT / 'tests' / 'sweep_cases'}]"
pytestmark = pytest.mark.slow


def sweep(tmp, *args, env=None, timeout=600):
    return run_cli(["-m", CASES, f"hydra.sweep.dir={tmp}", *args], cwd=tmp.parent,
                   timeout=timeout, env=env)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """fp32, bf16, an invalid combination and a run that diverges; W&B offline."""
    d = tmp_path_factory.mktemp("sweep") / "s"
    r = sweep(d, "+case=fp32,bf16,invalid,diverge", "logger=wandb",
              env={"WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]
    return d, r


def test_table_has_every_row_status_and_speedup(swept):
    d, r = swept
    for ext in ("csv", "parquet", "md"):
        assert (d / f"results.{ext}").is_file()
    df = pd.read_parquet(d / "results.parquet")
    assert list(df["status"]) == ["ok", "ok", "invalid", "diverged"]
    assert list(df["label"]) == ["+case=fp32", "+case=bf16", "+case=invalid", "+case=diverge"]
    assert "train.seq_len" in df.loc[2, "error"] and "diverged" not in df.loc[2, "error"]
    assert "nan" in df.loc[3, "error"]
    rec = [json.loads((d / str(i) / "metrics.json").read_text()) for i in range(4)]
    # fewest optimizations on (fp32) is the baseline; bf16's speedup is the ratio of records
    assert list(df["baseline"]) == [True, False, False, False]
    assert df.loc[0, "speedup"] == 1.0
    assert df.loc[1, "speedup"] == pytest.approx(rec[1]["tokens_per_s"] / rec[0]["tokens_per_s"])
    assert df.loc[1, "mem_saved_pct"] == pytest.approx(
        100 * (1 - rec[1]["peak_mem_gib"] / rec[0]["peak_mem_gib"]))
    assert df.loc[2:, "speedup"].isna().all()
    assert not (d / "2" / "job.log").exists()  # invalid: caught before a process started
    for i, status in enumerate(("ok", "ok", "invalid", "diverged")):  # each job's run.log
        assert f"status: {status}" in (d / str(i) / "run.log").read_text()
    assert "| +case=diverge" in (d / "results.md").read_text()
    assert "Sweep" in r.stdout and "job 4/4" in r.stdout
    for png in ("throughput", "memory", "pareto"):
        assert (d / "plots" / f"{png}.png").stat().st_size > 1000
    assert "![pareto]" in (d / "report.md").read_text()


def test_each_job_own_wandb_run_and_summary_table(swept):
    from wandb_reader import read_offline_run

    d, _ = swept
    groups = set()
    for i in (0, 1, 3):  # the invalid job starts no run
        files = list((d / str(i)).glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) == 1, i
        run = read_offline_run(files[0])
        groups.add(run["config"]["logger"]["group"])
        groups.add(run["group"])
        assert run["summary"]["status"] == ("diverged" if i == 3 else "ok")
    assert len(groups) == 1 and next(iter(groups)).startswith("sweep-")
    summary = list(d.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(summary) == 1
    s = read_offline_run(summary[0])
    assert {s["group"]} == groups  # the summary run beside its jobs
    assert s["summary"]["jobs"] == 4 and s["summary"]["jobs_ok"] == 2
    assert s["summary"]["results/_type"] == "table-file"
    table = json.loads(next(summary[0].parent.glob("files/media/table/results_*.table.json"))
                       .read_text())
    assert len(table["data"]) == 4 and "speedup" in table["columns"]
    for chart in ("throughput_table", "peak_memory_table"):  # the bar charts' data
        assert s["summary"][f"{chart}/nrows"] == 2


def test_resume_skips_finished_jobs_and_rebuilds_table(swept, tmp_path):
    d0, _ = swept
    d = tmp_path / "s"
    shutil.copytree(d0, d, ignore=shutil.ignore_patterns("wandb", "results.*"))
    logs = {i: (d / str(i) / "job.log").stat().st_mtime_ns for i in (0, 1, 3)}
    r = sweep(d, "+case=fp32,bf16,invalid,diverge", "logger=none", "sweep.resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("already done") == 3  # ok, ok, diverged; invalid is re-checked
    for i, mtime in logs.items():  # no job process ran again
        assert (d / str(i) / "job.log").stat().st_mtime_ns == mtime
    df = pd.read_parquet(d / "results.parquet")
    assert list(df["status"]) == ["ok", "ok", "invalid", "diverged"]
    old = pd.read_parquet(d0 / "results.parquet")
    assert list(df["tokens_per_s"].fillna(-1)) == list(old["tokens_per_s"].fillna(-1))


def test_remeasure_loaded_runs_a_busy_row_again_and_keeps_the_old_record(swept, tmp_path):
    """sweep.remeasure_loaded: a job measured under other CPU load (planted: 0.7) runs once
    more; its new record takes the row, the old one stays beside it; quiet rows stay."""
    from omegaconf import OmegaConf

    from moe_exp.config import SweepConfig
    from moe_exp.sweep.job import remeasure_loaded

    d0, _ = swept
    d = tmp_path / "s"
    shutil.copytree(d0, d, ignore=shutil.ignore_patterns("wandb"))
    for job, load in ((0, 0.7), (1, 0.01)):
        p = d / str(job) / "metrics.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "cpu_other_load": load}))
    quiet = (d / "1" / "metrics.json").read_text()
    s = OmegaConf.structured(SweepConfig(fresh_compile_cache=False))
    assert remeasure_loaded(d, s) == 1
    old = json.loads((d / "0" / "metrics.loaded.json").read_text())
    new = json.loads((d / "0" / "metrics.json").read_text())
    assert old["cpu_other_load"] == 0.7 and new["status"] == "ok" and new["job"] == 0
    assert new["timestamp"] != old["timestamp"] and new["config_hash"] == old["config_hash"]
    assert (d / "0" / "remeasured" / "job.log").is_file()
    assert (d / "1" / "metrics.json").read_text() == quiet
    assert not (d / "1" / "metrics.loaded.json").exists()


def test_resume_of_a_dir_with_no_records_warns_and_runs_every_job(tmp_path):
    """(A typo in the dir started a new sweep silently, before.)"""
    d = tmp_path / "typo"  # (its job in the sweep's process: not what this checks)
    r = sweep(d, "+case=fp32", "logger=none", "sweep.resume=true", "sweep.isolate=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"sweep.resume=true, but '{d}' holds no job records: nothing to resume" in r.stderr
    assert list(pd.read_csv(d / "results.csv")["status"]) == ["ok"]


def test_resume_with_other_values_keeps_every_finished_row(swept, tmp_path):
    """Resumed with fewer values, Hydra numbers the jobs anew: job 0 is now bf16, whose
    record sits in dir 1. fp32's record in dir 0 moves aside (it was overwritten) and
    every row stays in the table."""
    d0, _ = swept
    d = tmp_path / "s"
    shutil.copytree(d0, d, ignore=shutil.ignore_patterns("wandb", "results.*"))
    old = pd.read_parquet(d0 / "results.parquet")
    # a baseline only the dir's earlier rows have (no job now is fp32): not refused
    r = sweep(d, "+case=bf16", "logger=none", "sweep.resume=true",
              "++sweep.baseline={precision: fp32}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("already done") == 1 and "moved to" in r.stderr
    fp32_hash = old.loc[0, "config_hash"]
    moved = d / f"0-{fp32_hash}"
    rec = json.loads((moved / "metrics.json").read_text())
    assert rec["config_hash"] == fp32_hash and rec["job"] == moved.name  # its own row name
    assert "status: ok" in (moved / "run.log").read_text()
    df = pd.read_parquet(d / "results.parquet")
    assert sorted(df["config_hash"]) == sorted(old["config_hash"])
    assert set(df["status"]) == {"ok", "invalid", "diverged"}
    assert list(df.loc[df["baseline"], "precision"]) == ["fp32"]
    done = next(ln for ln in r.stdout.splitlines() if ln.startswith("[sweep] done"))
    assert done.startswith("[sweep] done: 1 job in ") and "(the table: 4 rows, with the " \
        "sweep dir's other configurations)" in done, done  # one job ran; the table: all


def _child_of(job_dir: Path, timeout=120):
    """pid of the job process running job_dir/job.json."""
    end = time.time() + timeout
    needle = str(job_dir / "job.json").encode()
    while time.time() < end:
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if needle in (p / "cmdline").read_bytes():
                        return int(p.name)
                except OSError:
                    pass
        time.sleep(0.2)
    raise TimeoutError(f"no process for {job_dir}")


_BACKGROUND: list = []  # sweeps started in the background, stopped after each test


@pytest.fixture(autouse=True)
def _stop_background_sweeps():
    """A test that fails before its sweep ends leaves no sweep (nor job) running: SIGTERM,
    which the sweep passes to its job."""
    yield
    while _BACKGROUND:
        proc = _BACKGROUND.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def _sweep_in_background(d: Path, cases: str, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "moe_exp.run", "-m", CASES,
                             f"hydra.sweep.dir={d}", cases, "logger=none", *args], cwd=d.parent,
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    _BACKGROUND.append(proc)
    return proc


def _default_sigint():
    """Ctrl-C's default in the sweep, whatever pytest was started under (a shell's `cmd &`
    ignores SIGINT, and Python then never turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_killed_job_is_crashed_row_and_sweep_goes_on(tmp_path):
    d = tmp_path / "s"
    proc = _sweep_in_background(d, "+case=long,fp32")
    pid = _child_of(d / "0")
    time.sleep(3)  # let it get into its steps
    os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["crashed", "ok"]
    assert "SIGKILL" in df.loc[0, "error"]
    assert df.loc[0, "config_hash"] and pd.isna(df.loc[0, "tokens_per_s"])


@pytest.mark.parametrize("sig, rc", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_stops_the_sweep_and_keeps_the_running_job_as_a_row(tmp_path, sig, rc):
    """SIGINT (Ctrl-C) or SIGTERM (SLURM, timeout: it used to leave the job's process
    running and the table short of the job) to the sweep: the job process is killed, the
    job it was running becomes a `crashed: interrupted` row, exit 130 / 143."""
    d = tmp_path / "s"
    proc = _sweep_in_background(d, "+case=fast,long")
    child = _child_of(d / "1")
    time.sleep(2)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, err[-3000:]
    with pytest.raises(ProcessLookupError):  # the job process went with it
        os.kill(child, 0)
    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["ok", "crashed"]
    assert "interrupted" in df.loc[1, "error"] and df.loc[1, "config_hash"]
    assert ("SIGTERM" in df.loc[1, "error"]) == (sig == "SIGTERM")


def test_ctrl_c_in_an_in_process_sweep_keeps_the_runs_own_record(tmp_path):
    """sweep.isolate=false: the run itself wrote what it did (its steps' losses, "at step N
    of M"); the row is that record, not a blank "interrupted" one."""
    d = tmp_path / "s"
    proc = _sweep_in_background(d, "+case=fast,long", "sweep.isolate=false")
    end = time.time() + 120
    while not (d / "1").is_dir() and time.time() < end:
        time.sleep(0.2)
    time.sleep(5)  # into its steps (job 1 starts in the sweep's process: no imports)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    rec = json.loads((d / "1" / "metrics.json").read_text())
    assert rec["status"] == "crashed" and " at step " in rec["error"], rec["error"]
    assert len(rec["losses"]) > 0 and rec["job"] == 1
    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["ok", "crashed"] and " at step " in df.loc[1, "error"]


def test_repeats_report_median_and_spread(tmp_path):
    d = tmp_path / "s"
    r = sweep(d, "+case=fp32,bf16", "logger=none", "sweep.repeats=2", "sweep.isolate=false")
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_parquet(d / "results.parquet")
    for i in range(2):
        reps = [json.loads((d / str(i) / f"rep{k}" / "metrics.json").read_text())
                for k in range(2)]
        tps = sorted(x["tokens_per_s"] for x in reps)
        assert df.loc[i, "repeats"] == 2
        combined = json.loads((d / str(i) / "metrics.json").read_text())
        assert combined["combined"] and off_contract(combined) == set()
        assert all(off_contract(x) == set() for x in reps)
        assert df.loc[i, "tokens_per_s"] == pytest.approx(sum(tps) / 2)  # median of two
        assert (df.loc[i, "tokens_per_s_min"], df.loc[i, "tokens_per_s_max"]) == \
            pytest.approx(tps)
    assert df.loc[1, "speedup_significant"] in (True, False)
    assert "spread" in (d / "results.md").read_text()


def test_compare_flags_planted_regression_and_passes_unchanged(swept, tmp_path):
    d, _ = swept
    same = run_compare(d, d)
    assert same.returncode == 0, same.stdout + same.stderr
    df = pd.read_parquet(d / "results.parquet")
    df.loc[1, "tokens_per_s"] *= 0.8  # bf16 got 20% slower
    slow = tmp_path / "slow.parquet"
    df.to_parquet(slow)
    r = run_compare(d / "results.parquet", slow, "--threshold", "5")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "REGRESSION" in r.stdout and "1 regression(s) in 4" in r.stdout
    assert run_compare(d, slow, "--threshold", "25").returncode == 0
    assert run_compare(d, tmp_path / "missing").returncode == 2
    assert run_compare(d, d, "--threshold", "nan").returncode == 2  # would turn checks off
    fewer = tmp_path / "fewer.parquet"  # an ok configuration (bf16) gone from NEW
    df0 = pd.read_parquet(d / "results.parquet")
    df0.drop(index=1).to_parquet(fewer)
    r = run_compare(d, fewer)
    assert r.returncode == 1 and "absent from NEW: +case=bf16" in r.stdout
    unmeasured = tmp_path / "unmeasured.parquet"  # ok, but no peak memory any more
    df1 = df0.copy()
    df1.loc[0, "peak_mem_gib"] = None
    df1.to_parquet(unmeasured)
    r = run_compare(d, unmeasured)
    assert r.returncode == 1 and "peak mem no longer measured" in r.stdout
    odd = tmp_path / "odd.csv"  # not a results table: one line, exit 2
    df0.drop(columns=["config_hash"]).to_csv(odd)
    r = run_compare(d, odd)
    assert r.returncode == 2 and "no column config_hash" in r.stderr and "Traceback" not in r.stderr
    other = tmp_path / "other.parquet"  # no configuration in common: unrelated tables
    df2 = df0.copy()
    df2["config_hash"] = df2["config_hash"] + "x"
    df2.to_parquet(other)
    r = run_compare(d, other)
    assert r.returncode == 2 and "REGRESSION" not in r.stdout
    assert r.stderr.strip() == ("error: no configuration appears in both tables (matched by "
                                "config_hash and extra; BASE has 4, NEW 4)")


def run_compare(*args):  # (wide: the verdicts checked below stay on one line)
    return python(["-m", "moe_exp.compare", *args], ROOT, env={"COLUMNS": "200"})


def test_report_cli_rebuilds_with_chosen_baseline(swept, tmp_path):
    d0, _ = swept
    d = tmp_path / "s"
    shutil.copytree(d0, d, ignore=shutil.ignore_patterns("wandb", "results.*", "plots"))
    r = python(["-m", "moe_exp.report", str(d), "--baseline", "precision=bf16"], ROOT)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(d / "results.parquet")
    assert list(df["baseline"]) == [False, True, False, False]
    assert df.loc[1, "speedup"] == 1.0
    assert (d / "plots" / "pareto.png").is_file() and (d / "report.md").is_file()
    bad = python(["-m", "moe_exp.report", str(d), "--baseline", "colour=red"], ROOT)
    assert bad.returncode == 2 and "--baseline: 'colour'" in bad.stderr
    bad_by = python(["-m", "moe_exp.report", str(d), "--by", "modle"], ROOT)
    assert bad_by.returncode == 2 and "--by: 'modle'" in bad_by.stderr
    before = (d / "results.csv").read_text()
    none = python(["-m", "moe_exp.report", str(d), "--baseline", "precision=fp16"], ROOT)
    assert none.returncode == 2 and "no finished" in none.stderr
    assert (d / "results.csv").read_text() == before  # tables left as they were


@pytest.fixture(scope="module")
def bf16_baseline(tmp_path_factory):
    """fp32 and bf16 with the README's ++sweep.baseline={precision:bf16}."""
    d = tmp_path_factory.mktemp("bf16_baseline") / "s"
    r = sweep(d, "+case=fp32,bf16", "logger=none", "++sweep.baseline={precision:bf16}",
              "sweep.isolate=false")  # (tables are the point: the jobs in its process)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def test_report_keeps_the_sweeps_own_baseline(bf16_baseline, tmp_path):
    """`report DIR` without --baseline rebuilds with the sweep's sweep.baseline (it used to
    switch to the default baseline silently); `--baseline` alone asks for the default."""
    d = tmp_path / "s"
    shutil.copytree(bf16_baseline, d)  # (the fixture's tables stay as the sweep wrote them)
    assert list(pd.read_parquet(d / "results.parquet")["baseline"]) == [False, True]
    again = python(["-m", "moe_exp.report", str(d), "--no-plots"], ROOT)
    assert again.returncode == 0, again.stderr
    assert "the sweep's own, precision=bf16" in again.stderr
    assert list(pd.read_parquet(d / "results.parquet")["baseline"]) == [False, True]
    default = python(["-m", "moe_exp.report", str(d), "--no-plots", "--baseline"], ROOT)
    assert default.returncode == 0, default.stderr
    assert list(pd.read_parquet(d / "results.parquet")["baseline"]) == [True, False]


def test_notebook_executes_against_a_sweep(swept):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    d, _ = swept
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    assert nb.cells[1].source.startswith("SWEEP_DIR = None")
    nb.cells[1].source = f'SWEEP_DIR = "{d}"\nBASELINE = None'
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outs) == 2
    assert "4 jobs" in "".join(o.get("text", "") for o in outs)
    answer = "".join(o.get("data", {}).get("text/markdown", "") for o in outs)
    assert "fits with its loss ok is job" in answer or "(its loss not judged) is job" in answer


def test_notebook_runs_through_a_sweep_without_finished_rows(tmp_path):
    """Every job skipped: the plot cells say so instead of raising, and the failed-rows cell
    (the one that matters then) is reached."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from moe_exp.results import FIELDS

    for job, prec in enumerate(("fp8", "tf32")):
        rec = dict.fromkeys(FIELDS)
        rec.update(status="skipped", error=f"precision: {prec} needs a GPU", model="tiny_moe",
                   precision=prec, config_hash=f"h{job}", overrides=[f"precision={prec}"])
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps(rec))
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    nb.cells[1].source = f'SWEEP_DIR = "{tmp_path}"\nBASELINE = None'
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"]
    assert "needs a GPU" in str(nb.cells[-1].outputs)


def test_notebook_finds_the_newest_sweep_from_its_own_folder(swept, tmp_path):
    """SWEEP_DIR = None as shipped, the kernel started in notebooks/ (as Jupyter does) and
    the sweeps in multirun/ of the project root."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    d, _ = swept
    newest = tmp_path / "multirun" / "2026-01-02" / "00-00-00"
    shutil.copytree(d, newest, ignore=shutil.ignore_patterns("wandb"))
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    nb.cells = nb.cells[:3]  # the set-up and the table
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path / "notebooks")}}).execute()
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outs if o.output_type == "error"], outs
    assert f"{newest}: 4 jobs" in "".join(o.get("text", "") for o in outs)


def test_job_timeout_kills_the_job_as_crashed(tmp_path):
    d = tmp_path / "s"
    r = sweep(d, "+case=long", "logger=none", "sweep.job_timeout_s=4")
    assert r.returncode == 1, r.stderr[-3000:]  # its only job failed
    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["crashed"]
    assert "sweep.job_timeout_s=4" in df.loc[0, "error"]
    assert f"[sweep] job #0: crashed: {df.loc[0, 'error']}" in r.stderr  # said as it happened


def test_in_process_sweep_nulls_what_a_later_job_cannot_measure(tmp_path):
    """sweep.isolate=false: job 1's process did not start for it, and on CPU its peak RSS
    would count job 0's leftovers; both are null with a reason, job 0 keeps them."""
    d = tmp_path / "s"
    r = sweep(d, "+case=fp32,bf16", "logger=none", "sweep.isolate=false")
    assert r.returncode == 0, r.stderr[-3000:]
    first, later = (json.loads((d / str(i) / "metrics.json").read_text()) for i in (0, 1))
    assert first["status"] == later["status"] == "ok"
    assert first["startup_s"] > 0 and first["peak_mem_gib"] > 0
    for key in ("startup_s", "peak_mem_gib"):
        assert later[key] is None and "in-process sweep" in later["null_reasons"][key]
    # what the run printed and logged agrees with its record
    log = (d / "1" / "run.log").read_text()
    assert "peak memory: null: a later job of an in-process sweep" in log
    assert "startup:" not in log and "startup:" in (d / "0" / "run.log").read_text()


def test_chosen_baseline_from_the_command_line_and_one_that_matches_nothing(bf16_baseline,
                                                                          tmp_path):
    """The README's ++sweep.baseline={...} picks the row; one that matches no ok row (only
    an invalid one: a baseline no job has fails up front) still ends in the table, plots and
    report (no speedups), with a one-line warning."""
    assert list(pd.read_parquet(bf16_baseline / "results.parquet")["baseline"]) == [False, True]
    d2 = tmp_path / "s2"
    r = sweep(d2, "+case=fp32,invalid", "logger=none", "++sweep.baseline={seq_len:4096}",
              "sweep.isolate=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[report] sweep.baseline seq_len=4096 matches no finished" in r.stderr
    assert (d2 / "report.md").is_file() and (d2 / "plots" / "throughput.png").is_file()


@pytest.mark.slow
def test_submitit_launcher_sweep_counts_and_tables(tmp_path):
    """Under submitit the job callbacks run in the jobs' processes: the final count comes
    from the records, the tables are kept by the jobs; submitit_local warns that its jobs
    run at once."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    d = tmp_path / "s"
    r = sweep(d, "+case=fp32,bf16", "logger=none", "hydra/launcher=submitit_local")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[sweep] done: 2 jobs" in r.stdout and ": 2 ok" in r.stdout
    assert "submitit_local starts every job at once" in r.stderr
    assert list(pd.read_csv(d / "results.csv")["status"]) == ["ok", "ok"]


def test_sweep_with_no_finished_job_says_so_and_exits_1(tmp_path):
    """Jobs that ran but none finished ok (a sweep of invalid jobs only fails up front)."""
    d = tmp_path / "s"  # (its job in the sweep's process: not what this checks)
    r = sweep(d, "+case=diverge", "logger=none", "sweep.isolate=false")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "[sweep] done: 1 job" in r.stdout and ": 1 diverged" in r.stdout
    assert "no job finished ok" in r.stderr
    assert list(pd.read_csv(d / "results.csv")["status"]) == ["diverged"]


def test_second_ctrl_c_while_the_interrupted_job_is_saved_is_held(tmp_path, monkeypatch):
    """A second Ctrl-C used to cut short the interrupted job's record or the table's write
    (the sweep ended with no results.*): SIGINT is ignored until both are written."""
    from conftest import compose

    from moe_exp.sweep import job, live

    def interrupted(*args):
        raise KeyboardInterrupt

    def update_table(*args):
        seen.append(signal.getsignal(signal.SIGINT))

    seen = []
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(job, "_repeats", interrupted)
    monkeypatch.setattr(live, "update_table", update_table)
    with pytest.raises(KeyboardInterrupt):
        job._run_job(compose(["logger=none"]), tmp_path / "0", tmp_path, [], {}, 0)
    assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is before
    rec = json.loads((tmp_path / "0" / "metrics.json").read_text())
    assert rec["status"] == "crashed" and "interrupted" in rec["error"] and rec["job"] == 0


def test_sweep_checks_fail_before_any_job(tmp_path):
    """One line and exit 2, no job run: a sweep dir that holds another sweep's records (its
    rows would mix into this table), a baseline key or swept value no row can have (found
    only at the end before; swept or fixed), a value the key does not allow, a bad sweep.* setting (a row
    per job before), a swept sweep.* key, a sweep whose every job is invalid or skipped."""
    used = tmp_path / "used"
    (used / "0").mkdir(parents=True)
    (used / "0" / "metrics.json").write_text("{}")
    reps = tmp_path / "reps"  # a job cut short during its repeats: its first repeat's record
    (reps / "0" / "rep0").mkdir(parents=True)
    (reps / "0" / "rep0" / "metrics.json").write_text("{}")
    cases = [
        (used, ["+case=fp32"], f"hydra.sweep.dir: '{used}' already holds another sweep's"),
        (reps, ["+case=fp32"], f"hydra.sweep.dir: '{reps}' already holds another sweep's "
         "results (1 job records)"),
        (tmp_path / "b", ["+case=fp32,bf16", "++sweep.baseline={precison:fp32}"],
         "sweep.baseline: 'precison' is not a column"),
        (tmp_path / "c", ["+case=fp32", "train.activation_checkpointing=nope,none"],
         "train.activation_checkpointing: 'nope' is not one of: none, full, selective"),
        (tmp_path / "d", ["+case=fp32", "precision=fp32,fp16", "++sweep.baseline={precision: bf16}"],
         "sweep.baseline: precision=bf16 is not among the swept values (fp32, fp16)"),
        (tmp_path / "d2", ["+case=fp32,bf16", "++sweep.baseline={compile: max-autotune}"],
         "sweep.baseline: no job of this sweep has compile=max-autotune (its jobs have "
         "compile: off)"),  # (an unswept column: found after every job ran, before)
        (tmp_path / "d3", ["+case=fp32,bf16", "optim.lr=0.01", "++sweep.baseline={optim.lr: 0.5}"],
         "sweep.baseline: no job of this sweep has optim.lr=0.5 (its jobs have optim.lr: "
         "0.01)"),
        (tmp_path / "e", ["+case=fp32", "train.activation_checkpointing=none,full",
                          "sweep.repeats=0"], "sweep.repeats: must be >= 1, got 0"),
        (tmp_path / "f", ["+case=fp32,bf16", "sweep.job_timeout_s=-1"],
         "sweep.job_timeout_s: must be > 0 seconds or null, got -1"),
        (tmp_path / "h", ["+case=fp32", "+train.stepz=1,2"],  # (two invalid rows before)
         "train.stepz: no such key in train"),
        (tmp_path / "i2", ["+case=fp32", "train.steps=3,a"],  # ([sweep] 2 jobs first)
         "train.steps: Error merging override train.steps=a; Value 'a' of type 'str' could "
         "not be converted to Integer"),
        (tmp_path / "i", ["+case=fp32,bf16", "train.steps=-1"],
         "train.steps: must be >= 1, got -1 (every job of the sweep is invalid)"),
        (tmp_path / "g", ["+case=fp32", "sweep.repeats=1,2"],  # (one row before)
         "sweep.repeats: a setting of the sweep or its logging, not of what a job "
         "measures: give it one value (got 1, 2)"),
        (tmp_path / "j", ["+case=fp32", "precision=bf16,bogus"],  # (Hydra's line, after
         "precision: 'bogus' is not one of: bf16, fp16, fp32, fp8, tf32"),  # multirun.yaml)
        (tmp_path / "k", ["+case=fp32,bf16", "+extra.tag=a", "sweep.baseline_by=[extra.tagg]"],
         "sweep.baseline_by: 'extra.tagg' is a label no job of this sweep has (its labels: "
         "extra.tag)"),  # (found after every job ran, before)
        (tmp_path / "l", ["+case=fp32", "comm.iters=3,5"],  # (one row of two jobs)
         "comm.iters=5: job #1 would measure what job #0 (comm.iters=3) does, one row"),
        (tmp_path / "q", ["+case=fp32", "train.seed=1,2,1"],  # (an explanation that did not
     "train.seed=1 listed twice: job #2 is job #0 again: give each value once"),  # fit, before)
        (tmp_path / "r", ["+case=fp32", "sweep.remeasure_loaded=true", "sweep.isolate=false"],
         "sweep.remeasure_loaded: re-runs a grid sweep's jobs from their job.json, in this "
         "process's launcher: not with +sweep=search, sweep.isolate=false or the submitit"),
    (tmp_path / "m", ["+case=fp32,fp3"],  # a group on Hydra's search path
         "case: 'fp3' is not one of: bf16, diverge, fast, fp32, invalid, long"),
        (tmp_path / "n", ["+case=fp32,bf16", "optim=adamw", "optim.momentum=0.9"],
         "optim.momentum: read by optim=muon only, and no job of this sweep has "
         "optim=muon"),  # (each job ran as adamw, the key unread)
        (tmp_path / "o", ["+case=fp32,bf16", "data=markov", "data.path=x.bin"],
         "data.path: read by data=tokens only, and no job of this sweep has data=tokens"),
        (tmp_path / "o3", ["+case=fp32,bf16", "logger.project=x"],  # (logger is not swept)
         "logger.project: read by logger=wandb only, and no job of this sweep has "
         "logger=wandb: use logger=wandb, or leave logger.project out"),
        (tmp_path / "o2", ["+case=fp32", "model=tiny_dense,small_dense", "model.top_k=1"],
         "model.top_k: read by a MoE model (model.num_experts > 0) only, and no job of "
         "this sweep has a MoE model"),
        *([] if torch.cuda.is_available() else [  # (a sweep of skipped rows, exit 1, before)
            (tmp_path / "p", ["+case=fp32", "precision=tf32,fp8"], "precision: precision=tf32 "
             "is not supported on hardware=cpu (supported: fp32, fp16, bf16) (every job "
             "of the sweep is skipped on this machine)")])]
    results = [cli_inproc(["-m", CASES, f"hydra.sweep.dir={d}", *args, "logger=none"],
                          tmp_path) for d, args, line in cases]
    for (d, args, line), r in zip(cases, results):
        assert r.returncode == 2, r.stderr[-3000:]
        assert r.stderr.strip().startswith(f"error: {line}") and len(r.stderr.strip().splitlines()) == 1
        assert "[sweep]" not in r.stdout, r.stdout
        assert len(list(d.glob("*/metrics.json"))) == (1 if d == used else 0)
        assert len(list(d.glob("*/rep*/metrics.json"))) == (1 if d == reps else 0)
        assert not (d / "multirun.yaml").exists()


def test_a_job_check_that_raises_leaves_the_sweep_to_its_jobs(tmp_path, monkeypatch):
    """An error in checking a job up front is the job's to report (as before the check):
    check_jobs returns and the sweep goes on. A ${...} that does not resolve (which raised
    there before) is a mistake: one line, exit 2, no job."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    import moe_exp.pipeline as run_mod
    from moe_exp.sweep.callback import plan
    from moe_exp.sweep.checks import check_jobs

    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(run_mod, "prepare", boom)
    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        config = GlobalHydra.instance().hydra.config_loader.load_configuration(
            "run", ["train.micro_batch_size=1,2", "logger=none"], run_mode=RunMode.MULTIRUN)
        jobs, _ = plan(config)
        assert check_jobs(config, jobs) is None
    d = tmp_path / "s"
    r = sweep(d, "+case=fp32", "train.steps=${oc.env:NOPE_NOT_SET}",
              "train.micro_batch_size=1,2", "logger=none")
    assert r.returncode == 2 and r.stderr.strip().startswith(
        "error: train.steps: '${oc.env:NOPE_NOT_SET}' does not resolve"), r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1 and not list(d.glob("*/metrics.json"))


def test_second_sweep_into_a_running_sweeps_dir_fails_before_any_job(tmp_path):
    """Two sweeps into one dir (a resume started twice) would write the same job dirs: the
    second one stops with one line naming the holder, exit 2, and writes nothing."""
    d = tmp_path / "s"
    first = _sweep_in_background(d, "+case=long")
    try:
        _child_of(d / "0")  # (refused before any job: in this process)
        r = cli_inproc(["-m", CASES, f"hydra.sweep.dir={d}", "+case=long", "sweep.resume=true",
                        "logger=none"], d.parent)
        assert r.returncode == 2, r.stderr[-3000:]
        line = r.stderr.strip()
        assert line.startswith(f"error: hydra.sweep.dir: '{d}' is in use by another sweep "
                               f"(pid {first.pid} on ") and len(line.splitlines()) == 1
        assert "[sweep]" not in r.stdout  # no job started
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=300)
    assert list(pd.read_csv(d / "results.csv")["status"]) == ["crashed"]  # the first's row
