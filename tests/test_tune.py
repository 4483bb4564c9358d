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
    rec = run_inproc([*TINY, "task=tune_batch", "hardware.memory_gib=0.15", "tune.multiple=8",
                      "train.micro_batch_size=16"], tmp_path)  # (its limit: about 20)
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
