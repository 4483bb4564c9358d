"""Whole runs on CPU: the record, precisions, checkpointing memory, W&B, the CLI."""
import datetime as dt
import glob
import json
import math
import re
from pathlib import Path

import pytest
import torch

from moe_exp.results import FIELDS
from wandb_reader import read_offline_run

from conftest import (cli_key, cli_runs, compose, in_pairs, off_contract, run_cli,
                      run_inproc)

# Runs two at a time take a thread each: two of torch's two threads on 2 cores waited for
# each other (a tiny_moe step took 9 s, not 0.2)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def default_record(tmp_path_factory):
    """In its own process, as a user runs it (peak RSS is then the run's own)."""
    out = tmp_path_factory.mktemp("default")
    p = run_cli(["logger=none", f"hydra.run.dir={out}"], out)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), out


def test_default_record_is_complete_and_sane(default_record):
    rec, out = default_record
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["status"] == "ok" and on_disk["error"] is None
    log = (out / "run.log").read_text()  # the record's gist, as the terminal's table has it
    assert "status: ok" in log and f"tokens/s: {rec['tokens_per_s']:,.0f}" in log
    assert all(k in on_disk for k in FIELDS)
    assert off_contract(on_disk) == set()
    assert rec["tokens_per_s"] > 0 and rec["tokens_per_s_per_device"] > 0
    assert rec["step_time_ms"] > 0 and rec["step_time_iqr_ms"] >= 0
    phases = sum(rec[f"{p}_ms"] for p in ("data", "forward", "backward", "optimizer"))
    assert 0 < phases <= rec["step_time_ms"] * 1.5
    assert rec["peak_mem_gib"] > 0 and rec["peak_reserved_gib"] is None
    assert "peak_reserved_gib" in rec["null_reasons"]
    if rec["mfu"] is None:  # (a CPU: no published peak)
        assert "peak FLOP/s" in rec["null_reasons"]["mfu"]
        assert rec["peak_flops"] is None and "peak FLOP/s" in rec["null_reasons"]["peak_flops"]
    else:
        assert 0 < rec["mfu"] < 1 and rec["peak_flops"] > 1e12
    assert rec["flops_per_token"] > 6 * (rec["params_active"] - 256 * 128) * 0.9
    assert rec["loss_last"] < rec["loss_first"] - 0.5  # the markov data is learnable
    assert len(rec["losses"]) == 23
    assert 0 <= rec["cpu_other_load"] <= 1  # other processes' share of the CPU
    assert rec["expert_load_cv"] >= 0 and rec["expert_load_max_over_mean"] >= 1
    assert len(rec["expert_load_cv_per_layer"]) == 2
    assert rec["aux_loss"] > 0.9  # Switch loss is >= ~1 for top-k routing
    assert rec["world_size"] == 1 and rec["hardware"] in ("cpu", "a100", "h100", "h100_pcie", "h100_nvl",
                                                       "h200", "h200_nvl", "cuda")
    assert rec["compile_s"] is None and rec["null_reasons"]["compile_s"] == "train.compile=off"
    assert rec["startup_s"] > 0  # its own process: process start -> first measured step
    assert len(rec["config_hash"]) == 12 and rec["torch_version"] == torch.__version__
    from moe_exp.hardware import cpu_name

    # which GPU (hardware=auto picks one where there is one), or which CPU: its figures
    # depend on it
    assert rec["device_name"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                                  else cpu_name())


def test_the_records_config_is_omegaconfs_own_resolution(monkeypatch):
    """pipeline.container: OmegaConf's to_container where the config resolves (a misspelt
    call once sent every run down the value-by-value fallback); there, a ${...} that does
    not resolve is null and the rest is kept."""
    from omegaconf import OmegaConf

    import moe_exp.pipeline as pipeline

    cfg = compose(["logger=none"])
    with monkeypatch.context() as m:
        m.setattr(pipeline, "_resolved", lambda node: pytest.fail("fell back"))
        assert pipeline.container(cfg) == OmegaConf.to_container(cfg, resolve=True)
    OmegaConf.set_struct(cfg, False)
    cfg.train.steps = "${bogus}"
    d = pipeline.container(cfg)
    assert d["train"]["steps"] is None and d["train"]["seq_len"] == cfg.model.max_seq_len


def test_cpu_name_gives_the_model_and_vector_units(monkeypatch, tmp_path):
    """From /proc/cpuinfo's first model name, with torch's CPU capability and AMX when the
    CPU has it (bf16 matmuls on AMX are several times faster: figures differ by far)."""
    import builtins

    from moe_exp import hardware

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(
        info if f == "/proc/cpuinfo" else f, *a, **k))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert hardware.cpu_name() == "Intel(R) Xeon(R) Platinum 8480+ (AVX512, AMX)"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    info.write_text("processor\t: 0\n")  # no model name (some ARM kernels)
    monkeypatch.setattr(hardware.platform, "processor", lambda: "")
    assert hardware.cpu_name() == "cpu (AVX512)"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_runs_on_cpu(precision, tmp_path):
    # (micro-batch 2: CPUs without bf16/fp16 matmuls emulate them, ~1 s a default step)
    rec = run_inproc([f"precision={precision}", "logger=none", "train.steps=6",
                      "train.micro_batch_size=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["precision"] == precision and math.isfinite(rec["loss_last"])
    assert rec["loss_last"] < rec["loss_first"]


@pytest.mark.parametrize("limit,share", [(1.5, None), (-100.0, 1.0)])
def test_record_says_how_often_padded_fell_back(limit, share, tmp_path, monkeypatch):
    """model.dispatch=padded: the record's moe_padded_fallback_share is the share of MoE
    calls that ran unpadded (a negative PAD_LIMIT makes every call fall back)."""
    import moe_exp.model.moe as moe
    from moe_exp.tasks.summary import summary_rows

    monkeypatch.setattr(moe, "PAD_LIMIT", limit)
    rec = run_inproc(["model.dispatch=padded", "logger=none", "train.steps=4",
                      "train.plan=false"], tmp_path)
    assert rec["status"] == "ok" and rec["moe_dispatch"] == "padded"
    got = rec["moe_padded_fallback_share"]
    assert 0 <= got <= 1 if share is None else got == share
    load = dict(summary_rows(rec))["expert load"]
    assert ("padded fell back on 100% of layer calls" in load) == (got == 1.0)
    other = run_inproc(["model.dispatch=loop", "logger=none", "train.steps=2",
                        "train.plan=false"], tmp_path / "l")
    assert other["moe_padded_fallback_share"] is None
    assert "only padded falls back" in other["null_reasons"]["moe_padded_fallback_share"]
    from moe_exp.tasks.summary import _fallbacks

    assert "<1%" in _fallbacks(0.004) and _fallbacks(0.0) == "" and _fallbacks(None) == ""


def test_dense_model_has_null_expert_stats_with_reason(tmp_path):
    rec = run_inproc(["model=tiny_dense", "logger=none", "train.steps=4"], tmp_path)
    assert rec["status"] == "ok"
    assert rec["expert_load_cv"] is None and "dense" in rec["null_reasons"]["expert_load_cv"]
    # every null field says why (moe_dispatch did not)
    assert not [k for k, v in rec.items() if v is None and k not in rec["null_reasons"]
                and k != "error"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_run_has_same_losses(mode, tmp_path, default_record):
    rec = run_inproc([f"train.activation_checkpointing={mode}", "logger=none",
                      "train.plan=false"], tmp_path)
    assert rec["status"] == "ok"
    assert rec["losses"] == pytest.approx(default_record[0]["losses"], rel=1e-4)


BIG_ACT = ["logger=none", "model.max_seq_len=256", "model.hidden_size=256", "model.num_layers=4",
           "train.micro_batch_size=16", "train.steps=2", "train.warmup_steps=1",
           "train.plan=false"]


@pytest.mark.slow
def test_full_checkpointing_lowers_peak_memory(tmp_path):
    peaks = {}
    for ac in ("none", "full"):  # separate processes: peak RSS is per process
        p = run_cli([*BIG_ACT, f"train.activation_checkpointing={ac}",
                     f"hydra.run.dir={tmp_path / ac}"], tmp_path)
        assert p.returncode == 0, p.stderr
        peaks[ac] = json.loads((tmp_path / ac / "metrics.json").read_text())["peak_mem_gib"]
    # activations dominate here: full AC saves ~40% (0.56-0.66 of none over 6 runs at micro
    # batch 16-32; 0.51-0.61 over 3 more at 16); CPU peak RSS varies by ~10% run to run,
    # hence the margin
    assert peaks["full"] < 0.75 * peaks["none"], peaks


IMPORTS_IN_WINDOW = """
import sys, tempfile
from moe_exp.bench import memory
from moe_exp.run import run
sys.path.insert(0, "tests")
from conftest import compose
seen = {}
base, read = memory.MemoryMeter.baseline, memory.MemoryMeter.read
memory.MemoryMeter.baseline = lambda self: (seen.setdefault("base", set(sys.modules)), base(self))[1]
memory.MemoryMeter.read = lambda self: (seen.setdefault("read", set(sys.modules)), read(self))[1]
rec = run(compose(["logger=none", "train.steps=2", "train.warmup_steps=1", *sys.argv[1:]]),
          out_dir=tempfile.mkdtemp(), progress=False)
assert rec["status"] == "ok", rec["error"]
print(" ".join(sorted(m for m in seen["read"] - seen["base"] if m.startswith("torch"))))
"""


@pytest.mark.parametrize("extra", [[], ["optim=muon", "optim.ns_steps=1"]],
                         ids=["adamw", "muon"])
def test_cpu_peak_memory_counts_no_module_imports(extra):
    """CPU peak_mem_gib is RSS above a baseline taken before the model is built: torch
    modules a run imports after it (torch.optim's lazy dynamo import: ~45 MiB, a third of
    tiny_moe's peak) would count as the run's memory. A fresh process, so nothing is
    imported already."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", IMPORTS_IN_WINDOW, *extra], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    late = p.stdout.strip().splitlines()[-1].split() if p.stdout.strip() else []
    heavy = ("torch._dynamo", "torch._inductor", "torch.distributed", "torch.onnx",
             "torch._functorch", "torch.fx")
    assert not [m for m in late if m.startswith(heavy)], late


def test_cpu_memory_cap_turns_running_out_into_an_error_and_is_lifted_after():
    import resource

    from moe_exp.bench.memory import cpu_memory_cap, is_oom

    before = resource.getrlimit(resource.RLIMIT_DATA)
    if before[0] != resource.RLIM_INFINITY:
        pytest.skip(f"ulimit -d is set here ({before[0]} bytes): the cap keeps it")
    with cpu_memory_cap(0.25) as headroom:
        assert headroom == pytest.approx(0.25 * 2**30, rel=1e-6)
        with pytest.raises(RuntimeError) as e:
            torch.ones(2**28)  # 1 GiB
        assert is_oom(e.value)
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert torch.ones(2**28).sum() == 2**28
    assert not is_oom(RuntimeError("shapes cannot be multiplied")) and is_oom(MemoryError())


def test_cgroup_room_is_the_least_over_the_cgroup_and_its_parents(tmp_path):
    """A container's or SLURM job's memory limit (cgroup v1 and v2): limit - usage +
    inactive file cache, the least over the process's cgroup and its parents."""
    from moe_exp.bench.memory import cgroup_free_bytes

    def cg(d, limit, usage, inactive, v1):
        d.mkdir(parents=True, exist_ok=True)
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file") \
            if v1 else ("memory.max", "memory.current", "inactive_file")
        (d / names[0]).write_text(f"{limit}\n")
        (d / names[1]).write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"cache 5\n{names[2]} {inactive}\n")

    v2, proc = tmp_path / "v2", tmp_path / "cgroup"
    cg(v2, "max", 10, 0, False)
    cg(v2 / "slurm" / "job_1", 8 * 2**30, 3 * 2**30, 2**30, False)  # the job's limit
    cg(v2 / "slurm" / "job_1" / "step_0", "max", 3 * 2**30, 2**30, False)
    proc.write_text("0::/slurm/job_1/step_0\n")
    assert cgroup_free_bytes(str(proc), str(v2)) == 6 * 2**30
    v1 = tmp_path / "v1"
    cg(v1 / "memory", 2**63 - 4096, 1, 0, True)  # v1's "no limit"
    proc.write_text("4:memory:/docker/abc\n3:cpu:/docker/abc\n")
    assert cgroup_free_bytes(str(proc), str(v1)) is None
    cg(v1 / "memory" / "docker" / "abc", 4 * 2**30, 2**30, 0, True)
    assert cgroup_free_bytes(str(proc), str(v1)) == 3 * 2**30
    proc.write_text("4:memory:/elsewhere\n")  # a container's own view: the mount's root
    cg(v1 / "memory", 2 * 2**30, 2**30, 0, True)
    assert cgroup_free_bytes(str(proc), str(v1)) == 2**30
    assert cgroup_free_bytes(str(tmp_path / "none"), str(v1)) is None


def test_oom_lines_read_the_same_from_every_allocator():
    from moe_exp.bench.memory import oom_line

    cpu = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
           "memory: you tried to allocate 64 bytes. Error code 12 (Cannot allocate memory)")
    assert oom_line(cpu) == ("DefaultCPUAllocator: can't allocate memory: you tried to "
                             "allocate 64 bytes")
    assert oom_line("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough "
                    "memory: you tried to allocate 8 bytes.").startswith("DefaultCPUAllocator: ")
    assert oom_line(f"rank 1 failed: RuntimeError: {cpu}") == \
        "rank 1 failed: RuntimeError: " + oom_line(cpu)  # a rank's, under the launcher
    assert oom_line("") == "out of memory (MemoryError)"  # str(MemoryError()) is empty
    assert oom_line("rank 1 failed: MemoryError") == "rank 1 failed: out of memory (MemoryError)"
    gpu = "CUDA out of memory. Tried to allocate 2.00 GiB"
    assert oom_line(gpu) == gpu and oom_line("", 2**30).endswith("and ulimit -d)")


def test_the_preflight_refuses_a_plan_over_the_memory_free_now(monkeypatch):
    """A probe or run whose planned peak fits the machine but not what is free of it now is
    skipped before any work (issue 53: tune_batch's probe held 15 of 24 GiB)."""
    from types import SimpleNamespace

    from moe_exp.bench import memory
    from moe_exp.plan.predict import too_big

    cfg = SimpleNamespace(hardware=SimpleNamespace(memory_gib=24.0, devices=1, device="cpu",
                                                   name="cpu"))
    monkeypatch.setattr(memory, "free_bytes", lambda device: 4 * 2**30)
    assert too_big(cfg, {"planned_peak_gib": 3.0}) is None
    assert too_big(cfg, {"planned_peak_gib": 6.0}).startswith(
        "train.micro_batch_size: the plan of this step peaks at 6 GiB on a device (task=plan "
        "for its split); this machine has 4 GiB free now")
    assert "hardware=cpu has 24 GiB" in too_big(cfg, {"planned_peak_gib": 30.0})
    monkeypatch.setattr(memory, "free_bytes", lambda device: None)  # unknown: the part's
    assert too_big(cfg, {"planned_peak_gib": 6.0}) is None
    monkeypatch.undo()  # the real one reads this machine
    assert memory.free_bytes("cpu") > 0 and memory.free_bytes("cuda") is None


def test_a_cpu_run_past_its_memory_ends_oom_with_a_record(tmp_path):
    """Not the kernel's OOM killer (no record, maybe another process killed): the run's
    allocations fail past the memory free at its start (here hardware.memory_gib: the
    weights fit, a batch of 256 sequences' activations do not). First the pre-flight: the
    plan of the step (train.plan, on by default) peaks past the memory: skipped, before
    any work, with the plan in the record."""
    o = ["logger=none", "hardware=cpu", "hardware.memory_gib=1", "train.micro_batch_size=256",
         "train.steps=2"]
    rec = run_inproc(o, tmp_path / "planned")
    assert rec["status"] == "skipped" and rec["error"].startswith(
        "train.micro_batch_size: the plan of this step peaks at "), rec["error"]
    assert rec["planned_peak_gib"] > 1 and rec["tokens_per_s"] is None
    rec = run_inproc([*o, "train.plan=false"], tmp_path)
    assert rec["status"] == "oom", rec["error"]
    assert rec["error"].startswith("DefaultCPUAllocator: can't allocate memory: ")
    assert rec["error"].endswith("(the process could allocate 1 GiB: the least of the memory "
                                 "free at its start, its cgroup's room, hardware.memory_gib "
                                 "and ulimit -d)")
    assert "enforce fail" not in rec["error"] and rec["tokens_per_s"] is None
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "oom"


def test_cpu_peak_memory_does_not_grow_with_the_runs_length(tmp_path):
    """Peak memory is the model's working set, not the run's length: a run 10x longer (its
    losses read once, at the end) peaks within 20% of a short one (run-to-run spread is
    ~10%: torch 2.11 gave 0.113 / 0.123 / 0.119 GiB at 20 / 400 / 1000 steps). Before:
    small tensors kept from every step pinned freed heap (2.2x at 400 steps; it grew with
    the steps), and the markov data was made for every step up front. One
    layer: half the time a step takes, and the pinning shows more, not less (those tensors
    put back: 2.6x at 400 steps on a thread, 3.2x on two; 1.03 to 1.07x without; at
    micro-batch 2 x 32 tokens it hid: 1.2x)."""
    def run(steps):
        return run_cli(["logger=none", "model.num_layers=1", f"train.steps={steps}",
                        "train.plan=false",
                        f"train.log_every={steps}", f"hydra.run.dir={tmp_path / str(steps)}"],
                       tmp_path, env=ONE_THREAD)

    peaks = {}
    for steps, p in zip((20, 200), in_pairs(run, [(20,), (200,)])):  # (each its own RSS)
        assert p.returncode == 0, p.stderr[-3000:]
        peaks[steps] = json.loads((tmp_path / str(steps) / "metrics.json").read_text())[
            "peak_mem_gib"]
    assert peaks[200] <= 1.2 * peaks[20], peaks


def test_wandb_offline_run_holds_config_and_metrics_and_is_finished(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    rec = run_inproc(["train.steps=5"], tmp_path)
    assert rec["status"] == "ok"
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1
    run = read_offline_run(files[0])
    assert run["config"]["model"]["name"] == "tiny_moe"
    assert run["config"]["train"]["seq_len"] == 128  # resolved, not ${...}
    assert run["summary"]["tokens_per_s"] == pytest.approx(rec["tokens_per_s"])
    # the whole record: nulls with their reasons, lists and dicts too
    assert run["summary"]["mfu"] is None and "peak FLOP/s" in run["summary"]["null_reasons"]["mfu"]
    assert run["summary"]["overrides"] == rec["overrides"]
    assert run["summary"]["tokens_per_expert"] == rec["tokens_per_expert"]
    assert [h["loss"] for h in run["history"]] == pytest.approx(rec["losses"])
    assert [h["lr"] for h in run["history"]] == pytest.approx(rec["lrs"])  # the lr curve
    assert run["exit_code"] == 0  # finished
    # W&B starts after the run (deferred): its history keeps when each row was logged, in
    # the measured loop, not when it was replayed
    stamps = [h["_timestamp"] for h in run["history"]]
    started = dt.datetime.fromisoformat(rec["timestamp"]).timestamp()
    assert started - 1 <= stamps[0] <= stamps[-1] < run["start_time"], (stamps, run)


def test_wandb_run_is_finished_when_the_run_fails(tmp_path, monkeypatch):
    import moe_exp.tasks.bench as runner

    def boom(*a, **k):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(runner, "train_loop", boom)
    rec = run_inproc(["train.steps=2"], tmp_path)
    assert rec["status"] == "error" and "planted failure" in rec["error"]
    run = read_offline_run(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))[0])
    assert run["exit_code"] == 1 and run["summary"]["status"] == "error"


def test_a_wandb_failure_after_the_run_is_a_warning(tmp_path, monkeypatch, capsys):
    """W&B starts after the measured steps: its failure then leaves the record as it is."""
    import wandb

    def refuse(*a, **k):
        raise wandb.errors.UsageError("planted: W&B refused\nsecond line")

    monkeypatch.setattr(wandb, "init", refuse)
    rec = run_inproc(["train.steps=2"], tmp_path)
    assert rec["status"] == "ok"
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "ok"
    err = capsys.readouterr().err
    assert "warning: W&B logging failed: UsageError: planted: W&B refused\n" in err
    assert "second line" not in err and "Traceback" not in err


def test_nan_loss_ends_the_run_as_diverged(tmp_path):
    rec = run_inproc(["logger=none", "optim.lr=1e30", "optim.grad_clip=0",
                      "optim.lr_warmup_steps=1", "train.steps=20", "train.log_every=8"], tmp_path)
    assert rec["status"] == "diverged" and "loss became" in rec["error"]
    # the curve before the first non-finite step is kept, and the error names that step
    n = len(rec["losses"])
    assert n >= 1 and all(map(math.isfinite, rec["losses"])) and rec["error"].endswith(f"step {n}")
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "diverged"


@pytest.mark.slow
def test_default_cli_run_writes_record_under_outputs(tmp_path):
    p = run_cli([], tmp_path)
    assert p.returncode == 0, p.stderr
    rec = json.loads(next(tmp_path.glob("outputs/*/*/metrics.json")).read_text())
    assert rec["status"] == "ok" and rec["loss_last"] < rec["loss_first"]
    assert "tokens/s" in p.stdout and "MFU" in p.stdout and "loss" in p.stdout
    assert list(tmp_path.glob("outputs/*/*/wandb/offline-run-*"))
    # process start -> first measured step: more than the warmup steps, less than the run
    assert 0 < rec["startup_s"] < 120


FAULTS = """
import resource, sys, torch
from moe_exp.host import malloc_retain
if sys.argv[1] == "1":
    assert malloc_retain()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = 0
for _ in range(20):  # a 64 MiB tensor (16384 pages), freed at once
    f0 = faults()
    torch.ones(2**24)
    n += faults() - f0 > 8192
print(n)
"""


def _thp_always() -> bool:
    try:
        return "[always]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(_thp_always(), reason="transparent huge pages 'always': a 64 MiB "
                    "mapping faults in a few huge pages, not 16384 pages")
def test_malloc_retain_reuses_resident_pages():
    """hardware.malloc_retain: once the heap has settled (2-8 allocations here: a freed
    chunk is too small for the next aligned request until neighbours coalesce), a 64 MiB
    tensor reuses its predecessor's pages; glibc otherwise mmaps and unmaps each one, so
    all 20 fault their 16384 pages in."""
    import subprocess
    import sys

    faults = {m: int(subprocess.run([sys.executable, "-c", FAULTS, m], capture_output=True,
                                    text=True, check=True).stdout) for m in "01"}
    assert faults["0"] == 20 and faults["1"] <= 12, faults


def test_malloc_retain_run(tmp_path):
    p = run_cli(["logger=none", "hardware.malloc_retain=true", "train.steps=4",
                 "train.warmup_steps=1", f"hydra.run.dir={tmp_path}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["status"] == "ok" and rec["tokens_per_s"] > 0


def test_kineto_marks_are_caught_other_stderr_passes(capfd):
    """Distributed ranks start and stop torch.profiler: kineto's USDT/STAGE marks written to
    fd 2 are dropped, anything else written there meanwhile still reaches stderr."""
    import os

    from moe_exp.train.loop import kineto_quiet

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with kineto_quiet():
        prof.__enter__()
        os.write(2, b"a real warning\n")
    torch.ones(4).sum()
    with kineto_quiet():
        prof.__exit__(None, None, None)
    err = capfd.readouterr().err
    assert "a real warning" in err
    assert "USDT:" not in err and "profiler_start" not in err and "STAGE:" not in err
    assert prof.key_averages()  # the profile itself still recorded


def test_distributed_breakdown_is_the_slowest_ranks_own():
    """Each step's phases come from the rank whose step was slowest, so they add up to the
    step time (a max per phase over ranks summed to 107% of it)."""
    from moe_exp.tasks.bench_record import slowest_rank_steps

    keys = ["step_ms", "forward_ms", "backward_ms"]
    # rank 0: slow forward; rank 1: slow backward; step 1's slowest is rank 1, step 0's rank 0
    every = torch.tensor([[[10.0, 9.0], [7.0, 3.0], [3.0, 6.0]],
                          [[9.0, 12.0], [2.0, 3.0], [7.0, 9.0]]], dtype=torch.float64)
    got = slowest_rank_steps(every, keys)
    assert got == {"step_ms": [10.0, 12.0], "forward_ms": [7.0, 3.0], "backward_ms": [3.0, 9.0]}
    for i in range(2):
        assert got["forward_ms"][i] + got["backward_ms"][i] == got["step_ms"][i]


@pytest.mark.slow
@pytest.mark.parametrize("sig, rc, says", [("SIGINT", 130, "Ctrl-C / SIGINT"),
                                           ("SIGTERM", 143, "SIGTERM")])
def test_ctrl_c_leaves_a_record_that_says_so(tmp_path, sig, rc, says):
    """SIGINT (Ctrl-C) or SIGTERM (timeout, SLURM, docker stop; it used to kill the run
    with no record) mid-run: the record says `crashed: interrupted (SIG...)` (it said
    `error` with no reason), and so does run.log; W&B is not started for it, exit code
    130 / 143, no traceback."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    import threading

    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "moe_exp.run", "train.steps=100000",
                          f"hydra.run.dir={out}"], cwd=tmp_path, stderr=subprocess.PIPE,
                         text=True, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: p.stderr.read(64), "")))
    reader.start()
    for _ in range(600):  # until its training loop has started (the progress bar shows)
        if "warmup:" in "".join(chunks) or p.poll() is not None:
            break
        time.sleep(0.2)
    time.sleep(1)
    p.send_signal(getattr(signal, sig))
    p.wait(timeout=120)
    reader.join(timeout=30)
    err = "".join(chunks)
    assert p.returncode == rc, err[-2000:]
    assert "Traceback" not in err
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "crashed" and rec["error"].startswith(f"interrupted ({says}) at")
    assert not (out / "wandb").exists()
    done = int(re.search(r"at step (\d+) of \d+", rec["error"]).group(1))
    assert done > 0 and len(rec["losses"]) == done  # every step done, logged or not
    assert rec["loss_first"] == rec["losses"][0] and rec["loss_last"] == rec["losses"][-1]
    assert all(math.isfinite(v) for v in rec["losses"])
    log = (out / "run.log").read_text()  # (it was empty: the interrupt skipped it)
    assert f"status: crashed: {rec['error']}" in log and "overrides: train.steps=100000" in log


def test_ctrl_c_on_a_distributed_run_is_an_interrupt(monkeypatch):
    """The elastic agent turns SIGINT into SignalException (an Exception) and leaves its
    handlers in place: launch turns it back into KeyboardInterrupt and restores them."""
    import signal

    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from moe_exp.distributed import launch

    def agent(config, entry):
        def run(*args):
            signal.signal(signal.SIGINT, lambda *a: None)  # as the agent does
            raise SignalException("got signal: 2", sigval=signal.SIGINT)
        return run

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(api, "elastic_launch", agent)
    with pytest.raises(KeyboardInterrupt):
        launch(print, 2)
    assert signal.getsignal(signal.SIGINT) is before


def test_gradient_sync_before_the_step_counts_as_backward(tmp_path, monkeypatch):
    """Expert parallelism all-reduces the replicated gradients after the last micro-step
    (Applied.before_step): backward time, as DDP's and FSDP's in-hook reductions are, not
    the optimizer's (clip + step + zero_grad)."""
    import time

    import moe_exp.optimizations as opt

    real = opt.apply

    def with_slow_sync(*args, **kwargs):
        applied = real(*args, **kwargs)
        applied.before_step = lambda: time.sleep(0.1)
        return applied

    monkeypatch.setattr(opt, "apply", with_slow_sync)
    rec = run_inproc(["logger=none", "train.steps=3", "train.warmup_steps=1"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    # (the sleep in the optimizer's phase would make it the longer: robust to a loaded CPU)
    assert rec["backward_ms"] >= 100 and rec["optimizer_ms"] < rec["backward_ms"] - 50, rec


def test_other_accelerators_sync_at_each_boundary_and_read_their_allocator(monkeypatch):
    """A device without CUDA events (Gaudi's hpu: torch.hpu once its bridge is imported)
    queues work asynchronously: each phase boundary waits for it, and peak memory comes from
    its allocator's own calls. (A stand-in torch.hpu: no Gaudi here.)"""
    from types import SimpleNamespace

    from moe_exp.bench.memory import MemoryMeter
    from moe_exp.bench.timer import StepTimer

    calls = []
    monkeypatch.setattr(torch, "hpu", SimpleNamespace(
        synchronize=lambda: calls.append("sync"),
        reset_peak_memory_stats=lambda: calls.append("reset"),
        empty_cache=lambda: calls.append("empty"), memory_allocated=lambda: 2**28,
        max_memory_allocated=lambda: 2**30, max_memory_reserved=lambda: 3 * 2**29),
        raising=False)
    hpu = torch.device("hpu")
    timer = StepTimer(hpu)
    timer.start()
    timer.lap("data")
    timer.end()
    assert calls == ["sync", "sync"]
    meter = MemoryMeter(hpu)
    meter.baseline()  # (what an earlier run in the process left is not this run's)
    meter.reset()
    assert calls[2:] == ["sync", "empty", "sync", "reset"]
    no_stats = "torch.hpu has no memory_stats"  # (allocator health: where it has them)
    assert meter.read() == ({"peak_mem_gib": 0.75, "peak_reserved_gib": 1.5,
                             "alloc_retries": None, "alloc_ooms": None},
                            {"alloc_retries": no_stats, "alloc_ooms": no_stats})


def test_other_load_counts_other_processes_not_our_own_tree():
    """cpu_other_load: a busy child (a data-loader worker), live or finished and waited
    for, is ours; the same busy loop in a process outside our tree is another's load, and
    the summary warns of it."""
    import os
    import subprocess
    import sys
    import time

    from moe_exp.bench.load import _tree_ticks, other_load, snapshot
    from moe_exp.tasks.summary import summary_rows

    spin = "import time\nt = time.time()\nwhile time.time() - t < {}: pass"
    t0 = _tree_ticks(os.getpid())
    # (a busy loop of 0.6 s of its own CPU, however busy the machine: 1 s of wall time
    # got 45 ticks once, where the other worker's ranks filled both cores)
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: "
                    "pass"], check=True)  # finished, waited
    assert _tree_ticks(os.getpid()) - t0 >= 50  # (10 ms ticks), as our cutime

    def share_while(start):
        proc = start()
        time.sleep(0.3)
        a = snapshot()
        time.sleep(1.0)
        share = other_load(a, snapshot())
        proc.wait()
        return share

    cpus = len(os.sched_getaffinity(0))
    for _ in range(3):  # (another test's ranks can fill every core: then try again)
        child = share_while(lambda: subprocess.Popen([sys.executable, "-c", spin.format(1.6)]))
        # `sh` starts the loop in the background and exits: the loop is no longer in our tree
        stranger = share_while(lambda: subprocess.Popen(
            ["sh", "-c", f"{sys.executable} -c '{spin.format(1.6)}' >/dev/null 2>&1 &"]))
        time.sleep(0.4)  # (until that loop has ended)
        if stranger >= 0.6 / cpus and child <= stranger - 0.4 / cpus:
            break
    assert stranger >= 0.6 / cpus and child <= stranger - 0.4 / cpus, (child, stranger, cpus)
    assert other_load(None, snapshot()) is None
    rows = dict(_summary_stub(summary_rows, {"cpu_other_load": 0.4, "null_reasons": {}}))
    assert "40% of this machine's CPU" in rows["WARNING"]


def _summary_stub(summary_rows, extra):
    """summary_rows on a minimal ok record plus `extra`."""
    from moe_exp.results import FIELDS

    r = dict.fromkeys(FIELDS)
    r.update(model="m", precision="fp32", activation_checkpointing="none", compile="off",
             parallel="none", device_name="cpu", params_total=1e6, params_active=1e6,
             tokens_per_s=1.0, tokens_per_s_per_device=1.0, step_time_ms=1.0,
             tflops_per_device=0.0, flops_per_token=1.0, loss_first=1.0, loss_last=1.0,
             data_ms=0.1, forward_ms=0.3, backward_ms=0.5, optimizer_ms=0.1)
    r.update(extra)
    return summary_rows(r)


def test_summary_breakdown_shares_add_up():
    """Shares of the phases' summed medians (of the median step they passed 100% under
    contention: forward 73%, backward 48%); one rank is '1 rank'."""
    import re

    from moe_exp.tasks.summary import summary_rows

    rows = dict(_summary_stub(summary_rows, {"null_reasons": {}, "step_time_ms": 0.8,
                                             "parallel": "ddp", "world_size": 1}))
    shares = [int(x) for x in re.findall(r"\((\d+)%\)", rows["breakdown"])]
    assert shares == [10, 30, 50, 10] and rows["parallel"].startswith("ddp on 1 rank;")


def test_summary_gives_the_reason_for_unmeasured_collectives():
    from moe_exp.tasks.summary import summary_rows

    why = "parallel.profile_steps=0 or train.steps <= profile_steps"
    rows = dict(_summary_stub(summary_rows, {"parallel": "ddp", "world_size": 2,
                                             "null_reasons": {"comm_ms": why}}))
    assert rows["parallel"] == f"ddp on 2 ranks; collectives null: {why}"
    rows = dict(_summary_stub(summary_rows, {"parallel": "ddp", "world_size": 2,
                                             "comm_ms": 3.25, "comm_share": 0.1}))
    assert rows["parallel"] == "ddp on 2 ranks; collectives 3.2 ms/step (10%)"


def test_per_step_expert_imbalance_is_recorded_and_noted_for_compiled_padded(tmp_path):
    """expert_load_step_max_over_mean: per micro-step, the busiest expert / the mean; with
    one layer, a sum of maxima is at least the maximum of the sums (the summed figure)."""
    from moe_exp.tasks.summary import summary_rows

    rec = run_inproc(["model.num_layers=1", "logger=none", "train.steps=5",
                      "train.grad_accum_steps=2"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    step = rec["expert_load_step_max_over_mean"]
    assert rec["expert_load_max_over_mean"] - 1e-9 <= step <= 8  # tiny_moe: 8 experts
    assert f"(per step {step:.2f})" in dict(summary_rows(rec))["expert load"]
    dense = run_inproc(["model=tiny_dense", "logger=none", "train.steps=2"], tmp_path / "d")
    assert dense["expert_load_step_max_over_mean"] is None
    assert "dense" in dense["null_reasons"]["expert_load_step_max_over_mean"]
    load = {"expert_load_cv": 0.5, "expert_load_max_over_mean": 1.2, "aux_loss": 1.1,
            "moe_dispatch": "padded", "null_reasons": {}}
    for compile_, per_step, note in [("default", 1.9, "did 1.90x the routed rows' work"),
                                     ("default", 1.4, None), ("off", 1.9, None)]:
        rows = dict(_summary_stub(summary_rows, {**load, "compile": compile_,
                                                 "expert_load_step_max_over_mean": per_step}))
        assert (note in rows["NOTE"]) if note else "NOTE" not in rows, rows


def test_cudagraph_skips_counted_where_cuda_graphs_were_asked_for():
    """reduce-overhead / max-autotune on CUDA: graphs inductor ran without CUDA graphs are
    counted (the loop dispatch's data-dependent shapes skip them) and the summary says so;
    elsewhere the field is null with the reason."""
    from moe_exp.tasks.bench_record import record_cudagraph_skips
    from moe_exp.tasks.summary import summary_rows

    cases = {("reduce-overhead", "cuda"): 3, ("max-autotune", "cuda"): 0,
             ("reduce-overhead", "cpu"): None, ("default", "cuda"): None}
    for (mode, dev), want in cases.items():
        cfg = compose([f"train.compile={mode}"])
        rec = {"null_reasons": {}}
        record_cudagraph_skips(rec, cfg, torch.device(dev), 3 if want is None else want)
        assert rec["cudagraph_skips"] == want, (mode, dev)
        assert ("cudagraph_skips" in rec["null_reasons"]) == (want is None), (mode, dev)
    rows = _summary_stub(summary_rows, {"compile": "reduce-overhead", "compile_s": 20.0,
                                        "cudagraph_skips": 3, "null_reasons": {}})
    assert any(k == "NOTE" and "3 compiled graph(s) ran without the CUDA graphs" in v
               for k, v in rows)


@pytest.mark.parametrize("how", ["closed", "read-only"])
def test_run_with_unwritable_stderr(tmp_path, how):
    """`2>&-` (or a read-only fd 2, as a pyenv shim leaves it): the progress bar does not
    fail the run; stderr goes to /dev/null and the summary still reaches stdout."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    def fd2():
        if how == "closed":
            os.close(2)
        else:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 2)

    p = subprocess.run([sys.executable, "-m", "moe_exp.run", "logger=none", "train.steps=2",
                        "train.warmup_steps=1", "train.plan=false", "train.micro_batch_size=2",
                        "train.seq_len=32", f"hydra.run.dir={tmp_path}"], cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                       text=True, timeout=300, preexec_fn=fd2)
    assert p.returncode == 0, p.stdout[-2000:]
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == "ok"
    assert "tokens/s" in p.stdout


JOB_LOGGING = ["file", "disabled", "stdout", "default"]


def _job_logging_args(choice):
    return ["logger=none", "train.steps=2", "train.warmup_steps=1", "train.micro_batch_size=2",
            "train.seq_len=32", "train.plan=false", f"hydra/job_logging={choice}",
            "hydra.run.dir={cwd}"]


@pytest.fixture(scope="module")
def job_logging_runs(tmp_path_factory):
    """A short run under each JOB_LOGGING option, two at a time (each mostly starts), on a
    thread each."""
    return cli_runs(tmp_path_factory, [(_job_logging_args(c), ONE_THREAD) for c in JOB_LOGGING])


@pytest.mark.parametrize("choice", JOB_LOGGING)
def test_any_hydra_job_logging_option_runs(choice, job_logging_runs):
    """Ours (`file`: run.log only) is an option of Hydra's job_logging group, so a user's
    choice replaces it whole (Hydra's own options crashed on our root handler `file`)."""
    p, tmp_path = job_logging_runs[cli_key(_job_logging_args(choice), ONE_THREAD)]
    assert p.returncode == 0, p.stderr[-2000:]
    rec = json.loads((tmp_path / "metrics.json").read_text())
    assert rec["status"] == "ok"
    assert "tokens/s" in p.stdout
    log = tmp_path / "run.log"  # (the losses differ between torch versions: read the record's)
    has_log = log.is_file() and f"loss: {rec['loss_first']:.4f} → " in log.read_text()
    assert has_log == (choice in ("file", "default"))
    assert ("][INFO] - loss:" in p.stdout) == (choice == "default")  # console only there
