"""Every config option composes; bad input fails before any work with one clear line."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import CONF, cli_inproc, cli_key, cli_runs, compose, in_pairs, run_cli, run_inproc

GROUPS = ["model", "precision", "parallel", "hardware", "data", "optim", "logger"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes(group, option):
    extra = ["data.path=x.bin"] if (group, option) == ("data", "tokens") else []
    cfg = compose([f"{group}={option}", *extra])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg[group].name == option


def test_groups_have_the_contract_options():
    have = {g: {p.stem for p in (CONF / g).glob("*.yaml")} for g in GROUPS}
    assert {"tiny_moe", "small_moe", "moe_1b", "mixtral_8x7b", "tiny_dense"} <= have["model"]
    assert have["precision"] == {"fp32", "tf32", "fp16", "bf16", "fp8"}
    assert have["hardware"] == {"auto", "cpu", "a100", "h100", "h100_pcie", "h100_nvl", "h200",
                                "h200_nvl", "gaudi3"}
    assert {"wandb", "none"} == have["logger"]


def test_dense_counterpart_is_one_override():
    assert compose(["model.num_experts=0"]).model.num_experts == 0
    dense = compose(["model=tiny_dense"]).model
    moe = compose(["model=tiny_moe"]).model
    assert dense.num_experts == 0 and dense.hidden_size == moe.hidden_size
    assert dense.ffn_hidden_size == moe.top_k * moe.ffn_hidden_size


@pytest.mark.parametrize("override,needle", [
    ("model.hiden_size=3", "hiden_size"),
    ("model.hidden_size=abc", "hidden_size"),
    ("precision=fp9", "precision"),
    ("train.stepz=3", "stepz"),
])
def test_hydra_rejects_typos_and_types(override, needle):
    with pytest.raises(Exception) as err:
        compose([override])
    assert needle in str(err.value)


# each of 2 ranks has its own loader workers: more than half the cores each is too many
WORKERS_2_RANKS = f"parallel=ddp hardware.devices=2 data.num_workers={(os.cpu_count() or 1) // 2 + 1}"
TF32_LISTED = "hardware=cpu hardware.precisions=[fp32,tf32] precision=tf32"
SKIPPED = ("precision=tf32", "precision=fp8", "hardware=h100", "hardware=gaudi3",
           "hardware.device=cuda", TF32_LISTED, "train.compile=reduce-overhead",
           "model=mixtral_8x7b", "model.dispatch=grouped train.compile=default",
           "data.num_workers=100000", WORKERS_2_RANKS)


@pytest.mark.parametrize("override,key", [
    ("train.compile=fast", "train.compile"),
    ("train.activation_checkpointing=some", "train.activation_checkpointing"),
    ("model.hidden_size=130", "model.hidden_size"),
    ("model.num_kv_heads=3", "model.num_kv_heads"),
    ("model.top_k=9", "model.top_k"),
    ("precision=tf32", "precision"),
    ("precision=fp8", "precision"),
    ("train.seq_len=512", "train.seq_len"),
    ("train.grad_accum_steps=0", "train.grad_accum_steps"),
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.steps=100000000000000000000", "train.steps"),  # (overflowed at run time)
    ("hardware=h100", "hardware"),
    ("hardware=gaudi3", "hardware"),
    ("hardware.device=cuda", "hardware.device"),  # a device override, not a GPU profile
    ("hardware.devices=2", "hardware.devices"),
    ("model=mixtral_8x7b", "model"),
    ("data=tokens", "data.path"),
    ("data.prefetch_factor=2", "data.prefetch_factor"),
    ("data.persistent_workers=true", "data.persistent_workers"),
    ("data.name=tokens", "data.name"),  # a label: the data would still be markov
    ("data.path=corpus.bin", "data.path"),  # without data=tokens: markov data, silently
    # a mistake before what this machine cannot do (3 ranks on 2 cores): 8 experts over 3
    ("parallel=expert hardware.devices=3", "parallel.expert_parallel_size"),
    ("optim.lr=nan", "optim.lr"),  # nan passes every comparison
    ("optim.grad_clip=nan", "optim.grad_clip"),
    ("optim.weight_decay=inf", "optim.weight_decay"),
    ("model.z_loss_coef=-1", "model.z_loss_coef"),
    ("hardware=cpu ++hardware.peak_flops.fp23=1e11", "hardware.peak_flops"),
    ("hardware=cpu hardware.precisions=[fp32,fp99]", "hardware.precisions"),
    ("hardware.name=cpu", "hardware.name"),  # a label on the auto group: no profile
    ("hardware=cpu hardware.memory_gib=-1", "hardware.memory_gib"),
    ("optim.lr=0", "optim.lr"),
    ("+train.foo=1", "train.foo"),  # `+` adds any key; nothing would read it
    ("+foo=1", "foo"),
    ("optim.beta1=1.5", "optim.beta1"),
    ("optim.eps=0", "optim.eps"),
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio"),
    ("optim.schedule=wsd optim.decay_ratio=0", "optim.decay_ratio"),  # (nothing decays)
    ("optim.schedule=onecycle optim.pct_start=1", "optim.pct_start"),
    ("optim.decay_ratio=0.5", "optim.decay_ratio"),  # cosine: only wsd reads it
    ("optim.schedule=onecycle optim.lr_warmup_steps=2", "optim.lr_warmup_steps"),  # its own
    ("optim.schedule=constant optim.min_lr_ratio=0.5", "optim.min_lr_ratio"),  # no decay
    ("optim.schedule=step", "optim.schedule"),
    ("train.gc_every=-1", "train.gc_every"),
    ("model.routing=skewed model.routing_skew=0.5", "model.routing_skew"),
    ("model.routing=skewed model.routing_skew=4.5", "model.routing_skew"),  # 8 experts / 2
    ("model.routing_skew=3", "model.routing_skew"),  # learned: only skewed reads it
    ("model.routing=skewed model.top_k=8", "model.routing"),  # every token on every expert
    ("model.routing=even", "model.routing"),
    ("train.attention=sparse", "train.attention"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.name=sgd", "optim.name"),
    ("parallel.prefetch=-1", "parallel.prefetch"),
    ("parallel.prefetch=1", "parallel.prefetch"),  # parallel=none: nothing to prefetch
    ("optim=muon optim.ns_steps=0", "optim.ns_steps"),
    ("model.ffn_hidden_size=255 model.dispatch=grouped", "model.dispatch"),  # 16-byte strides
    ("optim=muon optim.momentum=1.0", "optim.momentum"),
    ("optim.momentum=0.9", "optim.momentum"),  # adamw: only muon reads it
    ("++optim.ns_steps=3", "optim.ns_steps"),
    ("model.init_std=0", "model.init_std"),
    ("data.num_workers=1 data.prefetch_factor=0", "data.prefetch_factor"),
    ("data.num_workers=100000", "data.num_workers"),  # more than the machine's cores
    (WORKERS_2_RANKS, "data.num_workers"),
    # the key the user set is named (data.name, data.branching were, before)
    ("data.source=tokens", "data.source"),
    ("model.vocab_size=2", "model.vocab_size"),
    ("model.vocab_size=8 data.branching=9", "data.branching"),
    ("hardware=cpu ++hardware.peak_flops.fp32=-1", "hardware.peak_flops.fp32"),
    # settings that contradict the precision option's name (which labels every result)
    ("precision.autocast_dtype=bfloat16", "precision.autocast_dtype"),
    ("precision=fp32 precision.tf32=true", "precision.tf32"),
    ("precision=bf16 precision.autocast_dtype=float16", "precision.autocast_dtype"),
    # the first step compiles: it cannot be a measured one
    ("train.compile=default train.warmup_steps=0", "train.warmup_steps"),
    ("model.dispatch=grouped train.compile=default", "model.dispatch"),  # grouped_mm: bf16 only
    ("parallel=expert hardware.devices=2 parallel.expert_parallel_size=0",
     "parallel.expert_parallel_size"),  # (0 is not "all ranks": null is)
    ("parallel=ddp hardware.devices=2 parallel.bucket_cap_mb=-1", "parallel.bucket_cap_mb"),
    # found mid-run before: DDP's int64 bytes; a sampler's range; an OOM or a long wait
    ("parallel=ddp hardware.devices=2 parallel.bucket_cap_mb=1e300", "parallel.bucket_cap_mb"),
    ("train.grad_accum_steps=9223372036854775807", "train.grad_accum_steps"),
    ("train.grad_accum_steps=3000000", "train.grad_accum_steps"),
    # what CPU torch cannot do, even where the profile lists it: it ran, labelled as done
    (TF32_LISTED, "precision"),
    ("train.compile=reduce-overhead", "train.compile"),  # CUDA graphs
    # another strategy's key: nothing would read it
    ("parallel=fsdp hardware.devices=2 parallel.static_graph=true", "parallel.static_graph"),
    ("parallel=ddp hardware.devices=2 parallel.reshard_after_forward=false",
     "parallel.reshard_after_forward"),
    # DDP static_graph under no_sync (pytorch#143580)
    ("parallel=ddp hardware.devices=2 parallel.static_graph=true train.grad_accum_steps=2",
     "parallel.static_graph"),
    # found mid-run before (an overflow, a 64 GB RoPE table, a traceback)
    ("train.seed=100000000000000", "train.seed"),
    ("model.max_seq_len=1000000000", "model.max_seq_len"),
    ("model.max_seq_len=99999999999999999999", "model.max_seq_len"),
    ("train.steps=${bogus}", "train.steps"),
    ("model.name=${oc.env:MOE_EXP_NO_SUCH_VAR}", "model.name"),
    ("~train", "train"),
    ("model.name=", "model.name"),
    ("hardware=h100 hardware.device=cpu", "hardware.device"),  # an H100's peak on a CPU
    ("hardware=cpu hardware.name=h100", "hardware.name"),  # (it blamed hardware.device)
    ("hardware=cpu hardware.precisions=[]", "hardware.precisions"),
    ("precision.fp8_recipe=bogus", "precision.fp8_recipe"),
    ("precision.fp8_recipe=rowwise", "precision.fp8_recipe"),  # fp32: nothing reads it
    ("parallel=ddp hardware.devices=2 parallel.timeout_s=0.5", "parallel.timeout_s"),
    ("task=comm hardware.devices=2 comm.ops=[all_reduce,all_reduce]", "comm.ops"),
    # DDP communication hooks: a choice, the rank, keys only DDP / PowerSGD read
    ("parallel=ddp hardware.devices=2 parallel.comm_hook=fp8", "parallel.comm_hook"),
    ("parallel=ddp hardware.devices=2 parallel.comm_hook=powersgd parallel.powersgd_rank=0",
     "parallel.powersgd_rank"),
    ("parallel=fsdp hardware.devices=2 parallel.comm_hook=fp16", "parallel.comm_hook"),
    ("parallel=ddp hardware.devices=2 parallel.powersgd_rank=4", "parallel.powersgd_rank"),
    # an overflowed fp16 step's inf would stay in PowerSGD's error feedback
    ("parallel=ddp hardware.devices=2 parallel.comm_hook=powersgd precision=fp16",
     "parallel.comm_hook"),
    # HSDP: the mesh, FSDP's precision limits, no expert-parallel dimension
    ("parallel=hsdp hardware.devices=4 parallel.replicate=3", "parallel.replicate"),
    ("parallel=hsdp hardware.devices=2 parallel.replicate=0", "parallel.replicate"),
    ("parallel=fsdp hardware.devices=2 parallel.replicate=2", "parallel.replicate"),
    ("parallel=hsdp hardware.devices=2 parallel.expert_parallel_size=2",
     "parallel.expert_parallel_size"),
    ("parallel=hsdp hardware.devices=2 precision=fp16", "precision"),
])


def test_validation_rejects_before_any_work(override, key, tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available() and override in ("hardware=h100", "precision=tf32",
                                                  "precision=fp8", "hardware.device=cuda",
                                                  "train.compile=reduce-overhead"):
        pytest.skip("valid on a GPU")
    import moe_exp.tasks.protocol as runner

    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    rec = run_inproc([*override.split(), "logger=none"], tmp_path)
    # a valid request this hardware cannot do is `skipped`; a mistake is `invalid`
    want = "skipped" if override in SKIPPED else "invalid"
    assert rec["status"] == want
    assert rec["error"].startswith(f"{key}: ") and "\n" not in rec["error"]
    assert json.loads((tmp_path / "metrics.json").read_text())["status"] == want


@pytest.mark.parametrize("args", [["data=markov", "data.path=corpus.bin"],
                                  ["optim=adamw", "optim.momentum=0.9"],
                                  ["precision=bf16", "precision.fp8_recipe=rowwise"],
                                  ["model=tiny_dense", "model.top_k=1"],
                                  ["model.num_experts=0", "model.dispatch=loop"],
                                  ["data=tokens", "data.path={tokens}", "data.branching=8"]])
def test_a_key_the_chosen_option_does_not_read_runs_only_in_a_sweep(args, tmp_path,
                                                                    monkeypatch):
    """data.path on markov data, Muon's momentum on adamw: in a sweep over both options
    every job gets the key, and the job whose option does not read it runs (the sweep's
    check refuses a sweep where no job reads it). A single run with the option chosen is
    refused like one with the default: surely the other option was meant."""
    import moe_exp.tasks.protocol as runner

    class Started(Exception):
        pass

    def bench(*a, **k):
        raise Started

    from moe_exp.run import run

    monkeypatch.setattr(runner, "execute", bench)
    if any("{tokens}" in a for a in args):
        from moe_exp.data.tokens import prepare

        (tmp_path / "t.txt").write_text("some text to train on " * 50)
        prepare([tmp_path / "t.txt"], tmp_path / "t.bin")
        args = [a.replace("{tokens}", str(tmp_path / "t.bin")) for a in args]
    args = ["logger=none", *args]
    with pytest.raises(Started):  # (the overrides as Hydra passes them on the command line)
        run(compose(args), tmp_path, progress=False, overrides=args, in_sweep=True)
    rec = run(compose(args), tmp_path, progress=False, overrides=args)
    key = args[-1].split("=")[0]
    assert rec["status"] == "invalid" and rec["error"].startswith(f"{key}: read by ")


def test_a_dense_models_routing_keys_are_refused_only_where_the_command_line_sets_them():
    """A dense preset inherits its MoE parent's top_k (a custom one may differ from the
    schema's): nothing the user set is unread."""
    from moe_exp.validate import unread_keys

    cfg = compose(["logger=none", "model=tiny_dense", "model.top_k=1"])
    assert unread_keys(cfg, ["model=tiny_dense"]) == {}  # (as if a preset had top_k: 1)
    assert list(unread_keys(cfg, ["model=tiny_dense", "model.top_k=1"])) == ["model.top_k"]


def test_torchrun_ranks_need_a_parallel_strategy(tmp_path, monkeypatch):
    """Launched as several ranks with parallel=none, each would run (and record) alone."""
    import moe_exp.tasks.protocol as runner

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    rec = run_inproc(["logger=none"], tmp_path)
    assert rec["status"] == "invalid" and rec["error"].startswith("parallel: launched as 2 ranks")


def test_torchrun_ranks_per_node_must_be_hardware_devices(tmp_path, monkeypatch):
    """torchrun --nproc_per_node 1 with hardware.devices=2 ran one rank under the config
    (and hash) of two; a 2-node job's hash is not a 1-node job's."""
    import moe_exp.tasks.protocol as runner
    from moe_exp.results import new_record

    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        monkeypatch.setenv(k, v)
    rec = run_inproc(["logger=none", "parallel=ddp", "hardware.devices=2"], tmp_path)
    assert rec["status"] == "invalid" and rec["error"] == (
        "hardware.devices: torchrun's LOCAL_WORLD_SIZE is 1 (ranks on this node), but "
        "hardware.devices=2: set hardware.devices=1")
    cfg = OmegaConf.to_container(compose(["logger=none", "parallel=ddp"]), resolve=True)
    one_node = new_record(cfg, [])["config_hash"]
    monkeypatch.setenv("WORLD_SIZE", "2")  # 2 nodes x 1 rank
    assert new_record(cfg, [])["config_hash"] != one_node
    monkeypatch.delenv("RANK")
    assert new_record(cfg, [])["config_hash"] == one_node


@pytest.mark.parametrize("extra,error", [
    (["model.num_experts=3"], "parallel.expert_parallel_size: model.num_experts=3 is not "
                              "divisible by the expert-parallel size 2"),
    (["parallel.expert_parallel_size=2"], None),  # valid: 2 ranks in all, one per node
    (["parallel.expert_parallel_size=4"], "parallel.expert_parallel_size: must divide the "
                                          "world size 2 (torchrun's WORLD_SIZE), got 4")])
def test_expert_parallel_checks_use_the_whole_world(extra, error, tmp_path, monkeypatch):
    """Under torchrun on 2 nodes x 1 rank (hardware.devices=1 per node), the expert-parallel
    size is checked against the world of 2, as the run uses it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # (torchrun sets them)
    monkeypatch.setenv("MASTER_PORT", "29500")

    class Started(Exception):
        pass

    def rank_main(*a, **k):
        raise Started

    monkeypatch.setattr("moe_exp.pipeline.rank_main", rank_main)
    args = ["parallel=expert", "hardware.devices=1", "logger=none", *extra]
    if error is None:
        with pytest.raises(Started):
            run_inproc(args, tmp_path)
    else:
        rec = run_inproc(args, tmp_path)
        assert rec["status"] == "invalid" and rec["error"] == error


def test_memory_check_counts_what_sharding_saves(monkeypatch):
    from moe_exp.config import Unsupported
    from moe_exp.validate import check_memory

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    cfg = compose(["model=mixtral_8x7b", "hardware=h100", "hardware.memory_gib=400",
                   "hardware.devices=2", "parallel=fsdp"])
    with pytest.raises(Unsupported, match=r"train.micro_batch_size: 8 x seq_len 32768 needs "
                                          r">= 159 GiB of activations .* besides 348 GiB"):
        check_memory(cfg)  # the loss's fp32 log-probabilities alone: 8 x 32768 x 32000 x 4 B
    cfg.train.micro_batch_size, cfg.train.seq_len = 1, 1024  # activations ~0.6 GiB
    check_memory(cfg)  # ~348 GiB per GPU once sharded over 2
    for name in ("ddp", "expert"):  # replicated: ~696 GiB; expert: attention etc. replicated
        cfg.parallel.name = name
        cfg.hardware.memory_gib = 400 if name == "ddp" else 340
        with pytest.raises(Unsupported, match="GiB on one device"):
            check_memory(cfg)
    cfg.parallel.name, cfg.hardware.memory_gib = "fsdp", 200
    with pytest.raises(Unsupported):
        check_memory(cfg)
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun over two such machines: ~174 GiB each
    monkeypatch.setenv("RANK", "0")
    check_memory(cfg)
    cfg.hardware.device, cfg.hardware.memory_gib = "cpu", 300  # 2 ranks share it: ~348
    with pytest.raises(Unsupported, match="2 CPU ranks together"):
        check_memory(cfg)


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense"])
def test_memory_check_counts_muons_params_as_the_optimizer_does(model):
    from moe_exp.model.transformer import build_model
    from moe_exp.optim.muon import hidden_matrices
    from moe_exp.bench.flops import muon_params

    cfg = compose([f"model={model}", "optim=muon"])
    net = build_model(cfg.model)
    ids = hidden_matrices(net)
    assert muon_params(cfg.model) == sum(p.numel() for p in net.parameters() if id(p) in ids)


def test_cli_invalid_exits_nonzero_with_one_line(tmp_path):
    p = run_cli(["model.top_k=9", "logger=none"], tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == "error: model.top_k: must be in 1..num_experts=8, got 9"
    assert "Traceback" not in p.stderr + p.stdout


HYDRA_ERRORS = [
    ("train.stepz=3", "error: train.stepz: no such key in train (known: "
                      "activation_checkpointing, attention, checkpoint_async, "
                      "checkpoint_dir, checkpoint_every, checkpoint_keep, compile, eval_every, "
                      "eval_sequences, gc_every, grad_accum_steps, log_every, micro_batch_size, "
                      "plan, plan_depth, profile, profile_steps, resume_from, seed, seq_len, "
                      "steps, target_loss, warmup_steps)"),
    ("seed_row=all", "error: Could not override 'seed_row'. No match in the defaults list; "
                     "To append to your default list use +seed_row=all"),
    ("train.steps=abc", "error: train.steps: Error merging override train.steps=abc; Value "
                        "'abc' of type 'str' could not be converted to Integer"),
    ("precision=bf61", "error: precision: 'bf61' is not one of: bf16, fp16, fp32, fp8, tf32"),
]
FULL = {"HYDRA_FULL_ERROR": "1"}


@pytest.mark.parametrize("override,line", HYDRA_ERRORS)
def test_cli_hydra_errors_are_one_line_exit_2(override, line, cli_errors, tmp_path):
    """Hydra's own errors (unknown key or option, wrong type) read like moe_exp's checks."""
    p = cli_inproc([override], tmp_path)
    assert (p.returncode, p.stderr.strip()) == (2, line)
    full, _ = cli_errors[cli_key([override], FULL)]  # Hydra's own report (a traceback: a
    # process of its own)
    assert full.returncode != 0 and "Traceback" in full.stderr


@pytest.mark.parametrize("override,line", [
    ("data.path=~/c.bin", "override 'data.path=~/c.bin': Hydra cannot read '~' here; quote the "
                          "value: 'data.path=\"~/c.bin\"'"),
    ("x y=1", "override 'x y=1': Hydra cannot read ' ' here"),
    ("train.steps=[", "override 'train.steps=[': no viable alternative at input '['"),
    ("model=tiny_moe)", "override 'model=tiny_moe)': extraneous input ')' expecting <EOF>"),
])
def test_an_override_hydra_cannot_parse_is_named_with_its_fix(override, line):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from moe_exp.hydra_internals import hydra_error_line

    with pytest.raises(OverrideParseException) as e:
        OverridesParser.create().parse_overrides([override])
    got = hydra_error_line(e.value)
    assert got.startswith(line + " (the grammar: https://hydra.cc/") and "\n" not in got


MODELS = ("deepseek_v3, dense_1b, mixtral_8x7b, moe_1b, qwen3_30b_a3b, seed_dense, seed_moe16, "
          "seed_moe8, small_deepseek, small_dense, small_moe, small_qwen3, tiny_deepseek, tiny_dense, "
          "tiny_moe, tiny_qwen3")


GROUP_ERRORS = [
    (["model=null"], f"model: null is not an option (one of: {MODELS})"),
    (["-m", "precision=fp32,null"], "precision: null is not an option (one of: bf16, fp16, "
                                    "fp32, fp8, tf32)"),
    # Hydra would merge both configs into one run (and record the last one's name)
    (["model=[tiny_moe,small_moe]"], "model: one option per run, got the list "
                                     "[tiny_moe,small_moe] (a sweep over them: -m "
                                     "model=tiny_moe,small_moe)"),
    (["+seed_row=[all,baseline]"], "seed_row: one option per run, got the list [all,baseline] "
                                   "(a sweep over them: -m +seed_row=all,baseline)"),  # (+ lost)
    (["~model"], f"model: a run needs one option; it cannot be removed (one of: {MODELS})"),
    (["+sweep=optimizations"], "sweep: +sweep=optimizations is a sweep preset: run it with "
                               "-m (python -m moe_exp.run -m +sweep=optimizations)"),
]


@pytest.mark.parametrize("args,line", GROUP_ERRORS)
def test_cli_group_set_to_null_a_list_or_removed_is_one_line(args, line, tmp_path):
    p, cwd = cli_inproc([*args, "logger=none"], tmp_path), tmp_path
    assert (p.returncode, p.stderr.strip()) == (2, f"error: {line}")
    assert not (cwd / "outputs").exists() and not (cwd / "multirun").exists()


def test_a_sweep_setting_without_m_is_refused():
    """sweep.* acts only in a sweep: without -m it used to run once, silently."""
    from moe_exp.cli import group_override_error

    assert group_override_error(["sweep.repeats=3", "logger=none"]) == (
        "sweep.repeats: a sweep's setting, read only with -m (python -m moe_exp.run -m "
        "sweep.repeats=3 ...)")
    assert group_override_error(["++sweep.resume=true"]).startswith("sweep.resume: ")
    for multirun in (["-m"], ["--multi"], ["hydra.mode=MULTIRUN"]):
        assert group_override_error([*multirun, "sweep.repeats=3"]) is None
    assert group_override_error(["--cfg", "job", "sweep.repeats=3"]) is None  # runs nothing
    assert group_override_error(["--cfg", "hydra", "+sweep=seed003"]) is None


def test_a_usage_error_prints_hydra_usage_once(tmp_path):
    p = run_cli(["--cfg", "bogus"], tmp_path)
    assert p.returncode == 2 and p.stderr.count("usage: ") == 1, p.stderr
    assert "argument --cfg/-c: invalid choice: 'bogus'" in p.stderr


FLAG_ERRORS = [  # (Hydra's ValueError traceback, before)
    (["-m", "--cfg", "job"], "only one of --run, --multirun (-m), --cfg, --info and "
                             "--shell-completion at a time"),
    (["--resolve"], "--resolve goes with --cfg or --help"),
    (["-sc"], "--shell-completion (-sc) takes one of install=SHELL, uninstall=SHELL, "
              'query=SHELL (eval "$(python -m moe_exp.run -sc install=bash)")'),
    (["hydra.job.name=../../x"], "hydra.job.name: '../../x' names the run's log file: a plain "
                                 "name (no '/', not '.' or '..', at most 251 bytes)"),
    ([f"hydra.job.name={'d' * 252}"], f"hydra.job.name: '{'d' * 40}'... names the run's log "
     "file: a plain name (no '/', not '.' or '..', at most 251 bytes)"),  # (a traceback before)
    (["--experimental-rerun", "x.pickle"], "--experimental-rerun is not supported: rerun with "
     "the overrides of the run's record (metrics.json `overrides`, or .hydra/overrides.yaml)")]


@pytest.mark.parametrize("args,line", FLAG_ERRORS)
def test_conflicting_hydra_flags_are_one_line(args, line, tmp_path):
    p = cli_inproc([*args, "logger=none"], tmp_path)
    assert (p.returncode, p.stderr.strip()) == (2, f"error: {line}")


INTERPOLATION_ERRORS = [  # (OmegaConf's traceback from Hydra's set-up, before)
    (["hydra.run.dir=${oops}"], "hydra.run.dir: '${oops}' does not resolve: Interpolation key "
                                "'oops' not found"),
    (["hydra.job.name=${oc.env:NO_SUCH_VAR}"], "hydra.job.name: '${oc.env:NO_SUCH_VAR}' does "
     "not resolve: KeyError raised while resolving interpolation: \"Environment variable "
     "'NO_SUCH_VAR' not found\" (read by hydra.job_logging.handlers.file.filename)"),
    (["-m", "hydra.sweep.dir=${bogus:x}", "train.steps=2,3"],
     "hydra.sweep.dir: '${bogus:x}' does not resolve: Unsupported interpolation type bogus"),
    (["train.steps=${oc.decode:2}", "hydra.job.name=${oc.env:NO_SUCH_VAR}"],  # (not the first)
     "hydra.job.name: '${oc.env:NO_SUCH_VAR}' does not resolve: KeyError raised while "
     "resolving interpolation: \"Environment variable 'NO_SUCH_VAR' not found\" (read by "
     "hydra.job_logging.handlers.file.filename)"),
    (["--cfg", "job", "--resolve", "train.steps=${oops}"],
     "train.steps: '${oops}' does not resolve: Interpolation key 'oops' not found")]


@pytest.mark.parametrize("args,line", INTERPOLATION_ERRORS)
def test_an_interpolation_hydra_resolves_first_is_one_line(args, line, tmp_path):
    p, cwd = cli_inproc([*args, "logger=none"], tmp_path), tmp_path
    assert (p.returncode, p.stderr.strip()) == (2, f"error: {line}")
    assert not list(cwd.glob("**/metrics.json")) and "[sweep]" not in p.stdout


@pytest.fixture(scope="module")
def cli_errors(tmp_path_factory):
    """HYDRA_FULL_ERROR=1 runs of HYDRA_ERRORS (Hydra re-raises: a traceback a process of
    its own prints), two at a time (each mostly starts and fails: one core each)."""
    return cli_runs(tmp_path_factory, [([o], FULL) for o, _ in HYDRA_ERRORS])


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    one, swept = in_pairs(lambda *args: run_cli(list(args), tmp_path), [
        ("logger=none", "hydra.run.dir=notes.txt/run"),
        ("-m", "logger=none", "precision=fp32,bf16", "hydra.sweep.dir=notes.txt")])
    assert (one.returncode, one.stderr.strip()) == (
        2, "error: cannot make the output dir 'notes.txt/run': Not a directory")
    assert (swept.returncode, swept.stderr.strip()) == (
        2, "error: hydra.sweep.dir: cannot make 'notes.txt' the sweep's dir: File exists")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_cli_model_name_of_another_preset_is_refused(tmp_path):
    """model.name labels a custom model; small_moe on tiny_moe's sizes would mislabel every
    table row. The preset's own name, or a new one, is fine."""
    p = run_cli(["model.name=small_moe", "logger=none"], tmp_path)
    assert (p.returncode, p.stderr.strip()) == (2, "error: model.name: 'small_moe' is another "
                                                   "preset's name; these are model=tiny_moe's "
                                                   "sizes: pick model=small_moe, or name them "
                                                   "anew")
    from moe_exp.validate import check_model_label

    check_model_label(["model=small_moe", "model.name=small_moe"])
    check_model_label(["model.name=my_moe"])


def test_cli_cfg_info_help(tmp_path):
    job, info, p = in_pairs(lambda *args: run_cli(list(args), tmp_path), [
        ("--cfg", "job", "precision=bf16"), ("--info", "defaults"), ("--help",)])
    assert job.returncode == 0
    cfg = OmegaConf.create(job.stdout)
    assert cfg.precision.name == "bf16" and cfg.model.name == "tiny_moe"
    assert info.returncode == 0 and "model/tiny_moe" in info.stdout
    assert "hardware/auto" in info.stdout
    assert p.returncode == 0
    assert "precision=fp32 (default)|bf16|fp16|fp8|tf32" in p.stdout
    assert "+sweep=layouts|optimizations|" in p.stdout  # (a preset is added with +)
    assert "parallel.bucket_cap_mb=25.0  DDP's gradient bucket size (parallel=ddp only)" \
        in p.stdout  # (each key with its declaration: config.py)


def test_hardware_env_is_set_for_its_run_only(tmp_path, monkeypatch):
    """hardware.env holds for the run (its ranks inherit it), not for what runs after it in
    the same process (an in-process sweep's next job); the environment's own value wins."""
    import os

    import moe_exp.tasks.protocol as runner

    seen = []
    monkeypatch.setattr(runner, "execute", lambda task: seen.append(
        (os.environ.get("MOE_EXP_T1"), os.environ.get("MOE_EXP_T2"))) or task.ctx.new_record())
    monkeypatch.delenv("MOE_EXP_T1", raising=False)
    monkeypatch.setenv("MOE_EXP_T2", "mine")
    run_inproc(["logger=none", "++hardware.env.MOE_EXP_T1=on", "++hardware.env.MOE_EXP_T2=x"],
               tmp_path)
    assert seen == [("on", "mine")]
    assert "MOE_EXP_T1" not in os.environ and os.environ["MOE_EXP_T2"] == "mine"


@pytest.mark.parametrize("env,hw,says", [
    ("abc", None, "TORCHINDUCTOR_COMPILE_THREADS (environment): must be a whole number >= 1 "
                  "(compile workers), got 'abc'"),
    (None, "0", "hardware.env.TORCHINDUCTOR_COMPILE_THREADS: must be a whole number >= 1 "
                "(compile workers), got '0'"),
    (None, "3", None),
    (None, None, None)])
@pytest.mark.parametrize("compile_", ["off", "default"])
def test_compile_threads_are_checked_first_and_hardware_env_sets_them(env, hw, says, compile_,
                                                                      tmp_path, monkeypatch):
    """Inductor reads TORCHINDUCTOR_COMPILE_THREADS when its config is imported, by compile
    and by use_deterministic_algorithms in every run (a bad one was a ValueError mid-run);
    hardware.env's value is not overridden by the run's default of 1 on a machine of <= 4
    cores (it was, before), and that default is the run's alone."""
    import os

    import moe_exp.tasks.protocol as runner

    seen = []
    monkeypatch.setattr(runner, "execute", lambda task: seen.append(
        os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")) or task.ctx.new_record())
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    if env is not None:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", env)
    args = ["logger=none", f"train.compile={compile_}", "train.plan=false"]
    if hw is not None:
        args.append(f"++hardware.env.TORCHINDUCTOR_COMPILE_THREADS={hw}")
    rec = run_inproc(args, tmp_path)
    if says:
        assert (rec["status"], rec["error"], seen) == ("invalid", says, [])
    else:
        assert seen == [hw or ("1" if (os.cpu_count() or 1) <= 4 else None)]
        assert "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ  # (not left to later runs)


def test_gaudi_bridge_is_imported_under_hardware_env(tmp_path, monkeypatch):
    """hardware=gaudi3 sets PT_HPU_LAZY_MODE=0, which Gaudi's bridge reads when imported: the
    import (in the device check, before the run) sees it; afterwards it is unset again.
    A stand-in bridge records what it saw (there is no Gaudi here)."""
    import os
    import sys

    from omegaconf import open_dict

    from moe_exp.hardware import device_here

    pkg = tmp_path / "habana_frameworks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "torch.py").write_text("import os\nSEEN = os.environ.get('PT_HPU_LAZY_MODE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    for name in ("habana_frameworks", "habana_frameworks.torch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cfg = compose(["hardware=gaudi3"])
    try:
        with open_dict(cfg):
            device_here(cfg)
        assert sys.modules["habana_frameworks.torch"].SEEN == "0"
        assert "PT_HPU_LAZY_MODE" not in os.environ
    finally:  # later tests must see no bridge again
        for name in ("habana_frameworks.torch", "habana_frameworks"):
            sys.modules.pop(name, None)


def test_online_wandb_without_a_login_fails_before_any_work(tmp_path, monkeypatch):
    """WANDB_MODE=online with no W&B credentials used to crash after the measured steps,
    when the deferred W&B run started. Now: one line before any work, status `error` (a
    resumed sweep runs it again once logged in); found credentials pass. No W&B import."""
    from moe_exp.tracking import wandb_credentials

    env = dict(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), WANDB_MODE="online",
               WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_API_KEY="",
               WANDB_IDENTITY_TOKEN_FILE="", WANDB_BASE_URL="")
    r = run_cli([f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "WANDB_MODE: online needs W&B credentials" in r.stderr
    rec = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rec["status"] == "error" and rec["step_time_ms"] is None
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert not wandb_credentials()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40)
    assert wandb_credentials()
    # what a plain `wandb login` writes with W&B 0.31 (its default server is Forge's)
    (tmp_path / "netrc").write_text("machine api.forge.coreweave.com login user password "
                                    + "k" * 40)
    assert wandb_credentials()
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password \"\"\n")
    assert not wandb_credentials()  # an entry without a key: W&B would not use it
    (tmp_path / "netrc").write_text("machine wandb.example.com login user password " + "k" * 40)
    assert not wandb_credentials()  # another server's key...
    (tmp_path / "wandb-config").mkdir()
    (tmp_path / "wandb-config" / "settings").write_text(
        "[default]\nbase_url = https://wandb.example.com\n")
    assert wandb_credentials()  # ...is the one `wandb login --host` set up
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    (tmp_path / "netrc").unlink()
    assert wandb_credentials()


def test_netrc_fallback_reader(tmp_path, monkeypatch):
    """The hand-written .netrc check (for a W&B without the reader moe_exp uses)."""
    from moe_exp.tracking import _netrc_has_key

    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not _netrc_has_key({"api.wandb.ai"})  # no file
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password " + "k" * 40)
    assert _netrc_has_key({"api.wandb.ai", "api.forge.coreweave.com"})
    assert not _netrc_has_key({"wandb.example.com"})
    (tmp_path / "netrc").write_text('machine api.wandb.ai login user password ""\n')
    assert not _netrc_has_key({"api.wandb.ai"})  # an entry without a key


@pytest.mark.parametrize("device_name,profile,bf16_peak", [
    ("NVIDIA H100 80GB HBM3", "h100", 989e12), ("NVIDIA H100 PCIe", "h100_pcie", 756e12),
    ("NVIDIA H100 NVL", "h100_nvl", 835.5e12), ("NVIDIA H200", "h200", 989e12),
    ("NVIDIA H200 NVL", "h200_nvl", 835.5e12), ("NVIDIA A100-SXM4-80GB", "a100", 312e12)])
def test_auto_hardware_tells_the_gpu_parts_apart(device_name, profile, bf16_peak, monkeypatch):
    """hardware=auto picks the profile from the CUDA device name: a PCIe or NVL H100 given
    the SXM part's peaks would understate its MFU by 16-24%."""
    from moe_exp import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: device_name)
    assert hardware.detect() == profile
    assert hardware.load_profile(profile)["peak_flops"]["bf16"] == bf16_peak


@pytest.mark.parametrize("args, key", [
    (["logger.project=team/moe"], "logger.project"),
    (["logger.tags=[" + "x" * 65 + "]"], "logger.tags"),
    (["logger.tags=[a,[b]]"], "logger.tags")])
def test_wandb_names_are_checked_before_the_run(args, key, tmp_path, monkeypatch):
    """W&B refuses these at wandb.init, which a deferred start reaches only after the run."""
    import moe_exp.tasks.protocol as runner

    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    rec = run_inproc(["logger=wandb", *args], tmp_path)
    assert rec["status"] == "invalid" and rec["error"].startswith(f"{key}: ")


def test_rank_env_without_master_and_huge_timeout_fail_first(monkeypatch):
    """RANK/WORLD_SIZE set by hand without MASTER_ADDR/PORT (torch's rendezvous traceback,
    no record) and a parallel.timeout_s torch cannot hold (it failed in the ranks): one line
    each, before any work."""
    from moe_exp.config import ConfigError, NotReady
    from moe_exp.validate import check_ranges, check_rendezvous

    for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["parallel=ddp", "hardware=cpu", "hardware.devices=2"])
    with pytest.raises(NotReady, match="MASTER_ADDR: RANK and WORLD_SIZE are set"):
        check_rendezvous(cfg)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_rendezvous(cfg)
    cfg.parallel.timeout_s = 1e14
    with pytest.raises(ConfigError, match="parallel.timeout_s: must be in "
                                          "1..1,000,000,000 seconds"):
        check_ranges(cfg)


def test_a_choice_read_from_the_environment_names_the_variable(tmp_path, monkeypatch):
    """logger.mode is ${oc.env:WANDB_MODE,offline}: the user set WANDB_MODE, not the key."""
    import moe_exp.tasks.protocol as runner

    monkeypatch.setattr(runner, "execute", lambda *a, **k: pytest.fail("work started"))
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    rec = run_inproc(["train.steps=2"], tmp_path)
    assert (rec["status"], rec["error"]) == ("invalid", "WANDB_MODE: 'dryrun' is not one of: "
                                             "offline, online, disabled (it sets logger.mode)")
    rec = run_inproc(["train.steps=2", "logger.mode=dryrun"], tmp_path)
    assert rec["error"].startswith("logger.mode: 'dryrun' is not one of")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr("moe_exp.tracking.wandb_credentials", lambda: False)
    rec = run_inproc(["train.steps=2"], tmp_path)
    assert rec["error"].startswith("WANDB_MODE: online needs W&B credentials")
    # logger=none with the mode it means is not a key left unread
    monkeypatch.delenv("WANDB_MODE")
    class Started(Exception):
        pass

    def bench(*a, **k):
        raise Started

    monkeypatch.setattr(runner, "execute", bench)
    with pytest.raises(Started):  # (nothing refused it)
        run_inproc(["logger=none", "logger.mode=disabled"], tmp_path)
