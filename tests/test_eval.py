"""The held-out loss: the same batches for every configuration, never trained on; its
curve, its gap to the floor, and the steps and seconds to a target."""
import numpy as np
import torch

from moe_exp.data import build_loader, heldout

from conftest import cli_inproc, compose, run_cli, run_inproc

TINY = ["logger=none", "train.plan=false",
        "train.steps=4", "train.warmup_steps=1", "train.micro_batch_size=2",
        "model.max_seq_len=32"]


def test_heldout_set_is_the_same_for_every_configuration_and_never_trained_on():
    base = compose(["train.eval_sequences=70"])
    tokens, targets = heldout(base)
    assert tokens.shape == (70, base.train.seq_len) and torch.equal(tokens[:, 1:], targets[:, :-1])
    for other in (["precision=bf16", "train.micro_batch_size=3", "train.eval_sequences=70"],
                  ["parallel=ddp", "hardware.devices=2", "train.eval_sequences=70"]):
        assert torch.equal(heldout(compose(other))[0], tokens)
    assert torch.equal(heldout(compose(["train.eval_sequences=5"]))[0], tokens[:5])
    train = torch.cat([x for x, _ in build_loader(base, torch.device("cpu"), 512)])
    assert not (train[:, None, :] == tokens[None]).all(-1).any()  # no held-out row trained on
    assert heldout(compose(["train.eval_sequences=0"])) is None
    assert heldout(compose(["data=tokens", "data.path=x.bin"])) is None


def test_eval_loss_curve_target_and_no_effect_on_training(tmp_path):
    on = run_inproc([*TINY, "train.eval_every=2", "train.target_loss=5.45"], tmp_path / "on")
    off = run_inproc([*TINY, "train.eval_every=0"], tmp_path / "off")
    assert on["status"] == off["status"] == "ok"
    assert on["losses"] == off["losses"]  # evaluating trains nothing, draws no random number
    assert [s for s, _ in on["eval_losses"]] == [2, 4, 5]
    assert on["eval_loss"] == on["eval_losses"][-1][1] == off["eval_loss"]
    assert [s for s, _ in off["eval_losses"]] == [5]
    assert on["eval_gap"] == on["eval_loss"] - on["loss_floor"] > 0
    first = next(s for s, v in on["eval_losses"] if v <= 5.45)
    assert on["steps_to_target"] == first
    assert on["seconds_to_target"] == first * on["step_time_ms"] / 1e3
    assert off["steps_to_target"] is None
    assert off["null_reasons"]["steps_to_target"] == "train.target_loss not set"
    far = run_inproc([*TINY, "train.eval_every=2", "train.target_loss=0.01"], tmp_path / "far")
    assert far["seconds_to_target"] is None
    assert "not reached" in far["null_reasons"]["seconds_to_target"]


def test_target_loss_needs_eval_steps_and_a_heldout_set(tmp_path):
    for bad in (["train.target_loss=3"], ["train.target_loss=3", "train.eval_every=2",
                                          "train.eval_sequences=0"]):
        r = cli_inproc(["logger=none", *bad], tmp_path)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("error: train.target_loss: is checked on the eval steps")
    r = cli_inproc(["logger=none", "train.eval_every=-1"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: train.eval_every: must be in 0..")


def test_a_token_file_holds_out_its_last_sequences_with_data_heldout(tmp_path):
    import random

    from moe_exp.data import prepare

    random.seed(0)
    text = tmp_path / "a.txt"
    text.write_text("".join(random.choice("abcdefgh \n") for _ in range(4000)))
    path = tmp_path / "c.bin"
    n = prepare([text], path)["num_tokens"]
    tok = ["data=tokens", f"data.path={path}", "data.heldout=true", "train.eval_sequences=4"]
    cfg = compose([*TINY, *tok])
    tokens, targets = heldout(cfg)
    w = cfg.train.seq_len + 1
    raw = torch.from_numpy(np.fromfile(path, dtype="uint8").astype("int64"))
    assert torch.equal(tokens, raw[n - 4 * w:].view(4, w)[:, :-1])
    starts = build_loader(cfg, torch.device("cpu"), 64).dataset.starts
    assert max(starts) + w <= n - 4 * w  # no training window reaches the held-out tail
    rec = run_inproc([*TINY, *tok], tmp_path / "run")
    assert rec["status"] == "ok" and rec["eval_loss"] > 0 and rec["eval_gap"] is None
    off = run_inproc([*TINY, *tok[:2]], tmp_path / "off")
    assert off["eval_loss"] is None and "data.heldout=true" in off["null_reasons"]["eval_loss"]
    r = cli_inproc(["logger=none", *tok[:3], "train.eval_sequences=200"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: data.heldout: ")


def test_loss_ok_flags_a_harmful_row_and_passes_a_harmless_one(tmp_path):
    """Repeats from different initializations (sweep.vary_init) measure the eval loss's
    noise: an lr too small to learn (it does not diverge) is not ok, checkpointing (the same
    math) is."""
    import pandas as pd

    from moe_exp.sweep.table import loss_ok

    p = run_cli(["-m", "logger=none", "train.steps=8", "train.warmup_steps=1", "train.plan=false",
                 "sweep.repeats=2", "sweep.vary_init=true", "sweep.isolate=false",
                 "optim.lr=1e-3,1e-7", "train.activation_checkpointing=none,full",
                 f"hydra.sweep.dir={tmp_path}"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    df = pd.read_csv(tmp_path / "results.csv").set_index("label")
    ok = df["loss_ok"].to_dict()
    assert ok["optim.lr=0.001 train.activation_checkpointing=full"] is True
    assert ok["optim.lr=1e-07 train.activation_checkpointing=none"] is False
    assert ok["optim.lr=1e-07 train.activation_checkpointing=full"] is False
    seeds = [pd.read_json(tmp_path / "0" / f"rep{i}" / "metrics.json", typ="series")["init_seed"]
             for i in (0, 1)]
    assert seeds == [0, 1] and "loss ok" in (tmp_path / "results.md").read_text()
    same = {"eval_loss": 5.0, "eval_loss_min": 5.0, "eval_loss_max": 5.0}
    assert loss_ok(same, same) is None  # no noise measured: no verdict
