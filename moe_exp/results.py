"""The result record: one per run (`metrics.json`), one row per run in a sweep table."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from .knobs import NEW
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
# The extra keys runs write (docs/record.md); with FIELDS, the columns a
# sweep.baseline may name before any job has run.
EXTRAS = (
    "task", "extra", "null_reasons", "losses", "loss_floor", "eval_loss", "eval_losses",
    "eval_gap", "steps_to_target", "seconds_to_target", "lrs", "lr_schedule", "attention", "gc_every",
    "gc_ms", "gc_collections", "measured_steps", "tokens_per_step",
    "tokens_per_s_wall", "data_share", "startup_s", "comm_ms", "comm_share", "comm_exposed_ms", "comm",
    "comm_backend", "comm_hook", "grad_reduce_bytes", "z_loss", "seq_aux_loss", "tokens_per_expert", "expert_load_cv_per_layer",
    "expert_load_max_over_mean_per_layer", "expert_load_step_max_over_mean", "moe_dispatch", "moe_padded_fallback_share",
    "router_bias_spread", "drop_rate", "dead_experts", "expert_load_quantiles_per_layer",
    "optim_impl", "peak_flops", "compile_cache_hit_share", "cudagraph_skips", "cpu_other_load",
    "tune_max_micro_batch", "tune_best_micro_batch", "tune_limit", "tune_probes",
    "profile_trace", "profile_shares", "memory_snapshot", "gpu_util_pct", "gpu_mem_used_gib",
    "gpu_power_w", "grad_norm", "grad_norms", "grad_norm_spike", "alloc_retries", "init_seed",
    "alloc_ooms", "checkpoint_every", "checkpoint_async", "checkpoint_saves", "checkpoint_save_s", "checkpoint_save_total_s",
    "checkpoint_gib", "checkpoint_path", "checkpoint_load_s", "checkpoint_share",
    "resumed_from_step", "prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms",
    "token_latency_ms_p50", "token_latency_ms_p90", "token_latency_ms_p99", "weights_gib",
    "kv_cache_gib", "infer_other_gib", "measured_batches", "generated_tokens", "weights_from",
    "expert_hit_rate", "expert_bytes_moved_per_token", "expert_prefetch_hit_rate",
    "expert_move_ms_per_token", "experts_dropped", "dropped_experts_gib", "device_weights_gib",
    "eval_loss_change", "batching", "request_latency_ms_p50", "request_latency_ms_p90",
    "request_latency_ms_p99", "request_ttft_ms_p50", "request_ttft_ms_p99", "served_tokens_per_s",
    "batch_size_mean", "batch_size_max", "requests", "serving_costs", "quantized_layers",
    "quantized_saved_gib", "quantize", "plan_s", "planned_peak_gib", "planned_params_gib",
    "planned_grads_gib", "planned_optimizer_gib", "planned_activations_gib",
    "planned_temporaries_gib", "planned_buffers_gib", "planned_collective_gib",
    "planned_other_gib", "planned_fits", "planned_memory_gib",
    "planned_flops_per_step", "planned_comm", "planned_comm_gib", "planned_step_ms",
    "planned_tokens_per_s", "planned_compute_ms", "planned_comm_ms", "planned_mfu",
    "tracked_peak_gib", "planned_peak_error", "planned_step_error",
    "job",
    "repeat", "repeats",
    "repeats_ok", "combined", "resumed_from",
)
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
    keep = hashed_view(cfg_dict)
    if world is not None and world != (cfg_dict.get("hardware") or {}).get("devices"):
        keep["world_size"] = world
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def hashed_view(cfg_dict: dict) -> dict:
    """What of a configuration its hash counts, from each key's declaration (config.py):
    the keys its task reads; a key its option does not read at its default (or left out,
    or kept: Knob.unread), so setting it splits no configuration in two; a key at the value
    it had before it existed (Knob.since) left out, so older hashes stay valid (compare,
    resume). And parallel.prefetch past the model's layers as prefetching all of them."""
    from .config import DEFAULTS, KNOBS, UNHASHED

    task = cfg_dict.get("task", "bench")
    keep = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfg_dict.items()
            if k not in UNHASHED}

    given = {k: (dict(v) if isinstance(v, dict) else v) for k, v in keep.items()}

    def get(dotted):  # (the options chosen: as given, not as this view leaves them)
        head, _, leaf = dotted.partition(".")
        node = given.get(head)
        return (node.get(leaf) if isinstance(node, dict) else None) if leaf else node

    if task != "bench":  # only what this task reads: of a group, its keys that it reads
        out = {}
        for k, v in keep.items():
            if k == "world_size" or k in KNOBS and KNOBS[k].read_in(task):
                out[k] = v
            elif isinstance(v, dict):
                mine = [n for n in KNOBS if n.startswith(f"{k}.") and KNOBS[n].read_in(task)]
                if mine:
                    out[k] = {n.split(".", 1)[1]: v.get(n.split(".", 1)[1]) for n in mine}
        keep = out
    for dotted, knob in KNOBS.items():
        head, _, leaf = dotted.partition(".")
        node = keep.get(head)
        if not leaf or not isinstance(node, dict) or leaf not in node:
            continue
        read = knob.read_in(task) and (not knob.read_by or any(r.holds(get)
                                                                for r in knob.read_by))
        if not read and knob.unread == "drop":
            del node[leaf]
            continue
        if not read and knob.unread == "default":
            node[leaf] = DEFAULTS[dotted]
        if knob.since is not NEW and node[leaf] == knob.since:
            del node[leaf]
    layers, par = get("model.num_layers"), keep.get("parallel")
    if isinstance(layers, int) and isinstance(par, dict) and par.get("prefetch", 0) > layers:
        par["prefetch"] = layers  # more acts as all of them
    return {k: v for k, v in keep.items() if v != {}}  # (a group of new keys at their since)


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
    rec.update(lr_schedule=get("optim", "schedule"), attention=get("train", "attention"),
               gc_every=get("train", "gc_every"),
               checkpoint_every=get("train", "checkpoint_every"),
               checkpoint_async=get("train", "checkpoint_async"))
    rec["comm_hook"] = get("parallel", "comm_hook")
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


def why_died(rc: int) -> str:
    """How a child process that wrote no record ended, from its return code."""
    import signal

    if rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc
        oom = " (the kernel's OOM killer sends SIGKILL)" if -rc == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with code {rc} before writing its record"


def write_json_atomic(path: str | Path, obj) -> None:
    """A failed write (a full or read-only disk) leaves no temporary file, and its OSError
    names `path` (a write's own names none)."""
    path, tmp = Path(path), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would outlive the rename
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


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


def close_record(rec: dict, out_dir, tracker=None, show_error: bool = True) -> None:
    """A run's end: its error on stderr, every null with a reason, metrics.json written,
    the tracker's summary and finish."""
    if show_error and rec["status"] != "ok" and rec["error"]:
        print(f"error: run {rec['status']}: {rec['error']}\nrecord: "
              f"{out_dir / 'metrics.json'}", file=sys.stderr)
    fill_null_reasons(rec, f"not measured: run {rec['status']}")
    write_json_atomic(out_dir / "metrics.json", rec)
    if tracker:
        tracker.summary(rec)
        tracker.finish(ok=rec["status"] == "ok")


def fill_null_reasons(rec: dict, default: str) -> None:
    """Every null measurement gets a reason (kept ones stay)."""
    for k in FIELDS[FIELDS.index("tokens_per_s"):]:
        if rec.get(k) is None and k not in rec["null_reasons"]:
            rec["null_reasons"][k] = default
