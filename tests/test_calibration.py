"""task=calibrate and hardware.calibration: rates interpolated between the grid's points,
a step's time from them (a CPU's ops one after another, a GPU's host running ahead of its
device), the dispatch cost fitted from tiny runs, and the plan's time basis in its record."""
import json
import types

import pytest
import torch
from conftest import cli_inproc, compose, off_contract, run_inproc

from moe_exp.plan import calibrate as cal_mod
from moe_exp.plan.calibration import (VERSION, Calibration, CalibrationError, Grid,
                                      check_data)
from moe_exp.plan.ops import StepOps, layout, shape_key


def test_a_grid_interpolates_in_log_log_and_clamps_outside():
    g = Grid([[1, 100], [10, 1000]], [[1.0, 2.0], [100.0, 200.0]])
    assert g.rate(1, 10) == pytest.approx(1.0) and g.rate(100, 1000) == pytest.approx(200.0)
    assert g.rate(10, 10) == pytest.approx(10.0)  # halfway in log: the geometric mean
    assert g.rate(1e6, 1) == pytest.approx(100.0)  # outside: the edge's rate
    assert Grid([[64]], [5.0]).rate(3) == pytest.approx(5.0)  # one point: its rate everywhere


def _data(device="cpu", dispatch=10.0, flops=1e9, bw=1e9, sync=0.0, step=0.0):
    flat = {"axes": [[1, 10**6]] * 3, "rates": [[[flops] * 2] * 2] * 2, "measured": 8}
    return {"version": VERSION, "device": device, "device_name": "test", "torch": "x",
            "made": "2026-11-28T00:00:00", "dispatch_us": {"fp32": dispatch},
            "sync_us": sync, "step_us": step, "matmul": {"fp32:nn": flat},
            "bandwidth": {"axes": [[1, 10**9]], "rates": [bw, bw], "measured": 2}}


def _ops(rows, dispatched=None, io=None, split=None):
    return types.SimpleNamespace(ops=rows, dispatched=dispatched or len(rows), io=io or [],
                                 split=split)


MM = (1e6, 0, torch.float32, ("mm", 10, 10, 10, "nn", 1))  # 1 ms at 1 GFLOP/s
MEM = (0.0, 10**6, torch.float32, None)  # 1 ms at 1 GB/s
SYNC = (0.0, 0, None, ("sync",))


def test_a_cpus_step_is_each_ops_dispatch_then_its_kernel():
    c = Calibration(_data(dispatch=100.0, step=500.0), "t")
    t, busy = c.step_s(_ops([MM, MEM, MM]), "fp32")
    assert busy == pytest.approx(3e-3)
    assert t == pytest.approx(3e-3 + 3 * 100e-6 + 500e-6)
    # a probe step's ops ran 1.5x their grid times together: every op's dispatch and kernel
    slow = Calibration({**_data(dispatch=100.0, step=500.0),
                        "in_step": {"fp32": {"factor": 1.5}}}, "t")
    t, busy = slow.step_s(_ops([MM, MEM, MM]), "fp32")
    assert busy == pytest.approx(4.5e-3)
    assert t == pytest.approx(1.5 * (3e-3 + 3 * 100e-6) + 500e-6)
    assert slow.factor("tf32") == 1.5 and slow.factor("bf16") == 1.0  # (not measured)
    # tapered (version 3): each 1 ms kernel two thirds of the way from 10 µs to 10 ms in
    # log(time), so 1.5 - 0.5 * 2/3 of its time; dispatch the whole factor
    tapered = Calibration({**_data(dispatch=100.0, step=500.0), "in_step": {
        "fp32": {"factor": 1.5, "taper_s": [1e-5, 1e-2]}}}, "t")
    t, busy = tapered.step_s(_ops([MM, MEM, MM]), "fp32")
    assert busy == pytest.approx(3e-3 * (1.5 - 0.5 * 2 / 3))
    assert t == pytest.approx(busy + 1.5 * 3 * 100e-6 + 500e-6)
    assert tapered.in_step_s(1e-6, "fp32") == pytest.approx(1.5e-6)
    assert tapered.in_step_s(0.1, "fp32") == pytest.approx(0.1)


def test_a_gpus_host_runs_ahead_until_a_value_is_read():
    """Device-bound: kernels back to back, each host dispatch hidden; host-bound: the
    dispatches; a sync makes the host wait for the device, then costs sync_us."""
    c = Calibration(_data("cuda", dispatch=100.0, sync=50.0), "t")
    assert c.step_s(_ops([MM] * 4), "fp32")[0] == pytest.approx(100e-6 + 4e-3)
    fast = Calibration(_data("cuda", dispatch=2000.0, flops=1e12), "t")
    assert fast.step_s(_ops([MM] * 4), "fp32")[0] == pytest.approx(4 * 2e-3 + 1e-6)
    t = c.step_s(_ops([MM, SYNC, MM], dispatched=2), "fp32")[0]
    assert t == pytest.approx((100e-6 + 1e-3 + 50e-6) + (100e-6 + 1e-3))


def test_checkpointings_hooks_cost_each_op_what_they_cost_the_calibrations_step():
    d = _data(dispatch=10.0)
    d["dispatch_us"].update({"bf16": 20.0, "fp32+full": 15.0})
    c = Calibration(d, "t")
    assert c.dispatch_s("bf16", "full") == pytest.approx(30e-6)
    assert c.dispatch_s("fp16") == pytest.approx(20e-6)  # (fp16 takes bf16's)
    assert c.dispatch_s("fp32", "selective") == pytest.approx(10e-6)  # not measured: none
    d["dispatch_us"]["bf16+full"] = 25.0  # measured at its precision: as measured
    assert Calibration(d, "t").dispatch_s("bf16", "full") == pytest.approx(25e-6)


def test_a_file_that_is_not_a_calibration_is_refused():
    with pytest.raises(CalibrationError, match="not a moe_exp calibration"):
        check_data({"version": 0}, "f.json")
    with pytest.raises(CalibrationError, match="lacks matmul"):
        check_data({k: v for k, v in _data().items() if k != "matmul"}, "f.json")
    with pytest.raises(CalibrationError, match="no bf16 matmuls"):
        Calibration(_data(), "t").kernel_s(1e6, 0, torch.bfloat16, MM[3], "bf16")


def test_the_shapes_a_step_records_name_their_layouts():
    a, w = torch.ones(8, 4), torch.ones(6, 4)
    assert layout(a, w.t()) == "nt" and layout(a.t().contiguous().t(), w) == "tn"
    assert shape_key("mm", (a, w.t())) == ("mm", 8, 6, 4, "nt", 1)
    b = torch.ones(3, 8, 4)
    assert shape_key("bmm", (b, torch.ones(3, 4, 5))) == ("mm", 24, 5, 4, "nn", 3)
    q = torch.ones(1, 2, 16, 8)
    assert shape_key("scaled_dot_product_flash_attention_for_cpu", (q, q, q))[2:] == \
        (16, 16, 8)


def test_a_gpus_calibration_plans_the_traces_cpu_attention_as_cudas_kernel():
    d = _data("cuda")
    d["sdpa"] = {"scaled_dot_product_flash_attention:bf16": {
        "axes": [[16, 4096], [64, 128]], "rates": [[7e9, 7e9], [7e9, 7e9]]}}
    c = Calibration(d, "t")
    op = (7e6, 0, torch.bfloat16, ("sdpa", "scaled_dot_product_flash_attention_for_cpu",
                                  512, 512, 64))
    assert c.kernel_s(*op, "bf16") == pytest.approx(1e-3)


def test_grouped_mm_in_fp32_is_traced_on_fake_tensors():
    """grouped_mm's shape function takes bf16 only; the plan gives the fp32 kernel's output
    (the CPU's dispatch in fp32 is grouped) and records its shapes."""
    from moe_exp.plan.trace import trace_step

    step = trace_step(compose(["model=tiny_moe", "hardware=cpu", "model.dispatch=grouped",
                               "train.micro_batch_size=2"]))
    kinds = {op[3][0] for op in step.ops.ops if op[3]}
    assert {"gmm", "gmm_w", "mm"} <= kinds
    assert step.ops.dispatched > len(step.ops.ops) > 0


def test_calibrate_measures_a_grid_and_fits_the_dispatch_cost(monkeypatch):
    """A small grid measured here; the tiny runs' step times made up as 40 µs an op (60
    with full checkpointing) and their kernels: the dispatch cost found is that. The
    in-step probe's made up as 1 s: its factor makes the probe's plan that."""
    from moe_exp.plan.trace import trace_step

    monkeypatch.setitem(cal_mod.GRIDS, "cpu", dict(mm=([16, 64], [64], [64]),
                                                   sdpa=([128], [64]), bytes_max=2**14))

    def made_up(cfg, precision, shape, device, ac="none"):
        if shape is cal_mod.SHAPES["in_step"]:
            return 1.0
        cal = Calibration({**data_so_far[0], "dispatch_us": {}}, "t")
        n, k = cal_mod._traced(cfg, precision, shape, cal, ac)
        return (60e-6 if ac == "full" else 40e-6) * n + k

    data_so_far = []
    real_dispatch = cal_mod._dispatch

    def dispatch(cfg, device, cal, precisions):
        data_so_far.append(cal.data)
        return real_dispatch(cfg, device, cal, precisions)

    monkeypatch.setattr(cal_mod, "POINT_S", 10.0)  # (every point, on a busy machine too)
    monkeypatch.setattr(cal_mod, "_measured_step_s", made_up)
    monkeypatch.setattr(cal_mod, "_dispatch", dispatch)
    cfg = compose(["task=calibrate", "hardware=cpu", "hardware.precisions=[fp32]"])
    data = cal_mod.calibrate(cfg, torch.device("cpu"), progress=False)
    check_data(json.loads(json.dumps(data)), "made")
    assert data["matmul"]["fp32:nt"]["measured"] == 2
    assert data["dispatch_us"]["fp32"] == pytest.approx(40.0, rel=1e-6)
    assert data["dispatch_us"]["fp32+full"] == pytest.approx(60.0, rel=1e-6)
    assert data["step_us"] == 0.0
    probe = data["in_step"]["fp32"]
    assert probe["measured_ms"] == 1000.0 and 0 < probe["planned_ms"] < 1000.0
    made = Calibration(data, "made")
    assert made.factor("fp32") == probe["factor"] > 1000.0 / probe["planned_ms"]
    ops = trace_step(cal_mod._tiny(cfg, "fp32", cal_mod.SHAPES["in_step"])).ops
    assert made.step_s(ops, "fp32")[0] == pytest.approx(1.0)  # (the short ops more)
    assert data["sdpa"]  # the CPU's flash kernel, forward and backward
    assert set(data["section_s"]) >= {"matmul", "sdpa", "dispatch", "in_step"}


def test_a_plan_says_what_its_time_rests_on(tmp_path, capsys, monkeypatch):
    """Without a calibration: the datasheet's floor, said in the summary; with the shipped
    h100 one: its rates, the kernels' busy time within the step's."""
    monkeypatch.setenv("COLUMNS", "200")  # (the summary's cells on one line)
    o = ["task=plan", "logger=none", "model=tiny_moe", "hardware=h100", "precision=bf16"]
    rec = run_inproc(o, tmp_path / "a")
    assert rec["planned_time_basis"] == "datasheet" and rec["planned_kernel_ms"] is None
    assert "calibration" in rec["null_reasons"]["planned_kernel_ms"]
    assert "datasheet's peaks: a floor" in capsys.readouterr().out
    rec = run_inproc([*o, "hardware.calibration=h100"], tmp_path / "b")
    assert rec["status"] == "ok" and off_contract(rec) == set(), rec["error"]
    assert rec["planned_time_basis"].startswith("calibration ") and "H100" in \
        rec["planned_time_basis"]
    assert 0 < rec["planned_kernel_ms"] <= rec["planned_compute_ms"]
    assert rec["planned_compute_ms"] > 2 * rec["planned_flops_per_step"] / 989e12 * 1e3


@pytest.mark.parametrize("args, says", [
    (["hardware.calibration=/no/such.json"], "no calibration file /no/such.json"),
    (["hardware.calibration=h300"], "shipped: h100"),
    (["hardware=h100", "hardware.calibration=auto"], "auto is this machine's (cpu)"),
    (["task=calibrate", "hardware.devices=2"], "hardware.devices"),
])
def test_a_calibration_that_cannot_be_read_fails_before_any_work(tmp_path, args, says):
    args = ["task=plan", *args] if "task=calibrate" not in args else args
    got = cli_inproc([*args, "logger=none", f"hydra.run.dir={tmp_path}"], tmp_path)
    lines = got.stderr.strip().splitlines()
    assert got.returncode == 2 and len(lines) == 1 and says in lines[0], got.stderr
    assert "hardware" in lines[0] and "Traceback" not in got.stderr


def test_a_compiled_step_fuses_the_ops_between_its_matmuls():
    """x -> a -> b -> c between two matmuls: one kernel reading x (1 MB) and writing c,
    which the next matmul reads (1 MB); a and b stay inside it. The optimizer's ops
    (from ops.split) stay eager."""
    c = Calibration(_data(dispatch=100.0), "t")
    mem = (0.0, 2 * 10**6, torch.float32, None)
    ops = _ops([MM, mem, mem, mem, MM, mem], split=5, io=[
        ((), (("x", 10**6),)), ((("x", 10**6),), (("a", 10**6),)),
        ((("a", 10**6),), (("b", 10**6),)), ((("b", 10**6),), (("c", 10**6),)),
        ((("c", 10**6),), (("y", 10**6),)), ((("p", 10**6),), (("p", 10**6),))])
    eager = c.launches(ops, "fp32")
    fused = c.launches(ops, "fp32", compiled=True)
    assert [k[2] for k in eager] == pytest.approx([1e-3, 2e-3, 2e-3, 2e-3, 1e-3, 2e-3])
    assert [k[2] for k in fused] == pytest.approx([1e-3, 2e-3, 1e-3, 2e-3])
    assert fused[1][3:] == (("x",), ("a", "b", "c"))
    assert fused[-1][1] == pytest.approx(100e-6)  # (the optimizer's op: eager dispatch)


def test_collectives_overlap_the_compute_until_an_op_reads_what_they_write():
    """A GPU: an all-gather (2 ms) started after the first matmul; the next matmul does not
    need it and runs beside it, the one after reads it and waits; the step ends when its
    last collective does."""
    c = Calibration(_data("cuda", dispatch=1.0), "t")
    comm = (0.0, 0, None, ("comm", 0))
    ops = _ops([MM, comm, MM, MM], dispatched=3, io=[
        ((), (("w0", 1),)), ((("s", 1),), (("s", 1), ("full", 1))),
        ((("w0", 1),), (("y", 1),)), ((("full", 1),), (("z", 1),))])
    alone = c.step_s(ops, "fp32")[0]
    both = c.step_s(ops, "fp32", comm=[2e-3])[0]
    assert alone == pytest.approx(1e-6 + 3e-3)
    assert both == pytest.approx(1e-6 + 1e-3 + 2e-3 + 1e-3)  # (waits 1 ms: exposed)
    late = _ops(ops.ops[:3], dispatched=2, io=ops.io[:3])  # read by nothing: it ends last
    assert c.step_s(late, "fp32", comm=[2e-3])[0] == pytest.approx(1e-6 + 1e-3 + 2e-3)


def test_a_sweeps_table_sums_up_its_rows_plan_checks():
    import pandas as pd

    from moe_exp.sweep.table import plan_errors

    df = pd.DataFrame({"planned_step_error": [0.1, -0.3, None, 0.2],
                       "planned_peak_error": [0.01, 0.02, 0.03, None],
                       "planned_time_basis": ["calibration h100.json (H100)"] * 4})
    line = plan_errors(df)
    assert line.startswith("Plan check") and "step time median +10%, -30% to +20% over 3 " \
        "rows" in line and "peak median +2%, +1% to +3% over 3 rows" in line
    assert "calibration h100.json" in line and "compiled rows" not in line
    df["planned_memory_basis"] = ["eager step", "compiled step (AOTAutograd's ...)", None, None]
    assert "; compiled rows' peaks from the compiled step's partition." in plan_errors(df)
    assert plan_errors(pd.DataFrame({"status": ["ok"]})) == ""


def test_a_gpus_plan_of_mla_takes_the_memory_efficient_kernel():
    """MLA's query/key heads (48) and value heads (32) differ: CUDA runs the
    memory-efficient kernel, which saves no (S, S) scores; a CPU's plan keeps the math
    kernel the CPU runs."""
    from moe_exp.plan.trace import trace_step

    o = ["model=tiny_deepseek", "precision=bf16", "train.micro_batch_size=2"]
    gpu, cpu = (trace_step(compose([*o, f"hardware={h}"])) for h in ("h100", "cpu"))
    kernels = {op[3][1] for op in gpu.ops.ops if op[3] and op[3][0] == "sdpa"}
    assert kernels == {"scaled_dot_product_efficient_attention",
                       "scaled_dot_product_efficient_attention_backward"}
    assert not any(op[3] and op[3][0] == "sdpa" for op in cpu.ops.ops)
    assert gpu.at_peak["activations"] < cpu.at_peak["activations"]


def test_auto_makes_this_machines_calibration_once_and_then_reads_it(tmp_path, monkeypatch):
    """hardware.calibration=auto: made on first use into the cache (its time is the
    record's calibration_s), read from it after (calibration_s null, with why); a torchrun
    rank refuses to make it (every rank would, at once)."""
    from moe_exp.plan.predict import bench_plan

    made = []

    def fake_calibrate(cfg, device, progress=True):
        made.append(device.type)
        return {**_data(), "seconds": 12.5}

    monkeypatch.setenv("MOE_EXP_CACHE", str(tmp_path))
    monkeypatch.setattr(cal_mod, "calibrate", fake_calibrate)
    cfg = compose(["model=tiny_moe", "hardware=cpu", "hardware.calibration=auto",
                   "train.micro_batch_size=2"])
    with monkeypatch.context() as torchrun:  # (its ranks, each at once: none makes it)
        torchrun.setenv("RANK", "0")
        torchrun.setenv("WORLD_SIZE", "2")
        with pytest.raises(CalibrationError, match="run task=calibrate here first"):
            cal_mod.calibration_for(cfg)
    first, again = bench_plan(cfg), bench_plan(cfg)
    assert made == ["cpu"] and len(list((tmp_path / "calibration").glob("*.json"))) == 1
    assert first["calibration_s"] == 12.5 and first["planned_step_ms"] > 0
    assert again["calibration_s"] is None and "made before this run" in \
        again["null_reasons"]["calibration_s"]
    assert again["planned_step_ms"] == pytest.approx(first["planned_step_ms"])


def test_a_cpus_calibration_is_kept_for_its_thread_count():
    """A CPU's rates scale with torch's threads (2 threads: twice 1's FLOP/s here): the
    cache keeps one a count, and a calibration read at another count says so."""
    from moe_exp.plan.calibration import machine_key

    n, cpu = torch.get_num_threads(), torch.device("cpu")
    cal = Calibration({**_data(), "threads": 2}, "made.json")
    try:
        torch.set_num_threads(1)
        one, differs = machine_key(cpu), cal.label()
        torch.set_num_threads(2)
        two, same = machine_key(cpu), cal.label()
    finally:
        torch.set_num_threads(n)
    assert one != two and one.replace("1t-", "2t-") == two
    assert "this process runs 1 thread: its rates differ" in differs
    assert "2 threads" in same and "differ" not in same
    assert "no in-step factor" in same  # (a calibration made before the probe says so)
    probed = Calibration({**_data(), "in_step": {"fp32": {"factor": 1.2}}}, "made.json")
    assert "in-step" not in probed.label()


def test_a_gpu_plan_picks_the_expert_kernel_by_the_profiles_capability():
    """Without the GPU here, model.dispatch=auto is planned as CUDA picks it on the
    profile's part: grouped_mm's own kernel in bf16 on sm90 (hardware.compute_capability
    9.0: the H100 and H200 profiles), else loop; not by the profile's name."""
    import torch

    from conftest import compose
    from moe_exp.plan.trace import planned_config

    if torch.cuda.is_available():
        pytest.skip("a GPU here: the run's own pick")
    for o, want in [(["hardware=h100", "precision=bf16"], "grouped"),
                    (["hardware=h200_nvl", "precision=bf16"], "grouped"),
                    (["hardware=h100", "precision=fp32"], "loop"),
                    (["hardware=a100", "precision=bf16"], "loop"),
                    (["hardware=h100", "precision=bf16", "hardware.compute_capability=8.0"],
                     "loop"),
                    (["hardware=a100", "precision=bf16", "hardware.compute_capability=9.0"],
                     "grouped")]:
        cfg = compose(["task=plan", *o])
        assert planned_config(cfg).model.dispatch == want, o
