"""Faults and bad input from the audit: a broken record, a full or read-only disk, odd
command lines, impossible values, a launcher killed with SIGKILL, lock files. Each property
with the smallest run that shows it: the CLI in this process where its exit code and stderr
are the property (tests/conftest.run_cli's subprocess only where a process must die)."""
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

TINY = ["logger=none", "train.plan=false",
        "model=tiny_dense", "train.steps=1", "train.warmup_steps=0",
        "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=32",
        "model.vocab_size=64", "model.max_seq_len=16", "train.micro_batch_size=2"]


def cli(args, cwd, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m moe_exp.run ARGS` in this process (from cwd): (exit code, stdout, stderr).
    Hydra's global state, the log handlers it adds and the SIGTERM handler are put back."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from moe_exp import cli as run

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["moe_exp.run", *args])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "")  # (cli sets it)
    monkeypatch.setattr(run, "_STARTED", False)
    root = logging.getLogger()
    handlers, level, term = list(root.handlers), root.level, signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    try:
        run.cli()
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
            try:
                h.close()
            except OSError:  # (its disk is full: as logging.shutdown does at exit)
                pass
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)
        signal.signal(signal.SIGTERM, term)
        cb = sys.modules.get("moe_exp.sweep.callback")
        if cb is not None:
            cb.NO_JOB_OK = False
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The one line stderr holds (a run's progress bar aside)."""
    lines = [x for x in err.replace("\r", "\n").splitlines()
             if x.strip() and not x.startswith(("warmup:", "bench:"))]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# ---- 1. a record that breaks does not take its row out of the table


def _record(job, tps, **kw):
    from moe_exp.results import FIELDS

    r = dict.fromkeys(FIELDS)
    r.update(job=job, status="ok", model="m", precision="fp32", parallel="none",
             activation_checkpointing="none", compile="off", grad_accum_steps=1,
             tokens_per_s=tps, peak_mem_gib=1.0, config_hash=f"h{job}",
             overrides=[f"train.seed={job}"], extra={}, null_reasons={}, losses=[2.0, 1.0])
    r.update(kw)
    return r


def _sweep(d: Path, n: int) -> None:
    for job in range(n):
        (d / str(job)).mkdir(parents=True)
        (d / str(job) / "metrics.json").write_text(json.dumps(_record(job, 100.0 + job)))


@pytest.mark.parametrize("table", ["results.parquet", "results.csv"])
def test_report_keeps_the_row_of_a_record_that_broke(tmp_path, capsys, table):
    """report DIR with a job's metrics.json cut short rewrote results.* without that row:
    the table that held it lost it. Now the row the table holds is kept, and said."""
    import pandas as pd

    from moe_exp.report import main

    d = tmp_path / "s"
    _sweep(d, 3)
    assert main([str(d), "--no-plots"]) == 0
    if table == "results.csv":  # (only the CSV left: it is read instead)
        (d / "results.parquet").unlink()
    (d / "1" / "metrics.json").write_text('{"status": "ok", "tok')  # cut short
    capsys.readouterr()
    assert main([str(d), "--no-plots"]) == 0
    err = capsys.readouterr().err
    assert f"{d / '1' / 'metrics.json'}: not JSON" in err and \
        f"its row in {table} is kept" in err
    for t in ("results.parquet", "results.csv"):
        df = pd.read_parquet(d / t) if t.endswith("parquet") else pd.read_csv(d / t)
        assert list(df["job"]) == [0, 1, 2], t
        assert df["tokens_per_s"][1] == 101.0 and df["label"][1] == "train.seed=1"
        assert json.loads(df["overrides"][1]) == ["train.seed=1"]
    # the update after each job of a sweep keeps it too
    from omegaconf import OmegaConf

    from moe_exp.sweep.live import update_table

    update_table(d, OmegaConf.create({"name": None, "baseline": None,
                                      "baseline_by": ["model"]}))
    assert list(pd.read_parquet(d / "results.parquet")["job"]) == [0, 1, 2]
    # the record mended: its own values again
    (d / "1" / "metrics.json").write_text(json.dumps(_record(1, 7.0)))
    assert main([str(d), "--no-plots"]) == 0
    assert pd.read_parquet(d / "results.parquet")["tokens_per_s"][1] == 7.0


# ---- 3, 4. command lines that were a traceback or wrote over a record


@pytest.mark.parametrize("args, line", [
    (["hydra.run.dir="], "hydra.run.dir: empty: the run would write into the current dir"),
    (["-m", "hydra.sweep.dir=''", "train.seed=1,2"], "hydra.sweep.dir: empty"),
    (["-m", "hydra.sweep.subdir=", "train.seed=1,2"], "hydra.sweep.subdir: empty: every job"),
    (["model=5"], "model: '5' is not one of: deepseek_v3, dense_1b, "),
    (["precision=1"], "precision: '1' is not one of: bf16, fp16, fp32, fp8, tf32"),
    (["hardware=true"], "hardware: 'true' is not one of: a100, auto, cpu, "),
    (["-m", "model=tiny_moe,1.5"], "model: '1.5' is not one of: "),
    (["model=5", "--cfg", "job"], "model: '5' is not one of: "),
    ([f"train.steps={'9' * 5000}"],
     "train.steps: an integer of 5000 digits is more than any setting takes (at most 4300"),
    (["-m", f"train.steps=1,{'9' * 5000}"], "train.steps: an integer of 5000 digits"),
])
def test_bad_command_line_is_one_line(args, line, tmp_path, monkeypatch, capsys):
    (tmp_path / "metrics.json").write_text("{}")  # an earlier record in the cwd
    code, _, err = cli([*args, "logger=none"], tmp_path, monkeypatch, capsys)
    assert code == 2 and one_error_line(err).startswith(f"error: {line}"), err
    assert (tmp_path / "metrics.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_data_prepare_with_a_too_long_name_is_one_line(tmp_path, capsys):
    from moe_exp.data.__main__ import main

    (tmp_path / "a.txt").write_text("some text")
    for out, says in [("x" * 300 + ".bin", "a file name of 304 bytes; at most 250"),
                      ("x" * 252, "a file name of 252 bytes; at most 250"),  # (+ .json)
                      ("y" * 256 + "/c.bin", "a name of 256 bytes; a file or dir name is at "
                                            "most 255")]:
        assert main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / out)]) == 2
        assert says in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


# ---- 7. a key given twice


def test_a_key_given_twice_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    code, _, err = cli([*TINY, "train.steps=3", "train.steps=2", "hydra.run.dir=r"], tmp_path,
                       monkeypatch, capsys)
    assert code == 0, err
    assert err.splitlines()[0] == ("warning: train.steps is given 3 times (1, 3, 2): the last "
                                   "is used, train.steps=2")
    rec = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["measured_steps"] == 2


# ---- 5. compare: an impossible measured value is bad input


@pytest.mark.parametrize("key, value, says", [("tokens_per_s", float("inf"), "inf"),
                                              ("peak_mem_gib", -1.5, "-1.5")])
def test_compare_refuses_an_impossible_value(key, value, says, tmp_path, capsys):
    import pandas as pd

    from moe_exp.compare import main

    base, new = tmp_path / "base", tmp_path / "new"
    _sweep(base, 2)
    _sweep(new, 2)
    bad = _record(1, 101.0, **{key: value})
    (new / "1" / "metrics.json").write_text(json.dumps(bad))  # (JSON's Infinity)
    assert main([str(base), str(new)]) == 2
    assert one_error_line(capsys.readouterr().err) == (
        f"error: {new / '1' / 'metrics.json'}: {key} is {says}: a measured value is a finite "
        "number >= 0")
    pd.DataFrame([_record(0, 100.0) | {key: value, "overrides": "[]", "extra": "{}",
                                       "null_reasons": "{}", "losses": "[]"}]
                 ).to_csv(tmp_path / "t.csv", index=False)
    assert main([str(base), str(tmp_path / "t.csv")]) == 2
    assert f"t.csv: row of job 0: {key} is {says}" in one_error_line(capsys.readouterr().err)


# ---- 2. a full or read-only disk: one line naming the path, non-zero exit, no *.tmp


@pytest.fixture
def disk(tmp_path):
    """A 1 MiB tmpfs of its own (root can mount one; else the test is skipped: a full disk
    is not simulated here)."""
    d = tmp_path / "disk"
    d.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {p.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def fill(disk: Path, pages_left: int) -> None:
    """Fill the disk but for `pages_left` pages (4 KiB)."""
    import os

    (disk / "fill").unlink(missing_ok=True)
    st = os.statvfs(disk)
    with open(disk / "fill", "wb") as f:
        f.write(b"\0" * (st.f_bavail * st.f_frsize - pages_left * 4096))


def no_tmp_files(d: Path) -> None:
    assert not [p for p in d.rglob("*") if p.name.endswith(".tmp")]


def test_a_run_on_a_full_disk_is_one_line_wherever_it_fills(disk, tmp_path, monkeypatch,
                                                            capsys):
    """Free space for one more file, two, ...: the write that fails (Hydra's config save,
    the record, run.log) is one line naming it, exit 1, no traceback, no temporary file;
    until the run fits."""
    import shutil

    failed = []
    for pages in range(12):
        for p in disk.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        fill(disk, pages)
        code, _, err = cli([*TINY, f"hydra.run.dir={disk / 'r'}"], tmp_path, monkeypatch,
                           capsys)
        no_tmp_files(disk)
        assert code != 0, "the run fitted before its log failed"
        line = one_error_line(err)
        assert code == 1 and line.startswith(f"error: cannot write {disk / 'r'}/") and \
            "No space left on device" in line, (pages, err)
        failed.append(line.split()[3].rstrip(":")[len(str(disk / "r")) + 1:])
        if failed[-1] == "run.log":  # (the last it writes: the record is there)
            assert json.loads((disk / "r" / "metrics.json").read_text())["status"] == "ok"
            break
    assert {".hydra/config.yaml", "metrics.json", "run.log"} <= set(failed), failed


def test_a_failed_write_leaves_no_temporary_file_and_names_its_file(tmp_path, monkeypatch,
                                                                    capsys):
    """Where no tmpfs can be mounted (not root), the writers themselves: a write that fails
    (ENOSPC simulated in the JSON and Parquet writers, /dev/full for an open file) leaves
    the old file and no *.tmp, and its error names the file."""
    import errno

    import pandas as pd

    from moe_exp import results
    from moe_exp.sweep.table import write_error_line, write_tables

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "metrics.json").write_text("{}")
    monkeypatch.setattr(results.json, "dump", full)
    with pytest.raises(OSError) as e:
        results.write_json_atomic(tmp_path / "metrics.json", {"status": "ok"})
    assert write_error_line(e.value) == \
        f"cannot write {tmp_path / 'metrics.json'}: No space left on device"
    df = pd.DataFrame([_record(0, 1.0)])
    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    with pytest.raises(OSError) as e:
        write_tables(df, tmp_path)
    assert write_error_line(e.value) == \
        f"cannot write {tmp_path / 'results.parquet'}: No space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    assert (tmp_path / "metrics.json").read_text() == "{}"
    monkeypatch.undo()  # report DIR: one line, exit 1
    from moe_exp.report import main

    _sweep(tmp_path / "s", 1)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    assert main([str(tmp_path / "s"), "--no-plots"]) == 1
    assert one_error_line(capsys.readouterr().err) == \
        f"error: cannot write {tmp_path / 's' / 'results.parquet'}: No space left on device"
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["0"]
    if Path("/dev/full").exists():  # a buffered write fails at close: no file name in it
        with pytest.raises(OSError) as e:
            with open("/dev/full", "w") as f:
                f.write("x")
        assert write_error_line(e.value) == "cannot write /dev/full: No space left on device"


@pytest.mark.parametrize("when", ["config", "record", "report"])
def test_a_sweep_on_a_full_disk_ends_with_the_rows_it_has(when, disk, tmp_path, monkeypatch,
                                                          capsys):
    """The disk fills after job 0: before job 1's config save, during job 1 (its record),
    or before the report at the end. One line naming the file, exit 1, no traceback, no
    temporary file; the table holds job 0's row."""
    import pandas as pd

    from moe_exp.sweep import callback, report

    if when == "config":
        update = callback._update_table
        monkeypatch.setattr(callback, "_update_table",
                            lambda config: (update(config), fill(disk, 0)))
    elif when == "record":
        start = callback.SweepCallback.on_job_start
        monkeypatch.setattr(callback.SweepCallback, "on_job_start", lambda self, config, **k: (
            start(self, config, **k), config.hydra.job.num == 1 and fill(disk, 0)))
    else:
        own = report.report
        monkeypatch.setattr(report, "report", lambda *a, **k: (fill(disk, 0), own(*a, **k)))
    seeds = "1" if when == "report" else "1,2"
    code, _, err = cli(["-m", *TINY, f"train.seed={seeds}", "sweep.isolate=false",
                        f"hydra.sweep.dir={disk / 's'}"], tmp_path, monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 1 and line.startswith(f"error: cannot write {disk / 's'}/") and \
        "No space left on device" in line, err
    assert {"config": "1/.hydra/config.yaml", "record": "1/metrics.json",
            "report": "results."}[when] in line
    no_tmp_files(disk)
    assert list(pd.read_csv(disk / "s" / "results.csv")["job"]) == [0]
    assert not list((disk / "s").glob(".*.lock"))  # removed, however the sweep ended


# ---- 6. the launcher of a run's ranks killed with SIGKILL


def test_an_interrupt_from_a_vanished_launcher_says_so(tmp_path):
    """torch's spawn gives each rank SIGINT when its parent dies: rank 0's record then said
    `interrupted (Ctrl-C / SIGINT)`, or the error of a collective whose peer had stopped.
    Where the rank's parent is gone, it says that."""
    import os

    from moe_exp.distributed import reword_for_vanished_launcher as reword

    p = tmp_path / "metrics.json"
    rec = {"status": "crashed", "error": "interrupted (Ctrl-C / SIGINT) at step 2 of 5",
           "null_reasons": {"mfu": "not measured: run crashed"}}
    p.write_text(json.dumps(rec))
    assert not reword(p, os.getppid(), wait_s=0.05)  # the parent is alive: a Ctrl-C
    assert json.loads(p.read_text()) == rec
    gone = ("interrupted (its launching process, pid 999999999, vanished: killed outright, "
            "e.g. by kill -9 or the OOM killer; the ranks got SIGINT)")
    assert reword(p, 999_999_999)  # this process's parent at its start: gone
    assert json.loads(p.read_text())["error"] == f"{gone} at step 2 of 5"
    p.write_text(json.dumps({"status": "error", "error": "rank 0: RuntimeError: Connection "
                             "closed by peer", "null_reasons": {"mfu": "not measured: run "
                                                                       "error"}}))
    assert reword(p, 999_999_999)
    assert json.loads(p.read_text()) == {
        "status": "crashed", "error": f"{gone}; rank 0 then saw: rank 0: RuntimeError: "
        "Connection closed by peer", "null_reasons": {"mfu": "not measured: run crashed"}}
    no_tmp_files(tmp_path)


@pytest.mark.distributed
def test_kill_9_of_an_expert_parallel_launcher_is_recorded_as_such(tmp_path):
    import os

    err = open(tmp_path / "err.txt", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_exp.run", "parallel=expert", "hardware=cpu",
         "hardware.devices=2", "logger=none", *TINY[3:], "train.steps=100000",
         "hydra.run.dir=r"], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        for _ in range(240):  # the ranks in their measured steps
            if "bench:" in (tmp_path / "err.txt").read_text():
                break
            time.sleep(0.5)
        proc.kill()
        proc.wait()
        for _ in range(120):  # the ranks record and exit
            if not _group_alive(proc.pid):
                break
            time.sleep(0.5)
        assert not _group_alive(proc.pid), "the ranks outlived their launcher"
        rec = json.loads((tmp_path / "r" / "metrics.json").read_text())
        assert rec["status"] == "crashed" and rec["error"].startswith(
            f"interrupted (its launching process, pid {proc.pid}, vanished"), rec["error"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None
        err.close()


def _processes_naming(text: str) -> dict[int, str]:
    """{pid: environ} of the live processes whose command line names `text`."""
    out = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if text in (d / "cmdline").read_bytes().decode(errors="replace") and \
                    (d / "stat").read_text().split(") ")[-1][:1] != "Z":
                out[int(d.name)] = (d / "environ").read_bytes().decode(errors="replace")
        except OSError:  # (gone meanwhile)
            pass
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_kill_9_of_a_sweep_leaves_no_job_running(tmp_path):
    """A job runs in a session of its own: it watches its sweep's pid, and stops (and
    removes its compile cache) within 5 s of the sweep's kill -9."""
    import os

    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_exp.run", "-m", *TINY, "train.steps=100000",
         "train.seed=1,2", "hydra.sweep.dir=s"], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True)
    try:
        log = tmp_path / "s" / "0" / "job.log"
        for _ in range(240):  # the job in its measured steps
            if log.is_file() and "bench:" in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        jobs = _processes_naming(str(tmp_path / "s"))
        assert jobs, "no job process"
        caches = [v.split("=", 1)[1] for env in jobs.values() for v in env.split("\0")
                  if v.startswith("MOE_EXP_JOB_CACHE=")]
        assert caches and all(Path(c).is_dir() for c in caches)
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while _processes_naming(str(tmp_path / "s")) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        assert not _processes_naming(str(tmp_path / "s")), "a job outlived its sweep by 5 s"
        assert not any(Path(c).exists() for c in caches), "the job's compile cache is left"
    finally:
        for pid in _processes_naming(str(tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


# ---- 8. lock files


def test_a_lock_file_removed_while_it_was_being_taken_is_taken_anew(tmp_path, monkeypatch):
    """A sweep's end removes its lock files while holding them: a process that had opened
    one just before locks a file no one else can see; claim_dir and the table's lock then
    take the new one (two sweeps never hold one dir)."""
    import fcntl
    import os

    from moe_exp.sweep.live import _locked
    from moe_exp.sweep.checks import claim_dir

    flock = fcntl.flock
    for name in (".sweep.lock", ".results.lock"):
        calls = []

        def removed_first(f, op):  # the sweep that held it ends between open and lock
            if not calls:
                os.unlink(tmp_path / name)
            calls.append(op)
            return flock(f, op)

        monkeypatch.setattr(fcntl, "flock", removed_first)
        with (contextlib.nullcontext(claim_dir(tmp_path)) if name == ".sweep.lock" else
              _locked(tmp_path / name)) as f:
            assert len(calls) == 2 and os.fstat(f.fileno()).st_ino == \
                os.stat(tmp_path / name).st_ino
        f.close()
