"""The robustness audit's cases (issue 52), re-made: each bad file, size or key is one line
naming the key or file, a non-zero exit, no traceback, in under 10 s, before any work; the
accepted-and-wrong ones are refused. The CLI runs in this process (conftest.cli_inproc)."""
import json
import time

import pytest

from conftest import cli_inproc

TINY = ["logger=none", "model=tiny_moe", "train.steps=1", "train.warmup_steps=0",
        "train.plan=false"]
COMM = {"task": "comm", "status": "ok", "world_size": 2,
        "comm": [{"op": "all_reduce", "bytes": 1024, "latency_us": 10.0}]}


def _comm(**change) -> dict:
    rec = json.loads(json.dumps(COMM))
    for k, v in change.items():
        if k == "row":
            rec["comm"][0].update(v)
        else:
            rec[k] = v
    return rec


# (a comm record's JSON, what the line says after "hardware.comm_from: ")
COMM_FILES = [
    ([1, 2], "is not a finished task=comm record"),
    (None, "is not a finished task=comm record"),
    ("comm", "is not a finished task=comm record"),
    (_comm(world_size=None), "world_size is None, not a count of ranks"),
    (_comm(world_size=0), "world_size is 0"),
    (_comm(world_size=-8), "world_size is -8"),
    (_comm(row={"op": None}), "comm row 0 names no collective (op)"),
    (_comm(comm=["x"]), "comm row 0 names no collective (op)"),
    (_comm(row={"latency_us": "10"}), "has latency_us '10', not a positive time"),
    (_comm(row={"latency_us": -1.0}), "has latency_us -1.0"),
    (_comm(row={"latency_us": 0}), "has latency_us 0"),
    (_comm(row={"bytes": 0}), "has bytes 0, not a positive whole number"),
    (_comm(row={"bytes": -5}), "has bytes -5"),
]

PLAN = ["task=plan", "hardware=h100", "logger=none", "model=tiny_moe"]
INFER = ["task=infer", "logger=none", "model=tiny_moe"]
CASES = [  # (arguments, what the one line starts with after "error: ")
    ([*PLAN, "hardware.devices=100000", "parallel=fsdp"], "hardware.devices: must be in "
                                                          "1..16,384 ranks, got 100,000"),
    ([*INFER, "infer.requests=1000000000000", "infer.batching=static"],
     "infer.requests: must be in 1..1,000,000"),
    ([*INFER, "infer.max_batch_size=1000000000000", "infer.batching=static"],
     "infer.max_batch_size: must be in 1..65,536"),
    ([*INFER, "infer.batch_size=1000000000000"], "infer.batch_size: must be in 1..65,536"),
    ([*INFER, "infer.prompt_len=10000000"], "infer.prompt_len: must be in 1..1,048,576"),
    ([*INFER, "infer.arrival_rate=1e-320", "infer.batching=static"],
     "infer.arrival_rate: must be in [1e-06, 1,000,000,000] requests/s"),
    ([*INFER, "infer.experts_resident=2", "infer.prefetch=5"],
     "infer.prefetch: must be at most infer.experts_resident=2"),
    ([*INFER, "train.resume_from=/tmp"], "train.resume_from: read by task=bench"),
    ([*INFER, "train.profile=true"], "train.profile: read by task=bench"),
    ([*INFER, "train.checkpoint_every=2"], "train.checkpoint_every: read by task=bench"),
    ([*PLAN, "train.resume_from=/tmp"], "train.resume_from: read by task=bench"),
    ([*PLAN, "train.profile=true"], "train.profile: read by task=bench"),
    ([*PLAN, "hardware.spec_memory_gib=-5", "hardware.memory_gib=null"],
     "hardware.spec_memory_gib: must be in (0, 1,048,576] GiB"),
    ([*PLAN, "hardware.spec_memory_gib=1e300"], "hardware.spec_memory_gib: must be in (0, "),
    ([*PLAN, "hardware.link_bandwidth=0.5"], "hardware.link_bandwidth: must be in [1, 1e+16] bytes/s"),
    ([*PLAN, "hardware.network_bandwidth=1e300"], "hardware.network_bandwidth: must be in "),
    ([*PLAN, "hardware.memory_bandwidth=0"], "hardware.memory_bandwidth: must be in "),
    ([*PLAN, "hardware.peak_flops.bf16=0.5"],
     "hardware.peak_flops.bf16: must be in [1, 1e+20]"),
    ([*TINY, "infer.batch_size=4"], "infer.batch_size: read by task=infer only; this run has "
                                    "task=bench (use task=infer infer.batch_size=4)"),
    ([*TINY, "tune.multiple=2"], "tune.multiple: read by task=tune_batch only"),
    ([*TINY, "comm.iters=3"], "comm.iters: read by task=comm only"),
    ([*TINY, "train.checkpoint_every=1", "train.checkpoint_dir="],
     "train.checkpoint_dir: empty: checkpoints would go into the current dir"),
    ([*TINY, "train.checkpoint_every=1", "train.checkpoint_dir=/proc/no/such"],
     "train.checkpoint_dir: cannot write in /proc"),
    ([*TINY, "model.topk_groups=2"], "model.topk_groups: read with model.n_groups > 1 only"),
    ([*TINY, "train.profile=2"], "train.profile: must be true or false, got 2"),
    ([*TINY, "hardware.deterministic=yes"], "hardware.deterministic: must be true or false"),
    (["-m", *TINY, "hydra/sweeper=optuna", "+sweep=search", "optim.lr=interval(1,0.1)",
      "hydra.sweep.dir={cwd}/s"], "optim.lr: interval(1, 0.1): its low bound must be below"),
    (["-m", *TINY, "hydra/sweeper=optuna", "+sweep=search", "optim.lr=interval(-1,1)",
      "hydra.sweep.dir={cwd}/s"], "optim.lr: must be > 0, got -1 (the search's optim.lr=-1"),
    (["-m", *TINY, "hydra/sweeper=optuna", "+sweep=search", "hydra.sweeper.n_trials=0",
      "hydra.sweep.dir={cwd}/s"], "hydra.sweeper.n_trials: must be a whole number >= 1, got 0"),
    (["-m", *TINY, "hydra/sweeper=optuna", "+sweep=search",
      "train.micro_batch_size=interval(1.5,4)", "hydra.sweep.dir={cwd}/s"],
     "train.micro_batch_size: "),
]


def _one_line(p, says: str, started: float) -> None:
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode not in (0, None), p.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: {says}"), p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("args, says", CASES, ids=[" ".join(a[-2:]) for a, _ in CASES])
def test_a_bad_size_or_key_is_one_line_before_any_work(args, says, tmp_path):
    t0 = time.monotonic()
    p = cli_inproc([a.replace("{cwd}", str(tmp_path)) for a in args], tmp_path)
    _one_line(p, says, t0)
    for f in tmp_path.rglob("metrics.json"):  # (a refused run's record: no work done)
        assert json.loads(f.read_text())["status"] == "invalid"
    assert not list(tmp_path.rglob(".*.lock")), "a refused search left its lock"


@pytest.mark.parametrize("rec, says", COMM_FILES, ids=[s[:30] for _, s in COMM_FILES])
def test_a_comm_record_that_is_not_one_is_one_line(rec, says, tmp_path):
    f = tmp_path / "comm.json"
    f.write_text(json.dumps(rec))
    for task in (PLAN, [*TINY, "hardware.comm_from=" + str(f)]):  # (a bench run plans too)
        t0 = time.monotonic()
        args = [*task, f"hardware.comm_from={f}"] if task is PLAN else task
        if task is not PLAN:
            args = [a for a in args if a != "train.plan=false"]
        p = cli_inproc(args, tmp_path)
        _one_line(p, "hardware.comm_from: ", t0)
        assert says in p.stderr and str(f) in p.stderr, p.stderr


def test_a_run_that_fails_in_any_way_records_why(tmp_path, monkeypatch):
    """Each way a task's run can fail, BaseExceptions torch.distributed.checkpoint raises
    included, ends in a record whose status is a failure and whose error is a line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from conftest import run_inproc
    from moe_exp.results import STATUSES
    from moe_exp.tasks.bench import BenchTask
    from moe_exp.tasks.plan import PlanTask

    faults = {
        "an empty RuntimeError": (RuntimeError(), "RuntimeError"),
        "a CheckpointException": (CheckpointException("save", {0: (OSError(28, "No space left "
                                                                   "on device"), None)}),
                                  "rank 0: OSError: [Errno 28] No space left on device"),
        "a bare BaseException": (BaseException("odd"), "odd"),
        "a MemoryError": (MemoryError(), "MemoryError"),
    }
    for task, args in ((BenchTask, TINY), (PlanTask, PLAN)):
        for name, (e, says) in faults.items():
            def fail(self, rec, e=e):
                raise e
            monkeypatch.setattr(task, "run", fail)
            out = tmp_path / f"{task.name}-{name.replace(' ', '_')}"
            rec = run_inproc(args, out)
            assert rec["status"] in STATUSES and rec["status"] != "ok", (task.name, name)
            assert isinstance(rec["error"], str) and says in rec["error"], (name, rec["error"])
            assert "\n" not in rec["error"]
            written = json.loads((out / "metrics.json").read_text())
            assert written["error"] == rec["error"]
