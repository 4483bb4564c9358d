"""The result record: one per run (`metrics.json`), one row per run in a sweep table."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import tempfile
from pathlib import Path

from .ranks import rank_env

STATUSES = ("ok", "oom", "diverged", "invalid", "error", "crashed", "skipped")

# The contract of shared/DESIGN.md, in order; extra keys follow.
FIELDS = (
    "status", "error",
    "model", "precision", "parallel", "hardware", "data", "optim",
    "activation_checkpointing", "compile",
    "world_size", "micro_batch_size", "grad_accum_steps", "seq_len", "overrides", "config_hash",
    "tokens_per_s", "tokens_per_s_per_device", "step_time_ms", "step_time_iqr_ms",
    "data_ms", "forward_ms", "backward_ms", "optimizer_ms", "compile_s",
    "peak_mem_gib", "peak_reserved_gib",
    "flops_per_token", "tflops_per_device", "mfu", "params_total", "params_active",
    "loss_first", "loss_last", "aux_loss", "expert_load_cv", "expert_load_max_over_mean",
    "device_name", "torch_version", "timestamp",
)
# The extra keys runs write (README "The result record"); with FIELDS, the columns a
# sweep.baseline may name before any job has run.
EXTRAS = (
    "task", "extra", "null_reasons", "losses", "measured_steps", "tokens_per_step",
    "tokens_per_s_wall", "data_share", "startup_s", "comm_ms", "comm_share", "comm",
    "comm_backend", "z_loss", "tokens_per_expert", "expert_load_cv_per_layer",
    "expert_load_max_over_mean_per_layer", "expert_load_step_max_over_mean", "moe_dispatch", "moe_padded_fallback_share",
    "optim_impl", "peak_flops", "compile_cache_hit_share", "cudagraph_skips", "cpu_other_load",
    "job",
    "repeat", "repeats",
    "repeats_ok", "combined", "resumed_from",
)
# Keys that do not change what is measured, left out of the config hash.
HASH_EXCLUDE = ("logger", "extra", "sweep")


# optim keys only optim=muon reads: left out of other optimizers' hashes (adamw runs keep
# the hashes they had before muon existed, and a muon knob set on adamw changes nothing)
MUON_ONLY = ("momentum", "nesterov", "ns_steps")
# keys added after results were recorded: left out of the hash at their default value, so
# older sweeps' hashes stay valid (compare, resume)
ADDED_AT_DEFAULT = {("parallel", "prefetch"): 0}


def row_key(rec: dict) -> tuple:
    """What makes a row of a sweep table its own: the measured configuration and its free
    labels (runs that differ only in `extra` are one configuration, two rows). A table's
    `extra` is JSON text (sweep.table.flat)."""
    extra = rec.get("extra")
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError:
            pass
    if not isinstance(extra, (dict, str)):  # none, or a table's NaN
        extra = {}
    return rec.get("config_hash"), json.dumps(extra, sort_keys=True, default=str)


def config_hash(cfg_dict: dict, world: int | None = None) -> str:
    """world: the ranks of a torchrun job over several nodes (hardware.devices counts one
    node's): part of the hash where it differs from hardware.devices."""
    keep = {k: v for k, v in cfg_dict.items() if k not in HASH_EXCLUDE}
    if world is not None and world != (cfg_dict.get("hardware") or {}).get("devices"):
        keep["world_size"] = world
    optim = keep.get("optim")
    if isinstance(optim, dict) and optim.get("name") != "muon":
        keep["optim"] = {k: v for k, v in optim.items() if k not in MUON_ONLY}
    for (group, key), default in ADDED_AT_DEFAULT.items():
        if isinstance(keep.get(group), dict) and keep[group].get(key) == default:
            keep[group] = {k: v for k, v in keep[group].items() if k != key}
    if keep.get("task", "bench") == "bench":
        _unread_at_defaults(keep)
    else:  # task=comm: only what the collectives read
        keep = {k: ({n: v.get(n) for n in COMM_READS[k]} if COMM_READS[k] else v)
                for k, v in keep.items() if k in COMM_READS}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


# what task=comm reads (of a group: these keys; None: all): its hash is of these alone
COMM_READS = {"task": None, "world_size": None, "comm": None,
              "hardware": ("device", "devices", "env"), "parallel": ("backend", "timeout_s")}
# parallel keys only a run with ranks reads
RANKS_ONLY = ("backend", "timeout_s", "profile_steps")


def _unread_at_defaults(keep: dict) -> None:
    """A bench configuration's keys it does not read, at their defaults in `keep` (a copy):
    setting them, e.g. for every job of a sweep over parallel=none,ddp or data=markov,tokens,
    splits no configuration in two; with them at their defaults a hash is the one it was.
    comm.* (task=comm's); a parallel=none run's rank settings; accum_no_sync where gradients
    are reduced once per step anyway (none, expert); the other data source's key; fp8's
    recipe off precision=fp8. And
    parallel.prefetch past the model's layers, which acts as prefetching all of them."""
    import dataclasses

    from .config import CommConfig, DataConfig, ParallelConfig, PrecisionConfig

    if "comm" in keep:
        keep["comm"] = dataclasses.asdict(CommConfig())
    par = (keep.get("parallel") or {}).get("name")
    src = (keep.get("data") or {}).get("source")
    unread = {"parallel": (ParallelConfig, (RANKS_ONLY if par == "none" else ())
                           + (("accum_no_sync",) if par in ("none", "expert") else ())),
              "data": (DataConfig, ("path",) if src == "markov" else
                       ("branching",) if src == "tokens" else ()),
              "precision": (PrecisionConfig, ("fp8_recipe",) if (keep.get("precision") or {})
                            .get("name") != "fp8" else ())}
    for group, (schema, keys) in unread.items():
        if keys and isinstance(keep.get(group), dict):
            keep[group] = {**keep[group], **{k: getattr(schema, k) for k in keys
                                             if k in keep[group]}}
    layers = (keep.get("model") or {}).get("num_layers")
    if isinstance(layers, int) and (keep.get("parallel") or {}).get("prefetch", 0) > layers:
        keep["parallel"] = {**keep["parallel"], "prefetch": layers}  # more acts as all of them


def new_record(cfg_dict: dict, overrides: list[str]) -> dict:
    """A record with every field present: configuration filled, measurements null."""
    rec = dict.fromkeys(FIELDS)

    def get(group, key="name"):  # (a failed record's config may lack a key: ~train)
        return (cfg_dict.get(group) or {}).get(key)

    rec.update(
        status="error", model=get("model"), precision=get("precision"),
        parallel=get("parallel"), hardware=get("hardware"), data=get("data"),
        optim=get("optim"), activation_checkpointing=get("train", "activation_checkpointing"),
        compile=get("train", "compile"), world_size=get("hardware", "devices"),
        micro_batch_size=get("train", "micro_batch_size"),
        grad_accum_steps=get("train", "grad_accum_steps"), seq_len=get("train", "seq_len"),
        overrides=list(overrides),
        config_hash=config_hash(cfg_dict, env.world if (env := rank_env()) else None),
        timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    )
    rec["task"] = cfg_dict.get("task", "bench")
    rec["extra"] = dict(cfg_dict.get("extra") or {})
    rec["null_reasons"] = {}
    return rec


def failed_record(cfg_dict: dict, overrides: list[str], status: str, error: str,
                  why: str) -> dict:
    """A record for a run that measured nothing: its status, one-line error, and `why` as
    the reason of every null measurement."""
    rec = new_record(cfg_dict, overrides)
    rec.update(status=status, error=error)
    fill_null_reasons(rec, why)
    return rec


def write_json_atomic(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would outlive the rename
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def stop_on_sigterm() -> None:
    """SIGTERM (timeout, SLURM's scancel or time limit, docker stop) stops a run as Ctrl-C
    does: KeyboardInterrupt("SIGTERM"), so its record says crashed: interrupted and a
    sweep's table keeps its rows. Once: a second SIGTERM is ignored while those are written."""
    import signal

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt("SIGTERM")

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        pass


def stop_signal(e: BaseException) -> str:
    """What stopped a run, from its KeyboardInterrupt (see stop_on_sigterm)."""
    return "SIGTERM" if e.args[:1] == ("SIGTERM",) else "Ctrl-C / SIGINT"


def hold_sigint():
    """Ignore SIGINT for now, while an interrupted run's record and table are written (a
    second Ctrl-C cut them short); returns the handler to put back (None: not ours)."""
    import signal

    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def release_sigint(held) -> None:
    if held is not None:
        import signal

        signal.signal(signal.SIGINT, held)


def fill_null_reasons(rec: dict, default: str) -> None:
    """Every null measurement gets a reason (kept ones stay)."""
    for k in FIELDS[FIELDS.index("tokens_per_s"):]:
        if rec.get(k) is None and k not in rec["null_reasons"]:
            rec["null_reasons"][k] = default
