"""+sweep=layouts (issue 51): the layouts of a model on N GPUs, and the search end to end."""
import json

import pytest

from conftest import compose, run_cli

MIXTRAL = ["model=mixtral_8x7b", "hardware=h100", "hardware.devices=64", "precision=bf16",
           "train.seq_len=4096", "sweep.global_batch=128"]


def test_every_layout_is_valid_and_keeps_the_global_batch():
    """Each layout of mixtral_8x7b on 64 H100s (and the slower ones of one of each kind:
    option x tp x pp) passes the run's own checks, and its data ranks x micro-batch x
    accumulation (a pipeline's: its micro-batches) is the 128 sequences asked for; every
    size of each dim that divides what it splits is there, each mesh at its fastest corner.
    A TP mesh's pipelines (task=plan's; the search's are at tp 1) keep its tp and EP 8
    over its dp x tp ranks (etp=1)."""
    from moe_exp.config import data_ranks
    from moe_exp.pipeline import prepare
    from moe_exp.sweep.layouts import Layout, layouts, pipelines

    base = compose(MIXTRAL)
    flat, piped = layouts(base), pipelines(base, Layout(ep=8))
    piped_tp = pipelines(base, Layout(tp=2, ep=8))
    assert piped_tp and all(x.tp == 2 and x.ep == 8 and x.pp > 1 for x in piped_tp)
    kinds = {(x.option, x.tp > 1, x.pp > 1): x for x in flat + piped + piped_tp}  # (each)
    for lay in {x: 0 for y in [*flat, *piped, *piped_tp] for x in (
            (y, *y.slower()) if kinds[y.option, y.tp > 1, y.pp > 1] == y else (y,))}:
        cfg, rec = prepare(compose(["task=plan", *MIXTRAL, *lay.overrides()]), [])
        assert rec is None, (lay, rec["error"])
        t = cfg.train
        assert data_ranks(cfg.parallel, 64) * t.micro_batch_size * t.grad_accum_steps == 128
    assert {x.tp for x in flat} == {1, 2, 4, 8} and {x.ep for x in flat} == {1, 2, 4, 8}
    assert {x.replicate for x in flat} == {1, 8}  # (HSDP: a node's ranks a shard group)
    assert {(x.tp, x.micro, x.ac) for x in flat} == {(1, 2, "none"), (2, 4, "none"),
                                                     (4, 8, "none"), (8, 16, "none")}
    assert {(x.pp, x.schedule, x.pp_micro) for x in piped} == {
        (p, s, 2 * p) for p in (2, 4, 8) for s in ("1f1b", "interleaved_1f1b")}
    assert all(x.ep == 8 for x in piped) and not any(x.tp > 1 for x in piped)


def test_long_sequences_add_context_parallel_layouts():
    """At 16K tokens a sequence, mixtral_8x7b's layouts on 64 H100s add cp 2 and 4 (each
    rank keeping at least 4K tokens): FSDP, HSDP and EP with cp, TP x cp without EP (etp=1
    does not take cp yet), each valid and keeping the 128 sequences; the pipelines of a cp
    mesh keep its cp."""
    from moe_exp.config import cp_size, data_ranks
    from moe_exp.pipeline import prepare
    from moe_exp.sweep.layouts import Layout, layouts, pipelines

    long = [*MIXTRAL, "train.seq_len=16384"]
    base = compose(long)
    flat = [x for x in layouts(base) if x.cp > 1]
    assert {x.cp for x in flat} == {2, 4}
    assert not any(x.ep > 1 and x.tp > 1 for x in flat)
    assert {x.option for x in flat} == {"fsdp", "hsdp", "expert_fsdp"}
    piped = pipelines(base, Layout(ep=8, cp=2))
    assert piped and all(x.cp == 2 for x in piped)
    kinds = {(x.option, x.tp, x.cp, x.pp > 1): x for x in flat + piped}  # (one of each)
    for lay in kinds.values():
        cfg, rec = prepare(compose(["task=plan", *long, *lay.overrides()]), [])
        assert rec is None, (lay, rec["error"])
        assert cp_size(cfg.parallel) == lay.cp
        t = cfg.train
        assert data_ranks(cfg.parallel, 64) * t.micro_batch_size * t.grad_accum_steps == 128
    assert not any(x.cp > 1 for x in layouts(compose(MIXTRAL)))  # (4K: none)


def test_the_search_plans_best_first_what_could_still_win():
    """After each mesh's fastest corner (micro-batch 4, no checkpointing): the layouts a
    step slower (half the micro-batch, the next heavier checkpointing, full checkpointing)
    than one that did not fit, the highest bound first (the least of its planned faster
    neighbours' tokens/s), of equal bounds the leanest, while a bound beats the fastest
    that fits; none slower than a layout of its mesh that fits (it covers them), none
    below one whose state alone does not fit (None)."""
    from moe_exp.sweep.layouts import Frontier, Layout

    a, b = Layout(micro=4, accum=1), Layout(ep=2, micro=4, accum=1)
    assert a.slower() == [Layout(micro=2, accum=2), Layout(micro=4, accum=1, ac="selective"),
                          Layout(micro=4, accum=1, ac="full")]
    f = Frontier()
    f.add(a, False, 100.0)
    f.add(b, False, 90.0)
    assert f.next() == (Layout(micro=4, accum=1, ac="full"), 100.0)  # (a's leanest)
    f.add(Layout(micro=4, accum=1, ac="full"), True, 70.0)
    assert f.next() == (Layout(micro=4, accum=1, ac="selective"), 100.0)
    f.add(Layout(micro=4, accum=1, ac="selective"), True, 85.0)  # covers micro 2 + full
    assert f.next() == (Layout(micro=2, accum=2), 100.0)
    f.add(Layout(micro=2, accum=2), False, 80.0)  # (its slower ones: below 85)
    assert f.next() == (Layout(ep=2, micro=4, accum=1, ac="full"), 90.0)
    f.add(Layout(ep=2, micro=4, accum=1, ac="full"), True, 80.0)
    assert f.next() == (Layout(ep=2, micro=4, accum=1, ac="selective"), 90.0)
    f.add(Layout(ep=2, micro=4, accum=1, ac="selective"), True, 88.0)
    assert f.next() == (Layout(ep=2, micro=2, accum=2), 90.0)
    f.add(Layout(ep=2, micro=2, accum=2), True, 86.0)
    assert f.next() is None and f.best() == 88.0
    g = Frontier()
    g.add(a, None, 100.0)
    assert g.next() is None
    # a pipeline's micro-batches stay of one sequence: checkpointing only
    g.add(Layout(pp=2, pp_micro=4), False, 1.0)
    assert g.next() == (Layout(pp=2, pp_micro=4, ac="full"), 1.0)


def test_a_layout_search_plans_each_mesh_then_the_pipelines_and_names_the_fastest(tmp_path):
    """4 blocks on 2 GPUs at 4 sequences a step (tp 1: one kv head): FSDP and EP 2, each
    at its fastest corner, fit; then pp 2, each schedule, of the fastest one's data mesh.
    The report names the fastest layout that fits, the runners-up and why each loses."""
    d = tmp_path / "s"
    r = run_cli(["-m", "+sweep=layouts", "model=tiny_moe", "model.num_layers=4",
                 "model.num_kv_heads=1", "hardware=h100", "hardware.devices=2",
                 "sweep.global_batch=4", f"hydra.sweep.dir={d}"], tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = sorted((json.loads(p.read_text()) for p in d.glob("*/metrics.json")),
                  key=lambda x: x["job"])
    assert [x["status"] for x in recs] == ["ok"] * 4 and all(x["planned_fits"] for x in recs)
    assert [(x["parallel"], x["micro_batch_size"], x["pp"], x["pp_schedule"]) for x in recs] \
        == [("fsdp", 2, 1, None), ("expert_fsdp", 2, 1, None),
            ("fsdp", 4, 2, "1f1b"), ("fsdp", 4, 2, "interleaved_1f1b")]  # (ep 2 > dp 1)
    assert {x["activation_checkpointing"] for x in recs} == {"none"}
    report = (d / "report.md").read_text()
    best = max(recs, key=lambda x: x["planned_tokens_per_s"])
    assert f"the fastest planned layout that fits is job {best['job']} (" in report
    runners = report.split("Runners-up (planned), and why each loses:")[1].split("\n\n")[1]
    assert len(runners.splitlines()) == 3 and "; " in runners and " against " in runners


@pytest.mark.parametrize("extra, says", [
    (["sweep.global_batch=3"], "sweep.global_batch: no layout of hardware.devices=4 splits 3 "
                               "sequences a step (a multiple of the data ranks: 4 or 2)"),
    (["precision=fp32,bf16"], "precision: +sweep=layouts takes one value a key, got "
                              "fp32,bf16 (run the search once per value)"),
])
def test_a_layout_search_it_cannot_run_says_why_in_one_line(tmp_path, extra, says):
    r = run_cli(["-m", "+sweep=layouts", "model=tiny_moe", "hardware=h100",
                 "hardware.devices=4", *extra, f"hydra.sweep.dir={tmp_path}"], tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"error: {says}"
    assert not list(tmp_path.glob("*/metrics.json"))  # (nothing planned)
