"""Analytic FLOPs per token (the record's flops_per_token) vs FlopCounterMode on a real step."""
import pytest
import torch

from moe_exp.flop_check import check, count_step_flops
from moe_exp.model import MoE, grouped_mm_supported


@pytest.mark.parametrize("overrides", [
    ["model=tiny_dense"],
    ["model=tiny_moe", "model.dispatch=loop"],
    ["model=small_moe", "precision=bf16", "model.dispatch=grouped"],
    ["model=tiny_qwen3", "model.dispatch=loop"],
    ["model=tiny_deepseek", "model.dispatch=loop"],
    # token capacity: the useful FLOPs, those of the choices kept
    ["model=tiny_deepseek", "model.dispatch=loop", "model.capacity_factor=0.5"],
])
def test_analytic_flops_match_counted_step(overrides):
    if "model.dispatch=grouped" in overrides and not grouped_mm_supported("cpu", torch.bfloat16):
        pytest.skip("grouped_mm does not run here")
    r = check([*overrides, "train.micro_batch_size=2", "train.seq_len=64"])
    assert r["counted_per_token"] > 0
    assert abs(r["rel_diff"]) <= 0.02, r
    # attention is counted explicitly (CPU SDPA counts 0 without our formulas); MLA's
    # (value dims unlike q.k's) runs SDPA's math kernel there: matmuls FlopCounterMode counts
    assert "model=tiny_deepseek" in overrides or any("attention" in op and v > 0 for op, v in r["by_op"].items()), r["by_op"]
    if "model=small_moe" in overrides:
        assert r["by_op"]["aten._grouped_mm"] > 0


def _presets():
    """Every model preset but those a real step above counts."""
    from moe_exp.config import group_options

    return [m for m in group_options("model")
            if m not in ("tiny_dense", "tiny_moe", "small_moe", "tiny_qwen3", "tiny_deepseek")]


@pytest.mark.parametrize("model", _presets())
def test_every_presets_flops_on_meta_device(model):
    """Every other preset, its real shape layer for layer (at most 2 blocks past the dense
    first ones: each block of a kind is the same), on the meta device."""
    from conftest import compose

    m = compose([f"model={model}"]).model
    layers = min(m.num_layers, m.first_k_dense + 2)
    r = check([f"model={model}", f"model.num_layers={layers}", "train.micro_batch_size=1",
               "train.seq_len=64"], device="meta")
    assert abs(r["rel_diff"]) <= 0.02, r


@pytest.mark.parametrize("model, total, active", [("qwen3_30b_a3b", 30.5e9, 3.3e9),
                                                  ("deepseek_v3", 671e9, 37e9)])
def test_real_shapes_count_their_published_parameters(model, total, active):
    """The model cards' totals: Qwen3-30B-A3B 30.5B (3.3B active), DeepSeek-V3 671B (37B)."""
    from conftest import compose
    from moe_exp.bench.flops import param_counts

    c = param_counts(compose([f"model={model}"]).model)
    assert c["params_total"] == pytest.approx(total, rel=0.01)
    assert c["params_active"] == pytest.approx(active, rel=0.02)


def test_grouped_mm_formula_equals_mm_count_of_the_loop():
    if not grouped_mm_supported("cpu", torch.float32):
        pytest.skip("grouped_mm does not run here")
    torch.manual_seed(0)
    a = MoE(32, 48, num_experts=4, top_k=2, dispatch="grouped")
    b = MoE(32, 48, num_experts=4, top_k=2, dispatch="loop")
    b.load_state_dict(a.state_dict())
    x = torch.randn(40, 32)

    class Wrap(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, tokens, targets):
            y = self.moe(tokens)[0]

            class Out:
                loss = y.square().sum()
            return Out

    fa = count_step_flops(Wrap(a), x.clone().requires_grad_(), None)
    fb = count_step_flops(Wrap(b), x.clone().requires_grad_(), None)
    assert fa["total"] == fb["total"] > 0
    # experts: 3 matmuls x (fwd + 2 bwd) x 2*rows*H*F, rows = 40 tokens * top_k
    assert fa["by_op"]["aten._grouped_mm"] == 9 * 2 * 80 * 32 * 48


def test_flop_check_cli_names_a_bad_override_in_one_line(capsys):
    from moe_exp.flop_check import main

    assert main(["model=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model: 'tiny' is not one of: ") and err.count("\n") == 1
    # shapes the app refuses: the same one line (tracebacks before)
    for override, line in [("model.num_heads=3", "model.hidden_size: 128 is not divisible"),
                           ("model.num_layers=0", "model.num_layers: must be >= 1"),
                           ("train.seq_len=500", "train.seq_len: 500 exceeds")]:
        assert main([override]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_chunks_count_as_their_sequences_causal_attention(cp):
    """A cp rank's two lower-right causal calls (its chunks over the keys up to their ends)
    count, forward and backward, as the convention counts the whole sequence's causal call
    (in full), over cp: planned cp layouts are not flattered by the keys they skip."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from moe_exp.bench.formulas import flop_formulas
    from moe_exp.optimizations.parallel.context import _causal_over_prefix, chunks

    s, c = 64, 64 // (2 * cp)

    def counted(fn):
        q, k, v = (torch.randn(1, 2, s, 8, requires_grad=True) for _ in range(3))
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as m:
            fn(q, k, v).sum().backward()
        return m.get_total_flops()

    whole = counted(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    for rank in range(cp):
        part = counted(lambda q, k, v: torch.cat(
            [_causal_over_prefix(q[:, :, i * c:(i + 1) * c], k[:, :, :(i + 1) * c],
                                 v[:, :, :(i + 1) * c]) for i in chunks(cp, rank)], dim=2))
        assert part == whole / cp


@pytest.mark.parametrize("model", ["deepseek_v3", "mixtral_8x7b", "tiny_deepseek"])
def test_blocks_and_head_sum_to_flops_per_token(model):
    """parallel.pp_balance=flops weighs each block and the LM head by flops_per_token's own
    terms: together they are flops_per_token."""
    from conftest import compose
    from moe_exp.bench.flops import flops_per_token
    from moe_exp.shapes import block_flops, head_flops

    m = compose([f"model={model}"]).model
    w = block_flops(m, 4096)
    assert len(w) == m.num_layers
    assert sum(w) + head_flops(m) == pytest.approx(flops_per_token(m, 4096), rel=1e-12)


def test_a_flops_balanced_pipeline_lightens_the_heads_stage():
    """DeepSeek-V3 on 16 stages: blocks evenly (4 a stage, 3 on the last three) leave the
    last stage its 3 blocks and the 129K-token head (1.6 blocks' FLOPs), 8.8% over the
    mean stage; balanced by FLOPs, the head's stage keeps 2 blocks: 2.9% over. Every split
    of the 61 blocks into 16 stages of one block or more weighs at least as much."""
    import itertools

    from conftest import compose
    from moe_exp.shapes import block_flops, head_flops
    from moe_exp.config import balanced, pp_stages

    cfg = compose(["model=deepseek_v3", "parallel=fsdp", "parallel.pp=16",
                   "train.seq_len=4096"])
    w, head = block_flops(cfg.model, 4096), head_flops(cfg.model)

    def worst(first):
        ends = [*first[1:], len(w)]
        return max(sum(w[a:b]) + (head if b == len(w) else 0) for a, b in zip(first, ends))

    even = pp_stages(cfg)
    cfg.parallel.pp_balance = "flops"
    flops = pp_stages(cfg)
    assert len(flops) == 16 and flops[0] == 0 and flops[-1] == 59  # (the last: 2 blocks)
    assert worst(flops) < worst(even)
    mean = (sum(w) + head) / 16
    assert worst(even) / mean == pytest.approx(1.088, abs=1e-3)
    assert worst(flops) / mean == pytest.approx(1.029, abs=1e-3)
    # the partition is the best one: brute force over a small case
    small = (3.0, 1.0, 1.0, 2.0, 1.0, 1.0)
    cuts = balanced(small, 1.5, 3)
    best = min(max(sum(small[a:b]) + (1.5 if b == 6 else 0) for a, b in zip((0, *c), (*c, 6)))
               for c in itertools.combinations(range(1, 6), 2))
    assert max(sum(small[a:b]) + (1.5 if b == 6 else 0)
               for a, b in zip(cuts, (*cuts[1:], 6))) == best
    assert cuts[0] == 0 and len(cuts) == 3
