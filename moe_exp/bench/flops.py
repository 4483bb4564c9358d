"""Parameter counts and analytic training FLOPs per token, in the PaLM/torchtitan convention.

flops_per_token = 6 * N_matmul_active + 6 * L * n_heads * (d_qk + d_v) * S
N_matmul_active: the weights a token multiplies: attention, router, the top_k routed
experts and the shared ones or the dense FFN, and the LM head. Embeddings, being a lookup,
and norm weights are excluded. Causal attention is counted in full, as the convention does;
activation recomputation is not, so this gives MFU, not HFU.

moe_exp.flop_check checks it against torch's FlopCounterMode on real steps, with
bench/formulas.py for grouped_mm and CPU attention.
"""
from __future__ import annotations

from ..shapes import attention_params, block_params, moe_layers, qk_v_dims


def expert_params(m) -> int:
    """The routed experts' weights over all layers: what expert parallel shards."""
    return moe_layers(m) * m.num_experts * 3 * m.hidden_size * m.ffn_hidden_size


def param_counts(m) -> dict:
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    attn, attn_norms = attention_params(m)
    moe = moe_layers(m)
    dense = L - moe  # dense FFN blocks: a dense model's, or a MoE's first_k_dense
    dense_block, moe_block = block_params(m)
    ffn_total = dense * (dense_block - attn) + moe * (moe_block - attn - m.top_k * 3 * h * f) \
        + expert_params(m)
    embed = head = m.vocab_size * h
    norms = L * (2 * h + attn_norms) + h
    matmul_active = dense * dense_block + moe * moe_block + head
    return {
        "params_total": embed + head + norms + L * attn + ffn_total,
        "params_active": embed + norms + matmul_active,
        "params_matmul_active": matmul_active,
    }


def flops_per_token(m, seq_len: int, drop_rate: float = 0.0) -> float:
    """Training FLOPs per token, by the module's formula, less those of dropped choices.

    drop_rate: the share of routed choices dropped over capacity. They compute nothing, so
    the useful FLOPs leave them out.
    """
    qk, v = qk_v_dims(m)
    n = param_counts(m)["params_matmul_active"]
    return 6.0 * n + 6.0 * m.num_layers * m.num_heads * (qk + v) * seq_len \
        - routed_flops_per_token(m) * drop_rate


def routed_flops_per_token(m) -> float:
    """The routed experts' share of flops_per_token: what the dropped choices do not
    compute."""
    return 6.0 * moe_layers(m) * m.top_k * 3 * m.hidden_size * m.ffn_hidden_size


def analytic(m, seq_len: int) -> dict:
    """The record's figures known from the config alone."""
    counts = param_counts(m)
    return {"params_total": counts["params_total"], "params_active": counts["params_active"],
            "flops_per_token": flops_per_token(m, seq_len)}


# Memory lower bounds: validate.check_memory skips, before any work, a run that cannot fit.

def muon_params(m) -> int:
    """The number of parameters optim=muon updates, as optim.muon.hidden_matrices picks them.

    All but the embeddings, the head and the norms, which AdamW updates.
    """
    h = m.hidden_size
    norms = (2 * m.num_layers + 1) * h + m.num_layers * attention_params(m)[1]
    return param_counts(m)["params_total"] - 2 * m.vocab_size * h - norms


def state_lower_bound(cfg, world: int) -> float:
    """A lower bound on one rank's bytes of fp32 weights, gradients and optimizer state.

    16 B/param with AdamW: weight, grad and 2 moments; 12 for Muon's matrices, with 1 buffer
    each. Sharded as the parallel option shards them: FSDP over all `world` ranks, HSDP over
    a replica group, expert parallel's experts over its group.
    """
    m, p = cfg.model, cfg.parallel
    total = param_counts(m)["params_total"]
    experts = expert_params(m)
    if p.name in ("fsdp", "expert_fsdp"):
        per_rank = total / world
    elif p.name == "hsdp":  # sharded within a replica group
        from ..config import hsdp_mesh

        per_rank = total / (world // hsdp_mesh(p, cfg.hardware.devices, world)[0])
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
    """A lower bound on the activation bytes one rank holds at its step's peak, any settings.

    The fp32 log-probabilities the loss saves, micro-batch x seq x vocab, and each layer's
    input, which any activation checkpointing keeps.
    """
    from ..config import seq_part

    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * seq_part(cfg)
    width = 2 if cfg.precision.autocast_dtype else 4
    return tokens * (4 * m.vocab_size + width * m.num_layers * m.hidden_size)
