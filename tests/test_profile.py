"""train.profile: a trace of the last steps, its top ops' shares; NVML's figures."""
import json

from moe_exp.bench.profile import SHARES, category

from conftest import cli_inproc, run_inproc

TINY = ["logger=none", "train.plan=false",
        "train.steps=4", "train.warmup_steps=1", "train.micro_batch_size=2",
        "model.max_seq_len=32"]


def test_profile_writes_a_trace_of_the_models_ops_and_their_shares(tmp_path):
    rec = run_inproc([*TINY, "train.profile=true"], tmp_path / "on")
    assert rec["status"] == "ok" and rec["measured_steps"] == 4 - 2  # (the traced: untimed)
    trace = json.loads((tmp_path / "on" / rec["profile_trace"]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::_grouped_mm", "aten::mm", "aten::_fused_adamw_"} <= names
    assert "aten::mm" in (tmp_path / "on" / "profile.txt").read_text()
    shares = rec["profile_shares"]
    assert set(shares) == set(SHARES) and abs(sum(shares.values()) - 1) < 1e-9
    assert shares["matmul"] > 0.1 and shares["attention"] > 0 and shares["all_to_all"] == 0
    why = rec["null_reasons"]
    assert rec["memory_snapshot"] is None and why["memory_snapshot"] == "on CUDA only"
    assert rec["gpu_util_pct"] is None and why["gpu_util_pct"].startswith("no NVIDIA GPU or Gaudi")
    assert rec["alloc_retries"] is None and why["alloc_ooms"].startswith("CPU: no caching")
    off = run_inproc(TINY, tmp_path / "off")
    assert off["measured_steps"] == 4 and off["profile_shares"] is None
    assert off["null_reasons"]["profile_trace"] == "train.profile=false"
    assert not (tmp_path / "off" / "trace.json").exists()


def test_profile_categories_and_bad_input(tmp_path):
    assert [category(n) for n in ("aten::_grouped_mm", "aten::_cudnn_attention_backward",
                                  "aten::_fused_adamw_", "c10d::alltoall_base_",
                                  "nccl:all_reduce", "aten::copy_", "aten::_log_softmax")] \
        == ["matmul", "attention", "optimizer", "all_to_all", "all_reduce", "other", "other"]
    r = cli_inproc(["logger=none", "train.profile=true", "train.steps=2"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: train.steps: must exceed "
                                                     "train.profile_steps=2")


def test_report_links_each_traced_jobs_files(tmp_path):
    import pandas as pd

    from moe_exp.sweep.report import profile_links

    (tmp_path / "1" / "rep0").mkdir(parents=True)
    (tmp_path / "1" / "rep0" / "trace.json").write_text("{}")
    df = pd.DataFrame([{"job": "0", "label": "train.profile=False", "profile_shares": None},
                       {"job": "1", "label": "train.profile=True",
                        "profile_shares": {"matmul": 0.6, "other": 0.4, "attention": 0.0}}])
    text = profile_links(df, tmp_path)
    assert "- job 1 (train.profile=True): [trace](1/rep0/trace.json) · [top ops](1/rep0/" \
           "profile.txt) — matmul 60%, other 40%" in text and "job 0" not in text
    assert profile_links(df.iloc[:1], tmp_path) is None


def test_gaudi_figures_come_from_hlml_and_a_missing_library_is_a_reason(monkeypatch):
    """Gaudi's sampler reads HLML (pyhlml, pynvml's calls): a stand-in library, as none
    runs here; without it, a reason."""
    import sys
    import time
    import types

    import torch

    from moe_exp.bench.nvml import GpuSampler

    monkeypatch.setitem(sys.modules, "pyhlml", None)  # (not installed)
    assert GpuSampler(torch.device("hpu", 0)).stop()["null_reasons"]["gpu_util_pct"] \
        .startswith("pyhlml is not installed")
    fake = types.SimpleNamespace(
        hlmlInit=lambda: None, hlmlDeviceGetHandleByIndex=lambda i: ("dev", i),
        hlmlDeviceGetUtilizationRates=lambda h: 80 if h == ("dev", 1) else 0,
        hlmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 * 2**30),
        hlmlDeviceGetPowerUsage=lambda h: 450_000)  # (mW)
    monkeypatch.setitem(sys.modules, "pyhlml", fake)
    s = GpuSampler(torch.device("hpu", 1))
    s.start()
    time.sleep(0.35)
    assert s.stop() == {"gpu_util_pct": 80, "gpu_mem_used_gib": 3.0, "gpu_power_w": 450.0}
