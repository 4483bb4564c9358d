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


# Memory lower bounds (validate.check_memory skips a run that cannot fit before any work).

def muon_params(m) -> int:
    """Parameters optim=muon updates (optim.muon.hidden_matrices): all but the embeddings,
    the head and the norms (2 per block + the final one), which AdamW updates."""
    h = m.hidden_size
    return param_counts(m)["params_total"] - 2 * m.vocab_size * h - (2 * m.num_layers + 1) * h


def state_lower_bound(cfg, world: int) -> float:
    """Bytes one rank holds of fp32 weights, gradients and optimizer state (16 B/param with
    AdamW: weight, grad, 2 moments; 12 for Muon's matrices, 1 buffer each), sharded as the
    parallel option shards them (FSDP over all `world` ranks, HSDP over a replica group,
    expert parallel's experts over its group)."""
    m, p = cfg.model, cfg.parallel
    total = param_counts(m)["params_total"]
    experts = m.num_layers * m.num_experts * 3 * m.hidden_size * m.ffn_hidden_size
    if p.name in ("fsdp", "expert_fsdp"):
        per_rank = total / world
    elif p.name == "hsdp":  # sharded within a replica group
        from ..config import hsdp_mesh

        per_rank = total / hsdp_mesh(p, cfg.hardware.devices, world)[1]
    elif p.name == "expert":
        per_rank = total - experts + experts / (p.expert_parallel_size or world)
    else:
        per_rank = total
    per_param = 16.0
    if cfg.optim.name == "muon":
        matrices = muon_params(m)
        per_param = (16 * (total - matrices) + 12 * matrices) / total
    return per_rank * per_param


def activation_lower_bound(cfg) -> float:
    """Bytes of activations one rank holds at its step's peak whatever the settings: the
    fp32 log-probabilities the loss saves (micro-batch x seq x vocab) and each layer's input
    (kept under any activation checkpointing)."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * t.seq_len
    width = 2 if cfg.precision.autocast_dtype else 4
    return tokens * (4 * m.vocab_size + width * m.num_layers * m.hidden_size)
