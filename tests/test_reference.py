"""The model against the reference implementations (Hugging Face transformers) with the same
weights, in float64: the loss and every parameter's gradient agree to 1e-6 relative."""
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from moe_exp.config import ModelConfig
from moe_exp.model import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-6


def ours(**model) -> torch.nn.Module:
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    torch.manual_seed(0)
    m = build_model(cfg).double()
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


def hf_names(sd: dict, rope: int = 0) -> dict:
    """Our state dict as Hugging Face's Mixtral / Qwen3-MoE / DeepSeek-V3 names and layouts:
    experts' w1, w3 (E, H, F) -> gate_up_proj (E, 2F, H), w2 (E, F, H) -> down_proj (E, H, F).
    rope: MLA's RoPE dims per head, where the reference interleaves them (rope_interleave):
    its pairs (2i, 2i+1) are our halves' (i, i + rope/2)."""
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"],
           "lm_head.weight": sd["head.weight"]}
    plain = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
             "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
             "attn.wq.0": "self_attn.q_a_proj", "attn.wq.1": "self_attn.q_a_layernorm",
             "attn.wq.2": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
             "attn.kv_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj",
             "ffn.router.gate": "mlp.gate", "ffn.w1": "mlp.gate_proj", "ffn.w3": "mlp.up_proj",
             "ffn.w2": "mlp.down_proj", "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
             "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
             "ffn.shared_experts.w2": "mlp.shared_experts.down_proj"}
    for key, t in sd.items():
        if not key.startswith("layers."):
            continue
        _, i, rest = key.split(".", 2)
        pre = f"model.layers.{i}."
        if rest == "ffn.experts.w1":
            w3 = sd[key.replace("w1", "w3")]
            out[pre + "mlp.experts.gate_up_proj"] = torch.cat([t, w3], 2).transpose(1, 2)
        elif rest == "ffn.experts.w2":
            out[pre + "mlp.experts.down_proj"] = t.transpose(1, 2)
        elif rest == "ffn.router.expert_bias":
            out[pre + "mlp.gate.e_score_correction_bias"] = t
        elif rest != "ffn.experts.w3":
            mod, leaf = rest.rsplit(".", 1)
            if rope and mod in ("attn.wq", "attn.wq.2", "attn.wkv_a"):
                t = interleave_rows(t, rope, heads=mod != "attn.wkv_a")
            out[pre + plain[mod] + "." + leaf] = t
    return out


def interleave_rows(w: torch.Tensor, rope: int, heads: bool) -> torch.Tensor:
    """The last `rope` output rows (of each head, where heads) from halves to pairs."""
    perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    v = w.reshape(-1, w.shape[0] if not heads else w.shape[0] // HEADS, w.shape[1]).clone()
    part = v[:, -rope:].clone()
    v[:, -rope:][:, perm] = part
    return v.reshape(w.shape)


def compare(model, hf, vocab: int, rope: int = 0) -> None:
    hf = hf.double()
    missing, unexpected = hf.load_state_dict(hf_names(model.state_dict(), rope), strict=False)
    # (Mixtral's and Qwen3's have no balancing bias; DeepSeek-V3's, where moe_exp's is off)
    assert not unexpected and all("e_score_correction_bias" in k for k in missing), \
        (missing, unexpected)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ce = model(x, y).ce
    ref = F.cross_entropy(hf(input_ids=x).logits.flatten(0, 1), y.flatten())
    assert abs(ce.item() / ref.item() - 1) < TOL, (ce.item(), ref.item())
    ce.backward()
    ref.backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    theirs = hf_names(grads, rope)
    for name, p in hf.named_parameters():
        err = (theirs[name] - p.grad).norm() / p.grad.norm()
        assert err < TOL, (name, err.item())


def test_mixtral_equals_transformers_mixtral():
    m = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=32,
             num_experts=4, top_k=2, vocab_size=97, max_seq_len=32, rope_theta=1e4,
             norm_eps=1e-5, dispatch="loop")
    cfg = transformers.MixtralConfig(
        vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
        attn_implementation="eager", experts_implementation="eager")
    compare(ours(**m), transformers.MixtralForCausalLM(cfg), 97)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_equals_transformers_qwen3_moe(norm):
    """head_dim apart from hidden / heads, QK-norm, fine-grained experts, with and without
    renormalised top-k weights (Qwen3-30B-A3B renormalises)."""
    m = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
             qk_norm=True, ffn_hidden_size=16, num_experts=8, top_k=3, vocab_size=97,
             max_seq_len=32, rope_theta=1e6, norm_eps=1e-6, route_norm=norm, dispatch="loop")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=norm, max_position_embeddings=32,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    compare(ours(**m), transformers.Qwen3MoeForCausalLM(cfg), 97)


HEADS = 4  # the MLA test's


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("q_rank", [None, 24])
def test_deepseek_equals_transformers_deepseek_v3(interleave, q_rank):
    """MLA (q low-rank or not), a dense first block, sigmoid group-limited routing scaled by
    route_scale, a shared expert, the aux-loss-free balancing bias (set to random values:
    it moves the choice); the reference's interleaved RoPE pairs are our halves."""
    m = dict(hidden_size=64, num_layers=3, num_heads=HEADS, num_kv_heads=HEADS,
             attention_type="mla", q_lora_rank=q_rank, kv_lora_rank=16, qk_nope_head_dim=12,
             qk_rope_head_dim=8, v_head_dim=10, ffn_hidden_size=16, num_experts=8, top_k=3,
             num_shared_experts=2, first_k_dense=1, dense_ffn_hidden_size=48,
             score_func="sigmoid", route_scale=2.5, n_groups=4, topk_groups=2, vocab_size=97,
             max_seq_len=32, rope_theta=1e4, norm_eps=1e-6, dispatch="loop",
             bias_update_rate=0.001)
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16,
        q_lora_rank=q_rank, qk_rope_head_dim=8, v_head_dim=10, qk_nope_head_dim=12, n_group=4,
        topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_interleave=interleave,
        attn_implementation="eager", experts_implementation="eager")
    model = ours(**m)
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.ffn.router.expert_bias.normal_(std=0.1)
    compare(model, transformers.DeepseekV3ForCausalLM(cfg), 97, 8 if interleave else 0)
