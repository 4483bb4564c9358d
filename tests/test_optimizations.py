"""Optimizations applied from outside: grad accumulation, compile."""
import contextlib
import json
import os

import pytest
import torch

from moe_exp.train.loop import micro_step
from moe_exp.model import build_model

from conftest import compose, run_cli, run_inproc


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense"])
def test_grad_accumulation_of_4_equals_one_batch_of_4B(model):
    # The Switch balance loss is not linear in the batch (f_e * P_e per micro-batch),
    # so it is switched off here; CE and z-loss are per-token means.
    cfg = compose([f"model={model}", "model.aux_loss_coef=0"]).model
    torch.manual_seed(0)
    a = build_model(cfg).double()
    b = build_model(cfg).double()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (8, 32))
    targets = torch.randint(0, cfg.vocab_size, (8, 32))
    null = contextlib.nullcontext
    for i in range(4):
        micro_step(a, tokens[2 * i: 2 * i + 2], targets[2 * i: 2 * i + 2], null, None, 4)
    micro_step(b, tokens, targets, null, None, 1)
    for ga, gb in zip(_grads(a), _grads(b)):
        torch.testing.assert_close(ga, gb, rtol=1e-9, atol=1e-12)


def test_grad_accum_run_processes_4x_tokens(tmp_path):
    rec = run_inproc(["logger=none", "train.grad_accum_steps=4", "train.steps=3"], tmp_path)
    assert rec["status"] == "ok" and rec["tokens_per_step"] == 4 * 8 * 128


@pytest.mark.parametrize("dispatch,dtype,routing,model", [
    ("loop", None, "learned", "tiny_moe"), ("grouped", torch.bfloat16, "learned", "tiny_moe"),
    ("padded", torch.bfloat16, "learned", "tiny_moe"), ("loop", None, "balanced", "tiny_moe"),
    ("padded", torch.bfloat16, "skewed", "tiny_moe"),
    ("loop", None, "learned", "tiny_deepseek"), ("padded", torch.bfloat16, "learned",
                                                 "tiny_qwen3"),
    ("loop", None, "learned", "tiny_moe model.capacity_factor=1"),
    ("padded", torch.bfloat16, "learned",
     "tiny_moe model.capacity_factor=1.25 model.pad_to_capacity=true")])
def test_moe_dispatch_compiles_without_graph_breaks(dispatch, dtype, routing, model):
    """The dispatches `auto` picks under torch.compile: loop (fp32), grouped_mm (GPU, bf16),
    padded (CPU, bf16); with a set routing load; DeepSeek's (MLA, shared experts, a dense
    first block, sigmoid group-limited routing) and Qwen3's options; token capacity, and
    padded to it."""
    import torch._dynamo as dynamo

    from moe_exp.model.moe import grouped_mm_supported
    from moe_exp.optimizations.compile import apply_compile

    if dispatch == "grouped" and not grouped_mm_supported("cpu", dtype):
        pytest.skip("grouped_mm does not run here")
    cfg = compose([f"model={model.split()[0]}", *model.split()[1:],
                   f"model.dispatch={dispatch}", f"model.routing={routing}"]).model
    model = build_model(cfg)
    assert model.layers[-1].ffn.dispatch == dispatch
    apply_compile(torch.nn.Identity(), "default")  # sets the dynamo flags the run uses
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    dynamo.reset()
    with ctx:
        explain = dynamo.explain(model)(tokens, tokens)
    # no break, and none dynamo "cannot resume from" (then it skips the rest of the
    # function without counting a break: a Hydra config read in forward once did that)
    assert explain.graph_break_count == 0 and not explain.break_reasons, explain.break_reasons
    assert explain.graph_count == 1


# One layer and a small batch: the fewest kernels to compile cold (most of a compile's time
# on a CPU is the C++ compiler's, a kernel at a time). The padded dispatch: its kernels are
# those test_padded_dispatch_compiles_and_matches_eager needs (inductor's cache holds them).
COMPILED = ["logger=none", "train.plan=false", "model.dispatch=padded", "model.num_layers=1",
            "train.seq_len=32",
            "train.micro_batch_size=2", "train.steps=3", "train.warmup_steps=1",
            "train.compile=default"]


@pytest.fixture(scope="module")
def cold_compile(tmp_path_factory):
    """A compiled run on an empty inductor cache, dynamo's own reset: every graph compiled
    cold. The tests here share it (its record; the cache it filled) rather than each
    compiling the same graphs cold again."""
    d = tmp_path_factory.mktemp("compile")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(d / "cache"))
        torch._dynamo.reset()
        return d / "cache", run_inproc(COMPILED, d / "cold")


@pytest.mark.slow
def test_compiled_run_matches_eager_losses(tmp_path, cold_compile, monkeypatch):
    cache, compiled = cold_compile
    eager = run_inproc([*COMPILED, "train.compile=off"], tmp_path / "eager")
    assert compiled["status"] == "ok", compiled["error"]
    assert compiled["compile_s"] > 0
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-3)
    assert eager["compile_cache_hit_share"] is None
    assert eager["null_reasons"]["compile_cache_hit_share"] == "train.compile=off"
    # a run in the same process compiles afresh (dynamo reset) from inductor's cache; its
    # plan is of the compiled step (AOTAutograd's partition, fused), its check the CPU
    # allocator's live bytes in the last warmup step (-1.8% measured)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    again = run_inproc([*COMPILED, "train.plan=true", "train.warmup_steps=2"],
                       tmp_path / "again")
    assert again["compile_cache_hit_share"] == 1.0  # the cold run's graphs, each a hit
    assert again["planned_memory_basis"].startswith("compiled step")
    assert abs(again["planned_peak_error"]) < 0.10, again["null_reasons"]


@pytest.mark.slow
def test_compile_cache_hit_share_tells_a_cold_cache_from_a_warm_one(tmp_path, cold_compile):
    """compile_s depends on inductor's cache: the record says how warm it was (cold: the
    shared cold run; warm: a process of its own on the cache it filled)."""
    cache, cold = cold_compile
    p = run_cli([*COMPILED, f"hydra.run.dir={tmp_path}/warm"], tmp_path,
                env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert p.returncode == 0, p.stderr[-3000:]
    warm = json.loads((tmp_path / "warm" / "metrics.json").read_text())
    assert [cold["compile_cache_hit_share"], warm["compile_cache_hit_share"]] == [0.0, 1.0]


def test_compile_cache_off_is_null_with_its_reason(tmp_path, monkeypatch):
    """TORCHINDUCTOR_FX_GRAPH_CACHE=0 (fx_graph_cache off): inductor counts no lookup (hit,
    miss or bypass) for a graph it compiles, so the share is null and says why (a function
    of one kernel shows it: a model's run compiles two dozen)."""
    from omegaconf import OmegaConf

    from moe_exp.tasks.bench_record import graph_counts, record_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    before = graph_counts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch._dynamo.reset()
        torch.compile(lambda x: (x.sin() + 1).sum())(torch.randn(8))
    counts = [a - b for a, b in zip(graph_counts(), before)]
    rec = {"null_reasons": {}}
    record_compile_cache(rec, OmegaConf.create({"train": {"compile": "default"}}), *counts[:4])
    assert counts[0] >= 1 and rec["compile_cache_hit_share"] is None
    assert "FX_GRAPH_CACHE=0" in rec["null_reasons"]["compile_cache_hit_share"]


@pytest.mark.slow
def test_padded_dispatch_compiles_and_matches_eager(cold_compile, monkeypatch):
    """Inductor lowers the padded dispatch (a data-dependent capacity) in a whole model
    (a size-1 capacity once failed to lower) and gets eager's loss and gradients."""
    from moe_exp.optimizations.compile import apply_compile

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cold_compile[0]))  # (its C++ kernels)

    # one layer: what lowers in one lowers in each (24 kernels to compile cold, not 34)
    cfg = compose(["model.dispatch=padded", "model.num_layers=1"]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    ref = model(tokens, tokens).loss
    g_ref = torch.autograd.grad(ref, list(model.parameters()))
    torch._dynamo.reset()
    compiled = apply_compile(model, "default")
    loss = compiled(tokens, tokens).loss
    g = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_comm_time_is_the_union_of_collective_intervals():
    """gloo runs collectives on two worker threads at once and the caller's c10d event
    encloses its worker's; on a GPU, FSDP's all-gather and reduce-scatter kernels run on
    separate streams: the time with any collective in flight counts once."""
    from types import SimpleNamespace as NS

    from moe_exp.optimizations.parallel import comm_times

    def comm_ms_per_step(prof, steps):
        return comm_times(prof, steps)[0]

    def ev(name, start, end, device="CPU"):
        return NS(name=name, time_range=NS(start=start, end=end), device_type=device)

    gpu = [ev("nccl:all_gather", 0, 1000), ev("ncclDevKernel_AllGather", 0, 600, "CUDA"),
           ev("ncclDevKernel_ReduceScatter", 400, 1000, "CUDA"),  # another stream
           ev("ncclDevKernel_AllReduce", 2000, 2100, "CUDA")]
    assert comm_ms_per_step(NS(events=lambda: gpu), 1) == (1000 + 100) / 1e3  # kernels only

    events = [ev("c10d::allreduce_", 0, 1000), ev("gloo:all_reduce", 100, 900),  # nested
              ev("gloo:all_reduce", 500, 1500),  # another thread, overlapping
              ev("aten::mm", 1500, 9000),  # not a collective
              ev("gloo:all_reduce", 3000, 3500)]
    prof = NS(events=lambda: events)
    assert comm_ms_per_step(prof, 2) == (1500 + 500) / 1e3 / 2
    assert comm_ms_per_step(NS(events=lambda: []), 2) == 0.0


def test_exposed_comm_is_the_collective_time_no_compute_overlaps():
    """GPU: collective kernels while no other kernel runs (any stream); CPU: gloo's
    collectives while the rank runs no innermost op of its own (parents and waits aside)."""
    from types import SimpleNamespace as NS

    from moe_exp.optimizations.parallel import comm_times, overlap_us

    def comm_exposed_ms_per_step(prof, steps):
        return comm_times(prof, steps)[1]

    def ev(name, start, end, device="CPU", children=()):
        return NS(name=name, time_range=NS(start=start, end=end), device_type=device,
                  cpu_children=list(children))

    assert overlap_us([(0, 10), (5, 20)], [(15, 30), (40, 50)]) == 5
    gpu = [ev("nccl:all_gather", 0, 1000), ev("ncclDevKernel_AllGather", 0, 600, "CUDA"),
           ev("ncclDevKernel_ReduceScatter", 400, 1000, "CUDA"),
           ev("sm90_gemm", 200, 500, "CUDA"), ev("elementwise", 900, 1200, "CUDA")]
    assert comm_exposed_ms_per_step(NS(events=lambda: gpu), 1) == (1000 - 300 - 100) / 1e3
    mm = ev("aten::mm", 1500, 9000)
    cpu = [ev("c10d::allreduce_", 0, 1000), ev("gloo:all_reduce", 100, 900),
           ev("gloo:all_reduce", 500, 1500), ev("gloo:all_reduce", 3000, 3500),
           ev("aten::add_", 200, 300),  # computing while a collective runs: hidden
           ev("aten::linear", 0, 9000, children=[mm]), mm,  # (a parent is not compute)
           ev("c10d::wait", 1600, 1700), ev("record_param_comms", 0, 1000)]
    assert comm_exposed_ms_per_step(NS(events=lambda: cpu), 2) == (2000 - 100 - 500) / 1e3 / 2
    assert comm_exposed_ms_per_step(NS(events=lambda: cpu), 0) is None


@pytest.mark.parametrize("warmup,total", [(3, 23), (5, 8), (0, 10), (1, 2)])
def test_lr_schedule_peaks_once_and_ends_at_its_minimum(warmup, total):
    """Linear warmup to the peak, cosine to lr * min_lr_ratio on the last step (it stopped
    one step short: 0.107 for 0.1 by default; 0.325 with 5 warmup steps of 8)."""
    from types import SimpleNamespace

    from moe_exp.optim import lr_factor

    o = SimpleNamespace(lr_warmup_steps=warmup, min_lr_ratio=0.1, schedule="cosine")
    f = [lr_factor(s, total, o) for s in range(total)]
    assert f.count(1.0) == 1 and f.index(1.0) == max(0, warmup - 1)
    assert f[-1] == pytest.approx(0.1)
    assert all(a < b for a, b in zip(f[:f.index(1.0)], f[1:f.index(1.0) + 1]))  # rises
    assert all(a > b for a, b in zip(f[f.index(1.0):], f[f.index(1.0) + 1:]))  # then falls


def test_fsdp_prefetch_issues_the_next_blocks_all_gathers():
    """parallel.prefetch=2 (expert_fsdp: each block with its own sharded experts): a block
    prefetches its experts and the next two blocks with theirs in forward, its experts and
    the previous two (nearest first) in backward; the root the first two / last two."""
    from types import SimpleNamespace as NS

    from moe_exp.optimizations.parallel import _prefetch

    fwd, bwd = {}, {}

    def module(name):
        m = NS(name=name)
        m.set_modules_to_forward_prefetch = lambda ms: fwd.__setitem__(name, [x.name for x in ms])
        m.set_modules_to_backward_prefetch = lambda ms: bwd.__setitem__(name, [x.name for x in ms])
        return m

    units = [[module(f"b{i}"), module(f"e{i}")] for i in range(4)]
    _prefetch(module("root"), units, 2)
    assert fwd == {"b0": ["e0", "b1", "e1", "b2", "e2"], "b1": ["e1", "b2", "e2", "b3", "e3"],
                   "b2": ["e2", "b3", "e3"], "b3": ["e3"], "root": ["b0", "e0", "b1", "e1"]}
    assert bwd == {"b0": ["e0"], "b1": ["e1", "b0", "e0"], "b2": ["e2", "b1", "e1", "b0", "e0"],
                   "b3": ["e3", "b2", "e2", "b1", "e1"], "root": ["b3", "e3", "b2", "e2"]}


def test_tf32_switch_keeps_legacy_and_new_flags_in_step():
    """precision.tf32 on CUDA: after the switch every reader agrees and none raises (setting
    only the new fp32_precision flags made the legacy readers, which inductor's matmul
    lowering uses in torch 2.9-2.11, raise "mix of the legacy and new APIs")."""
    from moe_exp.optimizations.precision import set_matmul_precision

    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (True, False, True):
            set_matmul_precision(torch.device("cuda"), tf32)  # flags only: no GPU needed
            assert torch.backends.cuda.matmul.allow_tf32 is tf32
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
            assert torch.backends.cuda.matmul.fp32_precision == ("tf32" if tf32 else "ieee")
            assert torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cudnn.allow_tf32 = saved[1]


@pytest.mark.slow
def test_deterministic_makes_the_compiled_embedding_backward_repeat_eagers():
    """hardware.deterministic reaches inductor: without it the compiled embedding backward
    adds rows with atomics across threads (order, so bits, vary from call to call: compiled
    bf16 runs ended at different losses); with it, every call gives eager's gradient."""
    import torch.nn.functional as F

    from moe_exp.hardware import setup_backends

    cfg = compose(["hardware=cpu", "hardware.deterministic=true"])
    torch.manual_seed(0)
    w = torch.randn(64, 128, requires_grad=True)
    idx = torch.randint(0, 64, (8, 1024))  # every row picked ~128 times
    g = torch.randn(8, 1024, 128)
    (ref,) = torch.autograd.grad(F.embedding(idx, w), w, g)
    try:
        setup_backends(cfg)
        import torch._inductor.config as inductor

        assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic
        torch._dynamo.reset()
        f = torch.compile(lambda w, idx: F.embedding(idx, w))
        for _ in range(10):
            (gw,) = torch.autograd.grad(f(w, idx), w, g)
            assert torch.equal(gw, ref)
    finally:
        cfg.hardware.deterministic = False
        setup_backends(cfg)  # and back: a later job in this process must not inherit it
        torch._dynamo.reset()
    assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic


def test_deterministic_runs_refuse_an_op_without_a_deterministic_kernel(monkeypatch, tmp_path):
    """hardware.deterministic is torch's strict mode: an op with no deterministic kernel
    stops the run with one line naming it (warn_only let such runs go on and, on GPUs, kept
    the fused attention kernels' backward non-deterministic: on an H100 cuDNN's was)."""
    from moe_exp.hardware import set_deterministic
    from moe_exp.model import transformer

    norm = transformer.RMSNorm.forward

    def forward(self, x):  # put_ has no deterministic kernel on CPU either
        torch.zeros(4).put_(torch.tensor([0, 1]), torch.ones(2))
        return norm(self, x)

    monkeypatch.setattr(transformer.RMSNorm, "forward", forward)
    tiny = ["logger=none", "train.steps=2", "train.warmup_steps=0", "train.micro_batch_size=1"]
    try:
        rec = run_inproc([*tiny, "hardware.deterministic=true"], tmp_path / "det")
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        set_deterministic(False)
    assert rec["status"] == "error"
    assert rec["error"].startswith("hardware.deterministic: put_ has no deterministic kernel")
    assert "\n" not in rec["error"]
    off = run_inproc(tiny, tmp_path / "off")
    assert off["status"] == "ok" and not torch.are_deterministic_algorithms_enabled()


def test_deterministic_cuda_runs_get_a_fixed_cublas_workspace(monkeypatch):
    """Set for the run and its ranks (hardware_env, a sweep job's process), not left behind;
    the shell's own value wins."""
    from moe_exp.hardware import env_for, hardware_env

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    gpu = {"device": "cuda", "deterministic": True, "env": {"A_B": 1}}
    assert env_for(gpu) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "A_B": "1"}
    assert env_for({**gpu, "deterministic": False}) == env_for({**gpu, "device": "cpu"}) \
        == {"A_B": "1"}
    with hardware_env(compose(["hardware.device=cuda", "hardware.deterministic=true"]).hardware):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert "CUBLAS_WORKSPACE_CONFIG" not in env_for(gpu)


def test_router_dtype_fp32_runs_the_gate_in_fp32_under_autocast():
    """precision.router_dtype=fp32: every MoE router's gate matmul in fp32 under bf16
    autocast (compute: autocast's bf16), same parameters and names, applied by `apply`."""
    from moe_exp.model import build_model
    from moe_exp.optimizations import apply
    from moe_exp.optimizations.precision import FP32Linear

    cfg = compose(["precision=bf16", "precision.router_dtype=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    gate = model.layers[0].ffn.router.gate
    x = torch.randn(40, cfg.model.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gate(x).dtype == torch.bfloat16
    applied = apply(model, cfg, torch.device("cpu"))
    assert all(type(b.ffn.router.gate) is FP32Linear for b in model.layers)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gate(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ gate.weight.T, rtol=0, atol=0)
    assert [n for n, _ in applied.model.named_parameters()] == names


class _Actions:
    """A pipeline stage's actions, each taking `spend` seconds of a fake clock."""

    def __init__(self, clock, spend: float):
        self.clock, self.spend = clock, spend

    def forward_one_chunk(self, *_):
        self.clock[0] += self.spend

    backward_one_chunk = backward_weight_one_chunk = perform_reduce_grad = forward_one_chunk


def test_a_pipelines_action_clock_splits_the_time_no_action_runs(monkeypatch):
    """parallel.pp's pp_bubble_share, pp_overhead_share and pp_stage_ms on a CPU: a step of
    10 s in which a forward and a backward of 2 s each run, 3 s waiting in torch's
    _wait_batch_p2p (a hand-off) and 3 s elsewhere (posting, bookkeeping), has a bubble of
    0.3, an overhead of 0.3 and 4 s in its actions; a forward outside a step (eval) is not
    counted; a loss the clock times is, and so is a stage's gradient reduction after its
    last backward (FSDP2's reduce-scatter: 2-3 ms of a 120 ms step on 2 gloo ranks)."""
    from torch.distributed.pipelining import schedules

    from moe_exp.optimizations.parallel import pipeline

    now = [0.0]
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now[0])
    wait = lambda works: now.__setitem__(0, now[0] + 3.0)  # noqa: E731
    monkeypatch.setattr(schedules, "_wait_batch_p2p", wait)
    clock = pipeline.ActionClock(torch.device("cpu"))
    stage = _Actions(now, 2.0)
    clock.wrap(stage)
    stage.forward_one_chunk()  # (no step open)
    for _ in range(2):
        with clock.step():
            schedules._wait_batch_p2p([])  # (as the schedule calls it)
            stage.forward_one_chunk()
            now[0] += 3.0
            stage.backward_one_chunk()
    assert schedules._wait_batch_p2p is wait  # (torch's own again after the step)
    assert clock.steps(0, 2) == [pytest.approx((0.3, 4.0, 0.3))] * 2
    assert clock.steps(1, 5) == [pytest.approx((0.3, 4.0, 0.3))]
    # the last stage's loss, which the schedule computes between actions, is work too
    loss = clock.timed(lambda: now.__setitem__(0, now[0] + 1.0))
    with clock.step():
        stage.forward_one_chunk()
        loss()
        now[0] += 5.0
    assert clock.steps(2, 3) == [pytest.approx((0.0, 3.0, 0.625))]
    with clock.step():
        stage.forward_one_chunk()
        stage.perform_reduce_grad(1)
        now[0] += 4.0
    assert clock.steps(3, 4) == [pytest.approx((0.0, 4.0, 0.5))]
    with pytest.raises(RuntimeError), clock.step():  # (a step that raised: not timed)
        raise RuntimeError
    assert len(clock.timed_steps) == 4 and schedules._wait_batch_p2p is wait


def test_a_pipelines_step_ends_where_its_ranks_meet(monkeypatch):
    """A rank's schedule step ends after the pp group's all-reduce of the step's figures,
    where every rank of the pipeline meets: a last stage done 3 s before the first (1F1B's
    drain) waits those 3 s there, its bubble, as the plan's schedule counts them; stacking
    its figures is work."""
    from types import SimpleNamespace

    from moe_exp.optimizations.parallel import pipeline

    now = [0.0]
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now[0])
    reduced = []
    monkeypatch.setattr(pipeline.dist, "all_reduce",
                        lambda t, group: reduced.append(now.__setitem__(0, now[0] + 3.0)))
    clock = pipeline.ActionClock(torch.device("cpu"))
    stage = _Actions(now, 2.0)
    clock.wrap(stage)

    def stacked(device):
        now[0] += 1.0
        return torch.zeros(1)

    rank = SimpleNamespace(stages=[], _ces=[], rows=1, is_first=True, is_last=False,
                           clock=clock, group=None, _stacked=stacked,
                           _gathered=lambda flat: flat,
                           schedule=SimpleNamespace(step=lambda *a, **k:
                                                    stage.forward_one_chunk(),
                                                    eval=lambda *a, **k: None))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    pipeline.PipelineModel.forward(rank, tokens, tokens)
    assert clock.steps(0, 1) == [pytest.approx((0.5, 3.0, 0.0))] and len(reduced) == 1
    with torch.no_grad():  # (an evaluation: its figures summed too, no step timed)
        pipeline.PipelineModel.forward(rank, tokens, tokens)
    assert len(reduced) == 2 and len(clock.timed_steps) == 1


def test_a_compiled_run_compiles_as_a_process_of_its_own():
    """In-process runs (a sweep's, a benchmark's) compile as separate processes would: the
    8th of 8 compiled runs of tiny_moe and small_moe in one process failed in inductor's
    code ("name 'u144' is not defined": benchmarks/plan_rows.py, CPU rows) until a
    compiled run's apply reset dynamo (what an earlier run compiled is gone)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from moe_exp.optimizations import apply

    def double(x):
        return x * 2

    torch.compile(double, backend="eager")(torch.ones(2))
    assert _debug_get_cache_entry_list(double)
    cfg = compose(["model=tiny_moe", "hardware=cpu", "model.num_layers=1"])
    apply(build_model(cfg.model), cfg, torch.device("cpu"))  # (eager: nothing reset)
    assert _debug_get_cache_entry_list(double)
    cfg.train.compile = "default"
    apply(build_model(cfg.model), cfg, torch.device("cpu"))
    assert not _debug_get_cache_entry_list(double)
