"""The scripts under benchmarks/ run end to end (tiny settings) and write what they promise."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(script, *args, timeout=600):
    from conftest import python

    p = python([ROOT / "benchmarks" / script, *args], ROOT, timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_rounds_balance_each_contenders_place(monkeypatch):
    """Each round runs every contender once; over every 4 rounds each of 4 contenders runs
    once in each place, and the orders change from one block to the next (a fixed order
    biased the same code by up to 15% with its place)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _timing import run_rounds

    calls = []
    fns = {n: (lambda n=n: calls.append(n)) for n in "abcd"}
    res = run_rounds(fns, reps=12, warmup=0, max_other=float("inf"))
    assert res["rounds"] == 12 and res["dropped_rounds"] == 0
    rounds = [tuple(calls[i:i + 4]) for i in range(0, len(calls), 4)]
    assert len(rounds) == 12 and all(sorted(r) == list("abcd") for r in rounds)
    for b in range(0, 12, 4):
        assert all(sorted(r[p] for r in rounds[b:b + 4]) == list("abcd") for p in range(4))
    assert len({rounds[0], rounds[4], rounds[8]}) > 1
    assert set(res["median_ms"]) == set("abcd")


def test_moe_layer_benchmark_rows(tmp_path):
    """Every contender timed on the same routing (the script checks they agree), the bound
    column present, the skew making the routing unbalanced."""
    out = tmp_path / "layer.json"
    bench("moe_layer.py", "--shapes", "tiny", "--dtypes", "fp32,bf16", "--reps", "1",
          "--warmup", "0", "--no-compile", "--skew", "2", "--malloc-retain", "--json", str(out))
    data = json.loads(out.read_text())
    assert data["meta"]["malloc_retain"] is True
    rows = data["rows"]
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        ms = r["median_ms"]
        assert {"naive", "naive-v4", "loop", "padded", "auto", "mm-only"} <= set(ms)
        assert all(v > 0 for v in ms.values())
        assert r["speedup_vs_naive"]["naive"] == 1.0
        assert r["load"]["max_over_mean"] > 1.25  # balanced routing here is ~1.1
    assert rows[1]["auto"] == "padded"


@pytest.mark.slow
def test_compile_step_benchmark_row(tmp_path):
    out = tmp_path / "compile.json"
    # one layer of 2 experts: the loop dispatch's graph (a loop over the experts) compiles in
    # ~2/3 of tiny_moe's time
    bench("compile_step.py", "--models", "tiny_moe", "--precisions", "fp32", "--reps", "1",
          "--warm-cache", "--json", str(out), "train.seq_len=32", "train.micro_batch_size=2",
          "model.num_layers=1", "model.num_experts=2", "model.top_k=1")
    (row,) = json.loads(out.read_text())["rows"]
    assert row["dispatch"] == {"eager": "grouped", "compiled": "loop"}
    assert row["median_ms"]["eager"] > 0 and row["median_ms"]["compiled"] > 0
    assert row["first_compiled_step_s"] > 0


@pytest.mark.slow
def test_overhead_benchmark_phases(tmp_path):
    out = tmp_path / "overhead.json"
    bench("overhead.py", "--runs", "1", "--json", str(out), "train.steps=3",  # (W&B's start
          "train.warmup_steps=1", "train.micro_batch_size=2", "train.seq_len=32",  # left out)
          "logger=none")
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"default", "torch"}  # ("none" is the default here)
    assert 0 < res["runs"]["default"]["startup_s"] < res["runs"]["default"]["wall_s"]
    names = [name for name, _ in res["phases"]]
    assert names and all(t > 0 for _, t in res["phases"])
    assert any(name.startswith("torch") for _, name in res["imports"])


def test_flag_types_reject_bad_values(monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _timing import at_least, one_of

    assert at_least(1)("3") == 3
    for bad in ("0", "-2", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            at_least(1)(bad)
    assert one_of(("tiny", "small"))("tiny,small") == "tiny,small"
    with pytest.raises(argparse.ArgumentTypeError, match="huge"):
        one_of(("tiny", "small"))("tiny,huge")


def test_optimizer_step_benchmark_rows(tmp_path):
    """AdamW and Muon at each ns_steps timed on one model; Muon keeps less state (one
    buffer per matrix, not two)."""
    out = tmp_path / "opt.json"
    # (Muon's Newton-Schulz runs in bf16: on a CPU without bf16 matmuls a tiny_moe step at
    # ns=7 took 7 s, at ns=1 1.4 s; the script runs each contender 2 + reps times, more
    # under load)
    bench("optimizer_step.py", "--models", "tiny_moe", "--ns-steps", "1,2", "--reps", "1",
          "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    ms, state = row["median_ms"], row["state_mib"]
    assert set(ms) == {"adamw", "muon ns=1", "muon ns=2"} and row["vs_adamw"]["adamw"] == 1.0
    assert state["muon ns=2"] < 0.6 * state["adamw"]
    assert all(v > 0 for v in ms.values()) and row["rounds"] >= 1


def test_row_moves_benchmark_rows(tmp_path):
    """Both moves timed for both contenders (the script checks their gradients agree)."""
    out = tmp_path / "moves.json"
    bench("row_moves.py", "--shapes", "tiny", "--dtypes", "bf16", "--reps", "1",
          "--warmup", "0", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["move"] for r in rows] == ["fan-out", "permute"]
    for r in rows:
        assert set(r["median_ms"]) == {"index", "gather"}
        assert all(v > 0 for v in r["median_ms"].values())
        assert r["speedup"] == pytest.approx(r["median_ms"]["index"] / r["median_ms"]["gather"])


@pytest.mark.distributed
def test_muon_fsdp_benchmark_rows(tmp_path):
    """Both ways timed on 2 gloo ranks, the slower rank's medians."""
    out = tmp_path / "muon_fsdp.json"
    bench("muon_fsdp.py", "--models", "tiny_dense", "--reps", "1", "--json", str(out))
    (row,) = json.loads(out.read_text())["rows"]
    assert row["ranks"] == 2 and set(row["median_ms"]) == {"round-robin", "gathered"}
    assert all(v > 0 for v in row["median_ms"].values())
    assert row["speedup"] == pytest.approx(row["median_ms"]["gathered"] /
                                           row["median_ms"]["round-robin"])


@pytest.mark.slow
def test_pad_multiple_benchmark_rows(tmp_path):
    """Each multiple runs as its own training run; same losses (padding changes no math)."""
    out = tmp_path / "pad.json"
    stdout = bench("pad_multiple.py", "--rounds", "1", "--compile", "off", "--json", str(out),
                   "precision=fp32", "train.steps=3", "train.warmup_steps=1", "logger=none",
                   "train.micro_batch_size=2", "train.seq_len=32", "train.plan=false")
    # (fp32: the script's bf16 takes ~1 s a default step on a CPU without bf16 matmuls; the
    # rows and their losses are the point)
    rows = json.loads(out.read_text())["rows"]
    assert [r["multiple"] for r in rows] == [1, 16] and "×" in stdout
    assert all(r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0 for r in rows)
    assert rows[0]["loss_last"] == rows[1]["loss_last"]


def test_ab_runs_benchmark_rows(tmp_path):
    """Variants interleaved as whole runs; eager runs repeat their losses bit for bit."""
    out = tmp_path / "ab.json"
    stdout = bench("ab_runs.py", "--rounds", "2", "--variant", "a:", "--variant",
                   "ckpt:train.activation_checkpointing=full", "--json", str(out),
                   "--", "train.steps=2", "train.warmup_steps=1", "logger=none",
                   "train.micro_batch_size=2", "train.seq_len=32", "train.plan=false")
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["a", "ckpt"] and "×" in stdout
    assert all(r["runs"] + r["dropped"] == 2 and r["tokens_per_s"] > 0 for r in rows)
    assert [r["distinct_losses"] for r in rows] == [1, 1]
    assert rows[0]["loss_last"] == rows[1]["loss_last"]  # checkpointing changes no math


def test_mfu_table_rows_and_best(tmp_path, capsys, monkeypatch):
    """gpu_mfu.sh's table: a row per run (a failed run's cells —) and the best MFU."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import mfu_table

    ok = {"status": "ok", "step_time_ms": 812.5, "tokens_per_s": 40321.0, "mfu": 0.4123,
          "tflops_per_device": 408.0, "peak_mem_gib": 61.2, "data_share": 0.0004,
          "micro_batch_size": 8, "compile": "default", "device_name": "NVIDIA H100",
          "torch_version": "2.11.0"}
    for name, rec in {"mbs8_compile": ok, "mbs16_compile": {"status": "oom", "mfu": None},
                      "mbs8_eager": {**ok, "mfu": 0.30, "compile": "off"}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(rec))
    assert mfu_table.main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = {line.split()[0]: line.split() for line in lines if line.startswith("mbs")}
    assert row["mbs8_compile"][1:] == ["ok", "812.5", "40,321", "408.0", "41.2", "61.2", "0.04"]
    assert row["mbs16_compile"][1:] == ["oom"] + ["—"] * 6
    assert any(line.startswith("best MFU 41.2%") and "compile=default" in line for line in lines)


BAD_INPUT = [
    (["moe_layer.py", "--skew", "nan"], "--skew"),
    (["moe_layer.py", "--json", f"{__file__}/x.json"], "--json"),  # a file as its folder
    (["row_moves.py", "--device", "bogus"], "--device"),
    (["compile_step.py", "model.num_heads=3"], "model.num_heads"),
    (["overhead.py", "--runs", "1", "model.num_heads=3"], "model.num_heads"),
    (["muon_fsdp.py", "--ranks", "1000"], "ranks asked for"),
    (["pad_multiple.py", "--multiples", "0"], "--multiples"),
    (["plan_accuracy.py", "--compile", "default", "--parallel", "ddp"], "--compile"),
    (["ab_runs.py", "--rounds", "0", "--variant", "a:", "--variant", "b:"], "--rounds"),
    (["ab_runs.py", "--variant", "precision=bf16", "--variant", "b:"], "NAME:override"),
    (["mfu_table.py", "/nonexistent"], "folder"),
    (["attention.py", "--kernels", "flash,fast"], "--kernels"),
    (["attention.py", "model.hidden_sise=8"], "overrides"),
    (["attention.py", "train.seq_len=4096"], "overrides"),
]


def run_script(script, *args, monkeypatch):
    """`python benchmarks/SCRIPT ARGS` in this process (for a script that stops before any
    work: its start-up, torch's import, is not what is tested). A CompletedProcess."""
    import runpy

    from conftest import as_process

    path = str(ROOT / "benchmarks" / script)
    monkeypatch.setattr(sys, "argv", [path, *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the scripts insert their dirs)
    monkeypatch.chdir(ROOT)
    return as_process(args, lambda: runpy.run_path(path, run_name="__main__"))


@pytest.mark.parametrize("args, says", BAD_INPUT)
def test_bad_input_fails_first_with_one_line(args, says, monkeypatch):
    """Bad flags and configs end the script before any work: exit 2, one error line."""
    p = run_script(*args, monkeypatch=monkeypatch)
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in p.stderr, p.stderr


def test_attention_benchmark_rows(tmp_path):
    """Each kernel that runs here: the attention's and the model's fwd+bwd and the share;
    one this CPU lacks is a row with the reason."""
    out = tmp_path / "attention.json"
    stdout = bench("attention.py", "--kernels", "flash,math,cudnn", "--reps", "1", "--json",
                   str(out), "model.num_layers=1", "train.seq_len=32",
                   "train.micro_batch_size=2")
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert "CPU SDPA has the flash and math kernels only" in rows["cudnn"]["skipped"]
    for k in ("flash", "math"):
        assert 0 < rows[k]["attention_ms"] and 0 < rows[k]["share"] < 1, rows[k]
    assert rows["math"]["speedup"] == 1.0 and "×" in stdout


def test_plan_accuracy_benchmark_rows(tmp_path):
    """Each configuration's planned and measured peak, side by side, within 10%."""
    out = tmp_path / "plan.json"
    bench("plan_accuracy.py", "--models", "tiny_moe", "--precisions", "fp32", "--ac",
          "none,full", "--micro-batch", "2", "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["ac"] for r in rows] == ["none", "full"]
    assert all(abs(r["error"]) < 0.10 and r["planned"]["params"] > 0 for r in rows)


def test_plan_rows_at_this_cpus_peaks(tmp_path):
    """--cpu-peaks: a bench row checking its own plan, its roofline at this CPU's measured
    matmul and copy rates (the datasheet basis, not a calibration)."""
    out = tmp_path / "rows.json"
    bench("plan_rows.py", "--rows", "cpu", "--only", "0", "--steps", "2", "--cpu-peaks",
          "--json", str(out), "train.micro_batch_size=2")
    (r,) = json.loads(out.read_text())["rows"]
    assert r["status"] == "ok" and abs(r["planned_peak_error"]) < 0.10, r
    assert r["cpu_peaks"]["fp32"] > 0 and r["cpu_peaks"]["bandwidth"] > 0
    assert "bf16" not in r["cpu_peaks"]  # (row 0 is fp32: no minute of bf16 matmuls)
    (run,) = r["runs"]
    assert run["planned_time_basis"] == "datasheet"
    assert run["planned_step_error"] == pytest.approx(
        run["planned_step_ms"] / run["step_time_ms"] - 1)


def test_plan_rows_plans_each_row_with_a_calibration(tmp_path):
    """Each row a bench run planning its own step at a calibration's rates (here a flat
    one, 1 GFLOP/s and 1 GB/s): its step error is planned / measured - 1, its basis the
    file (a version 1 one: read as without the in-step factor)."""
    cal = tmp_path / "flat.json"
    flat = {"axes": [[1, 10**6]] * 3, "rates": [[[1e9] * 2] * 2] * 2, "measured": 8}
    cal.write_text(json.dumps({
        "version": 1, "device": "cpu", "device_name": "flat", "torch": "x",
        "made": "2026-11-28T00:00:00", "dispatch_us": {"fp32": 10.0}, "sync_us": 0.0,
        "matmul": {"fp32:nn": flat},
        "bandwidth": {"axes": [[1, 10**9]], "rates": [1e9, 1e9], "measured": 2}}))
    out = tmp_path / "rows.json"
    bench("plan_rows.py", "--rows", "cpu", "--only", "0", "--steps", "2", "--calibration",
          str(cal), "--json", str(out), "train.micro_batch_size=2")
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok" and abs(row["planned_peak_error"]) < 0.10, row
    assert row["planned_step_error"] == pytest.approx(
        row["planned_step_ms"] / row["step_time_ms"] - 1, rel=1e-6)
    assert row["runs"][0]["planned_time_basis"].startswith(f"calibration {cal}")
    assert row["machine_gflops"] == row["runs"][0]["machine_gflops"] > 0  # (before the run)
