"""Validation in two passes: a mistake is reported as `invalid` whatever this machine
cannot do besides (skipped) or is not ready for (error)."""
import pytest
import torch
from conftest import compose

from moe_exp.run import prepare


GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU can do it")


@pytest.mark.parametrize("limit, mistake, key", [
    # reduce-overhead needs CUDA graphs (skipped on a CPU); warmup 0 with compile: a mistake
    pytest.param("train.compile=reduce-overhead", "train.warmup_steps=0", "train.warmup_steps",
                 marks=GPU),
    pytest.param("hardware=h100", "train.steps=0", "train.steps", marks=GPU),
    pytest.param("precision=fp8", "optim.lr=-1", "optim.lr", marks=GPU),
    ("hardware.devices=64 parallel=ddp", "parallel.bucket_cap_mb=-1", "parallel.bucket_cap_mb"),
    ("hardware.memory_gib=0.001", "data.num_workers=-1", "data.num_workers"),
    ("logger.mode=online", "logger.project=a/b", "logger.project"),  # (not ready: error)
])
def test_a_mistake_is_invalid_whatever_else_is_wrong(limit, mistake, key, monkeypatch):
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    alone = limit.split()
    _, rec = prepare(compose(alone), alone)
    assert rec is not None and rec["status"] in ("skipped", "error"), rec and rec["error"]
    both = [*alone, mistake]
    _, rec = prepare(compose(both), both)
    assert rec["status"] == "invalid" and rec["error"].startswith(f"{key}: "), rec["error"]


@pytest.mark.parametrize("value", ["1e300", "0", "-1"])
def test_a_memory_size_no_device_has_is_invalid_up_front(value):
    """hardware.memory_gib=1e300 passed, then overflowed a byte count mid-run."""
    o = [f"hardware.memory_gib={value}"]
    _, rec = prepare(compose(o), o)
    assert rec["status"] == "invalid" and rec["error"].startswith("hardware.memory_gib: must be")


@pytest.mark.parametrize("overrides, says", [
    ("model=tiny_moe model.n_groups=3", "model.n_groups: must divide model.num_experts=8"),
    ("model=tiny_moe model.n_groups=8", "model.n_groups: must divide"),  # groups of 1
    ("model=tiny_moe model.n_groups=4 model.topk_groups=5", "model.topk_groups: must be in"),
    ("model=tiny_deepseek model.top_k=9", "model.top_k: 9 experts do not fit"),
    ("model=tiny_moe model.first_k_dense=2", "model.first_k_dense: must be below"),
    ("model=tiny_moe model.head_dim=15", "model.head_dim: must be an even number"),
    ("model=tiny_moe model.route_scale=0", "model.route_scale: must be > 0"),
    ("model=tiny_moe model.shared_ffn_hidden_size=0 model.num_shared_experts=1",
     "model.shared_ffn_hidden_size: must be >= 1"),
    ("model=tiny_deepseek model.qk_rope_head_dim=7", "model.qk_rope_head_dim: must be an even"),
    ("model=tiny_deepseek model.q_lora_rank=0", "model.q_lora_rank: must be >= 1 or null"),
    ("model=tiny_deepseek model.qk_norm=true", "model.qk_norm: "),  # GQA's, not MLA's
    ("model=tiny_dense model.num_shared_experts=1", "model.num_shared_experts: "),  # a MoE's
    ("model=tiny_moe model.dense_ffn_hidden_size=64", "model.dense_ffn_hidden_size: "),
    ("model=tiny_dense precision=bf16 precision.router_dtype=fp32", "precision.router_dtype: "),
    ("model=tiny_moe model.score_func=relu", "model.score_func: "),
    ("model=tiny_moe model.bias_update_rate=-0.001", "model.bias_update_rate: must be >= 0"),
    ("model=tiny_moe model.seq_aux_loss_coef=-1", "model.seq_aux_loss_coef: must be >= 0"),
    ("model=tiny_deepseek train.attention=flash", "train.attention: flash needs q/k and "
     "value heads of one size; MLA's are 48"),
    ("model=tiny_moe model.capacity_factor=1 model.dispatch=padded model.pad_to_capacity=true "
     "parallel=expert hardware.devices=2", "model.pad_to_capacity: not under parallel=expert"),
])
def test_architecture_mistakes_are_one_line_invalid(overrides, says):
    """The architecture options' bad values and the keys their model does not read."""
    o = overrides.split()
    _, rec = prepare(compose(o), o)
    assert rec["status"] == "invalid" and rec["error"].startswith(says), rec["error"]
    assert "\n" not in rec["error"]
