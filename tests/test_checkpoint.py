"""Checkpoints (train.checkpoint_every, resume_from): a resumed run's losses are the
uninterrupted run's, bit for bit (CPU, eager), after a sync or an async save, a SIGTERM, and
under expert parallelism on 2 gloo ranks."""
import json
import os
import signal
import time

import pytest
from conftest import cli_inproc, compose, run_cli, run_inproc

from moe_exp.run import prepare

TINY = ["logger=none", "train.plan=false",
        "train.steps=8", "train.warmup_steps=1", "train.micro_batch_size=2",
        "model.max_seq_len=32"]
SAME = ("losses", "grad_norms", "lrs", "eval_loss")  # (eval at the end: the same weights)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run, saving after steps 3, 6 and 9 and keeping them all."""
    out = tmp_path_factory.mktemp("whole")
    rec = run_inproc([*TINY, "train.checkpoint_every=3", "train.checkpoint_keep=0"], out)
    assert rec["status"] == "ok", rec["error"]
    return rec, out


def test_a_resumed_run_continues_bit_for_bit(whole, tmp_path):
    rec, out = whole
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000003", "step_000006", "step_000009"]
    assert rec["checkpoint_saves"] == 3 and rec["checkpoint_path"].endswith("step_000009")
    assert rec["checkpoint_gib"] > 0 and rec["checkpoint_save_s"] > 0
    assert rec["checkpoint_save_total_s"] == rec["checkpoint_save_s"]  # (saves that block)
    assert 0 < rec["checkpoint_share"] < 1 and rec["checkpoint_load_s"] is None
    res = run_inproc([*TINY, f"train.resume_from={out}/checkpoints/step_000003"], tmp_path)
    assert res["status"] == "ok", res["error"]
    for k in SAME:  # (the record's history holds the steps before the checkpoint)
        assert res[k] == rec[k], k
    assert res["resumed_from_step"] == 3 and res["checkpoint_load_s"] > 0
    assert res["measured_steps"] == 9 - 3  # (no warmup again: the window starts at step 3)
    assert res["checkpoint_saves"] is None and res["null_reasons"]["checkpoint_saves"] == \
        "train.checkpoint_every=0"


def test_an_async_checkpoint_resumes_as_exactly_and_old_ones_go(whole, tmp_path,
                                                                monkeypatch):
    from moe_exp.train.checkpoint import Checkpointer

    complete = Checkpointer._complete

    def slow(self, *a):  # (a callback that lags its future's result: the run waits for it)
        time.sleep(0.2)
        complete(self, *a)

    monkeypatch.setattr(Checkpointer, "_complete", slow)
    rec = run_inproc([*TINY, "train.checkpoint_every=3", "train.checkpoint_async=true",
                      "train.checkpoint_keep=2"], tmp_path / "a")
    assert rec["status"] == "ok", rec["error"]
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "step_000006", "step_000009"]
    assert rec["checkpoint_save_total_s"] > 0 and rec["checkpoint_saves"] == 3
    # a dir of checkpoints resumes from its latest complete one
    (tmp_path / "a" / "checkpoints" / "step_000009" / "loop.pt").unlink()  # (incomplete)
    res = run_inproc([*TINY, f"train.resume_from={tmp_path / 'a'}"], tmp_path / "b")
    assert res["status"] == "ok" and res["resumed_from_step"] == 6, res["error"]
    for k in SAME:
        assert res[k] == whole[0][k], k


def test_sigterm_saves_a_checkpoint_that_resumes(whole, tmp_path, monkeypatch):
    from moe_exp.train import loop

    class Preempted(loop.BiasBalancer):  # SIGTERM during the 4th step
        calls = 0

        def step(self):
            super().step()
            Preempted.calls += 1
            if Preempted.calls == 4:
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "BiasBalancer", Preempted)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        run_inproc([*TINY, "train.checkpoint_every=100"], tmp_path / "cut")
    assert signal.getsignal(signal.SIGTERM) is before  # (the run's handler is gone)
    cut = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert cut["status"] == "crashed" and "(SIGTERM) at step 4 of 9" in cut["error"]
    assert cut["checkpoint_path"].endswith("step_000004")
    assert cut["error"].endswith(f"train.resume_from={cut['checkpoint_path']}")
    monkeypatch.setattr(loop, "BiasBalancer", Preempted.__mro__[1])
    res = run_inproc([*TINY, f"train.resume_from={tmp_path / 'cut'}"], tmp_path / "resumed")
    assert res["status"] == "ok" and res["resumed_from_step"] == 4, res["error"]
    for k in SAME:
        assert res[k] == whole[0][k], k


@pytest.mark.distributed
def test_expert_parallel_resumes_bit_for_bit(tmp_path):
    """Each rank's experts are its own: saved under keys of their own, loaded back."""
    from torch.distributed.checkpoint import FileSystemReader

    o = ["parallel=expert", "hardware.devices=2", "logger=none", "train.steps=6",
         "train.plan=false",
         "train.warmup_steps=1", "train.micro_batch_size=2", "train.seq_len=32",
         "parallel.profile_steps=0"]
    p = run_cli([*o, "train.checkpoint_every=3", "train.checkpoint_keep=0", f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    keys = FileSystemReader(tmp_path / "a" / "checkpoints" / "step_000006").read_metadata() \
        .state_dict_metadata
    assert any(".experts.local_ep0." in k for k in keys) and \
        any(".experts.local_ep1." in k for k in keys)
    p = run_cli([*o, f"train.resume_from={tmp_path / 'a' / 'checkpoints'}/step_000003",
                 f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (json.loads((tmp_path / x / "metrics.json").read_text()) for x in "ab")
    assert b["resumed_from_step"] == 3
    for k in SAME:
        assert a[k] == b[k], k


@pytest.mark.distributed
def test_a_pipeline_resumes_bit_for_bit(tmp_path):
    """parallel.pp=2: each rank saves its stage under the whole model's keys, and the
    optimizer's groups per parameter (one key per group would keep one rank's list: the
    resumed run failed); the routers' biases move as before."""
    o = ["parallel=fsdp", "parallel.pp=2", "hardware.devices=2", "logger=none",
         "train.plan=false",
         "train.steps=4", "train.warmup_steps=1", "train.micro_batch_size=2",
         "train.seq_len=32", "parallel.profile_steps=0", "model.bias_update_rate=0.01"]
    p = run_cli([*o, "train.checkpoint_every=2", "train.checkpoint_keep=0",
                 f"hydra.run.dir={tmp_path / 'a'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli([*o, f"train.resume_from={tmp_path / 'a' / 'checkpoints'}/step_000002",
                 f"hydra.run.dir={tmp_path / 'b'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (json.loads((tmp_path / x / "metrics.json").read_text()) for x in "ab")
    assert b["resumed_from_step"] == 2
    for k in (*SAME, "router_bias_spread"):
        assert a[k] == b[k], k


def test_checkpoint_mistakes_are_one_line_invalid(whole, tmp_path):
    step3 = whole[1] / "checkpoints" / "step_000003"
    for overrides, says in [
        (["train.checkpoint_every=-1"], "train.checkpoint_every: must be >= 0"),
        (["train.checkpoint_async=true"], "train.checkpoint_async: read by checkpointing "
                                          "(train.checkpoint_every > 0) only"),
        ([f"train.resume_from={tmp_path}"], f"train.resume_from: no complete checkpoint in "
                                            f"{tmp_path}"),
        ([f"train.resume_from={step3}", "train.log_every=1"], None),  # (not the training)
        ([f"train.resume_from={step3}", "optim.lr=0.01"], "train.resume_from: "
                                                          f"{step3} was saved with optim "
                                                          "lr=0.003; this run has lr=0.01"),
        ([f"train.resume_from={step3}", "train.seed=1"], f"train.resume_from: {step3} was "
                                                         "saved with train.seed 0; this run "
                                                         "has 1"),
        ([f"train.resume_from={step3}", "model.top_k=1"], "train.resume_from: "),
        ([f"train.resume_from={step3}", "train.steps=3", "train.profile=true",
          "train.profile_steps=2"], "train.resume_from: "),  # (only profiled steps left)
    ]:
        o = [*TINY, *overrides]
        _, rec = prepare(compose(o), o)
        if says is None:
            assert rec is None or rec["status"] != "invalid", rec["error"]
            continue
        assert rec["status"] == "invalid" and rec["error"].startswith(says), rec["error"]
        assert "\n" not in rec["error"]


def test_the_last_step_is_saved_and_a_finished_run_has_nothing_left(whole, tmp_path):
    """A run of 4 steps saving every 3 saves steps 3 and 4, its last; resuming a finished
    run says there is nothing left to train, measures nothing and exits 0. (A longer run is
    another run: its schedule's length is in the checkpoint's identity.)"""
    o = [*TINY, "train.steps=3", "train.checkpoint_every=3", "train.checkpoint_keep=0"]
    rec = run_inproc(o, tmp_path / "a")
    assert rec["status"] == "ok" and rec["checkpoint_saves"] == 2, rec["error"]
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == [
        "step_000003", "step_000004"]
    last = whole[1] / "checkpoints" / "step_000009"
    r = cli_inproc([*TINY, f"train.resume_from={last}", f"hydra.run.dir={tmp_path / 'b'}"],
                   tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == (
        f"train.resume_from: nothing left to train: {last} is at step 9, this run's last "
        "(train.warmup_steps + train.steps = 9): its record is in its run dir")
    done = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert done["status"] == "skipped" and done["tokens_per_s"] is None


def _corrupt(step: "os.PathLike", how: str) -> None:
    """Damage one file of a checkpoint dir as a cut-short copy, a full disk or a stray
    edit would: loop.pt, DCP's .metadata and shards, a rank's rank<r>.pt."""
    import pickle
    from pathlib import Path

    import torch

    step = Path(step)
    loop = step / "loop.pt"
    good = torch.load(loop, weights_only=True)
    shard = next(step.glob("*.distcp"))
    if how == "loop truncated":
        loop.write_bytes(loop.read_bytes()[:100])
    elif how == "loop empty":
        loop.write_bytes(b"")
    elif how == "loop garbage":
        loop.write_bytes(os.urandom(512))
    elif how == "loop a list":
        torch.save([1, 2], loop)
    elif how == "loop text":
        loop.write_text("step: 3\n")
    elif how in ("loop without step", "loop step a string", "loop without identity",
                 "loop without scheduler"):
        key = how.split()[-1] if "without" in how else "step"
        bad = {k: v for k, v in good.items() if k != key} if "without" in how else \
            {**good, "step": "3"}
        torch.save(bad, loop)
    elif how == "loop an unsafe pickle":
        loop.write_bytes(pickle.dumps({"step": 3, "f": os.system}))
    elif how == "metadata missing":
        (step / ".metadata").unlink()
    elif how == "metadata garbage":
        (step / ".metadata").write_bytes(os.urandom(256))
    elif how == "shard truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "shard empty":
        shard.write_bytes(b"")
    elif how == "shard missing":
        shard.unlink()
    elif how == "rank state missing":
        (step / "rank0.pt").unlink()
    else:
        raise AssertionError(how)


DAMAGE = {  # what the one-line refusal says, after "train.resume_from: "
    "loop truncated": "is not a checkpoint's loop.pt", "loop empty": "is not a checkpoint's",
    "loop garbage": "is not a checkpoint's", "loop a list": "holds a list",
    "loop text": "is not a checkpoint's", "loop without step": "step is None",
    "loop step a string": "step is '3'", "loop without identity": "no identity",
    "loop without scheduler": "no schedule state", "loop an unsafe pickle": "is not a checkp",
    "metadata missing": "its DCP .metadata cannot be read",
    "metadata garbage": "its DCP .metadata cannot be read", "shard truncated": "bytes, ",
    "shard empty": "holds 0 bytes", "shard missing": "__0_0.distcp is missing",
    "rank state missing": "no rank<r>.pt",
}


def test_each_damaged_checkpoint_file_is_refused_in_one_line(whole, tmp_path):
    """Every kind of damage to each file is a one-line refusal naming the file, before any
    work: train.resume_from and infer.checkpoint read it through one checked loader."""
    import shutil

    from moe_exp.train.checkpoint import DONE

    for how, says in DAMAGE.items():
        step = tmp_path / how.replace(" ", "_") / "step_000003"
        shutil.copytree(whole[1] / "checkpoints" / "step_000003", step)
        _corrupt(step, how)
        for key in ("train.resume_from", "infer.checkpoint"):
            o = [*TINY, f"{key}={step}"] + (["task=infer"] if key.startswith("infer") else [])
            if key.startswith("infer"):
                o = [x for x in o if not x.startswith("train.")] + \
                    ["infer.prompt_len=8", "infer.new_tokens=8"]
            _, rec = prepare(compose(o), o)
            assert rec is not None and rec["status"] == "invalid", (how, key)
            assert rec["error"].startswith(f"{key}: ") and says in rec["error"], \
                (how, rec["error"])
            assert "\n" not in rec["error"] and str(step) in rec["error"]
    # a prune cut short: loop.pt goes first, so what is left is no checkpoint at all
    left = tmp_path / "pruned" / "step_000003"
    shutil.copytree(whole[1] / "checkpoints" / "step_000003", left)
    (left / DONE).unlink()
    o = [*TINY, f"train.resume_from={left}"]
    _, rec = prepare(compose(o), o)
    assert rec["status"] == "invalid" and "no complete checkpoint" in rec["error"]


def test_a_rank_state_that_cannot_be_read_is_a_record_with_the_reason(whole, tmp_path):
    """Damage found only at the load (rank0.pt's content) ends the run as a record with its
    status and reason, not a traceback."""
    import shutil

    step = tmp_path / "step_000003"
    shutil.copytree(whole[1] / "checkpoints" / "step_000003", step)
    (step / "rank0.pt").write_bytes(b"not a pickle")
    rec = run_inproc([*TINY, f"train.resume_from={step}"], tmp_path / "run")
    assert rec["status"] == "error" and (
        f"{step / 'rank0.pt'} is not a rank's RNG state (not a torch file of plain tensors and "
        "values: Unsupported operand 110)") in rec["error"], rec["error"]
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["error"] == rec["error"]
