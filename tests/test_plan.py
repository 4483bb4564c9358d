"""task=plan: a training step traced on fake tensors predicts the live tensor memory the
real step tracks (within 10%), for the hardware named, without allocating the model."""
import json

import pytest
import torch
from conftest import cli_inproc, compose, off_contract, run_cli, run_inproc

from moe_exp.plan.trace import measure_step, trace_step

PLAN = ["task=plan", "logger=none"]


@pytest.mark.parametrize("overrides", [
    "model=tiny_moe",
    "model=tiny_moe train.activation_checkpointing=full",
    "model=tiny_moe precision=bf16 train.activation_checkpointing=selective",
    "model=tiny_deepseek train.grad_accum_steps=2",
    "model=tiny_moe model.capacity_factor=0.5 optim=muon",
    "model=tiny_dense",
    "model=tiny_moe model.routing=skewed model.routing_skew=3",
])
def test_the_plan_predicts_the_real_steps_peak_within_10_percent(overrides):
    """The same two steps (the second with the optimizer's state) on real tensors, tracked
    by the same MemTracker: the plan's peak is within 10% (routing learned there, balanced
    in the plan), with the same parameters and optimizer state."""
    cfg = compose([*overrides.split(), "hardware=cpu", "train.micro_batch_size=4"])
    plan, real = trace_step(cfg), measure_step(cfg)
    assert abs(plan.peak_bytes / real.peak_bytes - 1) < 0.10, (plan, real)
    assert plan.at_peak["params"] == real.at_peak["params"] > 0
    assert plan.at_peak["optimizer"] == real.at_peak["optimizer"] > 0
    assert plan.flops > 0


def test_a_compiled_steps_plan_saves_what_the_partition_saves_and_fuses_pointwise_ops():
    """train.compile: the step's memory as AOTAutograd's min-cut partition and inductor's
    fusion make it. A pointwise op is a buffer only where an op it cannot fuse into reads
    it; a cat of ops read by it alone is one buffer they write into, from the first;
    full checkpointing saves the blocks' inputs, not their activations (checked against
    real compiled steps by the compiled bench run, tests/test_optimizations.py)."""
    from moe_exp.plan.compiled import fused_nodes, hoist_input_only, written_into_cats

    def f(x, w, i):
        y = (x.sin() * 2) @ w  # sin: fused into mul; mul: read by mm, a buffer
        return y.exp().sum(), torch.zeros_like(y).scatter(1, i, 1.0) * y  # a scatter on 0s
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(
        torch.randn(4, 4), torch.randn(4, 4), torch.zeros(4, 1, dtype=torch.long))
    fused = {n.target.overloadpacket.__name__ for n in fused_nodes(gm)}
    assert fused == {"sin", "exp", "zeros_like", "scatter"}, fused
    # (read by two ops: a sigmoid stored on a CPU, inlined on a GPU; a sin inlined)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x: ((s := x.sigmoid()) * 2 + s.sum(), (c := x.sin()) * 3 + c.sum()))(
        torch.randn(4, 4))
    on = {cpu: {n.target.overloadpacket.__name__ for n in fused_nodes(gm, cpu)}
          for cpu in (True, False)}
    assert "sin" in on[True] and "sigmoid" not in on[True] and "sigmoid" in on[False]
    # (what reads the inputs alone runs first, as inductor's scheduler runs it: sin)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda x, w: (x @ w) * x.sin())(
        torch.randn(4, 4), torch.randn(4, 4))
    hoist_input_only(gm)
    assert [str(n.target).split(".")[1] for n in gm.graph.nodes
            if n.op == "call_function"] == ["sin", "mm", "mul"]
    # (each expert's output written into the cat; b, read twice, copied into it)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x, w: (torch.cat([x @ w, (x @ w.t()).exp(), b := x @ x]), b))(
        torch.randn(4, 4), torch.randn(4, 4))
    first, into = written_into_cats(gm)
    names = {n: n.target.overloadpacket.__name__ for n in into}
    assert sorted(names.values()) == ["exp", "mm"] and [names[n] for n in first] == ["mm"]

    o = ["hardware=cpu", "model=tiny_moe", "model.num_layers=1", "train.seq_len=64",
         "train.micro_batch_size=4"]
    plans = {(c, ac): trace_step(compose([*o, f"train.compile={c}",
                                          f"train.activation_checkpointing={ac}"]))
             for c, ac in (("off", "none"), ("default", "none"), ("default", "full"))}
    # (this step compiled peaks 1.2% over the eager one, its plan -0.1% of it: the experts'
    # outputs held in their cat's buffer from the first)
    assert plans["default", "none"].peak_bytes != plans["off", "none"].peak_bytes
    assert plans["default", "full"].at_peak["activations"] < \
        plans["default", "none"].at_peak["activations"] / 4  # (measured: 8.2x fewer)


def test_a_plan_runs_for_hardware_this_machine_lacks(tmp_path):
    """hardware=h100 on a CPU: traced anyway; the step's FLOPs over the profile's bf16 peak;
    a memory it does not fit is a NO, and a profile without memory_gib a null with why."""
    o = [*PLAN, "model=small_moe", "hardware=h100", "precision=bf16"]
    rec = run_inproc([*o, "hardware.memory_gib=0.5"], tmp_path / "a")
    assert rec["status"] == "ok" and off_contract(rec) == set(), rec["error"]
    assert rec["tokens_per_s"] is None and rec["null_reasons"]["tokens_per_s"].startswith(
        "task=plan predicts")
    assert rec["planned_fits"] is False and rec["planned_peak_gib"] > 0.5 * 0.9
    # the roofline: no op faster than its FLOPs at the bf16 peak or its bytes at 3.35 TB/s
    assert rec["planned_step_ms"] == rec["planned_compute_ms"] + rec["planned_comm_ms"]
    assert rec["planned_comm_ms"] == 0 and rec["planned_compute_ms"] > max(
        rec["planned_flops_per_step"] / 989e12, rec["planned_peak_gib"] * 2**30 / 3.35e12) * 1e3
    assert rec["planned_mfu"] == pytest.approx(
        rec["planned_flops_per_step"] / 989e12 / (rec["planned_step_ms"] / 1e3))
    t = compose(o).train
    assert rec["planned_tokens_per_s"] == pytest.approx(
        t.micro_batch_size * t.seq_len / (rec["planned_step_ms"] / 1e3))
    parts = sum(rec[f"planned_{k}_gib"] for k in ("params", "grads", "optimizer", "activations",
                                                   "temporaries", "buffers", "collective",
                                                   "other"))
    assert parts == pytest.approx(rec["planned_peak_gib"])
    bare = run_inproc(o, tmp_path / "b")  # (the part's memory: its spec_memory_gib)
    assert bare["planned_memory_gib"] == 79.1 and bare["planned_fits"] is True


@pytest.mark.parametrize("override, says", [
    ("parallel=ddp parallel.comm_hook=powersgd hardware.devices=2",
     "error: parallel.comm_hook: task=plan traces DDP's comm_hook none|fp16|bf16, not powersgd"),
    ("parallel=expert hardware.devices=3", "error: parallel.expert_parallel_size: "
                                           "model.num_experts=8 is not divisible"),
    ("hardware.devices=2", "error: hardware.devices: parallel=none runs one rank"),
    ("precision=fp8", "error: precision: task=plan does not trace torchao's float8"),
    *([("hardware=a100", "error: hardware.memory_gib: hardware=a100 reads its memory from "
                         "the device, which is not here")] if not torch.cuda.is_available()
      else []),
    ("train.micro_batch_size=0", "error: train.micro_batch_size: must be >= 1"),
])
def test_bad_plans_fail_before_any_work(override, says, tmp_path):
    r = cli_inproc([*PLAN, *override.split()], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(says), r.stderr
    assert [json.loads(f.read_text())["status"] for f in tmp_path.glob("**/metrics.json")] \
        in ([], ["invalid"])


def test_an_fsdp_plan_shards_over_a_fake_process_group(tmp_path):
    """parallel=fsdp hardware.devices=64 on this one process: rank 0's shard of the
    parameters and optimizer state, FSDP's gathered ones as `collective`, no process group
    left behind."""
    import torch.distributed as dist

    one = run_inproc([*PLAN, "model=tiny_dense"], tmp_path / "one")
    two = run_inproc([*PLAN, "model=tiny_dense", "parallel=fsdp", "hardware.devices=2"],
                     tmp_path / "two")
    many = run_inproc([*PLAN, "model=tiny_dense", "parallel=fsdp", "hardware.devices=64"],
                      tmp_path / "many")
    assert one["status"] == two["status"] == many["status"] == "ok", many["error"]
    # (half, to FSDP2's padding of dim 0 to a multiple of the ranks)
    assert two["planned_params_gib"] == pytest.approx(one["planned_params_gib"] / 2, rel=1e-3)
    assert two["planned_optimizer_gib"] == pytest.approx(one["planned_optimizer_gib"] / 2,
                                                         rel=1e-3)
    assert many["planned_params_gib"] < one["planned_params_gib"] / 32
    assert many["world_size"] == 64 and many["planned_collective_gib"] > 0
    assert one["planned_comm"] == {} and one["planned_comm_gib"] == 0
    comm = two["planned_comm"]  # (FSDP fp32: the parameters gathered in the forward and
    # again in the backward, the gradients reduce-scattered)
    assert comm["all_gather"]["gib"] == pytest.approx(2 * comm["reduce_scatter"]["gib"])
    assert comm["reduce_scatter"]["gib"] == pytest.approx(2 * two["planned_params_gib"],
                                                          rel=0.01)
    assert not dist.is_initialized()


def test_an_fsdp_plans_optimizer_step_moves_its_shard_only():
    """FSDP2's parameters are DTensors: the optimizer step's ops on them count the rank's
    shard (the local ops DTensor runs), so over 2 ranks the step reads and writes half of
    one device's bytes (it counted the whole model's before). (A parallel plan steps AdamW
    for-loop: plan.trace.planned_config.)"""
    def optimizer_bytes(extra):
        ops = trace_step(compose(["hardware=cpu", "task=plan", "model=tiny_dense",
                                  "optim.impl=for-loop", *extra])).ops
        return sum(op[1] for op in ops.ops[ops.split:])

    one, two = optimizer_bytes([]), optimizer_bytes(["parallel=fsdp", "hardware.devices=2"])
    assert two == pytest.approx(one / 2, rel=0.1)  # (the norm for clipping: pow and sum)


@pytest.mark.parametrize("overrides", [
    ["model=tiny_moe", "parallel=expert_fsdp", "hardware.devices=4", "parallel.tp=2",
     "train.activation_checkpointing=selective"],
    ["model=tiny_deepseek", "train.grad_accum_steps=2", "train.activation_checkpointing=full"],
    # a pipeline: 2 and 3 MoE blocks a stage traced (blocks 0-5 and 6-11; uneven stages
    # are off by the one all-reduce of the whole model's expert counts, 1e-5 of a step's
    # collectives: its size follows every stage's blocks, not the rank's)
    ["model=tiny_moe", "parallel=fsdp", "hardware.devices=2", "parallel.pp=2",
     "model.num_layers=12", "train.micro_batch_size=2"],
])
def test_a_deep_model_is_planned_from_two_shallow_traces(tmp_path, overrides, monkeypatch):
    """train.plan_depth=auto traces 2 and 3 of a deep model's alike blocks (past its dense
    first) and extrapolates: every figure equals the whole model's trace, the peak's
    phase and split by kind too, and the record names the depths traced. A pipeline's
    stages are traced at 2 and 3 blocks each, and each rank's figures and actions' times
    extrapolated to its stages' blocks."""
    def flat(d, pre=""):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [(pre + k, v)]

    from moe_exp.plan import depth

    monkeypatch.setattr(depth, "MIN_BLOCKS", 6)  # (a whole trace of 6 blocks, not 8, to check)
    runs = {d: run_inproc([*PLAN, "model.num_layers=6", *overrides, "hardware=h100",
                           "precision=bf16", f"train.plan_depth={d}"], tmp_path / d)
            for d in ("auto", "full")}
    auto, full = ({k: v for k, v in flat(r) if k.startswith("planned")} for r in runs.values())
    lead = 1 if "model=tiny_deepseek" in overrides and "parallel.pp=2" not in overrides else 0
    assert runs["auto"]["planned_from_blocks"] == [lead + 2, lead + 3]
    assert runs["full"]["planned_from_blocks"] is None
    assert "plan_depth=full" in runs["full"]["null_reasons"]["planned_from_blocks"]
    auto.pop("planned_from_blocks"), full.pop("planned_from_blocks")
    assert auto.keys() == full.keys() and full["planned_step_ms"] > 0 < full["planned_mfu"]
    for k, v in full.items():
        close = isinstance(v, float) or isinstance(v, list) and all(isinstance(x, float)
                                                                     for x in v)
        assert auto[k] == (pytest.approx(v, rel=1e-9) if close else v), k


def test_a_long_pipelines_middle_ranks_are_planned_from_two_of_them(tmp_path):
    """pp 5, 1F1B: ranks 1 to 3 hold alike stages, so only ranks 0, 1, 3 and 4 are traced
    and rank 2 is on the line through 1 and 3 (its actions are theirs; it holds one
    micro-batch fewer in flight than rank 1): every figure equals the every-rank trace's."""
    def flat(d, pre=""):
        for k, v in d.items():
            yield from flat(v, f"{pre}{k}.") if isinstance(v, dict) else [(pre + k, v)]

    o = [*PLAN, "model=tiny_moe", "model.num_layers=5", "hardware=h100", "precision=bf16",
         "parallel=fsdp", "hardware.devices=5", "parallel.pp=5", "train.micro_batch_size=5"]
    auto, full = ({k: v for k, v in flat(run_inproc([*o, f"train.plan_depth={d}"],
                                                    tmp_path / d)) if k.startswith("planned")}
                  for d in ("auto", "full"))
    peaks = full["planned_pp_stage_peaks_gib"]
    assert peaks[1] - peaks[2] == pytest.approx(peaks[2] - peaks[3], rel=1e-6) != 0
    for k, v in full.items():
        assert auto[k] == (pytest.approx(v, rel=1e-9) if isinstance(v, (float, list)) else v), k


def test_a_plan_sweep_is_one_table_the_plans_that_fit_first(tmp_path):
    d = tmp_path / "s"
    r = run_cli(["-m", *PLAN, "train.micro_batch_size=8,2", "hardware.memory_gib=0.05",
                 "sweep.isolate=false", f"hydra.sweep.dir={d}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    import pandas as pd

    df = pd.read_csv(d / "results.csv")  # (every field, in job order)
    assert list(df["status"]) == ["ok", "ok"] and list(df["planned_fits"]) == [False, True]
    assert df["planned_peak_gib"].iloc[0] > df["planned_peak_gib"].iloc[1]
    rows = [x for x in (d / "results.md").read_text().splitlines() if x.startswith("| ")]
    assert "planned peak GiB" in rows[0] and "| yes " in rows[1] and "| NO " in rows[2]


def test_a_bench_run_records_its_plan_beside_what_it_measured(tmp_path):
    """train.plan (on by default): the run's plan in its record, checked against the live
    tensors of its last warmup step (within 10%) and its median step (the roofline at the
    peaks given), both errors planned / measured - 1; the terminal's plan line."""
    o = ["logger=none", "hardware=cpu", "train.steps=4", "++hardware.peak_flops.fp32=1e11",
         "hardware.memory_bandwidth=1e10"]
    rec = run_inproc(o, tmp_path / "on")
    assert rec["status"] == "ok", rec["error"]
    assert rec["planned_peak_error"] == rec["planned_peak_gib"] / rec["tracked_peak_gib"] - 1
    assert abs(rec["planned_peak_error"]) < 0.10 and rec["plan_s"] > 0
    assert rec["planned_step_error"] == pytest.approx(
        rec["planned_step_ms"] / rec["step_time_ms"] - 1)
    from moe_exp.tasks.summary import summary_rows

    line = dict(summary_rows(rec))["plan"]
    assert line.startswith(f"peak {rec['planned_peak_gib']:.3f} GiB planned, error ")
    off = run_inproc([*o, "train.plan=false"], tmp_path / "off")
    assert off["planned_peak_gib"] is None and off["tracked_peak_gib"] is None
    assert off["null_reasons"]["planned_peak_error"] == "train.plan=false"
    assert off["config_hash"] != rec["config_hash"]  # (a run without its check: its own row)


def test_the_roofline_takes_each_collective_over_its_groups_link():
    """FSDP over 16 ranks, 8 a node: its groups span two nodes, so each collective's bus
    share moves at network_bandwidth; over 8 ranks, within one node, at link_bandwidth.
    A task=comm record (hardware.comm_from) replaces both with its measured times."""
    from moe_exp.plan.roofline import call_seconds, measured_s

    for devices, key in ((16, "network_bandwidth"), (8, "link_bandwidth")):
        cfg = compose(["model=tiny_dense", "parallel=fsdp", f"hardware.devices={devices}",
                       "hardware=h100", "precision=bf16"])
        step = trace_step(cfg)
        want = sum(b * (2 if c == "all_reduce" else 1) * (devices - 1) / devices
                   for c, b, _ in step.ops.calls) / cfg.hardware[key] * 1e3
        each, why = call_seconds(step.ops, cfg.hardware)
        assert why is None and sum(each) * 1e3 == pytest.approx(want)
    curve = (2, [(1024, 10e-6), (2**20, 1e-3)])  # (measured on 2 ranks: bus share 1/2)
    assert measured_s(curve, "all_gather", 1024, 2) == 10e-6  # (a size measured)
    assert measured_s(curve, "all_gather", 32 * 1024, 2) == pytest.approx(
        10e-6 * (1e-3 / 10e-6) ** 0.5)  # (halfway in log size: the log-log line)
    assert measured_s(curve, "all_gather", 2**21, 8) == pytest.approx(2e-3 * (7 / 8) / (1 / 2))


def test_a_pipelines_sends_take_task_comms_send_row(tmp_path):
    """A pipeline's send and receive take a task=comm record's send row (a hand-off as a
    pipeline makes it), its post_us the sender's post; a record without one, a 2-rank
    all-to-all of twice the bytes."""
    import json
    from types import SimpleNamespace

    from moe_exp.plan.roofline import call_seconds, comm_curves

    rows = [{"op": "all_to_all", "bytes": 1024, "latency_us": 100.0},
            {"op": "send", "bytes": 1024, "latency_us": 30.0, "post_us": 5.0}]
    f = tmp_path / "metrics.json"
    f.write_text(json.dumps({"task": "comm", "status": "ok", "world_size": 2, "comm": rows}))
    curves = comm_curves(str(f))
    assert curves["send"] == (2, [(1024, 30e-6)]) and curves["send_post"] == (2, [(1024, 5e-6)])
    ops = SimpleNamespace(calls=[("send", 512, [0, 1]), ("recv", 512, [0, 1])])
    hw = SimpleNamespace(comm_from=str(f), devices_per_node=8)
    assert call_seconds(ops, hw) == ([30e-6, 30e-6], None)  # (below its sizes: its latency)
    f.write_text(json.dumps({"task": "comm", "status": "ok", "world_size": 2,
                             "comm": rows[:1]}))
    assert call_seconds(ops, hw) == ([100e-6, 100e-6], None)  # (all_to_all of 1,024 bytes)


def test_a_plan_that_does_not_fit_names_its_largest_memory_and_what_shrinks_it():
    from moe_exp.tasks.plan import summary_rows

    r = {"planned_memory_gib": 80.0, "planned_fits": False, "planned_peak_gib": 418.0,
         "planned_activations_gib": 339.0, "planned_optimizer_gib": 42.0, "seq_len": 32768,
         "null_reasons": {"planned_step_ms": "x"}, "planned_comm": None, "world_size": 1,
         "plan_s": 1.0, "micro_batch_size": 2, "hardware": "h100",
         "planned_flops_per_step": 1.0, "planned_step_ms": None}
    fits = dict(summary_rows({**r, "model": "m", "precision": "bf16"}))["fits"]
    assert fits.startswith("NO: 418 of 80 GiB") and "activations 339 GiB of it" in fits
    assert "train.seq_len=32768: a shorter sequence" in fits


def test_expert_stacks_are_sharded_where_their_dims_split_evenly():
    """FSDP2's placement of a block's expert stack (experts x in x out): dim 0 where the
    ranks split the experts; else the first of dims 1, 2 they split (FSDP2 pads dim 0
    only: an uneven dim 1 is refused); else dim 0 padded. tiny_moe over 3 ranks (8 x 128
    x 256: no dim splits by 3) plans, as it did before dim 1 (issue 49)."""
    from torch.distributed.tensor import Shard

    from moe_exp.model.moe import Experts
    from moe_exp.optimizations.parallel import expert_placement

    for shape, shards, want in [((8, 128, 256), 2, None), ((3, 128, 256), 2, Shard(1)),
                                ((8, 120, 256), 3, Shard(1)), ((8, 128, 96), 3, Shard(2)),
                                ((8, 128, 256), 3, None), ((1, 4096, 14336), 8, Shard(1))]:
        e = Experts(*shape)
        got = expert_placement(e, shards)
        assert got(e.w1) == want, (shape, shards)
        assert got(torch.nn.Parameter(torch.empty(3, 5))) is None  # (not the stack's)
    plan = trace_step(compose(["hardware=cpu", "parallel=fsdp", "hardware.devices=3"]))
    assert plan.at_peak["params"] > 0


def test_a_plan_says_its_phases_and_a_recompute_by_block(monkeypatch):
    """What a long plan's status line shows (screen.phase): forward by block, backward,
    and under full checkpointing each block's recompute in backward, last first."""
    import moe_exp.plan.trace as trace

    seen = []
    monkeypatch.setattr(trace, "phase", seen.append)
    trace.trace_step(compose(["hardware=cpu", "train.activation_checkpointing=full"]))
    assert seen == ["building the model on fake tensors", "the optimizer's state",
                    "forward, block 1 of 2", "forward, block 2 of 2", "backward",
                    "backward (recomputing), block 2 of 2",
                    "backward (recomputing), block 1 of 2", "the optimizer step"]


def test_the_plans_lazy_chunks_are_fsdp2s_chunks():
    """plan/trace._Chunks makes FSDP2's chunks of a parameter as they are asked for (made
    all at once over 256 ranks they took a third of a DeepSeek-V3 plan): each is the one
    FSDP2's _chunk_with_empty gives, empty tensors and ranks past the data included."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from moe_exp.plan.trace import _Chunks

    for size, n, dim in [(10, 4, 0), (3, 8, 0), (8, 8, 0), (7, 3, 1), (0, 4, 0), (1, 64, 0),
                         (0, 3, 1)]:
        t = torch.randn(size, 7) if dim == 0 else torch.randn(5, size)
        want, got = _chunk_with_empty(t, n, dim), _Chunks(t, n, dim)
        assert len(got) == len(want) == n
        for i in range(n):
            assert got[i].shape == want[i].shape and torch.equal(got[i], want[i])


def test_collective_groups_are_named_by_the_mesh_dims_they_span():
    """planned_comm_groups' names (config.group_dim): the group's ranks, stepping by the
    stride of the innermost dim of a run of adjacent mesh dims; expert parallel's dp x ep
    is its dp_shard."""
    from moe_exp.config import group_dim

    dims = [("dp", 2), ("ep", 2), ("tp", 2)]
    assert group_dim((0, 1), dims) == "tp"
    assert group_dim((0, 2), dims) == "ep"
    assert group_dim((0, 4), dims) == "dp"
    assert group_dim((1, 3, 5, 7), dims) == "dp_shard"
    assert group_dim(tuple(range(8)), dims) == "world"
    assert group_dim((0, 1), [("dp_shard", 2)]) == "dp_shard"
    assert group_dim((0, 1), [("dp_shard", 1), ("tp", 2)]) == "tp"
    assert group_dim((0, 1, 2, 3), dims) == "ep_tp"  # (parallel.etp=1's)


def test_a_tensor_parallel_plan_names_each_collectives_mesh_dim(tmp_path, capsys,
                                                               monkeypatch):
    """tp 2 x FSDP 2 on a fake process group of 4: rank 0's collectives split between the
    tp and dp_shard dims (planned_comm_groups, and the summary's collectives line);
    the parameters a quarter of one device's, as the record's tp and sp say; its FLOPs half
    of one device's on the same micro-batch (the local ops of DTensor's, not their global
    shapes nor sharding propagation's shape runs)."""
    monkeypatch.setenv("COLUMNS", "200")  # (the summary's lines unwrapped)
    one = run_inproc([*PLAN, "model=tiny_dense"], tmp_path / "one")
    rec = run_inproc([*PLAN, "model=tiny_dense", "parallel=fsdp", "hardware.devices=4",
                      "parallel.tp=2"], tmp_path / "tp")
    assert rec["status"] == "ok", rec["error"]
    assert rec["tp"] == 2 and rec["sp"] is True
    groups = rec["planned_comm_groups"]
    assert set(groups) == {"tp", "dp_shard"}
    assert sum(v["gib"] for g in groups.values() for v in g.values()) == \
        pytest.approx(rec["planned_comm_gib"])
    assert rec["planned_params_gib"] == pytest.approx(one["planned_params_gib"] / 4, rel=0.02)
    assert rec["planned_flops_per_step"] == pytest.approx(one["planned_flops_per_step"] / 2,
                                                          rel=1e-3)
    assert set(groups["tp"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    out = capsys.readouterr().out
    assert "tp: " in out and "dp_shard: " in out and "fsdp x tp 2 (sequence parallel)" in out


@pytest.mark.parametrize("schedule,pp,m,per", [("gpipe", 2, 2, 1), ("1f1b", 4, 8, 1),
                                               ("interleaved_1f1b", 4, 8, 2),
                                               ("zero_bubble", 2, 4, 2)])
def test_a_pipelines_simulated_bubble_is_its_schedules(schedule, pp, m, per):
    """plan/pipeline.py runs each rank's actions in the schedule's order with their times:
    with every stage's forward 1 and backward 2 (input and weight 1 each), the idle share is
    the textbook (p - 1) / (v m + p - 1) for GPipe, 1F1B and interleaved 1F1B, and zero
    bubble's split backward idles less than interleaved 1F1B."""
    from types import SimpleNamespace

    from moe_exp.plan.pipeline import schedule_order, simulate

    order = schedule_order(SimpleNamespace(pp=pp, pp_schedule=schedule,
                                           pp_stages_per_rank=per), m)
    assert sorted(a for rank in order for a in rank if a[1] == "F") == \
        [(s, "F", i) for s in range(pp * per) for i in range(m)]  # each forward once
    seconds = {(s, k): t / per for s in range(pp * per)
               for k, t in (("F", 1), ("B", 2), ("I", 1), ("W", 1))}
    span, busy, _ = simulate(order, seconds, 0.0)
    bubble = [1 - b / span for b in busy]
    textbook = (pp - 1) / (per * m + pp - 1)
    if schedule == "zero_bubble":
        assert max(bubble) < textbook
    else:
        assert bubble == pytest.approx([textbook] * pp)
    # a send between ranks delays what waits for it: the span grows
    assert simulate(order, seconds, 0.5)[0] > span


def test_a_pipelines_hand_off_starts_once_both_ranks_are_ready():
    """A send is a rendezvous: GPipe, 2 stages, 2 micro-batches, the second stage's forward
    twice the first's. Its second forward's data was sent (at 2) before it was ready (3.5):
    the hand-off (0.5) starts then, not at 2; a sender's post (0.25) comes after its action,
    before its next. Worked by hand: spans 10 and 10.5; busy time is the actions' alone
    (a gradient reduction of 0.5 after each stage's last backward: 10.5, busy 4.5 and 6.5)."""
    from types import SimpleNamespace

    from moe_exp.plan.pipeline import _with_reductions, each_action, schedule_order, simulate

    order = schedule_order(SimpleNamespace(pp=2, pp_schedule="gpipe"), 2)
    seconds = {(0, "F"): 1.0, (1, "F"): 2.0, (0, "B"): 1.0, (1, "B"): 1.0}
    assert simulate(order, seconds, 0.5) == (pytest.approx(10.0), [4.0, 6.0], [0.0, 0.0])
    # (posting, the rank's own time, not its bubble: rank 0 posts 2 forwards, rank 1 2
    # backwards)
    assert simulate(order, seconds, 0.5, 0.25) == (pytest.approx(10.5), [4.0, 6.0],
                                                   [0.5, 0.5])
    # each stage's gradient reduction runs after its last backward, on its rank alone: the
    # first stage's ends the step, busy time too
    assert [rank[-1] for rank in order] == [(0, "R", None), (1, "R", None)]
    seconds.update({(0, "R"): 0.5, (1, "R"): 0.5})
    assert simulate(order, seconds, 0.5)[:2] == (pytest.approx(10.5), [4.5, 6.5])
    zb = schedule_order(SimpleNamespace(pp=2, pp_schedule="zero_bubble",
                                        pp_stages_per_rank=2), 4)
    at = zb[0].index((2, "R", None))  # (torch's: after stage 2's last weight backward,
    assert zb[0][at - 1] == (2, "W", 3) and (0, "W", 3) in zb[0][at:]  # mid-schedule)
    # torch's lowering and the fallback deriving it (a torch without one) agree
    assert [_with_reductions([a for a in rank if a[1] != "R"], 4) for rank in zb] == zb
    # one action's time: a micro-batch's, of the step's total; a reduction's, whole
    assert each_action({(0, "F"): 4.0, (0, "R"): 1.0}, 4) == {(0, "F"): 1.0, (0, "R"): 1.0}


def test_a_pipeline_is_planned_stage_by_stage(tmp_path):
    """task=plan with parallel.pp=2 on an h100 profile: each stage's peak, its time in its
    actions, its sends, the simulated schedule's bubble; its step longer than the busiest
    stage's compute alone."""
    rec = run_inproc([*PLAN, "parallel=fsdp", "hardware.devices=2", "parallel.pp=2",
                      "hardware=h100", "parallel.pp_microbatches=4"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    peaks = rec["planned_pp_stage_peaks_gib"]
    assert len(peaks) == 2 and rec["planned_peak_gib"] == max(peaks)
    # one micro-batch of 2 x 128 tokens x hidden 128, fp32, each way, 4 micro-batches
    assert rec["planned_pp_send_gib"] * 2**30 == 4 * 2 * 128 * 128 * 4
    assert 0.1 < rec["planned_pp_bubble_share"] < 0.5  # 1f1b's textbook 1/5, and the sends
    assert rec["planned_step_ms"] > rec["planned_compute_ms"] / 2
    # the bubble is the stages' idle share of the schedule's span, within the step
    busy = rec["planned_pp_stage_ms"]
    assert len(busy) == 2 and min(busy) > 0
    span = sum(busy) / 2 / (1 - rec["planned_pp_bubble_share"])
    assert max(busy) < span <= rec["planned_step_ms"]
    assert rec["planned_tokens_per_s"] > 0 and rec["planned_from_blocks"] is None


def test_a_pipeline_split_by_planned_time_evens_its_stages(tmp_path):
    """parallel.pp_balance=time: DeepSeek's 3 dense first blocks plan at 0.6 of a MoE
    block's time on an h100 (each a difference of two plans of a stage's rank) against
    0.88 of its FLOPs, so its split puts 4 blocks on the first stage where FLOPs put 3:
    the stages' planned times come nearer each other and the step shortens (as planned:
    0.22 / 0.16 against 0.14 / 0.24 ms, the step -15%). A profile the plan cannot time
    refuses it in one line."""
    shape = [*PLAN, "model=tiny_deepseek", "model.num_layers=6", "model.first_k_dense=3",
             "parallel=fsdp", "hardware.devices=2", "parallel.pp=2", "hardware=h100"]
    runs = {b: run_inproc([*shape, f"parallel.pp_balance={b}"], tmp_path / b)
            for b in ("flops", "time")}
    assert runs["flops"]["pp_split"] == [3] and runs["time"]["pp_split"] == [4]
    spread = {b: max(r["planned_pp_stage_ms"]) / min(r["planned_pp_stage_ms"])
              for b, r in runs.items()}
    assert spread["time"] < spread["flops"]
    assert runs["time"]["planned_step_ms"] < runs["flops"]["planned_step_ms"]
    bad = run_inproc([*PLAN, "hardware=cpu", "parallel=fsdp", "hardware.devices=2",
                      "parallel.pp=2", "parallel.pp_balance=time"], tmp_path / "cpu")
    assert bad["status"] == "invalid"
    assert bad["error"].startswith("parallel.pp_balance: time needs the plan's time of a "
                                   "block: hardware=cpu gives no memory_bandwidth")


def test_a_bench_records_its_pipeline_plans_bubble_error():
    """A bench run with parallel.pp checks its planned bubble against the measured one
    (planned - measured, in shares) and each stage's time in its actions (planned /
    measured - 1); null with the plan's reason where there is none."""
    from moe_exp.plan.check import record_errors

    rec = {"null_reasons": {}, "planned_pp_bubble_share": 0.215, "pp_bubble_share": 0.229,
           "planned_pp_stage_ms": [90.0, 120.0], "pp_stage_ms": [100.0, 100.0]}
    record_errors(rec, cpu=True)
    assert rec["planned_pp_bubble_error"] == pytest.approx(-0.014)
    assert rec["planned_pp_stage_error"] == pytest.approx([-0.1, 0.2])
    pp1 = "parallel.pp=1: no pipeline"
    rec = {"null_reasons": {"planned_pp_bubble_share": pp1, "planned_pp_stage_ms": pp1},
           "planned_pp_bubble_share": None, "pp_bubble_share": None}
    record_errors(rec, cpu=True)
    assert rec["planned_pp_bubble_error"] is None and rec["planned_pp_stage_error"] is None
    assert rec["null_reasons"]["planned_pp_bubble_error"] == pp1
    assert rec["null_reasons"]["planned_pp_stage_error"] == pp1
