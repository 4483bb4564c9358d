"""Decoder-only transformer: RMSNorm, RoPE, GQA or MLA attention, MoE or dense SwiGLU FFN.

Plain PyTorch, no precision, parallelism or checkpointing code: those are applied
from outside by moe_exp.optimizations.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .moe import MoE, SwiGLU


class Output(NamedTuple):
    loss: torch.Tensor  # ce + the coefficients times the next three (what is trained)
    ce: torch.Tensor  # language-model cross-entropy
    balance: torch.Tensor  # Switch load-balancing loss, mean over MoE layers (0 if dense)
    z: torch.Tensor  # router z-loss, mean over MoE layers (0 if dense)
    counts: torch.Tensor  # (layers, experts) tokens routed to each expert; (0, 0) if dense
    seq_balance: torch.Tensor  # the balance loss per sequence (0 where its coef is 0)
    routed: torch.Tensor  # counts' shape: the router's choices, before any capacity drop


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # a bf16 x against an fp32 weight (QK-norm's, MLA's latents under autocast) has no
        # fused kernel: in fp32, back to x's dtype
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # (S, D/2)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    """Apply RoPE to x (B, h, S, D), rotating channel i of the first half with i of the second."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def repeat_kv_heads(q: torch.Tensor) -> bool:
    """Whether SDPA needs k/v repeated to q's heads for a fast kernel.

    On CUDA, grouped k/v heads run only in flash attention, which takes fp16 and bf16, or in
    the math kernel. In fp32 that means math, which keeps each (S, S) score matrix; repeated
    heads take the memory-efficient kernel. CPU's flash kernel takes grouped heads in every
    dtype.
    """
    return q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16)


def _kv_heads(q, k, v):
    """SDPA's k, v and enable_gqa: k/v repeated to q's heads where a fast kernel needs it."""
    gqa = k.shape[1] != q.shape[1]
    if gqa and repeat_kv_heads(q):
        r = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1), False
    return k, v, gqa


def causal_attention(q, k, v):
    """Causal SDPA of q (B, h, S, D) over k, v (B, h_kv, S, D); h is a multiple of h_kv."""
    k, v, gqa = _kv_heads(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def cached_attention(q, k, v, pos: int):
    """SDPA of new queries over a KV cache: q at positions pos.. over k, v at positions 0..

    Each query sees the keys up to its own position.
    """
    k, v, gqa = _kv_heads(q, k, v)
    s = q.shape[-2]
    mask = None if s == 1 else torch.ones(s, k.shape[-2], dtype=torch.bool,
                                          device=q.device).tril(pos)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _attend(attn, q, k, v, cache):
    """Attention with or without a model.cache.LayerCache.

    With one, k and v are stored and q attends to every position so far; from position 0
    it is the model's own kernel.
    """
    if cache is None:
        return attn.attend(q, k, v)
    pos = cache.pos
    k, v = cache.update(k, v)
    return attn.attend(q, k, v) if pos == 0 else cached_attention(q, k, v, pos)


def _tables(cos, sin, cache):
    """RoPE's tables from the cache's position on; all of them without a cache."""
    return (cos, sin) if cache is None or not cache.pos else (cos[cache.pos:], sin[cache.pos:])


def head_dim(cfg) -> int:
    """The dims RoPE rotates per head.

    model.head_dim, or hidden_size / num_heads where that is null; for MLA, qk_rope_head_dim.
    """
    if cfg.attention_type == "mla":
        return cfg.qk_rope_head_dim
    return cfg.head_dim or cfg.hidden_size // cfg.num_heads


class Attention(nn.Module):
    """Grouped-query attention. qk_norm: RMSNorm of each head's q and k before RoPE, as Qwen3."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = head_dim(cfg)
        h, d = cfg.hidden_size, self.head_dim
        self.wq = nn.Linear(h, self.n_heads * d, bias=False)
        self.wk = nn.Linear(h, self.n_kv * d, bias=False)
        self.wv = nn.Linear(h, self.n_kv * d, bias=False)
        self.wo = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.attend = causal_attention  # (q, k, v) -> y; an attention kernel may replace it

    def forward(self, x, cos, sin, cache=None):
        b, s, _ = x.shape
        cos, sin = _tables(cos, sin, cache)
        q = self.q_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = _attend(self, q, k, v, cache)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class LatentAttention(nn.Module):
    """MLA: multi-head latent attention, as DeepSeek-V2 and V3.

    q goes through a low-rank projection of q_lora_rank, or a full one where that is null.
    Keys and values come from one shared, RMS-normed latent of kv_lora_rank, expanded per
    head. RoPE acts on qk_rope_head_dim extra dims per head, whose key part all heads share.
    RoPE rotates halves, as everywhere here; DeepSeek's checkpoints interleave pairs, which
    is the same attention with those dims permuted.
    """

    def __init__(self, cfg):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_heads
        self.n_heads, self.kv_rank = n, cfg.kv_lora_rank
        self.nope, self.rope, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.wq = nn.Sequential(nn.Linear(h, cfg.q_lora_rank, bias=False),
                                    RMSNorm(cfg.q_lora_rank, cfg.norm_eps),
                                    nn.Linear(cfg.q_lora_rank, n * qk, bias=False))
        else:
            self.wq = nn.Linear(h, n * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, n * (self.nope + self.vdim), bias=False)
        self.wo = nn.Linear(n * self.vdim, h, bias=False)
        self.attend = causal_attention  # (q, k, v) -> y; an attention kernel may replace it
        # (latent, k_rope) -> the keys' source positions to expand (context parallel: the
        # whole sequence's, gathered); None: x's own
        self.latents = None

    def forward(self, x, cos, sin, cache=None):
        """Attend over x; a cache keeps keys and values per head as expanded, not the latent."""
        b, s, _ = x.shape
        cos, sin = _tables(cos, sin, cache)
        q = self.wq(x).view(b, s, self.n_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        latent, k_rope = self.kv_norm(latent), apply_rope(k_rope[:, None], cos, sin)
        if self.latents is not None:
            latent, k_rope = self.latents(latent, k_rope)
        kv = self.wkv_b(latent).view(b, latent.shape[1], self.n_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = k_rope.expand(-1, self.n_heads, -1, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        y = _attend(self, q, k, v, cache)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def moe_layer(cfg, layer: int) -> bool:
    """Whether block `layer` has a MoE FFN; the first model.first_k_dense blocks are dense."""
    return cfg.num_experts > 0 and layer >= cfg.first_k_dense


def make_moe(cfg) -> MoE:
    """Build cfg's MoE FFN from plain numbers, so that forward reads no config."""
    shared = cfg.num_shared_experts * (cfg.shared_ffn_hidden_size or cfg.ffn_hidden_size)
    cap = cfg.capacity_factor
    return MoE(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k, cfg.dispatch,
               cfg.routing, float(cfg.routing_skew), shared_ffn=shared,
               capacity_factor=None if cap is None else float(cap), drop_policy=cfg.drop_policy,
               pad_to_capacity=bool(cfg.pad_to_capacity), score_func=cfg.score_func,
               route_norm=bool(cfg.route_norm), route_scale=float(cfg.route_scale),
               n_groups=int(cfg.n_groups), topk_groups=int(cfg.topk_groups),
               bias_rate=float(cfg.bias_update_rate),
               seq_aux=float(cfg.seq_aux_loss_coef) > 0)


class Block(nn.Module):
    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.attention_type == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.is_moe = moe_layer(cfg, layer)
        if self.is_moe:
            self.ffn = make_moe(cfg)
        else:  # a dense model's FFN, or one of a MoE's first_k_dense layers
            size = cfg.dense_ffn_hidden_size if cfg.num_experts > 0 else None
            self.ffn = SwiGLU(cfg.hidden_size, size or cfg.ffn_hidden_size)

    def forward(self, x, cos, sin, cache=None):
        """Run the block: returns (x, balance, seq_balance, z, counts, routed counts).

        A dense block returns zeros after x. cache: this layer's model.cache.LayerCache,
        when generating.
        """
        x = x + (self.attn(self.attn_norm(x), cos, sin) if cache is None else
                 self.attn(self.attn_norm(x), cos, sin, cache))
        h = self.ffn_norm(x)
        if self.is_moe:
            y, balance, seq, z, counts, routed = self.ffn(h)
        else:
            y = self.ffn(h)
            balance = seq = z = torch.zeros((), device=x.device)
            counts = routed = torch.zeros(0, dtype=torch.long, device=x.device)
        return x + y, balance, seq, z, counts, routed


class CrossEntropy(nn.Module):
    """The next-token loss on (tokens, vocab) logits; a module, so a parallel layout can
    take its place."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, targets)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        # plain numbers: torch.compile cannot trace attribute reads on a Hydra/OmegaConf
        # config and gives up on the rest of forward
        self.init_std, self.num_layers = float(cfg.init_std), int(cfg.num_layers)
        self.aux_loss_coef, self.z_loss_coef = float(cfg.aux_loss_coef), float(cfg.z_loss_coef)
        self.seq_aux_loss_coef = float(cfg.seq_aux_loss_coef)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.loss = CrossEntropy()
        cos, sin = rope_tables(head_dim(cfg), cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        std = self.init_std
        out_std = std / math.sqrt(2 * self.num_layers)  # GPT-2 scaled residual init
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight", "w2")):
                nn.init.trunc_normal_(p, std=out_std, a=-3 * out_std, b=3 * out_std)
            else:
                nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> Output:
        x = self.embed(tokens)
        balances, seqs, zs, counts, routed = [], [], [], [], []
        for layer in self.layers:
            x, balance, seq, z, c, r = layer(x, self.rope_cos, self.rope_sin)
            if layer.is_moe:
                balances.append(balance)
                seqs.append(seq)
                zs.append(z)
                counts.append(c)
                routed.append(r)
        logits = self.head(self.norm(x))
        ce = self.loss(logits.flatten(0, 1).float(), targets.flatten())
        if not counts:  # dense
            zero = torch.zeros((), device=x.device)
            none = torch.zeros(0, 0, dtype=torch.long, device=x.device)
            return Output(ce, ce, zero, zero, none, zero, none)
        balance, seq, z = (torch.stack(v).mean() for v in (balances, seqs, zs))
        loss = ce + self.aux_loss_coef * balance + self.seq_aux_loss_coef * seq + \
            self.z_loss_coef * z
        return Output(loss, ce, balance, z, torch.stack(counts), seq, torch.stack(routed))


@torch.no_grad()
def decode(model: Transformer, tokens: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Run new tokens through the model at the cache's positions and advance the cache.

    tokens: (B, new). Returns their logits and the MoE layers' counts of them, (layers,
    experts), or (0, 0) if dense. From an empty cache it gives the forward pass's logits.
    """
    x = model.embed(tokens)
    counts = []
    for layer, c in zip(model.layers, cache.layers):
        x, _, _, _, n, _ = layer(x, model.rope_cos, model.rope_sin, c)
        if layer.is_moe:
            counts.append(n)
    cache.advance(tokens.shape[1])
    logits = model.head(model.norm(x))
    return logits, (torch.stack(counts) if counts else
                    torch.zeros(0, 0, dtype=torch.long, device=x.device))


def block_items(layers: nn.Module):
    """(key, block) pairs of a model's blocks: a ModuleList's indices, or the keys of a
    pipeline stage's ModuleDict (each block's index in the whole model)."""
    return list(layers.items() if isinstance(layers, nn.ModuleDict) else enumerate(layers))


def build_model(cfg) -> Transformer:
    return Transformer(cfg)
