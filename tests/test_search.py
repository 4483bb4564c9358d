"""+sweep=search: Hydra's Optuna sweeper runs moe_exp's trials; every trial is a row, a
trial that is not ok is a failed Optuna trial (never a crash), and the study resumes."""
import json

import pandas as pd
import pytest

from conftest import run_cli

SEARCH = ["-m", "hydra/sweeper=optuna", "+sweep=search", "model=tiny_moe", "train.steps=2",
          "train.warmup_steps=1", "train.micro_batch_size=2", "logger=none", "train.plan=false",
          "train.compile=off",  # (fixed: out of the space)
          "train.seq_len=choice(32,4096)"]  # 4096: longer than tiny_moe's max: invalid


def _study(d):
    import optuna

    return optuna.load_study(study_name="moe_exp", storage=f"sqlite:///{d}/optuna.db")


@pytest.mark.slow
def test_search_trials_are_rows_failures_are_failed_trials_and_it_resumes(tmp_path):
    optuna = pytest.importorskip("optuna")
    d = tmp_path / "s"
    r = run_cli([*SEARCH, f"hydra.sweep.dir={d}", "hydra.sweeper.n_trials=5"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "holds no job records" not in r.stderr  # (the preset's resume: no warning)
    # what a person reads: a line per trial, no colour codes off a terminal, none of
    # Optuna's study lines; the dir holds the multirun.yaml report and the notebook read
    out = r.stdout + r.stderr
    assert "\x1b[" not in out and "study" not in out.replace("Study name", "")
    assert [ln.split(" ")[2] for ln in r.stdout.splitlines()
            if ln.startswith("[search] trial")] == [f"{i}/5" for i in range(1, 6)]
    assert "hydra_plugins.moe_exp_search" in (d / "multirun.yaml").read_text()
    trials = _study(d).trials
    assert len(trials) == 5
    # what this CPU cannot run left the space before the study: no skipped trial
    assert "[search] precision: tf32, fp8 left out of the space" in r.stdout
    assert not {t.params["precision"] for t in trials} & {"tf32", "fp8"}
    # the baseline first: the first value of each choice
    assert trials[0].params == {"precision": "fp32", "train.activation_checkpointing": "none",
                                "train.seq_len": 32}
    recs = {}
    for p in d.glob("*/metrics.json"):
        rec = json.loads(p.read_text())
        recs[tuple(sorted(o for o in rec["overrides"] if o.startswith(
            ("precision=", "train.activation_checkpointing=", "train.seq_len="))))] = rec
    states = {"ok": 0, "failed": 0}
    for t in trials:
        key = tuple(sorted(f"{k}={v}" for k, v in t.params.items()))
        rec = recs[key]
        if rec["status"] == "ok":
            assert t.state == optuna.trial.TrialState.COMPLETE
            assert t.values == [rec["tokens_per_s"], rec["peak_mem_gib"]]
            states["ok"] += 1
        else:  # invalid (seq_len 4096): failed, no values
            assert t.state == optuna.trial.TrialState.FAIL and t.values is None
            states["failed"] += 1
    assert states["ok"] >= 1 and states["failed"] >= 1, states
    df = pd.read_csv(d / "results.csv")
    assert len(df) == len(recs) and set(df["status"]) >= {"ok"}
    assert (d / "report.md").read_text().splitlines()[2] == "## The answer"
    # the same command again: the study goes on (its sampler sees the earlier trials) and
    # the table keeps every earlier row
    again = run_cli([*SEARCH, f"hydra.sweep.dir={d}", "hydra.sweeper.n_trials=1"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_study(d).trials) == 6
    assert len(pd.read_csv(d / "results.csv")) >= len(df)


def test_search_without_the_optuna_sweeper_says_what_to_install():
    from hydra.errors import MissingConfigException

    from moe_exp.hydra_internals import hydra_error_line

    e = MissingConfigException("no optuna", missing_cfg_file="hydra/sweeper/optuna",
                               options=["basic"])
    assert hydra_error_line(e) == ("hydra/sweeper: 'optuna' is not one of: basic (the Optuna "
                                   'sweeper of +sweep=search: pip install -e ".[search]")')


def test_trial_values_fail_what_does_not_fit_or_hurts_the_loss(tmp_path):
    from test_answer import rec

    from moe_exp.sweep.search import TrialFailed, trial_values

    base = rec(0, 100.0, 2.0, (3.00, 2.99, 3.01))
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "metrics.json").write_text(json.dumps(base))
    assert trial_values(rec(1, 150.0, 1.5, (3.005, 2.995, 3.015), precision="bf16"),
                        tmp_path) == [150.0, 1.5]
    with pytest.raises(TrialFailed, match="loss not ok"):
        trial_values(rec(2, 200.0, 1.4, (3.2, 3.19, 3.21), precision="fp16"), tmp_path)
    with pytest.raises(TrialFailed, match="^oom: "):
        trial_values(rec(3, None, None, status="oom", error="CUDA out of memory"), tmp_path)
    assert trial_values(rec(4, 120.0, 1.0, precision="fp16"), tmp_path) == [120.0, 1.0]


def test_search_trials_benchmark_finds_a_planted_best_row(tmp_path):
    """benchmarks/search_trials.py replays the preset's search on a planted grid (30 rows of
    +sweep=optimizations' space, one clearly fastest) and counts the trials to reach it."""
    pytest.importorskip("optuna")
    import itertools

    from test_answer import rec
    from test_benchmarks import bench

    space = itertools.product(("fp32", "tf32", "fp16", "bf16", "fp8"),
                              ("none", "full", "selective"), ("off", "default"))
    for job, (p, ac, c) in enumerate(space):
        ok = p in ("fp32", "bf16", "fp16")
        tps = 100.0 + job + (500 if (p, ac, c) == ("bf16", "none", "default") else 0)
        r = rec(job, tps if ok else None, 1.0 + (ac == "none") if ok else None,
                status="ok" if ok else "skipped", precision=p,
                **{"train.activation_checkpointing": ac, "train.compile": c})
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / "metrics.json").write_text(json.dumps(r))
    out = tmp_path / "search.json"
    text = bench("search_trials.py", str(tmp_path), "--seeds", "3", "--samplers",
                 "preset,random", "--json", str(out))
    res = json.loads(out.read_text())
    assert res["size"] == 30 and res["space"] == 18 and res["ok"] == 18  # (tf32, fp8 out)
    assert res["target"] == {"precision": "bf16", "train.activation_checkpointing": "none",
                             "train.compile": "default"}
    for name in ("preset", "random"):
        r = res["samplers"][name]
        found = [(t, c) for t, c in zip(r["trials"], r["configs"]) if t is not None]
        assert len(r["trials"]) == 3 and len(found) == r["found"] >= 1
        assert all(2 <= c <= t <= 90 for t, c in found)  # (the baseline is trial 1)
    assert "fastest: precision=bf16" in text


def test_a_bad_value_in_the_search_space_fails_before_any_trial(tmp_path):
    pytest.importorskip("optuna")
    d = tmp_path / "s"
    r = run_cli(["-m", "hydra/sweeper=optuna", "+sweep=search", "logger=none",
                 "train.activation_checkpointing=choice(none,fulll)", f"hydra.sweep.dir={d}"],
                tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: train.activation_checkpointing: 'fulll' is not one of: none, full, selective"]
    assert not (d / "optuna.db").exists() and not list(d.glob("*/metrics.json"))


def test_the_plugins_own_optuna_sweeper_without_the_preset_fails_before_any_trial(tmp_path):
    """Its default direction (one, minimize) cannot take a trial's (tokens/s, peak GiB)."""
    pytest.importorskip("optuna")
    from omegaconf import OmegaConf

    from moe_exp.sweep.search import direction_error

    assert direction_error(OmegaConf.create({"direction": ["maximize", "minimize"]})) is None
    d = tmp_path / "s"
    r = run_cli(["-m", "hydra/sweeper=optuna", "logger=none", "train.compile=choice(off,default)",
                 f"hydra.sweep.dir={d}"], tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: hydra.sweeper.direction: a search's trials return (tokens/s, peak GiB), so "
        "[maximize, minimize], got ['minimize']: add +sweep=search"]
    assert not list(d.glob("*/metrics.json"))
