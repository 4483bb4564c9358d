"""The accelerator's own figures over the measured window: utilization, memory used, power.

A thread samples them every 0.1 s, through NVML (nvidia-ml-py) on NVIDIA GPUs and through
HLML, Habana's pyhlml with the same calls, on Gaudi. Both libraries are optional.
"""
from __future__ import annotations

import threading

import torch

FIELDS = ("gpu_util_pct", "gpu_mem_used_gib", "gpu_power_w")


def _nvml(device: torch.device):
    """A () -> (utilization %, memory used GiB, power W) reader of the run's GPU."""
    import pynvml

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    h = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-"))
                                         else f"GPU-{uuid}")
    return lambda: (pynvml.nvmlDeviceGetUtilizationRates(h).gpu,
                    pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**30,
                    pynvml.nvmlDeviceGetPowerUsage(h) / 1e3)  # (mW)


def _hlml(device: torch.device):
    """The same reader on Gaudi, through HLML, for the run's hpu index; utilization is the AIP's."""
    import pyhlml

    pyhlml.hlmlInit()
    h = pyhlml.hlmlDeviceGetHandleByIndex(device.index or 0)
    return lambda: (pyhlml.hlmlDeviceGetUtilizationRates(h),
                    pyhlml.hlmlDeviceGetMemoryInfo(h).used / 2**30,
                    pyhlml.hlmlDeviceGetPowerUsage(h) / 1e3)  # (mW)


LIBRARIES = {"cuda": (_nvml, "nvidia-ml-py is not installed (pip install nvidia-ml-py)", "NVML"),
             "hpu": (_hlml, "pyhlml is not installed (Habana's HLML wrapper, "
                            "github.com/HabanaAI/pyhlml)", "HLML")}


class GpuSampler:
    """Samples the accelerator's figures over the measured window.

    start() at the window's opening; stop() at its end returns the record's fields. `why`
    says why there are none: no such library for the device, the library not installed, or
    the library refused.
    """

    def __init__(self, device: torch.device):
        self.why, self.read, self.samples = None, None, []
        if device.type not in LIBRARIES:
            self.why = f"no NVIDIA GPU or Gaudi: the run's device is {device.type}"
            return
        opener, missing, self.lib = LIBRARIES[device.type]
        try:
            self.read = opener(device)
        except ImportError:
            self.why = missing
        except Exception as e:  # noqa: BLE001 - the library's own errors: a reason
            self.why = f"{self.lib}: {type(e).__name__}: {e}"

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.samples.append(self.read())
            except Exception as e:  # noqa: BLE001
                self.why = f"{self.lib}: {type(e).__name__}: {e}"
                return

    def start(self) -> None:
        if self.read is not None:
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def stop(self) -> dict:
        """Stop sampling; returns the fields and, where they are null, the reasons.

        The fields: mean utilization %, most memory used in GiB, mean power in W.
        """
        if self.read is not None and hasattr(self, "_thread"):
            self._stop.set()
            self._thread.join()
        if self.samples and self.why is None:
            util, mem, power = zip(*self.samples)
            return {"gpu_util_pct": sum(util) / len(util), "gpu_mem_used_gib": max(mem),
                    "gpu_power_w": sum(power) / len(power)}
        return dict.fromkeys(FIELDS) | {"null_reasons": dict.fromkeys(
            FIELDS, self.why or "the measured window was shorter than one 0.1 s sample")}
