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
