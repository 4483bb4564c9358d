"""Checkpoints (train.checkpoint_every, resume_from): a resumed run's losses are the
uninterrupted run's, bit for bit (CPU, eager), after a sync or an async save, a SIGTERM, and
under expert parallelism on 2 gloo ranks."""
import json
import os
import signal
import time

import pytest
from conftest import compose, run_cli, run_inproc

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
        ([f"train.resume_from={step3}", "train.steps=2"], "train.resume_from: "),
    ]:
        o = [*TINY, *overrides]
        _, rec = prepare(compose(o), o)
        if says is None:
            assert rec is None or rec["status"] != "invalid", rec["error"]
            continue
        assert rec["status"] == "invalid" and rec["error"].startswith(says), rec["error"]
        assert "\n" not in rec["error"]
