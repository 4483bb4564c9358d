"""A model config's sizes, from the config alone: each head's dims, a block's parameters and
its training FLOPs per token (bench/flops.py's terms, in the PaLM/torchtitan convention).

Below the instruments: the pipeline's split by FLOPs (config.pp_stages) reads them."""
from __future__ import annotations


def head_dim(m) -> int:
    """GQA's dims per head, the same for q, k and v."""
    return m.head_dim or m.hidden_size // m.num_heads


def qk_v_dims(m) -> tuple[int, int]:
    """The dims per head that q.k and the values span, for attention's FLOPs."""
    if m.attention_type == "mla":
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return head_dim(m), head_dim(m)


def attention_params(m) -> tuple[int, int]:
    """One block's attention parameters: matmul weights, then norm weights."""
    h, n = m.hidden_size, m.num_heads
    if m.attention_type == "mla":
        qk, r = m.qk_nope_head_dim + m.qk_rope_head_dim, m.q_lora_rank
        q = h * r + r * n * qk if r else h * n * qk
        kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + \
            m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv + n * m.v_head_dim * h, (r or 0) + m.kv_lora_rank
    d = head_dim(m)
    return h * n * d * 2 + h * m.num_kv_heads * d * 2, 2 * d if m.qk_norm else 0


def moe_layers(m) -> int:
    """The number of blocks with a MoE FFN: all but the first_k_dense; none if dense."""
    return m.num_layers - m.first_k_dense if m.num_experts > 0 else 0


def block_params(m) -> tuple[int, int]:
    """The matmul parameters a token runs through in a dense block and in a MoE block (its
    attention's, its FFN's: shared experts, router and top_k routed ones)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    attn, _ = attention_params(m)
    moe = moe_layers(m)
    dense_f = (m.dense_ffn_hidden_size or f) if moe else f
    shared = 3 * h * m.num_shared_experts * (m.shared_ffn_hidden_size or f) if moe else 0
    router = h * m.num_experts if moe else 0
    return attn + 3 * h * dense_f, attn + shared + router + m.top_k * 3 * h * f


def block_flops(m, seq_len: int) -> list[float]:
    """Each block's training FLOPs per token, flops_per_token's terms (the LM head's apart:
    head_flops): the dense first blocks', then the MoE blocks'."""
    qk, v = qk_v_dims(m)
    scores = 6.0 * m.num_heads * (qk + v) * seq_len
    dense, moe = (6.0 * n + scores for n in block_params(m))
    first = m.num_layers - moe_layers(m)
    return [dense] * first + [moe] * (m.num_layers - first)


def head_flops(m) -> float:
    """The LM head's training FLOPs per token."""
    return 6.0 * m.vocab_size * m.hidden_size
