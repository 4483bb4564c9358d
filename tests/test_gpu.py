"""CUDA checks (skipped where no GPU is visible)."""
import pytest
import torch

from moe_exp.model import MoE, grouped_mm_supported

from conftest import run_inproc

pytestmark = pytest.mark.gpu


def test_grouped_dispatch_on_cuda_matches_loop():
    if not grouped_mm_supported("cuda", torch.bfloat16):
        pytest.skip("grouped_mm not supported on this GPU")
    torch.manual_seed(0)
    a = MoE(256, 512, num_experts=8, top_k=2, dispatch="grouped").cuda()
    b = MoE(256, 512, num_experts=8, top_k=2, dispatch="loop").cuda()
    with torch.no_grad():  # (MoE leaves its experts uninitialised: Transformer fills them)
        for p in a.parameters():
            p.normal_(0, 0.05)
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 128, 256, device="cuda", requires_grad=True)
    outs = {}
    for name, m in (("grouped", a), ("loop", b)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)[0]
        g = torch.ones_like(y) / y.numel() ** 0.5
        outs[name] = [y.float(), *torch.autograd.grad(y, [x, *m.parameters()], g)]
    assert outs["grouped"][0].abs().mean() > 1e-3  # real outputs, not zeros of zero weights
    names = ["output", "x.grad"] + [f"{n}.grad" for n, _ in a.named_parameters()]
    for name, u, v in zip(names, outs["grouped"], outs["loop"]):  # forward and backward
        err = (u.float() - v.float()).abs().max() / v.float().abs().max().clamp(min=1e-6)
        assert err < 3e-2, (name, err.item())


@pytest.mark.parametrize("precision,compile_", [("bf16", "off"), ("tf32", "off"),
                                               ("fp16", "off"), ("tf32", "default")])
def test_cuda_run_records_allocator_peaks_and_mfu(precision, compile_, tmp_path):
    # tf32 compiled: inductor's matmul lowering reads the TF32 flags (pytorch#166387)
    rec = run_inproc([f"precision={precision}", "logger=none", "model=small_moe",
                      f"train.compile={compile_}"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["peak_mem_gib"] > 0 and rec["peak_reserved_gib"] >= rec["peak_mem_gib"]
    assert rec["alloc_ooms"] == 0 and rec["alloc_retries"] >= 0
    if rec["mfu"] is not None:
        assert 0 < rec["mfu"] < 1
    assert rec["loss_last"] < rec["loss_first"]


def test_muon_on_cuda_matches_torch_muon_and_trains(tmp_path):
    """Newton-Schulz on the GPU (bf16): the update is torch.optim.Muon's per expert, and a
    small_moe bf16 run with optim=muon trains."""
    from moe_exp.optim.muon import Muon

    if not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon to compare with")
    g = torch.Generator(device="cuda").manual_seed(0)
    stack = torch.randn(4, 64, 96, device="cuda", generator=g)
    grad = torch.randn(4, 64, 96, device="cuda", generator=g)
    ours = stack.clone().requires_grad_()
    ours.grad = grad.clone()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True, ns_steps=5)
    Muon([ours], torch.optim.AdamW([torch.zeros(1, device="cuda", requires_grad=True)]),
         **kw).step()
    ref = [stack[e].clone().requires_grad_() for e in range(4)]
    for r, gr in zip(ref, grad):
        r.grad = gr.clone()
    torch.optim.Muon(ref, adjust_lr_fn="match_rms_adamw", **kw).step()
    # The updates, as bf16 Newton-Schulz allows: our batched bmm and torch's per-matrix mm may
    # round differently on a GPU (one bf16 ulp of an update entry is ~2e-5 here; on CPU,
    # tests/test_muon.py checks several steps to 1e-6). A wrong lr scale or a transposed
    # NS would be off by far more than 3%.
    decayed = stack * (1 - kw["lr"] * kw["weight_decay"])
    ours_d, ref_d = ours.detach() - decayed, torch.stack([r.detach() for r in ref]) - decayed
    rel = ((ours_d - ref_d).norm() / ref_d.norm()).item()
    assert rel < 0.03, rel
    rec = run_inproc(["optim=muon", "precision=bf16", "logger=none", "model=small_moe"],
                     tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["loss_last"] < rec["loss_first"]


def test_fp32_grouped_heads_take_the_memory_efficient_kernel():
    """CUDA runs grouped k/v heads in flash (fp16/bf16) or the math kernel only; fp32 repeats
    them so SDPA takes the memory-efficient kernel, same values as the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from moe_exp.model.transformer import causal_attention

    q = torch.randn(2, 16, 512, 64, device="cuda")
    k = torch.randn(2, 4, 512, 64, device="cuda")
    v = torch.randn(2, 4, 512, 64, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = causal_attention(q, k, v)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_efficient_attention" in ops, sorted(ops)
    with sdpa_kernel(SDPBackend.MATH):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=True)
    torch.testing.assert_close(y, ref, rtol=2e-3, atol=2e-3)  # (TF32 may be on)


def test_grouped_mm_uneven_and_empty_groups():
    """Real routing gives any group sizes: odd ones and empty experts. grouped_mm's CUDA
    kernel asserts 16-byte-aligned, non-empty groups in some layouts (the weight gradient is
    a 2-D x 2-D product grouped along its K): forward and both gradients match per-expert
    matmuls here. Last in this file: a device-side assert would end the process's CUDA."""
    from moe_exp.model.moe import grouped_mm

    if not grouped_mm_supported("cuda", torch.bfloat16):
        pytest.skip("grouped_mm not supported on this GPU")
    torch.manual_seed(0)
    sizes = [13, 0, 1, 50, 7, 0, 33, 24]  # ends 13, 13, 14, 64, 71, 71, 104, 128
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(sum(sizes), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(sizes), 64, 96, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn(sum(sizes), 96, device="cuda", dtype=torch.bfloat16)
    y = grouped_mm(x, w, ends)
    gx, gw = torch.autograd.grad(y, [x, w], g)
    xs, gs = x.float().split(sizes), g.float().split(sizes)
    ref_y = torch.cat([a @ w[e].float() for e, a in enumerate(xs)])
    ref_gx = torch.cat([b @ w[e].float().T for e, b in enumerate(gs)])
    ref_gw = torch.stack([a.T @ b for a, b in zip(xs, gs)])
    for name, u, v in (("y", y, ref_y), ("x.grad", gx, ref_gx), ("w.grad", gw, ref_gw)):
        torch.testing.assert_close(u.float(), v, rtol=2e-2, atol=2e-1, msg=name)
    assert gw[1].abs().max() == 0 and gw[5].abs().max() == 0  # the empty experts


@pytest.mark.parametrize("model,compile_", [("small_deepseek", "off"),
                                           ("small_deepseek", "default"),
                                           ("small_qwen3", "off")])
def test_cuda_fine_grained_shared_and_sigmoid_routing_train(model, compile_, tmp_path):
    # many small experts, a shared expert, sigmoid scores with the balancing bias and the
    # per-sequence balance loss, all on the grouped CUDA path
    rec = run_inproc(["precision=bf16", "logger=none", f"model={model}",
                      f"train.compile={compile_}"], tmp_path)
    assert rec["status"] == "ok", rec["error"]
    assert rec["loss_last"] < rec["loss_first"]
    if model == "small_deepseek":
        assert rec["seq_aux_loss"] > 0


def test_cuda_profile_writes_a_memory_snapshot_and_nvml_figures(tmp_path):
    import importlib.util
    import pickle

    rec = run_inproc(["precision=bf16", "logger=none", "model=small_moe", "train.profile=true"],
                     tmp_path)
    assert rec["status"] == "ok", rec["error"]
    snap = pickle.loads((tmp_path / rec["memory_snapshot"]).read_bytes())
    assert snap["segments"] and abs(sum(rec["profile_shares"].values()) - 1) < 1e-9
    if importlib.util.find_spec("pynvml"):
        assert 0 <= rec["gpu_util_pct"] <= 100 and rec["gpu_power_w"] > 0
    else:
        assert rec["null_reasons"]["gpu_util_pct"].startswith("nvidia-ml-py is not installed")


def test_a_pipelines_action_clock_reads_cuda_events_after_the_steps():
    """On a GPU the pipeline's idle share comes from CUDA events, read once they are done:
    a step whose one action is a chain of matmuls, then as long again of matmuls outside
    it, idles about half of it."""
    from moe_exp.optimizations.parallel.pipeline import ActionClock

    class Stage:
        def forward_one_chunk(self, x):
            for _ in range(20):
                x = x @ x / x.shape[0]
            return x

        backward_one_chunk = backward_weight_one_chunk = forward_one_chunk

    clock, stage = ActionClock(torch.device("cuda")), Stage()
    clock.wrap(stage)
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        with clock.step():
            stage.forward_one_chunk(x)
            Stage.forward_one_chunk(stage, x)  # (the same work, not an action)
    steps = clock.steps(1, 3)
    assert len(steps) == 2 and all(0.3 < s < 0.7 and t > 0 and o is None
                                   for s, t, o in steps), steps
