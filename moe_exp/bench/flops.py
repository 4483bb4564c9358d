"""Parameter counts and analytic training FLOPs per token (PaLM / torchtitan convention).

flops_per_token = 6 * N_matmul_active + 6 * L * n_heads * (d_qk + d_v) * S
N_matmul_active: the weights a token multiplies (attention, router, top_k experts or the
dense FFN, LM head); embeddings (a lookup) and norm weights excluded. Causal attention is
counted in full, as the convention does; activation recomputation is not counted (MFU,
not HFU).

Checked against torch.utils.flop_counter.FlopCounterMode on real steps (with formulas for
grouped_mm and CPU attention): moe_exp.bench.flop_check and tests/test_flops.py.
"""
from __future__ import annotations


def param_counts(m) -> dict:
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.hidden_size // m.num_heads
    attn = h * m.num_heads * d * 2 + h * m.num_kv_heads * d * 2
    if m.num_experts > 0:
        ffn_total = m.num_experts * 3 * h * f + h * m.num_experts
        ffn_active = m.top_k * 3 * h * f + h * m.num_experts
    else:
        ffn_total = ffn_active = 3 * h * f
    embed = head = m.vocab_size * h
    norms = m.num_layers * 2 * h + h
    matmul_active = m.num_layers * (attn + ffn_active) + head
    return {
        "params_total": embed + head + norms + m.num_layers * (attn + ffn_total),
        "params_active": embed + norms + matmul_active,
        "params_matmul_active": matmul_active,
    }


def flops_per_token(m, seq_len: int) -> float:
    d = m.hidden_size // m.num_heads
    n = param_counts(m)["params_matmul_active"]
    return 6.0 * n + 6.0 * m.num_layers * m.num_heads * (d + d) * seq_len


def analytic(m, seq_len: int) -> dict:
    """The record's figures known from the config alone."""
    counts = param_counts(m)
    return {"params_total": counts["params_total"], "params_active": counts["params_active"],
            "flops_per_token": flops_per_token(m, seq_len)}
