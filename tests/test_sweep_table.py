"""Sweep table logic on hand-made records (no runs)."""
import json
import pytest
from omegaconf import OmegaConf

from moe_exp.results import FIELDS
from moe_exp.sweep.plots import pareto_mask
from moe_exp.sweep.table import build_table, combine

from conftest import CONF, compose


def rec(job, tps, mem, status="ok", **kw):
    r = dict.fromkeys(FIELDS)
    r.update(job=job, status=status, model="m", precision="fp32", parallel="none",
             activation_checkpointing="none", compile="off", grad_accum_steps=1,
             tokens_per_s=tps, peak_mem_gib=mem, config_hash=f"h{job}", overrides=[])
    r.update(kw)
    r["overrides"] = [f"{k}={v}" for k, v in kw.items() if k != "model"]
    return r


def test_default_baseline_is_fewest_optimizations_on_per_model():
    rows = [rec(0, 150.0, 1.0, precision="bf16"), rec(1, 100.0, 2.0),
            rec(2, 300.0, 0.5, precision="bf16", compile="default"),
            rec(3, 50.0, 4.0, model="big"), rec(4, 80.0, 3.0, model="big", precision="bf16"),
            rec(5, None, None, status="oom")]
    df = build_table(rows)
    assert list(df["baseline"]) == [False, True, False, True, False, False]
    assert list(df["speedup"][:5]) == pytest.approx([1.5, 1.0, 3.0, 1.0, 1.6])
    assert list(df["mem_saved_pct"][:5]) == pytest.approx([50.0, 0.0, 75.0, 0.0, 25.0])
    assert df["speedup"][5] is None or df["speedup"].isna()[5]
    assert df["label"][0] == "precision=bf16"


def test_each_model_size_is_its_own_baseline_group():
    """model.hidden_size=64,128 under one model name: two architectures; each is compared
    with its own runs (a speedup of 128 over 64 would say nothing about an optimization)."""
    small = dict(params_total=1000, params_active=500)
    big = dict(params_total=4000, params_active=2000)
    rows = [rec(0, 200.0, 1.0, **small), rec(1, 300.0, 1.0, precision="bf16", **small),
            rec(2, 100.0, 2.0, **big), rec(3, 120.0, 2.0, precision="bf16", **big)]
    df = build_table(rows)
    assert list(df["baseline"]) == [True, False, True, False]
    assert list(df["speedup"]) == pytest.approx([1.0, 1.5, 1.0, 1.2])
    for r, h in zip(rows, (64, 64, 128, 128)):  # a baseline on a size key compares sizes
        r["overrides"].append(f"model.hidden_size={h}")
    df = build_table(rows, baseline={"model.hidden_size": 64, "precision": "fp32"})
    assert list(df["baseline"]) == [True, False, False, False]
    assert list(df["speedup"]) == pytest.approx([1.0, 1.5, 0.5, 0.6])


def test_report_baseline_takes_one_value_per_key(capsys):
    from moe_exp.report import _pairs

    assert _pairs(["precision=bf16", "optim.lr=1e-3"]) == {"precision": "bf16", "optim.lr": 0.001}
    with pytest.raises(SystemExit) as e:
        _pairs(["precision=bf16", "precision=fp32"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --baseline: precision given twice; one value per key\n"


def test_default_baseline_prefers_adamw_and_a_baseline_may_name_an_override():
    rows = [rec(0, 160.0, 1.0, optim="muon"), rec(1, 100.0, 1.0, optim="adamw")]
    assert list(build_table(rows)["baseline"]) == [False, True]  # muon is an optimization on
    rows = [rec(0, 100.0, 1.0), rec(1, 90.0, 1.0)]
    rows[0]["overrides"], rows[1]["overrides"] = ["parallel.prefetch=1"], ["parallel.prefetch=0"]
    df = build_table(rows, baseline={"parallel.prefetch": 0})  # a key only the overrides hold
    assert list(df["baseline"]) == [False, True]
    with pytest.raises(KeyError, match="no row has 'parallel.prefetc'"):
        build_table(rows, baseline={"parallel.prefetc": 0})
    with pytest.raises(KeyError, match=r"sweep.baseline: precision=fp32 matches 2 rows"):
        build_table(rows, baseline={"precision": "fp32"})  # ambiguous: say so, pick none
    # several matches: the one with the fewest optimizations on
    rows = [rec(0, 100.0, 1.0, precision="bf16", compile="default"),
            rec(1, 90.0, 1.0, precision="bf16")]
    assert list(build_table(rows, baseline={"precision": "bf16"})["baseline"]) == [False, True]
    # override values compare as Hydra types them, like the baseline's own values
    rows = [rec(0, 100.0, 1.0), rec(1, 90.0, 1.0)]
    rows[0]["overrides"] = ["parallel.accum_no_sync=true", "optim.lr=1e-3"]
    rows[1]["overrides"] = ["parallel.accum_no_sync=false", "optim.lr=3e-3"]
    for baseline in ({"parallel.accum_no_sync": False}, {"optim.lr": 3e-3}):
        assert list(build_table(rows, baseline=baseline)["baseline"]) == [False, True]


def test_sweep_value_check_reads_quoted_values_as_jobs_get_them():
    from moe_exp.sweep.checks import SweepError, _unquoted, check_values

    check_values({"train.compile": ['"off"', "'default'"]})
    with pytest.raises(SweepError, match="train.compile: 'fast' is not one of"):
        check_values({"train.compile": ["off", "fast"]})
    assert _unquoted("'true'") == "true" and _unquoted("true") == "true"


def test_baseline_value_check_types_swept_values_as_the_table_does():
    """A quoted 'true' is the string true (what the table compares), unquoted true a bool;
    1e-3 and 0.001 are one number."""
    from omegaconf import OmegaConf

    from moe_exp.sweep.checks import SweepError, check_baseline

    def check(baseline, values, key="+extra.tag"):
        cfg = OmegaConf.create({"sweep": {"baseline": baseline, "baseline_by": ["model"]},
                                "hydra": {"overrides": {"task": []}}})
        check_baseline(cfg, {key: values})

    check({"extra.tag": "true"}, ["'true'", "b"])
    check({"optim.lr": 0.001}, ["1e-3", "3e-3"], "optim.lr")
    check({"optim.lr": 1.0}, ["1", "2"], "optim.lr")  # (refused as text, before)
    with pytest.raises(SweepError, match="extra.tag=1 is not among the swept values"):
        check({"extra.tag": 1}, ["true", "b"])  # (True is not 1)
    with pytest.raises(SweepError, match="optim.lr=0.002 is not among the swept values"):
        check({"optim.lr": 0.002}, ["1e-3", "3e-3"], "optim.lr")


def test_baseline_extra_label_checked_before_the_jobs():
    """An extra.* key no job will have (a typo) fails up front; labels come from the
    composed config, the command line, and the swept seed_row options."""
    from omegaconf import OmegaConf

    from moe_exp.sweep.checks import SweepError, check_baseline

    def check(by, params, extra=None):
        cfg = OmegaConf.create({"sweep": {"baseline": None, "baseline_by": by},
                                "extra": extra or {}, "hydra": {"overrides": {"task": []}}})
        check_baseline(cfg, params)

    rows = {"+seed_row": ["baseline", "all"]}
    check(["extra.seed_row"], rows)
    check(["extra.note"], {}, extra={"note": "x"})
    with pytest.raises(SweepError, match="'extra.seed_rwo' is a label no job of this sweep "
                                         r"has \(its labels: extra.seed_row\)"):
        check(["extra.seed_rwo"], rows)
    with pytest.raises(SweepError, match="its labels: none"):
        check(["extra.tag"], {"precision": ["fp32", "bf16"]})

    def check_baseline_value(value):
        cfg = OmegaConf.create({"sweep": {"baseline": {"extra.seed_row": value},
                                          "baseline_by": []},
                                "hydra": {"overrides": {"task": []}}})
        check_baseline(cfg, rows)

    check_baseline_value("all")
    with pytest.raises(SweepError, match="extra.seed_row=baselin is not a value any job has "
                                         r"\(all, baseline\)"):
        check_baseline_value("baselin")


def test_swept_group_option_checked_before_the_jobs():
    from moe_exp.sweep.checks import SweepError, check_values

    check_values({"model": ["tiny_moe", "small_moe"], "+seed_row": ["all"]})
    with pytest.raises(SweepError, match="precision: 'bogus' is not one of: bf16, fp16"):
        check_values({"precision": ["bf16", "bogus"]})
    with pytest.raises(SweepError, match="seed_row: 'al' is not one of"):
        check_values({"+seed_row": ["al"]})


def test_chosen_baseline_and_unknown_key():
    rows = [rec(0, 100.0, 1.0), rec(1, 200.0, 1.0, precision="bf16")]
    df = build_table(rows, baseline={"precision": "bf16"})
    assert list(df["speedup"]) == pytest.approx([0.5, 1.0])
    with pytest.raises(KeyError, match="sweep.baseline: 'colour'"):
        build_table(rows, baseline={"colour": "red"})
    with pytest.raises(KeyError, match="sweep.baseline_by: 'modle'"):
        build_table(rows, by=["modle"])


def test_baseline_on_a_dotted_key_into_a_dict_column():
    """extra.* keys (e.g. the seed table's extra.seed_row), also as read back from a table
    file where the dict is a JSON string."""
    import pandas as pd

    rows = [rec(0, 100.0, 1.0, extra={"seed_row": "baseline"}),
            rec(1, 200.0, 1.0, precision="bf16", extra='{"seed_row": "mixed_precision"}')]
    df = build_table(rows, baseline={"extra.seed_row": "mixed_precision"})
    assert list(df["baseline"]) == [False, True]
    assert list(df["speedup"]) == pytest.approx([0.5, 1.0])
    with pytest.raises(KeyError, match="no row has 'extra.seed_rwo'"):  # a typo
        build_table(rows, by=["extra.seed_rwo"])
    rows[1]["extra"] = {}  # a key some rows lack: those rows group under None
    df = build_table(rows, baseline={"extra.seed_row": "baseline"}, by=["extra.seed_row"])
    assert list(df["baseline"]) == [True, False] and pd.isna(df["speedup"][1])


def test_repeats_combine_to_median_and_significance():
    a = combine([rec(0, t, 1.0, repeat=i) for i, t in enumerate([100.0, 104.0, 96.0])])
    b = combine([rec(1, t, 1.0, repeat=i, precision="bf16") for i, t in
                 enumerate([150.0, 152.0, 148.0])])
    c = combine([rec(2, t, 1.0, repeat=i, compile="default") for i, t in
                 enumerate([103.0, 99.0, 101.0])])
    assert (a["tokens_per_s"], a["tokens_per_s_min"], a["tokens_per_s_max"]) == (100.0, 96.0, 104.0)
    # figures beyond the contract fields are medians too, not the first repeat's
    x = combine([rec(0, 100.0, 1.0, repeat=i, startup_s=s, data_share=0.01 * s)
                 for i, s in enumerate([5.7, 3.7, 3.6])])
    assert (x["startup_s"], x["data_share"]) == pytest.approx((3.7, 0.037))
    busy = combine([rec(0, t, 1.0, repeat=i, cpu_other_load=load)  # not hidden by a median
                    for i, (t, load) in enumerate([(100.0, 0.01), (2200.0, 0.62), (98., 0.02)])])
    assert busy["cpu_other_load"] == 0.62
    two = combine([rec(0, t, 1.0, repeat=i, micro_batch_size=8) for i, t in enumerate([1., 3.])])
    assert two["micro_batch_size"] == 8 and isinstance(two["micro_batch_size"], int)
    df = build_table([a, b, c])
    assert list(df["speedup_significant"]) == [None, True, False]
    # an even count: the step time is the one the median tokens/s means
    two = combine([rec(4, t, 1.0, repeat=i, tokens_per_step=1000, step_time_ms=1e6 / t)
                   for i, t in enumerate([100.0, 300.0])])
    assert two["tokens_per_s"] == 200.0 and two["step_time_ms"] == pytest.approx(5000.0)
    assert (two["step_time_ms_min"], two["step_time_ms_max"]) == pytest.approx((1e4 / 3, 1e4))
    # its breakdown adds up to that step time (medians of the phases alone gave 170% of it
    # when repeats differed as much as 1:3 on a busy machine)
    two = combine([rec(5, t, 1.0, repeat=i, tokens_per_step=1000, step_time_ms=1e6 / t,
                       data_ms=0.0, forward_ms=0.4e6 / t, backward_ms=0.5e6 / t,
                       optimizer_ms=0.1e6 / t) for i, t in enumerate([100.0, 300.0])])
    phases = sum(two[k] for k in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"))
    assert phases == pytest.approx(two["step_time_ms"]) and two["forward_ms"] == pytest.approx(2000)
    bad = combine([rec(3, 100.0, 1.0, repeat=0), rec(3, None, None, status="crashed",
                                                    repeat=1, error="killed")])
    assert bad["status"] == "crashed" and bad["repeats_ok"] == 1 and "repeat 1" in bad["error"]


def test_pareto_frontier():
    import pandas as pd

    df = pd.DataFrame({"tokens_per_s": [100, 200, 150, 90], "peak_mem_gib": [1.0, 2.0, 2.5, 0.5]})
    assert list(pareto_mask(df)) == [True, True, False, True]
    none = df.iloc[:0]
    assert none[pareto_mask(none)].empty  # a row mask even when there are no rows


def test_frontier_per_model_and_names_without_the_model_twice():
    """Models of different sizes are not a trade-off: each gets its own frontier. A row's
    name carries its model once."""
    from moe_exp.sweep.plots import frontier_mask, ok_rows

    rows = [rec(0, 100.0, 1.0, model="small"), rec(1, 90.0, 2.0, model="small"),
            rec(2, 10.0, 8.0, model="big"), rec(3, 12.0, 9.0, model="big", precision="bf16")]
    for r in rows:  # swept over models, as +sweep=seed_table does
        r["overrides"] = [f"model={r['model']}", *r["overrides"]]
    d = ok_rows(build_table(rows))
    assert list(frontier_mask(d)) == [True, False, True, True]  # big's rows: none dominated
    # across models "small" would dominate both big rows
    assert list(pareto_mask(d)) == [True, False, False, False]
    assert list(d["label"])[3] == "model=big precision=bf16"
    assert list(d["name"]) == ["small", "small", "big", "big · precision=bf16"]


def test_plots_of_a_table_without_finished_rows():
    """All skipped (or a task=comm sweep): the plots say there is nothing to plot (the
    notebook's plot cells used to raise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_exp.sweep.plots import PLOTS

    df = build_table([rec(0, None, None, status="skipped"), rec(1, None, None, status="oom")])
    for name, fn in PLOTS.items():
        fig, ax = plt.subplots()
        fn(ax, df)
        assert "no finished" in " ".join(t.get_text() for t in ax.texts), name
        plt.close(fig)


def test_presets_compose_and_count_jobs():
    from moe_exp.sweep.callback import plan

    cfg = compose(["+sweep=optimizations"])
    assert cfg.sweep.name == "optimizations"
    params = cfg.hydra.sweeper.params if "hydra" in cfg else None
    assert params is None  # compose() leaves the hydra node out: count from the yaml instead
    hydra_cfg = OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                    "params": OmegaConf.load(
                        CONF / "sweep" / "optimizations.yaml").hydra.sweeper.params},
        "overrides": {"task": ["+sweep=optimizations", "model=small_moe,tiny_moe"]}}})
    jobs, varying = plan(hydra_cfg)
    assert len(jobs) == 5 * 3 * 2 * 2 and "model=tiny_moe" in jobs[-1]
    assert set(varying) == {"precision", "train.activation_checkpointing", "train.compile",
                            "model"}


def test_routing_preset_sweeps_balancing_by_capacity_and_every_job_is_valid():
    """+sweep=routing: aux loss x aux-free bias x capacity (dropless, 1.0, 1.25), 12 jobs,
    each of which passes validation on tiny_deepseek."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from moe_exp.run import prepare
    from moe_exp.sweep.callback import plan

    args = ["+sweep=routing", "model=tiny_deepseek"]
    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        config = GlobalHydra.instance().hydra.config_loader.load_configuration(
            "run", args, run_mode=RunMode.MULTIRUN)
        jobs, varying = plan(config)
    assert len(jobs) == 12 and set(varying) == {
        "model.aux_loss_coef", "model.bias_update_rate", "model.capacity_factor"}
    for job in jobs[::5]:
        _, rec = prepare(compose(job), job)
        assert rec is None, rec["error"]


def test_jobs_fast_composition_is_hydras():
    """check_jobs composes one job per choice of groups and sets the value overrides on a
    copy: the row keys are those of Hydra's own composition of each job."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from moe_exp.sweep.callback import plan
    from moe_exp.sweep.checks import _Jobs

    args = ["+sweep=optimizations", "model=tiny_moe,tiny_dense", "optim.lr=1e-3,0.003",
            "+extra.tag=x", "parallel.profile_steps=0"]
    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        config = GlobalHydra.instance().hydra.config_loader.load_configuration(
            "run", args, run_mode=RunMode.MULTIRUN)
        jobs, _ = plan(config)
        js = _Jobs(config)
        picked = jobs[::9]
        assert len(picked) >= 12
        rows = [js.row(js.full(j)) for j in picked]
        assert {"model", "precision"} <= js.groups
        assert [js.row(js.fast(j)) for j in picked] == rows and len(set(rows)) == len(rows)
        assert len(js.bases) < len(picked)  # (groups composed once per choice)


def test_plan_counts_a_glob_over_a_group():
    """model=glob(tiny*): the options it matches (before: no count, no checks)."""
    from hydra import initialize_config_module

    from moe_exp.sweep.callback import plan

    cfg = OmegaConf.create({"hydra": {
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"},
        "overrides": {"task": ["model=glob(tiny*)", "precision=fp32,bf16"]}}})
    with initialize_config_module(config_module="moe_exp.conf", version_base="1.3"):
        jobs, varying = plan(cfg)
    tiny = ["tiny_deepseek", "tiny_dense", "tiny_moe", "tiny_qwen3"]
    assert varying == {"model": tiny, "precision": ["fp32", "bf16"]}
    assert len(jobs) == 8 and ["model=tiny_moe", "precision=bf16"] in jobs


@pytest.mark.distributed
def test_seed003_preset_runs_muon_and_prefetch_under_fsdp(tmp_path):
    """+sweep=seed003: adamw/muon x prefetch 0/1 under fsdp on 2 ranks, AdamW the baseline.
    Run here at prefetch 1 alone (the command line's value replaces the preset's list):
    AdamW and Muon each with explicit prefetching (their losses match one process's in
    test_distributed), a launch of 2 ranks per job."""
    import pandas as pd
    import torch

    from conftest import run_cli

    cfg = compose(["+sweep=seed003"])
    assert cfg.parallel.name == "fsdp" and cfg.hardware.devices == 2
    assert dict(cfg.sweep.baseline) == {"optim": "adamw", "parallel.prefetch": 0}
    params = OmegaConf.load(CONF / "sweep" / "seed003.yaml").hydra.sweeper.params
    assert dict(params) == {"optim": "adamw,muon", "parallel.prefetch": "0,1"}
    if torch.cuda.is_available():
        pytest.skip("the run part: 2 gloo ranks on CPU")
    d = tmp_path / "s"
    # (one Newton-Schulz step: Muon's five, in bf16, took most of a CPU step; the jobs in the
    # sweep's process, each launching its ranks: what runs is the point, not where)
    r = run_cli(["-m", "+sweep=seed003", "parallel.prefetch=1",
                 "sweep.baseline={optim:adamw,parallel.prefetch:1}",
                 "logger=none", "train.steps=2", "train.warmup_steps=1",
                 "train.micro_batch_size=2", "train.seq_len=32", "parallel.profile_steps=0",
                 "optim.ns_steps=1", "train.plan=false", "sweep.isolate=false",
                 f"hydra.sweep.dir={d}"], tmp_path,
                timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    df = pd.read_csv(d / "results.csv")
    assert list(df["status"]) == ["ok"] * 2 and list(df["optim"]) == ["adamw", "muon"]
    assert list(df["baseline"]) == [True, False]
    assert df["overrides"].str.contains("parallel.prefetch=1").all()


def test_sweep_keys_do_not_change_the_config_hash():
    from moe_exp.results import config_hash

    a = OmegaConf.to_container(compose([]), resolve=True)
    b = OmegaConf.to_container(compose(["sweep.resume=true", "sweep.repeats=3"]), resolve=True)
    c = OmegaConf.to_container(compose(["precision=bf16"]), resolve=True)
    assert config_hash(a) == config_hash(b) != config_hash(c)


def test_seed_tables_render_rows_columns_and_reasons():
    from moe_exp.sweep.seed import seed_tables

    rows, job = [], 0
    for model, tps in (("seed_dense", 100.0), ("seed_moe8", 80.0)):
        for key, mult, mem in (("baseline", 1.0, 2.0), ("mixed_precision", 1.5, 1.5),
                               ("checkpointing", 1.2, 1.0), ("mem_checkpointing", 0.9, 1.4)):
            rows.append(rec(job, tps * mult, mem, model=model, params_total=1_000_000,
                            extra={"seed_row": key}))
            job += 1
        rows.append(rec(job, None, None, status="skipped", model=model, params_total=None,
                        error="parallel.cpu_offload: FSDP CPU offload needs GPUs",
                        extra={"seed_row": "mem_cpu_offload"}))
        job += 1
    md = seed_tables(build_table(rows))
    assert "| + Mixed Precision | 150 | 120 | 1.50x | 1.5x |" in md
    assert "| Baseline | 100 | 80 | 1.00x | 1.0x |" in md
    assert "| + Expert Parallelism | not run | not run | — | 2.7x |" in md
    assert "| + Gradient Checkpointing | 0.004 GiB | 1.400 GiB | 30% | 29% |" in md
    assert "skipped: FSDP CPU offload needs GPUs" in md
    # a skipped row measured nothing: the model's size comes from its other rows
    assert "| + CPU Offloading | 0.004 GiB | skipped" in md and "nan" not in md
    assert seed_tables(build_table([rec(0, 1.0, 1.0)])) == ""


def test_labels_name_the_combination_even_for_one_row():
    from moe_exp.sweep.table import labels

    two = [rec(0, 1.0, 1.0, precision="fp32", seq_len=64),
           rec(1, 1.0, 1.0, precision="bf16", seq_len=64)]
    assert labels(two) == ["precision=fp32", "precision=bf16"]  # what varies
    assert labels(two[:1]) == ["precision=fp32 seq_len=64"]  # an interrupted sweep's one row


def test_plot_labels_stay_inside_the_figure():
    """Long combination labels at the right edge of the Pareto plot and the value texts past
    the longest bar are drawn inside the figure as saved (they used to be clipped)."""
    from moe_exp.sweep.plots import figure

    long = dict(precision="bf16", compile="max-autotune", activation_checkpointing="selective")
    rows = [rec(0, 24000.0, 0.20), rec(1, 31000.0, 0.15, precision="bf16"),
            rec(2, 27000.0, 0.12, activation_checkpointing="full"),
            rec(3, 39000.0, 0.14, precision="bf16", compile="default"),
            rec(4, 42000.0, 0.31, **long)]
    df = build_table(rows)
    assert list(df["label"])[0] == "defaults"  # the row with no overrides
    for name in ("pareto", "throughput", "memory"):
        fig = figure(name, df)
        fig.canvas.draw()
        texts = [t for t in fig.axes[0].texts if t.get_text().strip()]
        assert len(texts) == 5
        for t in texts:
            ext = t.get_window_extent()
            assert fig.bbox.x0 <= ext.x0 and ext.x1 <= fig.bbox.x1, (name, t.get_text())


def test_comm_sweep_table_shows_bus_bandwidth():
    """A task=comm sweep has no tokens/s: its table shows what it measured."""
    from moe_exp.sweep.table import markdown

    rows = [rec(i, None, None, task="comm", world_size=2, comm_backend="gloo",
                busbw_gbps_all_reduce=0.31 * (i + 1), busbw_gbps_all_to_all=0.22)
            for i in range(2)]
    md = markdown(build_table(rows))
    assert "all_reduce GB/s" in md and "all_to_all GB/s" in md and "tokens/s" not in md
    assert "0.62" in md and "gloo" in md


def test_sweep_report_with_an_unknown_baseline_key_falls_back(tmp_path, capsys):
    """A sweep whose sweep.baseline/baseline_by names no column still ends in its table and
    report, with the default baseline and a one-line warning (`report --baseline` fails)."""
    import json

    from moe_exp.sweep.report import report

    for r in (rec(0, 100.0, 1.0), rec(1, 200.0, 1.0, precision="bf16")):
        (tmp_path / str(r["job"])).mkdir()
        (tmp_path / str(r["job"]) / "metrics.json").write_text(json.dumps(r))
    paths = report(tmp_path, baseline={"colour": "red"}, plots=False)
    assert "sweep.baseline: 'colour' is not a column" in capsys.readouterr().err
    assert paths["csv"].is_file() and "2.00×" in paths["md"].read_text()
    report(tmp_path, by=["extra.seed_rwo"], plots=False)
    assert "sweep.baseline_by: " in capsys.readouterr().err
    with pytest.raises(KeyError, match="--baseline"):
        report(tmp_path, baseline={"colour": "red"}, plots=False, strict=True)


def test_report_names_rows_measured_under_other_load():
    from moe_exp.sweep.table import markdown

    rows = [rec(0, 100.0, 1.0), rec(1, 2200.0, 1.0, precision="bf16")]
    rows[0]["cpu_other_load"], rows[1]["cpu_other_load"] = 0.62, 0.02
    md = markdown(build_table(rows))
    assert "not reliable): job 0 (62%); the speedup of job 1 is against a contended " \
        "baseline." in md and "job 1 (" not in md.split("reliable")[1]
    rows[0]["cpu_other_load"], rows[1]["cpu_other_load"] = 0.02, 0.62  # a busy row only
    md = markdown(build_table(rows))
    assert "not reliable): job 1 (62%)." in md
    rows[0]["cpu_other_load"], rows[1]["cpu_other_load"] = None, 0.02  # not measured: no claim either way
    assert "not reliable" not in markdown(build_table(rows))


def test_set_aside_moves_another_configurations_repeats(tmp_path):
    """A repeats job cut off before its job-level record: its rep records are another
    configuration's too, and move aside whole rather than being overwritten."""
    import json

    from moe_exp.sweep.job import set_aside

    job = tmp_path / "0"
    (job / "rep0").mkdir(parents=True)
    (job / "rep0" / "metrics.json").write_text(json.dumps(rec(0, 1.0, 1.0, config_hash="old")))
    (job / "run.log").write_text("old log\n")
    assert set_aside(job, ("old", "{}")) is None  # the same configuration: left for resume
    dest = set_aside(job, ("new", "{}"))
    assert dest == tmp_path / "0-old"
    assert json.loads((dest / "rep0" / "metrics.json").read_text())["config_hash"] == "old"
    assert (dest / "run.log").read_text() == "old log\n" and (job / "run.log").read_text() == ""
    assert not (job / "rep0").exists()


def test_sweep_settings_read_as_the_sweep_had_them(tmp_path):
    """report/notebook read sweep.baseline / baseline_by from multirun.yaml: an empty
    baseline_by is one group (not [model]), interpolations resolve, a broken file is one
    error line."""
    from moe_exp.sweep.table import sweep_settings

    assert sweep_settings(tmp_path) == (None, ["model"])  # no multirun.yaml
    (tmp_path / "multirun.yaml").write_text(
        "base_prec: bf16\nsweep:\n  baseline: {precision: '${base_prec}'}\n  baseline_by: []\n")
    assert sweep_settings(tmp_path) == ({"precision": "bf16"}, [])
    (tmp_path / "multirun.yaml").write_text("sweep: [unclosed\n")
    with pytest.raises(ValueError, match="cannot read its sweep settings") as e:
        sweep_settings(tmp_path)
    assert "\n" not in str(e.value)  # one error line


def _write_jobs(d, records):
    import json

    for i, r in enumerate(records):
        (d / str(i)).mkdir(parents=True)
        (d / str(i) / "metrics.json").write_text(json.dumps({**r, "job": i}))


def test_rows_differing_only_in_extra_labels_stay_two_rows(tmp_path):
    """extra.* is left out of config_hash (free labels); a sweep over it used to keep one
    row (collect deduplicated by hash) and a resume matched either record to both jobs."""
    from moe_exp.results import row_key
    from moe_exp.sweep.job import finished_records
    from moe_exp.sweep.table import collect

    a, b = rec(0, 1.0, 1.0, extra={"tag": "a"}), rec(1, 2.0, 1.0, extra={"tag": "b"})
    b["config_hash"] = a["config_hash"]
    _write_jobs(tmp_path, [a, b, {**b, "job": 2}])  # a resume's copy of b: still one row
    assert [r["extra"]["tag"] for r in collect(tmp_path)] == ["a", "b"]
    found = finished_records(tmp_path, row_key(b), tmp_path / "1")
    assert [p.parent.name for p, _ in found] == ["1", "2"]
    # a table's extra is JSON text: the same key
    assert row_key({**b, "extra": '{"tag": "b"}'}) == row_key(b) != row_key(a)


def test_seed_memory_table_with_null_peak_says_dash_not_nan():
    """An in-process sweep's later CPU rows are ok with a null peak (NaN in the table)."""
    from moe_exp.sweep.seed import seed_tables

    rows = [rec(0, 100.0, None, extra={"seed_row": "baseline"}, params_total=10**6),
            rec(1, 120.0, 1.0, extra={"seed_row": "mem_checkpointing"}, params_total=10**6)]
    md = seed_tables(build_table(rows))
    assert "nan" not in md
    assert "| Baseline | 0.004 GiB | — | — |" in md
    assert "| + Gradient Checkpointing | 0.004 GiB | 1.000 GiB | - |" in md  # no base to save on


def test_notebook_table_finds_relative_dirs_and_rejects_what_matches_nothing(tmp_path,
                                                                              monkeypatch):
    import os

    from moe_exp.sweep.report import find_sweep_dir, notebook_table

    sweep = tmp_path / "multirun" / "2026-01-01" / "10-00-00"
    _write_jobs(sweep, [rec(0, 1.0, 1.0), rec(1, 2.0, 1.0, precision="bf16")])
    (sweep / "multirun.yaml").write_text("{}")  # (Hydra writes it in every sweep's dir)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where Jupyter starts
    rel = "multirun/2026-01-01/10-00-00"  # as the sweep printed it
    assert find_sweep_dir(rel) == sweep.resolve() == find_sweep_dir(None)
    named = tmp_path / "multirun" / "seed"  # hydra.sweep.dir=multirun/seed, newer: found,
    (named / "0").mkdir(parents=True)  # not its newest sub-dir (it was plots/)
    (named / "multirun.yaml").write_text("{}")
    (named / "plots").mkdir()
    os.utime(named, (2e9, 2e9))
    assert find_sweep_dir(None) == named.resolve()
    d, df = notebook_table(rel, {"precision": "bf16"})
    assert d == sweep.resolve() and list(df["baseline"]) == [False, True]
    with pytest.raises(FileNotFoundError, match="SWEEP_DIR: no directory multirun/typo"):
        find_sweep_dir("multirun/typo")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no job records"):
        notebook_table(tmp_path / "empty")
    with pytest.raises(KeyError, match="BASELINE precision=fp8: no finished"):
        notebook_table(rel, {"precision": "fp8"})


def test_report_baseline_values_are_typed_as_hydra_typed_the_sweep():
    from moe_exp.report import _pairs

    assert _pairs(["optim.lr=1e-3", "data.pin_memory=false", "precision=bf16"]) == \
        {"optim.lr": 0.001, "data.pin_memory": False, "precision": "bf16"}


def test_compare_reads_csv_hashes_as_text_and_compares_bus_bandwidth(tmp_path, capsys):
    """A hash of digits (or digits and one e) read back from CSV stays the hash; task=comm
    tables compare their bus bandwidth (they have no tokens/s)."""
    import pandas as pd

    from moe_exp.compare import compare, load

    base = pd.DataFrame([{"config_hash": "0123456e7890", "status": "ok", "tokens_per_s": None,
                          "peak_mem_gib": None, "busbw_gbps_all_reduce": 10.0},
                         {"config_hash": "123456789012", "status": "ok", "tokens_per_s": None,
                          "peak_mem_gib": None, "busbw_gbps_all_reduce": 10.0}])
    new = base.assign(busbw_gbps_all_reduce=[9.9, 5.0])
    for df, name in ((base, "base.csv"), (new, "new.csv")):
        df.to_csv(tmp_path / name, index=False)
    b, n = load(tmp_path / "base.csv"), load(tmp_path / "new.csv")
    assert list(b["config_hash"]) == ["0123456e7890", "123456789012"]
    entries, only = compare(b, n, 5.0)
    assert not only and [bool(e["regressions"]) for e in entries] == [False, True]
    assert "all_reduce GB/s -50.0%" in entries[1]["regressions"][0]
    # relabelled between the runs (+extra.note=before / after): still matched by the hash
    before, after = b.assign(extra='{"note": "before"}'), n.assign(extra='{"note": "after"}')
    entries, only = compare(before, after, 5.0)
    assert len(entries) == 2 and not only
    # two rows per hash told apart only by labels: matched by labels, never across them
    two = pd.concat([b.iloc[:1].assign(extra='{"t": "a"}'), b.iloc[:1].assign(extra='{"t": "b"}')])
    entries, only = compare(two, two.iloc[:1], 5.0)
    assert len(entries) == 1 and only == ["REGRESSION: ok in BASE, absent from NEW: 0123456e7890"]


def test_compare_reads_records_warns_on_broken_ones_and_flags_contention(tmp_path, capsys):
    """A dir's table comes from its job records (a stale results.parquet is not read); a
    file that is not a record is a warning naming it (it crashed compare and report); a
    row measured under other CPU load says its verdict is not reliable."""
    import pandas as pd

    from moe_exp.compare import compare, load

    d = tmp_path / "s"
    for job, r in enumerate([rec(0, 100.0, 1.0), rec(1, 100.0, 1.0, precision="bf16")]):
        (d / str(job)).mkdir(parents=True)
        (d / str(job) / "metrics.json").write_text(json.dumps(r))
    pd.DataFrame([{"config_hash": "h0", "status": "ok", "tokens_per_s": 1.0,
                   "peak_mem_gib": 1.0}]).to_parquet(d / "results.parquet")  # stale
    assert sorted(load(d)["tokens_per_s"]) == [100.0, 100.0]
    base = load(d)
    for text, why in [("{}", "not a record (no status, config_hash"),
                      ("[1]", "not a record (JSON, but not an object"),
                      ('{"status": "ok", "tok', "not JSON"),
                      (json.dumps(rec(1, 1.0, 1.0, status="fine")),
                       "not a record (status 'fine' is not one"),
                      (json.dumps(rec(1, 1.0, 1.0) | {"tokens_per_s": "fast"}),  # by hand
                       "not a record (tokens_per_s is 'fast', not a number)"),
                      (json.dumps(rec(1, 1.0, 1.0) | {"config_hash": ["x"]}),  # crashed
                       "not a record (config_hash is ['x'], not text)"),  # collect, compare
                      (json.dumps(rec(1, 1.0, 1.0) | {"overrides": 5}),
                       "not a record (overrides is 5, not a list of text)")]:
        (d / "1" / "metrics.json").write_text(text)
        assert list(load(d)["job"]) == [0]
        assert f"{d / '1' / 'metrics.json'}: {why}" in capsys.readouterr().err, text
    (d / "1" / "metrics.json").write_text(json.dumps(rec(1, 50.0, 1.0, precision="bf16",
                                                         cpu_other_load=0.7)))
    entries, _ = compare(base, load(d), 5.0)
    assert entries[1]["regressions"] and "NEW 70%" in entries[1]["contended"]
    assert "contended" not in entries[0]
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load(tmp_path / "nope")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(ValueError, match="empty.csv: not a readable table"):
        load(tmp_path / "empty.csv")
    pd.DataFrame([{"config_hash": "h0", "status": "ok", "tokens_per_s": "abc",
                   "peak_mem_gib": 1.0}]).to_csv(tmp_path / "edited.csv", index=False)
    with pytest.raises(ValueError, match="edited.csv: column tokens_per_s: 'abc' is not a n"):
        load(tmp_path / "edited.csv")  # (it said only: could not convert string to float)


def test_report_wandb_group_is_the_sweeps_own(tmp_path):
    """`report --wandb` logs its summary beside the sweep's runs (it was `report-<dir>`)."""
    from moe_exp.sweep.report import own_group

    d = tmp_path / "2026-01-01" / "10-00-00"
    d.mkdir(parents=True)
    assert own_group(d) is None  # not a sweep's dir: report names its own group
    (d / "multirun.yaml").write_text("sweep: {name: optimizations}\nlogger: {group: null}\n")
    assert own_group(d) == "optimizations-2026-01-01_10-00-00"
    (d / "multirun.yaml").write_text("sweep: {name: null}\nlogger: {group: mine}\n")
    assert own_group(d) == "mine"
    # the dir as the sweep named it (hydra.sweep.dir=runs/s): its jobs' group
    (d / "multirun.yaml").write_text("hydra: {sweep: {dir: runs/s}}\nsweep: {name: null}\n"
                                     "logger: {group: null}\n")
    assert own_group(d) == "sweep-runs_s"


def test_report_wandb_project_is_the_sweeps_own_and_mode_is_checked(tmp_path, monkeypatch):
    from moe_exp.sweep.report import own_logger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert (own_logger(tmp_path).project, own_logger(tmp_path).mode) == ("moe_exp", "offline")
    (tmp_path / "multirun.yaml").write_text("logger: {project: mine, entity: team, "
                                            "mode: '${oc.env:WANDB_MODE,offline}'}\n")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = own_logger(tmp_path)
    assert (cfg.project, cfg.entity, cfg.mode) == ("mine", "team", "disabled")
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match="WANDB_MODE: 'bogus' is not one of: offline"):
        own_logger(tmp_path)


def test_wandb_group_names_the_sweep_dir_without_empty_parts():
    from pathlib import Path

    from moe_exp.sweep.live import sweep_group

    cfg = OmegaConf.create({"sweep": {"name": None}})
    assert sweep_group(cfg, Path("multirun/2026-11-23/10-00-00")) == \
        "sweep-2026-11-23_10-00-00"
    assert sweep_group(cfg, Path("sw_rep")) == "sweep-sw_rep"  # was "sweep-_sw_rep"
    cfg.sweep.name = "seed003"
    assert sweep_group(cfg, Path("/tmp/runs/a")) == "seed003-runs_a"


def test_time_left_counts_every_job_that_ran_however_short():
    """The estimate used to leave out jobs under 2 s (meant for resumed ones): a sweep of
    fast in-process jobs never had one. Now a record from before the job started is what
    marks a resumed job."""
    import datetime as dt
    import time

    from moe_exp.sweep.callback import reused

    now = time.time()
    stamp = dt.datetime.fromtimestamp(now - 0.5, dt.timezone.utc).isoformat(timespec="seconds")
    assert not reused({"timestamp": stamp}, now)  # written by this job (whole seconds)
    old = dt.datetime.fromtimestamp(now - 3600, dt.timezone.utc).isoformat(timespec="seconds")
    assert reused({"timestamp": old}, now)
    assert not reused(None, now) and not reused({"timestamp": None}, now)
