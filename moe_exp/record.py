"""The result record's keys and types: the header every record has, then a section per task.

docs/record.md says what each means. A record is a dict, written as metrics.json; these
declare it: results.FIELDS and EXTRAS, the table's text columns and check() derive from
them. The configuration's own columns come from the knobs, by Knob.column in config.py."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Optional

F, I, S, B = Optional[float], Optional[int], Optional[str], Optional[bool]
L, D = Optional[list], Optional[dict]


@dataclass
class Header:
    """Every record's keys: shared/DESIGN.md's contract in its order, then what every task writes.

    The measurements are null, with a reason, where a task makes none."""
    status: str = "error"
    error: S = None
    model: S = None
    precision: S = None
    parallel: S = None
    hardware: S = None
    data: S = None
    optim: S = None
    activation_checkpointing: S = None
    compile: S = None
    world_size: I = None
    micro_batch_size: I = None
    grad_accum_steps: I = None
    seq_len: I = None
    overrides: Optional[list] = None
    config_hash: S = None
    tokens_per_s: F = None
    tokens_per_s_per_device: F = None
    step_time_ms: F = None
    step_time_iqr_ms: F = None
    data_ms: F = None
    forward_ms: F = None
    backward_ms: F = None
    optimizer_ms: F = None
    compile_s: F = None
    peak_mem_gib: F = None
    peak_reserved_gib: F = None
    flops_per_token: F = None
    tflops_per_device: F = None
    mfu: F = None
    params_total: I = None
    params_active: I = None
    loss_first: F = None
    loss_last: F = None
    aux_loss: F = None
    expert_load_cv: F = None
    expert_load_max_over_mean: F = None
    device_name: S = None
    torch_version: S = None
    timestamp: S = None
    task: S = None
    extra: D = None  # +extra.NAME=value labels
    null_reasons: D = None  # {key: why it is null}


@dataclass
class ExpertLoad:
    """The experts' load, from bench.experts.load_stats, and the dispatch that ran."""
    tokens_per_expert: L = None
    expert_load_cv_per_layer: L = None
    expert_load_max_over_mean_per_layer: L = None
    expert_load_quantiles_per_layer: L = None
    dead_experts: I = None
    drop_rate: F = None
    moe_dispatch: S = None
    eval_loss: F = None
    checkpoint_load_s: F = None


@dataclass
class Planned:
    """A step's plan from plan/predict.py: the keys task=plan and a bench run's check share."""
    plan_s: F = None
    planned_peak_gib: F = None
    planned_step_ms: F = None
    planned_compute_ms: F = None
    planned_comm_ms: F = None
    planned_comm_exposed_ms: F = None  # what the collectives add to the step
    planned_tokens_per_s: F = None
    planned_comm_gib: F = None
    planned_time_basis: S = None  # datasheet (a floor) | calibration <its file> (...)
    planned_memory_basis: S = None  # eager step | compiled step (...) | eager step (why)
    planned_kernel_ms: F = None  # the device's busy time (a calibrated plan's)
    calibration_s: F = None  # making the calibration in this run (hardware.calibration=auto)
    planned_pp_stage_peaks_gib: L = None  # parallel.pp: each pp rank's planned peak
    planned_pp_bubble_share: F = None  # parallel.pp: the simulated share ranks wait on others
    planned_pp_send_gib: F = None  # parallel.pp: a rank's sends a step (the most)
    planned_pp_stage_ms: L = None  # parallel.pp: each pp rank's time in its actions a step


@dataclass
class Training(ExpertLoad, Planned):
    """task=bench: the measured training run, and its plan's errors."""
    losses: L = None
    loss_floor: F = None
    eval_losses: L = None
    eval_gap: F = None
    steps_to_target: I = None
    seconds_to_target: F = None
    lrs: L = None
    gc_ms: F = None
    gc_collections: I = None
    measured_steps: I = None
    tokens_per_step: I = None
    tokens_per_s_wall: F = None
    data_share: F = None
    startup_s: F = None
    comm_ms: F = None
    comm_share: F = None
    comm_exposed_ms: F = None
    comm_kinds: D = None  # comm_ms and comm_exposed_ms per collective kind, max over ranks
    grad_reduce_bytes: I = None
    pp_bubble_share: F = None  # parallel.pp: the share of a schedule step a rank waits on others
    pp_overhead_share: F = None  # parallel.pp, CPU: the share neither in actions nor waiting
    pp_send_gib: F = None  # parallel.pp: activations and their gradients a rank sends a step
    pp_stage_peaks_gib: L = None  # parallel.pp: each stage's peak (its ranks' max)
    pp_stage_ms: L = None  # parallel.pp: each stage's time in its actions a step (ranks' max)
    z_loss: F = None
    seq_aux_loss: F = None
    expert_load_step_max_over_mean: F = None
    moe_padded_fallback_share: F = None
    router_bias_spread: F = None
    optim_impl: S = None
    peak_flops: F = None
    compile_cache_hit_share: F = None
    cudagraph_skips: I = None
    cpu_other_load: F = None
    profile_trace: S = None
    profile_shares: D = None
    memory_snapshot: S = None
    gpu_util_pct: F = None
    gpu_mem_used_gib: F = None
    gpu_power_w: F = None
    grad_norm: F = None
    grad_norms: L = None
    grad_norm_spike: L = None
    alloc_retries: I = None
    alloc_ooms: I = None
    init_seed: I = None
    checkpoint_saves: I = None
    checkpoint_save_s: F = None
    checkpoint_save_total_s: F = None
    checkpoint_gib: F = None
    checkpoint_path: S = None
    checkpoint_share: F = None
    resumed_from_step: I = None
    tracked_peak_gib: F = None
    planned_peak_error: F = None
    planned_step_error: F = None
    planned_pp_bubble_error: F = None  # planned - measured pp_bubble_share (a share)
    planned_pp_stage_error: L = None  # each stage's planned / measured pp_stage_ms - 1


@dataclass
class Tune(Training):
    """task=tune_batch: the fastest probe's record, the search's answer and its probes."""
    tune_max_micro_batch: I = None
    tune_best_micro_batch: I = None
    tune_limit: S = None
    tune_probes: L = None


@dataclass
class Comm:
    """task=comm: each collective's latency and bus bandwidth by size."""
    comm: L = None
    comm_backend: S = None
    busbw_gbps_all_reduce: F = None
    busbw_gbps_all_gather: F = None
    busbw_gbps_reduce_scatter: F = None
    busbw_gbps_all_to_all: F = None
    busbw_gbps_send: F = None


@dataclass
class Inference(ExpertLoad):
    """task=infer: generation and serving."""
    batching: S = None
    quantize: S = None
    prefill_tokens_per_s: F = None
    decode_tokens_per_s: F = None
    ttft_ms: F = None
    token_latency_ms_p50: F = None
    token_latency_ms_p90: F = None
    token_latency_ms_p99: F = None
    weights_gib: F = None
    kv_cache_gib: F = None
    infer_other_gib: F = None
    measured_batches: I = None
    generated_tokens: I = None
    weights_from: S = None
    expert_hit_rate: F = None
    expert_bytes_moved_per_token: F = None
    expert_prefetch_hit_rate: F = None
    expert_move_ms_per_token: F = None
    experts_dropped: I = None
    dropped_experts_gib: F = None
    device_weights_gib: F = None
    eval_loss_change: F = None
    request_latency_ms_p50: F = None
    request_latency_ms_p90: F = None
    request_latency_ms_p99: F = None
    request_ttft_ms_p50: F = None
    request_ttft_ms_p99: F = None
    served_tokens_per_s: F = None
    batch_size_mean: F = None
    batch_size_max: I = None
    requests: I = None
    serving_costs: D = None
    quantized_layers: I = None
    quantized_saved_gib: F = None


@dataclass
class Plan(Planned):
    """task=plan: the traced step's memory by kind, whether it fits, its time."""
    planned_params_gib: F = None
    planned_grads_gib: F = None
    planned_optimizer_gib: F = None
    planned_activations_gib: F = None
    planned_temporaries_gib: F = None
    planned_buffers_gib: F = None
    planned_collective_gib: F = None
    planned_other_gib: F = None
    planned_fits: B = None
    planned_memory_gib: F = None
    planned_flops_per_step: F = None
    planned_comm: D = None
    planned_comm_groups: D = None  # planned_comm per mesh dim: {"tp": {kind: ...}, ...}
    planned_mfu: F = None
    planned_from_blocks: L = None  # the two depths traced, the rest extrapolated (plan_depth)


@dataclass
class Sweep:
    """What a sweep adds to its jobs' records.

    A combined record also has <key>_min and <key>_max of its repeats' numbers."""
    job: Any = None  # the job's number (its dir's name)
    repeat: I = None
    repeats: I = None
    repeats_ok: I = None
    combined: B = None
    resumed_from: S = None


@dataclass
class Calibrated:
    """task=calibrate: what the device's kernels achieve, for a plan's time."""
    calibration_file: S = None
    calibration_cached: S = None  # the copy hardware.calibration=auto reads
    calibration_s: F = None
    calibration_points: I = None
    dispatch_us: D = None  # an eager step's cost per op dispatched, by precision
    in_step_factor: D = None  # a CPU step's short ops over their grid times, by precision
    sync_us: F = None
    matmul_tflops: D = None  # the best matmul rate measured, by precision
    bandwidth_gbps: F = None  # the best elementwise bandwidth measured (bytes moved)


SECTIONS = (Training, Tune, Comm, Inference, Plan, Calibrated, Sweep)


def names(section) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(section))


def types(section) -> dict[str, Any]:
    return typing.get_type_hints(section)


def text_keys(section=Header) -> tuple[str, ...]:
    """The keys of a section that hold text."""
    return tuple(k for k, t in types(section).items() if t in (str, S))


def columns() -> dict[str, str]:
    """{record column: its knob's dotted key}, by each Knob.column in config.py."""
    from .config import KNOBS

    return {k.column: key for key, k in KNOBS.items() if k.column}


def declared() -> dict[str, Any]:
    """Every key a record may hold, with its type: the header, the knobs' columns, each section."""
    out = {c: Optional[_schema_type(key)] for c, key in columns().items()}
    for s in (Header, *SECTIONS):
        out.update(types(s))
    return out


def _schema_type(key: str):
    """A config key's type, from its schema in config.py."""
    from .config import RunConfig

    head, _, leaf = key.partition(".")
    typ = types(RunConfig)[head]
    return types(typ)[leaf] if leaf else typ


def check(rec: dict) -> list[str]:
    """What in a record its declaration does not allow: undeclared keys, wrong-typed values.

    A combined record's <key>_min / _max keys count as declared, and its numbers, medians
    of its repeats', may be fractions where one run's are whole."""
    known, bad = declared(), []
    for k, v in rec.items():
        typ = known.get(k)
        if typ is None and k.endswith(("_min", "_max")) and k[:-4] in known:
            typ = F
        if rec.get("combined") and typ == I:
            typ = F
        if typ is None:
            bad.append(f"{k}: not declared (record.py)")
        elif not _holds(typ, v):
            bad.append(f"{k}: {v!r} is not {typ}")
    return bad


def _holds(typ, v) -> bool:
    if typ is Any:
        return True
    args = typing.get_args(typ)
    if typing.get_origin(typ) is typing.Union:
        return any(_holds(a, v) for a in args)
    if typ is type(None):
        return v is None
    base = typing.get_origin(typ) or typ
    if base is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if base is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, base)
