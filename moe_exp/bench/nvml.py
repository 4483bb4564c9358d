"""The GPU's own figures over the measured window, through NVML (nvidia-ml-py, optional):
utilization, memory used and power, sampled by a thread every 0.1 s."""
from __future__ import annotations

import threading

import torch

FIELDS = ("gpu_util_pct", "gpu_mem_used_gib", "gpu_power_w")


class GpuSampler:
    """start() at the window's opening, stop() at its end -> the record's fields; `why`
    says why there are none (not a CUDA device, no nvidia-ml-py, NVML refused)."""

    def __init__(self, device: torch.device):
        self.why, self.handle, self.samples = None, None, []
        if device.type != "cuda":
            self.why = f"no NVIDIA GPU: the run's device is {device.type}"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
            self.nvml = pynvml
        except ImportError:
            self.why = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        except Exception as e:  # noqa: BLE001 - NVML's own errors: a reason, not a crash
            self.why = f"NVML: {type(e).__name__}: {e}"

    def _sample(self) -> None:
        n, h = self.nvml, self.handle
        while not self._stop.wait(0.1):
            try:
                self.samples.append((n.nvmlDeviceGetUtilizationRates(h).gpu,
                                     n.nvmlDeviceGetMemoryInfo(h).used / 2**30,
                                     n.nvmlDeviceGetPowerUsage(h) / 1e3))
            except Exception as e:  # noqa: BLE001
                self.why = f"NVML: {type(e).__name__}: {e}"
                return

    def start(self) -> None:
        if self.handle is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def stop(self) -> dict:
        """The fields (mean utilization %, most memory used, mean power W) and their reasons."""
        if self.handle is not None and hasattr(self, "_thread"):
            self._stop.set()
            self._thread.join()
        if self.samples and self.why is None:
            util, mem, power = zip(*self.samples)
            return {"gpu_util_pct": sum(util) / len(util), "gpu_mem_used_gib": max(mem),
                    "gpu_power_w": sum(power) / len(power)}
        return dict.fromkeys(FIELDS) | {"null_reasons": dict.fromkeys(
            FIELDS, self.why or "the measured window was shorter than one 0.1 s sample")}
