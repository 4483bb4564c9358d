"""The model: forward/backward, dropless dispatch against a naive per-token reference."""
import warnings

import pytest
import torch
import torch.nn.functional as F

from moe_exp.bench.flops import param_counts
from moe_exp.model import MoE, build_model, grouped_mm_supported
from moe_exp.model.moe import _grouped_mm

from conftest import compose

DISPATCHES = ["loop", "padded"] + (["grouped"] if grouped_mm_supported("cpu", torch.float32) else [])


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: out[t] = sum_j w_tj * SwiGLU_{e_tj}(x[t]), over the choices kept
    (with a capacity: those drop_over_capacity keeps)."""
    from moe_exp.model.capacity import capacity, drop_over_capacity

    flat = x.reshape(-1, x.shape[-1])
    _, _, weights, experts = moe.router(flat)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if moe.capacity_factor is not None:
        cap = capacity(flat.shape[0], moe.top_k, moe.num_experts, moe.capacity_factor)
        kept = drop_over_capacity(experts, weights, moe.num_experts, cap,
                                  moe.drop_policy)[0].view_as(experts) < moe.num_experts
    ex = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros_like(flat[t])
        for j in range(moe.top_k):
            e = experts[t, j]
            if not kept[t, j]:
                continue
            h = F.silu(flat[t] @ ex.w1[e]) * (flat[t] @ ex.w3[e])
            acc = acc + weights[t, j] * (h @ ex.w2[e])
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_dispatch_matches_naive_reference(dispatch):
    torch.manual_seed(0)
    moe = MoE(32, 48, num_experts=6, top_k=2, dispatch=dispatch)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 7, 32, requires_grad=True)
    out, balance, _, z, counts, _ = moe(x)
    assert counts.sum() == 3 * 7 * 2 and counts.shape == (6,)
    x_ref = x.detach().clone().requires_grad_()
    ref = naive_moe(moe, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *moe.experts.parameters(), moe.router.gate.weight], g)
    grads_ref = torch.autograd.grad(ref, [x_ref, *moe.experts.parameters(),
                                          moe.router.gate.weight], g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


ROUTERS = {  # the router and expert options of DeepSeek-V3 and Qwen3 beside Mixtral's
    "sigmoid-groups-scaled-shared": dict(score_func="sigmoid", n_groups=3, topk_groups=2,
                                         route_scale=2.5, shared_ffn=40),
    "softmax-unnormalised": dict(route_norm=False),
    "sigmoid-balanced": dict(score_func="sigmoid", routing="balanced"),
    # token capacity below the load (each drop policy), and padded to it (static shapes)
    "capacity-score": dict(capacity_factor=0.8),
    "capacity-position": dict(capacity_factor=1.0, drop_policy="position", shared_ffn=24),
    "capacity-padded": dict(capacity_factor=1.25, pad_to_capacity=True),
}


@pytest.mark.parametrize("router, dispatch", [  # (pad_to_capacity runs the padded kernel)
    (r, d) for r in ROUTERS for d in DISPATCHES
    if d == "padded" or not ROUTERS[r].get("pad_to_capacity")])
def test_router_options_match_the_reference_in_every_dispatch(router, dispatch):
    """Sigmoid scores, group-limited choice, route_scale, unnormalised weights and shared
    experts: each dispatch equals the token-by-token reference, forward and backward; the
    weights are the chosen experts' scores (normalised where route_norm), times route_scale;
    group-limited tokens use experts of topk_groups groups only, the best by their top two."""
    torch.manual_seed(0)
    kw = ROUTERS[router]
    moe = MoE(32, 48, num_experts=6, top_k=2, dispatch=dispatch, **kw)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, 7, 32, requires_grad=True)
    out, balance, _, z, counts, _ = moe(x)
    if "capacity_factor" in kw:  # 42 choices, capacity ceil(f * 42 / 6) each: some dropped
        cap = -(-kw["capacity_factor"] * 42 // 6)
        assert counts.max() <= cap and counts.sum() < 42
    else:
        assert counts.sum() == 42
    assert torch.isfinite(balance)
    x_ref = x.detach().clone().requires_grad_()
    ref = naive_moe(moe, x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    params = [p for p in moe.parameters()]
    for a, b in zip(torch.autograd.grad(out, [x, *params], g),
                    torch.autograd.grad(ref, [x_ref, *params], g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    flat = x.detach().reshape(-1, 32)
    logits, probs, weights, experts = moe.router(flat)
    scores = logits.sigmoid() if kw.get("score_func") == "sigmoid" else logits.softmax(-1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(21))
    chosen = scores.gather(1, experts)
    if kw.get("route_norm", True):
        chosen = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, chosen * kw.get("route_scale", 1.0))
    if kw.get("n_groups", 1) > 1:
        best = scores.view(21, 3, 2).sum(-1).topk(2, dim=-1).indices  # groups of 2: top-2 = all
        for row, groups in zip(experts.tolist(), best.tolist()):
            assert {e // 2 for e in row} <= set(groups)


@pytest.mark.parametrize("policy", ["score", "position"])
def test_capacity_drops_exactly_the_policys_choices(policy):
    """Each expert keeps its `capacity` best choices: the highest routing weights (score;
    ties by token order) or the earliest tokens (position); the others are dropped."""
    from moe_exp.model.capacity import drop_over_capacity

    g = torch.Generator().manual_seed(3)
    experts = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(30)])  # (30, 2)
    weights = torch.rand(30, 2, generator=g)
    got = drop_over_capacity(experts, weights, 5, 7, policy)[0].view(30, 2)
    for e in range(5):
        pairs = [(t, j) for t in range(30) for j in range(2) if experts[t, j] == e]
        if policy == "score":
            pairs.sort(key=lambda p: -weights[p].item())
        want_kept = set(pairs[:7])
        for p in pairs:
            assert (got[p] == e) == (p in want_kept) and (got[p] in (e, 5))


def test_grouped_equals_loop():
    if "grouped" not in DISPATCHES:
        pytest.skip("grouped_mm not supported on this CPU build")
    torch.manual_seed(1)
    a = MoE(64, 96, num_experts=8, top_k=2, dispatch="grouped")
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.1)
    b = MoE(64, 96, num_experts=8, top_k=2, dispatch="loop")
    b.load_state_dict(a.state_dict())
    x = torch.randn(4, 16, 64)
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_set_routing_gives_the_load_asked_for(dispatch):
    """model.routing=balanced: every expert exactly the same count; skewed: the busiest at
    the max/mean asked for (within 5%); each token's k experts distinct, weighted by the
    router's own probabilities of them (renormalised: the router still learns); every
    dispatch equals the token-by-token reference, forward and backward."""
    torch.manual_seed(0)
    for routing, skew in (("balanced", 2.0), ("skewed", 1.5), ("skewed", 2.9)):
        moe = MoE(32, 48, num_experts=6, top_k=2, dispatch=dispatch, routing=routing,
                  skew=skew)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.2)
        x = torch.randn(4, 18, 32, requires_grad=True)  # 72 tokens, 144 choices: 24 each
        out, _, _, _, counts, _ = moe(x)
        load = (counts.max() / counts.float().mean()).item()
        assert moe.router.largest(72) == counts.max()  # (padded's capacity, from sizes)
        if routing == "balanced":
            assert counts.tolist() == [24] * 6
        else:
            assert load == pytest.approx(skew, rel=0.05)
        _, probs, weights, experts = moe.router(x.detach().reshape(-1, 32))
        assert all(len(set(row)) == 2 for row in experts.tolist())
        chosen = probs.gather(1, experts)
        torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
        x_ref = x.detach().clone().requires_grad_()
        ref = naive_moe(moe, x_ref)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        g = torch.randn_like(out)
        params = [*moe.experts.parameters(), moe.router.gate.weight]
        grads = torch.autograd.grad(out, [x, *params], g)
        for a, b in zip(grads, torch.autograd.grad(ref, [x_ref, *params], g)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert grads[-1].abs().sum() > 0  # the router's gradient


def test_padded_dispatch_under_a_set_load_reads_no_value():
    """model.routing=balanced|skewed: the padded capacity comes from the sizes, no value
    read from the counts (learned: one, the largest count). Compiled with two MoE layers,
    inductor merged their alike, constant counts and left a capacity read from them
    undefined ("expected [u1] to have been codegen-ed"; tiny_moe bf16 compiled, balanced
    and skewed, runs since)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n = getattr(self, "n", 0) + (func is torch.ops.aten._local_scalar_dense.default)
            return func(*args, **(kwargs or {}))

    for routing, want in (("balanced", 0), ("skewed", 0), ("learned", 1)):
        moe = MoE(32, 48, num_experts=6, top_k=2, dispatch="padded", routing=routing,
                  skew=1.5)
        with Reads() as reads:
            moe(torch.randn(4, 18, 32))
        assert reads.n == want, routing


def test_balanced_run_records_a_load_of_exactly_one(tmp_path):
    """A run with model.routing=balanced: max/mean load 1.0 in every layer and every step."""
    from conftest import run_inproc

    rec = run_inproc(["logger=none", "model.routing=balanced", "train.steps=2",
                      "train.warmup_steps=0", "train.micro_batch_size=2"], tmp_path)
    assert rec["status"] == "ok"
    assert rec["expert_load_max_over_mean"] == rec["expert_load_step_max_over_mean"] == 1.0
    assert rec["expert_load_cv"] == 0.0


def test_router_weights_renormalised_and_aux_losses():
    torch.manual_seed(0)
    moe = MoE(16, 16, num_experts=4, top_k=2)
    _, probs, weights, experts = moe.router(torch.randn(10, 16))
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    assert (experts[:, 0] != experts[:, 1]).all()
    # A perfectly uniform router gives a Switch balance loss of exactly 1.
    torch.nn.init.zeros_(moe.router.gate.weight)
    _, balance, _, z, counts, _ = moe(torch.randn(64, 16))
    assert balance.item() == pytest.approx(1.0, abs=1e-6)
    assert z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-5)


@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense", "small_moe", "tiny_qwen3",
                                   "tiny_deepseek"])
def test_forward_backward_and_param_count(model):
    cfg = compose([f"model={model}"]).model
    torch.manual_seed(0)
    m = build_model(cfg)
    assert sum(p.numel() for p in m.parameters()) == param_counts(cfg)["params_total"]
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    out = m(tokens, tokens)
    # A fresh model predicts about uniformly: loss near ln(vocab).
    assert abs(out.ce.item() - torch.log(torch.tensor(float(cfg.vocab_size))).item()) < 0.5
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    if cfg.num_experts:  # (the MoE blocks': not first_k_dense's)
        assert out.counts.shape == (cfg.num_layers - cfg.first_k_dense, cfg.num_experts)
        assert (out.counts.sum(1) == 2 * 16 * cfg.top_k).all()


def test_model_file_knows_nothing_of_optimizations():
    import inspect

    import moe_exp.model.moe as moe_mod
    import moe_exp.model.transformer as tr

    src = inspect.getsource(tr) + inspect.getsource(moe_mod)
    for word in ("torch.utils.checkpoint", "torch.distributed", "GradScaler", "torch.compile(",
                 "fully_shard", "torch.autocast("):
        assert word not in src


def test_grouped_mm_probe_answers_the_same_under_no_grad_and_inference_mode():
    """The probe can run inside a forward (padded's fallback): the caller's grad mode must
    not turn "supported" into a cached "unsupported"."""
    from moe_exp.model import moe

    answers = []
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        moe._SUPPORTED.clear()
        with mode():
            answers.append(grouped_mm_supported("cpu", torch.float32))
    moe._SUPPORTED.clear()
    assert answers == [answers[0]] * 3


def test_grouped_mm_probe_reports_unsupported_dtype_cleanly():
    assert isinstance(grouped_mm_supported("cpu", torch.float16), bool)
    assert _grouped_mm is not None


def _lopsided_padded_moe(ffn: int) -> MoE:
    """hidden 16, 8 experts, top-2, padded; experts 0 and 1 win every (positive) token."""
    torch.manual_seed(2)
    a = MoE(16, ffn, num_experts=8, top_k=2, dispatch="padded")
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        a.router.gate.weight[:2] += 5.0
    return a


def test_padded_dispatch_with_one_hot_expert_matches_loop(monkeypatch):
    """All tokens prefer two of 8 experts: padded falls back to grouped/loop (no 4x
    padding: no bmm at all) and gives the loop's numbers."""
    bmm_calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: bmm_calls.append(1) or real_bmm(*a))
    a = _lopsided_padded_moe(ffn=24)
    b = MoE(16, 24, num_experts=8, top_k=2, dispatch="loop")
    b.load_state_dict(a.state_dict())
    x = torch.randn(512, 16).abs()
    ya, _, _, _, counts, _ = a(x)
    assert counts[2:].sum() == 0
    torch.testing.assert_close(ya, b(x)[0], rtol=1e-5, atol=1e-6)
    assert not bmm_calls
    assert (a.padded_calls, a.padded_fallbacks) == (1, 1)  # counted for the record
    a.router.gate.weight.data.normal_(std=0.01)  # balanced again: padded pads
    a(torch.randn(512, 16))
    assert len(bmm_calls) == 3
    assert (a.padded_calls, a.padded_fallbacks) == (2, 1)


def test_experts_padded_on_sorted_rows_matches_loop(monkeypatch):
    """The expert-sorted entry (what expert parallelism's local experts get) pads too (its
    three bmm run): same outputs and gradients as the loop, counts including an empty
    expert."""
    from moe_exp.model.moe import Experts

    bmm_calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a: bmm_calls.append(1) or real_bmm(*a))
    torch.manual_seed(3)
    ex = Experts(4, 16, 24)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.2)
    counts = torch.tensor([5, 0, 7, 6])
    x = torch.randn(18, 16, requires_grad=True)
    g = torch.randn(18, 16)
    outs = {}
    for mode in ("padded", "loop"):
        y = ex(x, counts, mode)
        outs[mode] = (y, *torch.autograd.grad(y, [x, *ex.parameters()], g))
    assert len(bmm_calls) == 3
    for a, b in zip(outs["padded"], outs["loop"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_dispatch_choice():
    from moe_exp.model.moe import resolve_dispatch

    grouped = grouped_mm_supported("cpu", torch.float32)
    assert resolve_dispatch("auto", "cpu", torch.bfloat16) == "padded"
    assert resolve_dispatch("auto", "cpu", torch.float32, compiled=True) == "loop"
    assert resolve_dispatch("auto", "cpu", torch.bfloat16, compiled=True) == "padded"
    assert resolve_dispatch("auto", "cpu", torch.float32) == ("grouped" if grouped else "loop")
    assert resolve_dispatch("loop", "cpu", torch.bfloat16) == "loop"
    # grouped_mm needs 16-byte strides: a hidden or ffn size off that grid gets the loop
    assert resolve_dispatch("auto", "cpu", torch.float32, sizes=(128, 255)) == "loop"
    assert resolve_dispatch("auto", "cuda", torch.bfloat16, sizes=(1028, 256)) == "loop"


@pytest.mark.parametrize("capability,dtype,want", [
    ((9, 0), torch.bfloat16, "grouped"), ((10, 0), torch.bfloat16, "grouped"),
    ((9, 0), torch.float32, "loop"), ((9, 0), torch.float16, "loop"),
    ((8, 0), torch.bfloat16, "loop")])
def test_auto_dispatch_on_cuda_takes_grouped_only_where_it_has_a_kernel(
        monkeypatch, capability, dtype, want):
    """grouped_mm's CUDA kernel is bf16 on sm90/sm100; elsewhere torch loops over the
    experts after a host sync per call: auto takes the loop (one sync per layer)."""
    from moe_exp.model import moe

    monkeypatch.setattr(moe, "grouped_mm_supported", lambda device, dtype: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert moe.resolve_dispatch("auto", "cuda", dtype, sizes=(1024, 1152)) == want
    assert moe.resolve_dispatch("grouped", "cuda", dtype, sizes=(1024, 1152)) == "grouped"
    # an explicit grouped runs as asked, with a warning where auto would not take it
    from moe_exp.optimizations.dispatch import resolve_model_dispatch

    cfg = compose(["model.dispatch=grouped", "precision="
                   + {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_model_dispatch(cfg, torch.device("cuda"))
    assert cfg.model.dispatch == "grouped"
    said = [str(w.message) for w in caught if "model.dispatch=grouped" in str(w.message)]
    assert len(said) == (want == "loop") and all("auto picks loop" in m for m in said)


def test_padded_fallback_with_unaligned_sizes_runs_the_loop():
    """ffn 252 in bf16 is off grouped_mm's 16-byte grid: unbalanced routing falls back to
    the loop, not to grouped_mm (which raised "strides should be multiple of 16 bytes")."""
    a = _lopsided_padded_moe(ffn=252)
    x = torch.randn(512, 16).abs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = a(x)[0]
    y.float().sum().backward()
    assert a.padded_fallbacks == 1 and torch.isfinite(a.experts.w2.grad).all()


def test_dispatch_probe_leaves_the_global_rng_alone():
    """The weights' init follows the probe: a probe drawing random numbers would make a
    run's weights depend on whether an earlier run in the process had probed (cached)."""
    from moe_exp.model import moe as moe_mod

    moe_mod._SUPPORTED.clear()
    torch.manual_seed(0)
    grouped_mm_supported("cpu", torch.float32)
    a = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_experts_with_no_rows(dispatch):
    """An expert-parallel rank may receive no tokens: every kernel returns (0, H)."""
    from moe_exp.model.moe import Experts

    ex = Experts(4, 8, 12)
    for p in ex.parameters():
        torch.nn.init.normal_(p)
    y = ex(torch.zeros(0, 8, requires_grad=True), torch.zeros(4, dtype=torch.long), dispatch)
    y.sum().backward()
    assert y.shape == (0, 8) and ex.w1.grad is not None and ex.w1.grad.abs().sum() == 0


@pytest.mark.parametrize("dispatch", DISPATCHES)
@pytest.mark.parametrize("options", [{}, dict(n_groups=2), dict(capacity_factor=1.0),
                                     dict(capacity_factor=1.0, pad_to_capacity=True)])
def test_moe_on_no_tokens(dispatch, options):
    """An empty batch gives an empty output and zero (not nan) aux losses (an expert-parallel
    rank may get none): with group-limited routing and token capacity too."""
    moe = MoE(8, 12, 4, 2, dispatch=dispatch, **options)
    out, balance, _, z, counts, _ = moe(torch.zeros(0, 3, 8, requires_grad=True))
    (out.sum() + balance + z).backward()
    assert out.shape == (0, 3, 8) and counts.tolist() == [0, 0, 0, 0]
    assert balance.item() == 0 and z.item() == 0
    assert moe.experts.w1.grad.abs().sum() == 0 and moe.router.gate.weight.grad.abs().sum() == 0


def _hints_seen(moe: MoE, xs: list[torch.Tensor], capture: bool) -> list[int]:
    """Trace moe under torch.compile (no inductor) on each input in turn and return the size
    hints its shape environments hold. (torch's own config.patch: pytest's monkeypatch
    deletes the option on undo, as torch's config module keeps values outside __dict__.)"""
    import torch._dynamo as dynamo
    from torch._guards import detect_fake_mode

    seen: list[int] = []

    def backend(gm, example_inputs):
        seen.extend(detect_fake_mode(example_inputs).shape_env.var_to_hint_override.values())
        return gm.forward

    with dynamo.config.patch(capture_scalar_outputs=capture):
        dynamo.reset()
        compiled = torch.compile(moe, backend=backend)
        for x in xs:
            torch.testing.assert_close(compiled(x)[0], moe(x)[0])
        dynamo.reset()
    return seen


@pytest.mark.skipif(not hasattr(torch._dynamo, "override_optimization_hint"),
                    reason="torch has no override_optimization_hint (older than 2.13)")
@pytest.mark.parametrize("dispatch", ["padded", "loop"])
def test_compiled_dispatch_hints_its_data_dependent_sizes(dispatch):
    """Without a hint inductor sizes these buffers at 0 bytes and fuses none of their loops
    (benchmarks/moe-layer.md#size-hints-for-compiled-code: 1.01-1.34x on the compiled layer)."""
    from moe_exp.model.moe import SIZE_HINT

    torch.manual_seed(0)
    moe = MoE(16, 32, 4, 2, dispatch=dispatch)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    xs = [torch.randn(24, 16), torch.randn(40, 16)]
    hints = _hints_seen(moe, xs[:1], True)
    # padded: its capacity; loop: each expert's row count
    assert hints == [SIZE_HINT] * (1 if dispatch == "padded" else 4)
    # .item() not traced: the graph breaks there, and the second token count makes the
    # sizes backed symbols (automatic dynamic shapes), which take no hint: no crash, none
    assert _hints_seen(moe, xs, False) == []


def test_repeated_kv_heads_give_grouped_attention(monkeypatch):
    """fp32 on CUDA repeats k/v heads (so SDPA can take its memory-efficient kernel): the
    same outputs and gradients as grouped heads, checked here by forcing that path."""
    from moe_exp.model import transformer

    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    k = torch.randn(2, 2, 16, 8, requires_grad=True)
    v = torch.randn(2, 2, 16, 8, requires_grad=True)
    assert not transformer.repeat_kv_heads(q)  # CPU: grouped heads as they are
    outs = {}
    for repeat in (False, True):
        monkeypatch.setattr(transformer, "repeat_kv_heads", lambda q: repeat)
        y = transformer.causal_attention(q, k, v)
        outs[repeat] = (y, *torch.autograd.grad(y, [q, k, v], torch.ones_like(y)))
    assert outs[True][2].shape == k.shape  # gradients summed back over the repeated heads
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pad_capacity_rounds_up_and_judges_balance_on_the_real_rows():
    """Capacity: the largest group rounded up to PAD_MULTIPLE rows (fewer distinct matmul
    shapes: on CPU in bf16 each new one builds oneDNN kernels); whether to fall back is
    judged on the real largest group, not the rounded one."""
    from moe_exp.model.moe import PAD_LIMIT, PAD_MULTIPLE, pad_capacity

    for top in (2, 17, 33, 100):
        counts = torch.tensor([top, 1, 1, 1])
        cap = pad_capacity(counts, int(counts.sum()) * 100)  # balanced enough
        assert cap % PAD_MULTIPLE == 0 and top <= cap < top + PAD_MULTIPLE
    # largest 65 of 300 rows: 8 * 65 = 520 <= PAD_LIMIT * 300 + 128 = 578 pads, though the
    # rounded 8 * 80 = 640 would not
    counts = torch.tensor([65, 35, 35, 35, 35, 35, 35, 25])
    assert int(counts.sum()) == 300 and 8 * 80 > PAD_LIMIT * 300 + 16 * 8
    assert pad_capacity(counts, 300) == 80
    skew = torch.tensor([80, 35, 35, 35, 35, 35, 35, 10])  # 8 * 80 > 578: falls back
    assert pad_capacity(skew, int(skew.sum())) is None


def test_aux_free_bias_balances_a_skewed_router_and_is_state_not_a_parameter(tmp_path):
    """model.bias_update_rate: with the router's weights fixed toward a few experts, the
    bias alone brings the load's CV down within a few dozen steps, with a capacity too (it
    follows the load routed, not the load kept: at capacity 1.0 every overloaded expert
    keeps the mean); the bias is in the model's state dict, never among its parameters
    (nor so the optimizer's), centred at 0, and only the choice sees it (weights stay the
    router's scores). A run records its spread."""
    from moe_exp.train.balance import BiasBalancer, bias_spread

    for cap in (None, 1.0):
        torch.manual_seed(0)
        moe = MoE(32, 16, num_experts=8, top_k=2, score_func="sigmoid", bias_rate=0.02,
                  capacity_factor=cap)
        with torch.no_grad():
            moe.router.gate.weight.normal_(std=0.3)
            moe.router.gate.weight[:2] += 0.5  # experts 0 and 1 favoured
        assert "router.expert_bias" in moe.state_dict()
        assert all("bias" not in n for n, _ in moe.named_parameters())
        balancer = BiasBalancer(moe)
        cvs = []
        for _ in range(40):
            *_, kept, routed = moe(torch.randn(128, 32) + 0.5)
            if not cvs:  # (the favoured experts' choices over capacity are dropped)
                assert routed.sum() == 128 * 2 and (kept.sum() < 256) == (cap is not None)
            cvs.append((routed.float().std(unbiased=False) / routed.float().mean()).item())
            balancer.add(routed[None])
            balancer.step()
        assert cvs[0] > 0.5 and sum(cvs[-5:]) / 5 < 0.4 * cvs[0], (cap, cvs)
        assert abs(moe.router.expert_bias.sum().item()) < 1e-5
    assert bias_spread(moe) == pytest.approx(
        (moe.router.expert_bias.max() - moe.router.expert_bias.min()).item())
    x = torch.randn(10, 32)
    logits, _, weights, experts = moe.router(x)
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, experts) /
                               logits.sigmoid().gather(1, experts).sum(-1, keepdim=True))
    from conftest import run_inproc

    rec = run_inproc(["logger=none", "model=tiny_deepseek", "model.bias_update_rate=0.01",
                      "train.steps=3", "train.warmup_steps=1", "train.micro_batch_size=2",
                      "train.seq_len=32"], tmp_path)
    assert rec["status"] == "ok" and rec["router_bias_spread"] > 0


def test_sequence_balance_loss_is_the_switch_loss_per_sequence(tmp_path):
    """model.seq_aux_loss_coef: the balance loss of each sequence's own choices and scores
    (DeepSeek-V3's sequence-wise L_Bal, Megatron's seq_aux_loss), averaged over the
    sequences: a loop over the sequences agrees; for one sequence it is the batch's loss;
    the trained loss adds it times its coefficient, and a run records it."""
    torch.manual_seed(0)
    moe = MoE(16, 24, num_experts=8, top_k=2, score_func="sigmoid", seq_aux=True)
    x = torch.randn(3, 10, 16)
    _, balance, seq, _, _, _ = moe(x)
    _, probs, _, experts = moe.router(x.reshape(-1, 16))
    per_seq = []
    for p, e in zip(probs.view(3, 10, 8), experts.view(3, 10 * 2)):
        f = torch.bincount(e, minlength=8).float() * 8 / e.numel()
        per_seq.append((f * p.mean(0)).sum())
    assert seq.item() == pytest.approx(torch.stack(per_seq).mean().item(), rel=1e-6)
    assert seq.item() != pytest.approx(balance.item(), rel=1e-3)  # (not the batch's)
    one = moe(x[:1])
    assert one[2].item() == pytest.approx(one[1].item(), rel=1e-6)
    assert MoE(16, 24, num_experts=8, top_k=2)(x)[2].item() == 0  # (off: not computed)

    cfg = compose(["model.seq_aux_loss_coef=0.5"]).model
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model(tokens, tokens)
    assert out.seq_balance.item() > 0
    assert out.loss.item() == pytest.approx((out.ce + cfg.aux_loss_coef * out.balance + 0.5 *
                                             out.seq_balance + cfg.z_loss_coef * out.z).item())
    from conftest import run_inproc

    short = ["logger=none", "train.plan=false", "train.steps=2", "train.warmup_steps=1",
             "train.micro_batch_size=2",
             "train.seq_len=16"]
    rec = run_inproc([*short, "model.seq_aux_loss_coef=0.001"], tmp_path / "on")
    assert rec["status"] == "ok" and rec["seq_aux_loss"] > 0
    rec = run_inproc(short, tmp_path / "off")
    assert rec["seq_aux_loss"] is None
    assert rec["null_reasons"]["seq_aux_loss"] == "model.seq_aux_loss_coef=0: not computed"
