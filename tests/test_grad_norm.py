"""The gradient norm of every step, before clipping: as computed directly."""
import math
import statistics

import torch

from conftest import run_inproc

TINY = ["logger=none", "train.plan=false",
        "train.steps=3", "train.warmup_steps=1", "train.micro_batch_size=2",
        "model.max_seq_len=32"]


def test_grad_norm_is_every_steps_norm_before_clipping(monkeypatch, tmp_path):
    clip, direct = torch.nn.utils.clip_grad_norm_, []

    def spy(params, max_norm, *a, **k):
        params = list(params)
        direct.append(torch.linalg.vector_norm(  # (float64: fp32 over 1.7M values drifts)
            torch.cat([p.grad.double().flatten() for p in params if p.grad is not None])).item())
        return clip(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    rec = run_inproc([*TINY, "optim.grad_clip=0.5"], tmp_path / "clip")  # (TINY: no plan,
    # whose fake steps would call the spy too)
    assert rec["status"] == "ok" and len(rec["grad_norms"]) == len(direct) == 4
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rec["grad_norms"], direct))
    assert math.isclose(rec["grad_norm"], statistics.median(direct), rel_tol=1e-5)
    assert rec["grad_norm_spike"] is None and max(direct) > 0.5  # (clipped: still the norm before)
    off = run_inproc([*TINY, "optim.grad_clip=0"], tmp_path / "off")
    assert off["grad_norm"] is None and off["null_reasons"]["grad_norm"].startswith(
        "optim.grad_clip=0")


def test_a_sudden_spike_is_named_and_the_summary_warns(tmp_path):
    from types import SimpleNamespace

    from moe_exp.tasks.bench_record import record_grad_norm
    from moe_exp.tasks.summary import summary_rows

    rec = {"null_reasons": {}}
    cfg = SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0))
    record_grad_norm(cfg, rec, SimpleNamespace(grad_norms=[1.0, 1.2, 0.8, 1.0, 25.0, 1.0]))
    assert rec["grad_norm"] == 1.0 and rec["grad_norm_spike"] == [4, 25.0]
    run = run_inproc(TINY, tmp_path)
    assert run["grad_norm_spike"] is None
    assert ("WARNING", "gradient norm spiked at step 4: 25× the median of the 20 steps before "
                       "it") in summary_rows({**run, **rec, "null_reasons": run["null_reasons"]})
