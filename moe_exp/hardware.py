"""Hardware profiles: resolve `hardware=auto`, pick the device, apply environment knobs."""
from __future__ import annotations

import contextlib
import os
import platform
import sys

import torch
from omegaconf import OmegaConf

from .config import CONF, ConfigError, Unsupported
from .host import glibc, malloc_retain, status_kib

# CUDA device name -> profile, first match wins (the PCIe and NVL parts peak lower than SXM)
GPU_PROFILES = {"H100 PCIe": "h100_pcie", "H100 NVL": "h100_nvl", "H200 NVL": "h200_nvl",
                "H200": "h200", "H100": "h100", "A100": "a100"}


def detect() -> str:
    """Profile name for this machine: from the CUDA device name, else cpu."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for token, profile in GPU_PROFILES.items():
            if token in name:
                return profile
        return "cuda"
    return "cpu"


def _generic_cuda() -> dict:
    major, minor = torch.cuda.get_device_capability(0)
    prec = ["fp32", "fp16"] + (["tf32", "bf16"] if major >= 8 else [])
    if (major, minor) >= (8, 9):
        prec.append("fp8")
    return {"name": "cuda", "device": "cuda", "peak_flops": {}, "precisions": prec}


def load_profile(name: str) -> dict:
    if name == "cuda":
        return _generic_cuda()
    return OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))


def resolve(cfg) -> None:
    """Fill `hardware` in place: auto -> detected profile; device; memory_gib."""
    hw = cfg.hardware
    if hw.name == "auto":
        prof = load_profile(detect())
        # Keys the user set on auto (non-empty) win over the detected profile's.
        for key, value in prof.items():
            mine = hw.get(key)
            if key == "peak_flops":
                hw.peak_flops = {**value, **dict(hw.peak_flops)}
            elif key == "name" or mine in (None, "auto", [], {}) or key not in hw:
                hw[key] = value
    elif not hw.precisions and hw.device != "auto":
        raise ConfigError("hardware.precisions", "empty: name the precisions this hardware "
                          "runs (e.g. [fp32,bf16])")
    elif not hw.precisions:  # `hardware.name=X` on the auto group loads no profile
        raise ConfigError("hardware.name", f"'{hw.name}' only labels a profile; pick one with "
                          f"hardware={hw.name} (or hardware=auto to detect it)")
    if hw.device == "auto":
        hw.device = "cuda" if torch.cuda.is_available() else "cpu"
    if hw.memory_gib is None:  # (none without the device: device_here says so later)
        hw.memory_gib = device_memory_gib(hw.device)


# cuBLAS is deterministic only with a fixed workspace, read when cuBLAS starts in a process
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def env_for(hw) -> dict:
    """The run's environment variables, less those the environment sets already: it wins.

    hardware.env; with hardware.deterministic on CUDA, DETERMINISTIC_ENV; on <= 4 cores,
    TORCHINDUCTOR_COMPILE_THREADS=1."""
    env = dict(hw.get("env") or {})
    if hw.get("deterministic") and hw.get("device") == "cuda":
        env = {**DETERMINISTIC_ENV, **env}
    if (os.cpu_count() or 1) <= 4:  # inductor's default: a worker per core, on 2 cores slower
        env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **env}
    return {k: str(v) for k, v in env.items() if k not in os.environ}


@contextlib.contextmanager
def hardware_env(hw):
    """hardware.env for the duration of one run; its ranks, started inside, inherit it.

    An in-process sweep's next job does not. Variables read when a library is imported, such
    as OMP_NUM_THREADS by torch, act only in processes started with them: the ranks, and
    sweep jobs in their own process with sweep.isolate=true."""
    added = env_for(hw)
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _relabelled(hw, shipped: dict) -> bool:
    """Whether hw only borrows a shipped profile's name, e.g. hardware=cpu hardware.name=h100.

    It does where neither its peaks nor its precisions are that profile's."""
    return shipped.get("peak_flops") != dict(hw.peak_flops) and \
        shipped.get("precisions") != list(hw.precisions)


def _shipped_device(hw) -> str | None:
    """The device of the shipped profile named hw.name; None where there is no such profile."""
    shipped = (CONF / "hardware" / f"{hw.name}.yaml").is_file()
    return load_profile(hw.name).get("device") if shipped else None


def check_device(cfg) -> None:
    """Raises ConfigError on the hardware group's mistakes: the run is invalid."""
    hw = cfg.hardware
    own = _shipped_device(hw)
    if own not in (None, "cpu") and hw.device != own and _relabelled(hw, load_profile(hw.name)):
        raise ConfigError("hardware.name", f"'{hw.name}' is the name of a shipped {own} "
                          f"profile, and this profile (device {hw.device}) is another: pick "
                          f"hardware={hw.name}, or another name (it labels every result)")
    if own not in (None, "cpu") and hw.device != own:  # (its peaks and memory are the GPU's)
        raise ConfigError("hardware.device", f"{hw.device} with hardware={hw.name}, a profile "
                          f"of a {own} device (its peak FLOP/s and memory): leave "
                          f"hardware.device at {own}, or pick hardware=auto or cpu")
    if hw.devices < 1:
        raise ConfigError("hardware.devices", f"must be >= 1, got {hw.devices}")


def device_here(cfg) -> None:
    """Raises Unsupported on what this machine lacks for the hardware asked: the run is skipped."""
    hw = cfg.hardware
    own = _shipped_device(hw)
    if hw.device == "cuda" and not torch.cuda.is_available():
        if own == "cuda":  # a GPU profile (not a device override)
            raise Unsupported("hardware", f"hardware={hw.name} needs a CUDA GPU and none is "
                              "visible; use hardware=auto or hardware=cpu")
        raise Unsupported("hardware.device", "cuda: no CUDA GPU is visible; use "
                          "hardware=auto or hardware=cpu (a CUDA profile's peaks on a CPU "
                          "would not be this machine's)")
    if hw.device == "hpu":
        try:
            with hardware_env(hw):  # the bridge reads PT_HPU_LAZY_MODE when imported
                import habana_frameworks.torch  # noqa: F401
        except ImportError:
            key, who = ("hardware", f"hardware={hw.name}") if own == "hpu" else \
                ("hardware.device", "hpu")
            raise Unsupported(key, f"{who} needs Intel Gaudi's PyTorch bridge "
                              "(habana_frameworks), which is not installed here") from None
    if hw.get("malloc_retain") and not glibc():
        raise Unsupported("hardware.malloc_retain", "needs glibc's malloc (Linux); "
                          "use hardware.malloc_retain=false")
    if hw.device == "cuda" and hw.devices > torch.cuda.device_count():
        raise Unsupported("hardware.devices", f"{hw.devices} ranks asked for, "
                          f"{torch.cuda.device_count()} CUDA device(s) visible")


def device_memory_gib(device: str) -> float | None:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    if device == "cpu":
        try:
            return status_kib("MemTotal", "/proc/meminfo") / 2**20
        except (OSError, RuntimeError):
            return None
    return None


def device_name(device: torch.device) -> str:
    """The record's device_name: the GPU's name, or the CPU's model and its vector units.

    The units are those torch's CPU kernels use: bf16 matmuls run several times faster with
    AMX than without."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name() if device.type == "cpu" else device.type


def cpu_name() -> str:
    """The CPU's model and vector units, e.g. 'Intel(R) Xeon(R) Platinum 8480+ (AVX512, AMX)'."""
    model = ""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), "")
    units = [torch.backends.cpu.get_cpu_capability()]
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        units.append("AMX")
    return f"{model or platform.processor() or 'cpu'} ({', '.join(units)})"


def torch_device(cfg) -> torch.device:
    if cfg.hardware.device == "cpu":
        return torch.device("cpu")
    return torch.device(cfg.hardware.device, int(os.environ.get("LOCAL_RANK", 0)))


def setup_backends(cfg) -> None:
    if cfg.hardware.malloc_retain and not malloc_retain():
        raise Unsupported("hardware.malloc_retain", "glibc refused the mallopt settings")
    det = bool(cfg.hardware.deterministic)
    if cfg.hardware.device == "cuda":
        torch.backends.cudnn.benchmark = cfg.hardware.cudnn_benchmark and not det
    set_deterministic(det)  # (and DETERMINISTIC_ENV: see env_for)


# how torch words its refusal of an op without a deterministic kernel (set_deterministic)
NONDETERMINISTIC = " does not have a deterministic implementation"


def nondeterministic_error(e: BaseException) -> str | None:
    """The one-line error of a run stopped by an op without a deterministic kernel, or None."""
    text = str(e)
    if NONDETERMINISTIC not in text:
        return None
    op = text.split(NONDETERMINISTIC)[0].strip().splitlines()[-1]
    return (f"hardware.deterministic: {op} has no deterministic kernel, so torch refuses to "
            "run it; set hardware.deterministic=false for this configuration")


def set_deterministic(on: bool) -> None:
    """hardware.deterministic: torch's deterministic algorithms, strict, and inductor's own.

    Strict: an op that has no deterministic kernel raises. warn_only would also leave the
    fused attention kernels' backward, cuDNN's among them, on their atomic adds, and losses
    would differ between runs. Inductor reads the setting when it lowers, using eager's
    index_put instead of its atomic adds, e.g. in the embedding's backward; its own
    deterministic mode picks kernels without timing them. Set both ways: a job in a shared
    process must not inherit the last one's."""
    torch.use_deterministic_algorithms(on)
    inductor = sys.modules.get("torch._inductor.config")
    if on and inductor is None:
        import torch._inductor.config as inductor
    if inductor is not None and hasattr(inductor, "deterministic"):
        inductor.deterministic = on or os.environ.get("TORCHINDUCTOR_DETERMINISTIC") == "1"
