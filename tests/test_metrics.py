"""The record's derived figures from raw timings (bench.metrics.step_metrics): no run."""
import pytest

from moe_exp.bench.metrics import step_metrics


def _phases(n, data=1.0):
    return {"data_ms": [data] * n, "forward_ms": [3.0] * n, "backward_ms": [5.0] * n,
            "optimizer_ms": [1.0] * n}


def test_throughput_breakdown_and_mfu_from_step_times():
    # 4 ranks x 1024 tokens a step; median step 100 ms (one slow outlier), 5 steps in 0.6 s
    out = step_metrics([90.0, 100.0, 100.0, 110.0, 400.0], _phases(5, data=10.0),
                       tokens_per_step=1024, world=4, wall_s=0.6, first_step_s=2.1,
                       compiled=True, startup_s=5.0, flops_per_token=1e9, peak_flops=1e14)
    assert out["step_time_ms"] == 100.0 and out["step_time_iqr_ms"] == 10.0
    assert out["tokens_per_s_per_device"] == pytest.approx(10240.0)
    assert out["tokens_per_s"] == pytest.approx(4 * 10240.0)
    assert out["tokens_per_s_wall"] == pytest.approx(4 * 1024 * 5 / 0.6)  # (the outlier too)
    assert out["tokens_per_step"] == 4096 and out["measured_steps"] == 5
    assert (out["data_ms"], out["forward_ms"], out["backward_ms"], out["optimizer_ms"]) == \
        (10.0, 3.0, 5.0, 1.0)
    assert out["data_share"] == pytest.approx(0.1)
    assert out["compile_s"] == pytest.approx(2.0)  # the first step beyond a steady one
    assert out["startup_s"] == pytest.approx(3.0)  # compile excluded
    assert out["tflops_per_device"] == pytest.approx(10.24)
    assert out["mfu"] == pytest.approx(0.1024) and out["peak_flops"] == 1e14


def test_figures_that_cannot_be_derived_are_none():
    out = step_metrics([50.0], _phases(1), tokens_per_step=100, world=1, wall_s=0.05,
                       first_step_s=0.04, compiled=False, startup_s=None,
                       flops_per_token=1e6, peak_flops=None)
    assert out["step_time_iqr_ms"] is None  # one step: no spread
    assert out["compile_s"] is None and out["startup_s"] is None
    assert out["mfu"] is None and out["peak_flops"] is None
    # a compiled first step faster than a steady one (a warm cache) compiles in 0 s
    out = step_metrics([50.0, 50.0], _phases(2), tokens_per_step=100, world=1, wall_s=0.1,
                       first_step_s=0.01, compiled=True, startup_s=1.0,
                       flops_per_token=1e6, peak_flops=1e12)
    assert out["compile_s"] == 0.0 and out["startup_s"] == 1.0
