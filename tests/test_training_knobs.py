"""The loop's training knobs outside the model: the lr schedule (optim.schedule), Python's
garbage collection (train.gc_every) and the attention kernel (train.attention)."""
import gc
from types import SimpleNamespace

import pytest
import torch

from conftest import compose, run_inproc

SHORT = ["logger=none", "train.plan=false",
         "model.num_layers=1", "train.micro_batch_size=2", "train.seq_len=32",
         "train.steps=6", "train.warmup_steps=1", "train.log_every=3"]


def schedule(name, warmup=2, total=20, **kw):
    from moe_exp.optim import lr_factor

    o = SimpleNamespace(schedule=name, lr_warmup_steps=warmup, min_lr_ratio=0.1,
                        decay_ratio=0.25, **kw)
    return [lr_factor(s, total, o) for s in range(total)]


def test_linear_constant_and_wsd_schedules():
    """After the same warmup: linear falls evenly to min_lr_ratio; constant stays at the
    peak; wsd stays there, then falls evenly over the last decay_ratio of the steps after
    warmup to min_lr_ratio on the last step."""
    lin, const, wsd = schedule("linear"), schedule("constant"), schedule("wsd")
    assert lin[:2] == const[:2] == wsd[:2] == [0.5, 1.0]
    steps = [a - b for a, b in zip(lin[1:], lin[2:])]
    assert lin[-1] == pytest.approx(0.1) and max(steps) == pytest.approx(min(steps))
    assert const[1:] == [1.0] * 19
    # 18 steps after warmup x decay_ratio 0.25: the last 4.5 decay (the last 5 steps)
    assert wsd[1:15] == [1.0] * 14 and wsd[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(wsd[14:], wsd[15:]))


def test_onecycle_is_torchs_one_cycle():
    """onecycle: torch's OneCycleLR over the run's steps: from lr/25 up to lr at pct_start,
    then down to lr/25e4; the momentum is left alone (AdamW's beta1)."""
    from moe_exp.optim import build_optimizer

    cfg = compose(["optim.schedule=onecycle", "optim.pct_start=0.25", "train.steps=17",
                   "train.warmup_steps=3"])
    model = torch.nn.Linear(4, 4)
    opt, sched, _ = build_optimizer(model, cfg, torch.device("cpu"))
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    lr = cfg.optim.lr
    assert lrs[0] == pytest.approx(lr / 25) and max(lrs) == pytest.approx(lr)
    assert lrs.index(max(lrs)) == 4  # (pct_start x 20 steps - 1)
    assert lrs[-1] == pytest.approx(lr / 25 / 1e4)
    assert opt.param_groups[0]["betas"] == (cfg.optim.beta1, cfg.optim.beta2)


def test_a_run_records_its_lr_curve(tmp_path):
    """The record holds each step's learning rate: what the schedule gave the optimizer."""
    from moe_exp.optim import lr_factor

    cfg = compose([*SHORT, "optim.schedule=wsd", "optim.lr_warmup_steps=1"])
    rec = run_inproc([*SHORT, "optim.schedule=wsd", "optim.lr_warmup_steps=1"], tmp_path)
    assert rec["status"] == "ok" and rec["lr_schedule"] == "wsd"
    assert rec["lrs"] == pytest.approx([cfg.optim.lr * lr_factor(s, 7, cfg.optim)
                                        for s in range(7)])
    assert rec["lrs"][1] == rec["lrs"][4] == pytest.approx(cfg.optim.lr)  # stable


def test_gc_every_collects_on_schedule_and_times_it(tmp_path):
    """gc_every=2: automatic GC off for the run, one collection every 2 steps, timed: 3 in
    the 6 measured steps (steps 1..6 of 7); GC is back on after the run."""
    assert gc.isenabled()
    rec = run_inproc([*SHORT, "train.gc_every=2"], tmp_path / "every2")
    assert rec["status"] == "ok" and rec["gc_every"] == 2
    assert rec["gc_collections"] == 3 and rec["gc_ms"] > 0
    assert gc.isenabled()
    auto = run_inproc(SHORT, tmp_path / "auto")  # automatic: whatever Python ran, counted
    assert auto["gc_collections"] >= 0 and auto["gc_ms"] >= 0


def test_collector_turns_automatic_gc_off_and_back():
    from moe_exp.optimizations.collect import Collector

    with Collector(3) as c:
        assert not gc.isenabled()
        c.timing = True
        assert [c.step(s) for s in range(6)] == [False, False, True, False, False, True]
    assert gc.isenabled() and c.count == 2 and c.per_step(6)[1] == 2
    with Collector(0):
        assert gc.isenabled()


def _qkv(dtype=torch.float32, grad=True):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8, dtype=dtype, requires_grad=grad)
    k, v = (torch.randn(2, 2, 16, 8, dtype=dtype, requires_grad=grad) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("name,kernel", [("flash", "Flash"), ("math", None)])
def test_an_sdpa_backend_runs_that_kernel_alone(name, kernel):
    """flash / math: that SDPA kernel ran (its backward node says so), grouped k/v heads
    included, with the model's result."""
    from moe_exp.model.transformer import causal_attention
    from moe_exp.optimizations.attention import sdpa_only

    q, k, v = _qkv()
    y = sdpa_only(name, q, k, v)
    node = y.grad_fn.name()
    assert (kernel in node) if kernel else ("Flash" not in node and "Efficient" not in node)
    torch.testing.assert_close(y, causal_attention(q, k, v))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_computes_causal_attention():
    """FlexAttention's causal block mask and grouped heads give SDPA's result (forward, eager:
    CPU has no FlexAttention backward)."""
    from moe_exp.model.transformer import causal_attention
    from moe_exp.optimizations.attention import flex_causal

    q, k, v = _qkv(grad=False)
    torch.testing.assert_close(flex_causal(q, k, v, compiled=False), causal_attention(q, k, v))


def test_apply_attention_sets_every_layers_kernel():
    from moe_exp.model import build_model
    from moe_exp.optimizations.attention import apply_attention, flex_causal

    model = build_model(compose([]).model)
    apply_attention(model, "flex")
    kernels = [m.attend for m in model.modules() if hasattr(m, "attend")]
    assert len(kernels) == 2 and all(k is flex_causal for k in kernels)


@pytest.mark.parametrize("name,device,dtype,why", [
    ("efficient", "cpu", torch.float32, "CPU SDPA has the flash and math kernels only"),
    ("cudnn", "cpu", torch.bfloat16, "CPU SDPA has the flash and math kernels only"),
    ("flex", "cpu", torch.float32, "no backward on CPU"),
    ("flash", "cuda", torch.float32, "needs fp16 or bf16"),
    ("cudnn", "cuda", torch.float32, "needs fp16 or bf16"),
    ("flash", "hpu", torch.bfloat16, "only math or auto"),
    ("flash", "cpu", torch.float32, None), ("math", "cuda", torch.float32, None),
    ("efficient", "cuda", torch.float32, None), ("flash", "cuda", torch.bfloat16, None)])
def test_which_kernels_a_device_runs(name, device, dtype, why):
    from moe_exp.optimizations.attention import attention_unsupported

    got = attention_unsupported(name, device, dtype, (9, 0) if device == "cuda" else None)
    assert (got is None) if why is None else (why in got), got


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU's kernels")
def test_a_kernel_the_device_lacks_is_skipped_before_any_work():
    from moe_exp.run import prepare

    o = ["train.attention=efficient"]
    _, rec = prepare(compose(o), o)
    assert rec["status"] == "skipped"
    assert rec["error"] == "train.attention: efficient: torch's CPU SDPA has the flash and " \
                           "math kernels only"


def test_math_attention_trains_as_the_default_kernel(tmp_path):
    """A run on math attention (the default picks flash on this CPU): the same losses to
    rounding, and the record says which kernel."""
    auto = run_inproc(SHORT, tmp_path / "auto")
    math_ = run_inproc([*SHORT, "train.attention=math"], tmp_path / "math")
    assert math_["status"] == "ok" and math_["attention"] == "math"
    assert math_["losses"] == pytest.approx(auto["losses"], rel=1e-4)


SEED002 = ("baseline", "cudnn_benchmark", "mixed_precision", "flash_attention", "compile", "gc",
           "data_loader", "onecycle", "ddp", "grad_compression")


def test_seed002_rows_compose_and_the_preset_sweeps_them():
    """Each +seed002_row option is one checklist item on the baseline (all items off) and
    passes the checks here (CPU); the preset sweeps every row against the baseline."""
    from omegaconf import OmegaConf

    from moe_exp.config import CONF
    from moe_exp.validate import validate

    base = compose(["+seed002_row=baseline"])
    assert (base.train.attention, base.hardware.cudnn_benchmark, base.precision.name,
            base.train.gc_every, base.data.num_workers) == ("math", False, "fp32", 0, 0)
    for row in SEED002:
        cfg = compose([f"+seed002_row={row}", "hardware=cpu"])
        validate(cfg, [f"+seed002_row={row}"])
        assert cfg.extra.seed002_row == row
    preset = OmegaConf.load(CONF / "sweep" / "seed002.yaml")
    assert preset.hydra.sweeper.params["+seed002_row"].split(",") == list(SEED002)
    assert dict(preset.sweep.baseline) == {"extra.seed002_row": "baseline"}


def test_seed002_table_puts_claims_beside_measured_changes():
    """Flash is measured against bf16 with math attention, the rest against the baseline; a
    skipped row says why."""
    from test_sweep_table import rec

    from moe_exp.sweep.seed002 import seed002_table
    from moe_exp.sweep.table import build_table

    measured = {"baseline": (100.0, 2.0), "mixed_precision": (150.0, 1.0),
                "flash_attention": (180.0, 0.9), "compile": (110.0, 2.0)}
    rows = [rec(i, tps, mem, loss_last=2.5, extra={"seed002_row": k})
            for i, (k, (tps, mem)) in enumerate(measured.items())]
    rows.append(rec(9, None, None, status="skipped", extra={"seed002_row": "gc"},
                    error="train.gc_every: planted"))
    md = seed002_table(build_table(rows))
    assert "| Flash attention (bf16) | 180 | +20% (vs mixed_precision) | -10% | 2.500 | " \
           "30-50% faster |" in md
    assert "| Mixed precision (bf16) | 150 | +50% (vs baseline) | -50% |" in md
    assert "| cuDNN benchmarking | not run | - | - | - | 5-10% faster |" in md
    assert "| Garbage collection every 5 steps | skipped: planted |" in md
    assert seed002_table(build_table([rec(0, 1.0, 1.0)])) == ""
