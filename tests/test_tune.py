"""task=tune_batch: the micro-batch search, its probes in their own processes."""
import itertools

import pytest

from moe_exp.tasks.tune import search

from conftest import run_inproc

TINY = ["logger=none", "train.steps=1", "train.warmup_steps=0", "model.max_seq_len=64"]


def test_search_finds_every_planted_limit_in_logarithmic_probes():
    for limit, start, top in itertools.product(range(0, 70), (1, 5, 64), (64, 100)):
        probed = []

        def fits(k):
            probed.append(k)
            return k <= limit

        largest, first_no = search(fits, start, top)
        want = min(limit, top) or None
        assert largest == want, (limit, start, top)
        assert first_no == (limit + 1 if limit < top else None)
        assert len(probed) == len(set(probed)) <= 2 * top.bit_length() + 1


@pytest.mark.slow
def test_tune_batch_finds_the_limit_of_a_memory_cap(tmp_path):
    rec = run_inproc([*TINY, "task=tune_batch", "hardware.memory_gib=0.1", "tune.multiple=8",
                      "train.micro_batch_size=16", "tune.goal=largest"], tmp_path)  # (its
    # limit: 32, two runs, the larger probes skipped by their plans; goal=fastest could stop
    # before it where tokens/s flattens)
    assert rec["status"] == "ok", rec["error"]
    probes = {p["micro_batch_size"]: p for p in rec["tune_probes"]}
    largest = rec["tune_max_micro_batch"]
    assert rec["tune_limit"] == "memory" and largest % 8 == 0
    # (past it: oom, or skipped where the probe's plan peaks past the memory)
    assert probes[largest]["status"] == "ok"
    assert probes[largest + 8]["status"] in ("oom", "skipped")
    assert all((p["status"] == "ok") if n <= largest else p["status"] in ("oom", "skipped")
               for n, p in probes.items())
    best = max((p for p in probes.values() if p["status"] == "ok"),
               key=lambda p: p["tokens_per_s"])
    assert rec["tune_best_micro_batch"] == best["micro_batch_size"] == rec["micro_batch_size"]
    assert rec["tokens_per_s"] == best["tokens_per_s"] and rec["task"] == "tune_batch"
    assert rec["cpu_other_load"] == max(p["cpu_other_load"] for p in probes.values()
                                        if p["status"] == "ok")  # (the pick's reliability)
    assert (tmp_path / "probes.csv").read_text().count("\n") == len(probes) + 1


@pytest.mark.slow
def test_tune_batch_survives_a_probe_killed_without_a_record(tmp_path, monkeypatch):
    """As the kernel's OOM killer would: SIGKILL, no record; the search goes on."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "if any(a.startswith('train.micro_batch_size=') and int(a.split('=')[1]) >= 3\n"
        "       for a in sys.argv):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    rec = run_inproc([*TINY, "task=tune_batch", "train.micro_batch_size=2"], tmp_path / "run")
    assert rec["status"] == "ok", rec["error"]
    assert rec["tune_max_micro_batch"] == rec["tune_best_micro_batch"] == 2
    probes = {p["micro_batch_size"]: p for p in rec["tune_probes"]}
    assert set(probes) == {2, 3, 4} and probes[2]["status"] == "ok"
    assert probes[4]["status"] == "crashed" and "killed by SIGKILL" in probes[4]["error"]


def test_the_fastest_goal_stops_once_tokens_per_s_stops_rising(tmp_path, monkeypatch):
    """tune.goal=fastest (the default) ends after two larger micro-batches fit under 5% above
    the best before them; tune.goal=largest searches on to the memory's limit; both from
    planted probes (no process each), as are tune.max_seconds' early end."""
    import moe_exp.tasks.tune as tune

    tps = {1: 100.0, 2: 190.0, 4: 300.0, 8: 310.0, 16: 305.0, 32: 320.0, 64: 330.0}

    def probe(overrides, n, out_dir):
        return {"status": "ok", "tokens_per_s": tps[n], "cpu_other_load": 0.0,
                "peak_mem_gib": n / 64} if n in tps \
            else {"status": "oom", "error": "planted"}

    monkeypatch.setattr(tune, "run_probe", probe)
    monkeypatch.setattr(tune.TuneTask, "summary_rows", staticmethod(lambda rec: []))  # (a
    # planted probe is no bench record)
    args = [*TINY, "task=tune_batch", "train.micro_batch_size=1"]
    rec = run_inproc(args, tmp_path / "fastest")
    assert rec["status"] == "ok", rec["error"]
    assert [p["micro_batch_size"] for p in rec["tune_probes"]] == [1, 2, 4, 8, 16]
    assert rec["tune_limit"] == "throughput" and rec["tune_best_micro_batch"] == 8
    assert rec["tune_max_micro_batch"] == 16
    rec = run_inproc([*args, "tune.goal=largest"], tmp_path / "largest")
    assert rec["tune_limit"] == "memory" and rec["tune_max_micro_batch"] == 64
    assert rec["tune_best_micro_batch"] == 64
    assert not tune.plateaued({1: {"status": "ok", "tokens_per_s": 1.0},
                               2: {"status": "ok", "tokens_per_s": 2.0}})
    import types

    monkeypatch.setattr(tune, "time", types.SimpleNamespace(
        monotonic=iter(range(0, 10_000, 100)).__next__))
    rec = run_inproc([*args, "tune.goal=largest", "tune.max_seconds=150"], tmp_path / "budget")
    assert rec["tune_limit"] == "tune.max_seconds" and rec["tune_max_micro_batch"] == 2
