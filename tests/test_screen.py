"""What a person sees fits their terminal: the sweep table, a plan sweep, report, compare
and --help at 80, 100 and 200 columns (issue 53)."""
import os
import subprocess
import sys

import pandas as pd
import pytest

from moe_exp.sweep.table import build_table, print_table

from test_sweep_table import rec

WIDTHS = (80, 100, 200)


def _widest(text: str) -> int:
    return max(map(len, text.splitlines()))


def _rows():
    rows = [rec(0, 1000.0, 1.0), rec(1, 2000.0, 2.06, precision="bf16", compile="default",
                                     activation_checkpointing="full"),
            rec(2, None, None, status="error", precision="fp16")]
    rows[2]["error"] = ("RuntimeError: out of memory while running the step of a model far "
                        "too large for this machine")
    rows[0]["loss_last"], rows[1]["loss_last"], rows[1]["mfu"] = 5.0, 5.1, 0.12
    rows[1]["cpu_other_load"] = 0.7
    return rows


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep_table_fits_and_keeps_the_answers_columns(cols, capsys):
    print_table(build_table(_rows()), "Sweep multirun/2026-11-28/10-00-00", cols)
    out, err = capsys.readouterr()
    assert _widest(out) <= cols and _widest(err) <= cols, out + err
    head = out.split("┡")[0]
    for col in ("job", "combination", "status", "tokens/s", "speedup", "peak GiB"):
        assert col in head, (cols, out)
    if "mem saved" in head:  # more memory than the baseline: how many times, not "-106%"
        assert "none (2.06×)" in out and "-106%" not in out
    if "error" not in head:  # the failed row's reason still shows, under the table
        assert "job 2: RuntimeError: out of memory" in out
    if cols == 200:
        assert "not shown here" not in out and "12.0%" in out and "mem saved" in head
    else:
        assert "(results.md has them all, not shown here: " in out
    assert "warning: measured while other processes" in err


@pytest.mark.parametrize("cols", WIDTHS)
def test_report_answer_fits_and_its_command_still_pastes(cols):
    """The report's answer, printed before the table: prose wrapped, the command cut at
    spaces with a shell's ` \\` (a command wider than the terminal wrapped mid-word)."""
    import shlex

    from moe_exp import screen
    from moe_exp.sweep.answer import answer_text

    rows = _rows()
    for r in rows:
        r["overrides"] += ["model=small_moe", "train.activation_checkpointing=selective",
                           "train.micro_batch_size=16", "parallel=expert_fsdp"]
    out = screen.text(answer_text(build_table(rows)), cols)
    assert _widest(out) <= cols and "## The answer" in out
    cmd = next(ln for ln in out.split("\n\n") if ln.lstrip().startswith("python -m"))
    assert shlex.split(cmd.replace("\\\n", " "))[:3] == ["python", "-m", "moe_exp.run"]
    assert "train.micro_batch_size=16" in shlex.split(cmd.replace("\\\n", " "))


@pytest.mark.parametrize("cols", WIDTHS)
def test_plan_sweep_table_drops_empty_columns_and_fits(cols, capsys):
    rows = []
    for job, (gib, fits, tps) in enumerate([(10.0, True, 5e4), (90.0, False, 9e4)]):
        r = rec(job, None, None, task="plan", parallel=["fsdp", "expert_fsdp"][job])
        r.update(planned_peak_gib=gib, planned_fits=fits, planned_tokens_per_s=tps,
                 planned_comm_gib=1.5)
        rows.append(r)
    print_table(build_table(rows), "plans", cols)
    out = capsys.readouterr().out
    head = out.split("┡")[0]
    assert _widest(out) <= cols and "fits" in head and "planned tokens/s" in head
    assert "MFU" not in head and "speedup" not in head  # empty in every plan row


@pytest.mark.parametrize("cols", WIDTHS)
def test_compare_fits(cols, tmp_path, capsys, monkeypatch):
    from moe_exp.compare import main

    long = "model=small_moe precision=bf16 train.activation_checkpointing=selective " \
           "train.compile=default parallel=expert_fsdp"
    base = pd.DataFrame([{"config_hash": f"h{i}", "status": "ok", "label": f"{long} {i}",
                          "tokens_per_s": 1000.0 * (i + 1), "peak_mem_gib": 1.0}
                         for i in range(3)])
    new = base.assign(tokens_per_s=[1000.0, 1000.0, 3000.0])
    base.to_csv(tmp_path / "b.csv", index=False)
    new.to_csv(tmp_path / "n.csv", index=False)
    monkeypatch.setenv("COLUMNS", str(cols))
    assert main([str(tmp_path / "b.csv"), str(tmp_path / "n.csv")]) == 1
    out = capsys.readouterr().out
    assert _widest(out) <= cols and "REGRESSION" in out, out


@pytest.mark.parametrize("cols", WIDTHS)
def test_help_lines_fit(cols):
    from moe_exp import help as h

    for text in (h.groups_text(cols), h.keys_text(cols), h.topic_text("train", cols),
                 h.topic_text("model", cols)):
        assert _widest(text) <= cols
    assert h.topic_text("no_such_key") is None
    # one line per key in the short form; --help KEY holds its whole text
    short, whole = h.keys_text(cols), h.topic_text("hardware.calibration", cols)
    assert sum("hardware.calibration=" in line for line in short.splitlines()) == 1
    assert "datasheet's peaks, a floor" in whole.replace("\n    ", " ")


def test_help_page_and_topic_on_the_command_line_fit_80_columns():
    env = {**os.environ, "COLUMNS": "80"}
    page = subprocess.run([sys.executable, "-m", "moe_exp.run", "--help"], env=env,
                          capture_output=True, text=True, check=True).stdout
    assert _widest(page) <= 80 and "--help KEY" in page
    one = subprocess.run([sys.executable, "-m", "moe_exp.run", "--help", "train.steps",
                          "nope"], env=env, capture_output=True, text=True)
    assert one.returncode == 2 and one.stderr.strip() == (
        "error: --help nope: no key or config group of that name (--help alone lists them)")


def test_a_wait_over_its_threshold_says_what_it_waits_for():
    """screen.Status: a line naming the wait and its phase once it has lasted `after`
    seconds (5 by default), nothing for a shorter wait (a tiny plan says nothing)."""
    import io
    import time

    from moe_exp.screen import Status, phase

    log = io.StringIO()
    with Status("[plan] mixtral", after=0.0, stream=log):
        phase("forward, block 3 of 32")
        time.sleep(1.2)
    assert log.getvalue().startswith("[plan] mixtral: forward, block 3 of 32 (")
    quick = io.StringIO()
    with Status("[plan] tiny", stream=quick):
        phase("backward")
    assert quick.getvalue() == ""
    phase("outside any wait")  # (no Status: nothing to say, no error)


def test_a_compiling_steps_bar_is_redrawn_while_it_waits():
    """tqdm redraws a bar only when a step ends: during a first compiled step of a minute
    its elapsed time stood at 00:00. screen.Ticking redraws it until closed."""
    import time

    from moe_exp.screen import Ticking

    import threading

    class Bar:  # (tqdm's two calls Ticking makes)
        drawn, lock = 0, threading.RLock()

        def get_lock(self):
            return self.lock

        def refresh(self, nolock=False):
            assert nolock and self.lock._is_owned()  # (its lock held by the with-block)
            self.drawn += 1

    bar = Bar()
    ticking = Ticking(bar, every=0.05)
    time.sleep(0.5)
    ticking.close()
    drawn = bar.drawn
    time.sleep(0.2)
    assert drawn >= 3 and bar.drawn == drawn  # (none after close)
