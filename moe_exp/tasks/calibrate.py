"""task=calibrate: measures what this device's kernels achieve, for a plan's time.

plan/calibrate.py measures; the file it writes (calibration.json in the run dir, and this
machine's cache, which hardware.calibration=auto reads) is what hardware.calibration names."""
from __future__ import annotations

from ..config import ConfigError
from ..record import Calibrated
from ..results import fill_null_reasons
from .protocol import Task


class CalibrateTask(Task):
    name = "calibrate"
    noun = "calibration"
    section = Calibrated
    title = "moe_exp calibration"
    model = False

    @staticmethod
    def check(cfg) -> None:
        from ..plan.calibrate import DTYPES

        if cfg.hardware.devices != 1:
            raise ConfigError("hardware.devices", "task=calibrate measures one device: 1 (its "
                              "collectives: task=comm)")
        if not set(cfg.hardware.precisions) & set(DTYPES):
            raise ConfigError("hardware.precisions", f"{list(cfg.hardware.precisions)}: "
                              f"task=calibrate measures {', '.join(DTYPES)}; name one")

    def run_name(self) -> str:
        return f"calibrate-{self.ctx.cfg.hardware.name}"

    def run(self, rec: dict) -> None:
        import torch

        from ..hardware import device_name, torch_device
        from ..plan.calibrate import calibrate
        from ..plan.calibration import Calibration, cache_dir, machine_key, write

        cfg, out = self.ctx.cfg, self.ctx.out_dir
        device = torch_device(cfg)
        data = calibrate(cfg, device, self.ctx.progress)
        cached = cache_dir() / f"{machine_key(device)}.json"
        write(data, out / "calibration.json")
        write(data, cached)
        best = lambda g: max(_leaves(g["rates"]))  # noqa: E731
        rec.update(task="calibrate", device_name=device_name(device),
                   torch_version=torch.__version__,
                   calibration_file=str(out / "calibration.json"),
                   calibration_s=data["seconds"], dispatch_us=data["dispatch_us"],
                   in_step_factor=Calibration(data, str(out)).in_step or None,
                   sync_us=data["sync_us"], bandwidth_gbps=best(data["bandwidth"]) / 1e9,
                   matmul_tflops=_best_by_precision(data["matmul"]),
                   calibration_points=sum(g["measured"] for part in (
                       data["matmul"], data["grouped_mm"], data["sdpa"]) for g in part.values())
                   + data["bandwidth"]["measured"])
        rec["calibration_cached"] = str(cached)
        if not rec["in_step_factor"]:
            rec["null_reasons"]["in_step_factor"] = "a GPU's step is not probed (its host " \
                "runs ahead of its kernels)"
        fill_null_reasons(rec, "task=calibrate measures kernels, not training")

    @staticmethod
    def summary_rows(r: dict) -> list[tuple[str, str]]:
        from ..plan.calibration import TAPER

        mm = ", ".join(f"{k} {v:,.3g}" for k, v in (r.get("matmul_tflops") or {}).items())
        disp = ", ".join(f"{k} {v:,.1f}" for k, v in (r.get("dispatch_us") or {}).items())
        return [
            ("calibration", f"{r['device_name']}: {r['calibration_points']} shapes measured "
                            f"in {r['calibration_s']:.0f} s"),
            ("best matmul", f"{mm} TFLOP/s"),
            ("bandwidth", f"{r['bandwidth_gbps']:,.1f} GB/s at best (an add: 2 reads, 1 "
                          "write)"),
            ("dispatch", f"{disp} µs an eager step's op"),
            *([("in a step", ", ".join(f"{k} x{v:.2f}" for k, v in r["in_step_factor"].items())
                + f" a short op's grid time, tapering to x1 at {TAPER[1] * 1e3:g} ms (what "
                "makes a probe step's plan its measured time)")]
              if r.get("in_step_factor") else []),
            ("file", f"{r['calibration_file']} (hardware.calibration=<it>; this machine's "
                     f"cache, hardware.calibration=auto: {r.get('calibration_cached')})"),
        ]


def _leaves(x):
    if isinstance(x, list):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


def _best_by_precision(grids: dict) -> dict:
    """The best matmul rate of each precision over its layouts, in TFLOP/s."""
    out = {}
    for key, g in grids.items():
        p = key.split(":")[0]
        out[p] = max(out.get(p, 0.0), max(_leaves(g["rates"])) / 1e12)
    return out
