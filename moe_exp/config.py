"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The root schema (`run_schema`) sits first in `conf/run.yaml`'s defaults list, so
every group option and every command-line override is merged into these
dataclasses: an unknown key or a wrong type is rejected by Hydra before any work.
Choices among strings (e.g. `train.compile`) are checked in `validate.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

CONF = Path(__file__).parent / "conf"  # the config groups' option files, and run.yaml


def group_options(group: str) -> List[str]:
    """The options of a config group (its files under conf/)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def override_texts(node) -> List[str]:
    """Hydra's overrides (hydra.overrides.task) as written: a `${...}` in one is the value's,
    for the job to resolve, not resolved (and maybe failing) where the list is read."""
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.to_container(node, resolve=False)]


def default_choices() -> Dict[str, str]:
    """{group: option} of run.yaml's defaults list: the groups every run has."""
    from omegaconf import OmegaConf

    return {k: v for d in OmegaConf.load(CONF / "run.yaml").defaults if not isinstance(d, str)
            for k, v in d.items()}

# Allowed values of string-valued keys, checked by validate.py (one place, one message).
CHOICES: Dict[str, List[str]] = {
    "task": ["bench", "comm"],
    "precision.name": ["fp32", "tf32", "fp16", "bf16", "fp8"],
    "precision.fp8_recipe": ["tensorwise", "rowwise", "rowwise_with_gw_hp"],  # torchao's
    "parallel.name": ["none", "ddp", "fsdp", "expert", "expert_fsdp"],
    "parallel.backend": ["auto", "nccl", "gloo"],
    "hardware.device": ["auto", "cpu", "cuda", "hpu"],
    "data.source": ["markov", "tokens"],
    "optim.name": ["adamw", "muon"],
    "optim.impl": ["auto", "fused", "foreach", "for-loop"],
    "logger.name": ["wandb", "none"],
    "logger.mode": ["offline", "online", "disabled"],
    "model.dispatch": ["auto", "grouped", "padded", "loop"],
    "comm.dtype": ["float32", "bfloat16", "float16"],
    "train.activation_checkpointing": ["none", "full", "selective"],
    "train.compile": ["off", "default", "reduce-overhead", "max-autotune",
                      "max-autotune-no-cudagraphs"],
}


@dataclass
class ModelConfig:
    name: str = "tiny_moe"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 256  # per expert (or of the dense FFN when num_experts=0)
    num_experts: int = 8  # 0 = dense SwiGLU FFN
    top_k: int = 2
    vocab_size: int = 256
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    aux_loss_coef: float = 0.01  # Switch load-balancing loss
    z_loss_coef: float = 0.001  # router z-loss
    # expert matmuls: grouped (grouped_mm) | padded (bmm) | loop | auto (the fastest that
    # runs here: see moe_exp.model.moe.resolve_dispatch)
    dispatch: str = "auto"


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    autocast_dtype: Optional[str] = None  # bfloat16 | float16 | None (no autocast)
    grad_scaler: bool = False  # fp16 loss scaling
    tf32: bool = False  # TF32 tensor-core matmuls for fp32 (CUDA only)
    fp8_recipe: str = "tensorwise"  # torchao Float8LinearConfig recipe (fp8 only)


@dataclass
class ParallelConfig:
    name: str = "none"  # none | ddp | fsdp | expert | expert_fsdp
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    timeout_s: float = 120.0  # a collective waiting longer fails the run (never a hang)
    expert_parallel_size: Optional[int] = None  # ranks experts are sharded over; null = all
    # ddp
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    # ddp / fsdp: with train.grad_accum_steps > 1, reduce gradients on the last micro-step
    # only (DDP no_sync, FSDP2 set_requires_gradient_sync); false: on every micro-step
    accum_no_sync: bool = True
    # fsdp / expert_fsdp (FSDP2 fully_shard per block; mixed precision from the precision group)
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # CPUOffloadPolicy: GPUs only
    # FSDP2 prefetching: 0 = its default (implicit: backward prefetches the next block,
    # forward relies on the CPU running ahead); N >= 1 = each block explicitly issues the
    # all-gathers of the next N blocks in forward and backward (more overlap, more memory)
    prefetch: int = 0
    # the last N of train.steps run under torch.profiler to measure communication time
    # (several ranks only; left out of the step-time figures)
    profile_steps: int = 2


@dataclass
class HardwareConfig:
    name: str = "auto"
    device: str = "auto"
    devices: int = 1  # ranks launched on this machine
    memory_gib: Optional[float] = None  # per device; null = read from the device
    # Dense peak FLOP/s per device for each precision; null = unknown (MFU is then null).
    peak_flops: Dict[str, Optional[float]] = field(default_factory=dict)
    precisions: List[str] = field(default_factory=lambda: ["fp32", "fp16", "bf16"])
    cudnn_benchmark: bool = True
    deterministic: bool = False
    env: Dict[str, str] = field(default_factory=dict)
    # glibc malloc keeps freed memory for reuse instead of returning it (big tensors are not
    # page-faulted in again each step: faster CPU steps; the CPU peak RSS then also counts
    # memory malloc kept). Off by default.
    malloc_retain: bool = False


@dataclass
class DataConfig:
    name: str = "markov"
    source: str = "markov"  # markov (synthetic, learnable) | tokens (memory-mapped file)
    path: Optional[str] = None  # tokens file made by `python -m moe_exp.data prepare`
    branching: int = 4  # markov: successors per token (entropy = log(branching) nats)
    num_workers: int = 0
    pin_memory: bool = True  # only used on CUDA
    prefetch_factor: Optional[int] = None  # needs num_workers > 0
    persistent_workers: bool = False  # needs num_workers > 0


@dataclass
class OptimConfig:
    name: str = "adamw"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    lr_warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping
    impl: str = "auto"  # AdamW's: auto | fused | foreach | for-loop
    # muon only (AdamW keeps the embeddings, head and norms: beta1/beta2/eps/impl above)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations


@dataclass
class LoggerConfig:
    name: str = "wandb"
    project: str = "moe_exp"
    mode: str = "offline"
    entity: Optional[str] = None
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    steps: int = 20  # measured steps
    warmup_steps: int = 3  # run first, excluded from timing (compile, allocator growth)
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    seq_len: int = 128
    activation_checkpointing: str = "none"
    compile: str = "off"
    seed: int = 0
    log_every: int = 5  # steps between loss reads (each read waits for the device)


@dataclass
class CommConfig:
    """task=comm: collective latency and bus bandwidth over message sizes."""
    ops: List[str] = field(default_factory=lambda: ["all_reduce", "all_gather",
                                                    "reduce_scatter", "all_to_all"])
    min_bytes: int = 1024
    max_bytes: int = 64 * 2**20
    factor: int = 4  # each size is the previous one times this
    iters: int = 10  # timed repetitions per size (median reported)
    warmup: int = 3
    dtype: str = "float32"


@dataclass
class SweepConfig:
    """How a multirun (-m) runs its jobs and builds its table (not part of the config hash)."""
    name: Optional[str] = None  # preset name; the W&B group defaults to it + the sweep dir
    # e.g. {precision: bf16}; empty (or null) = the ok row with the fewest optimizations on.
    # (set it with ++sweep.baseline={...}; {} not null: Hydra cannot add keys to a null)
    baseline: Optional[Dict[str, Any]] = field(default_factory=dict)
    baseline_by: List[str] = field(default_factory=lambda: ["model"])  # one baseline per value
    repeats: int = 1  # runs per combination: the table reports median and spread
    resume: bool = False  # skip jobs whose records are already in the sweep dir (config hash)
    isolate: bool = True  # each job in its own process (a crash becomes a `crashed` row)
    job_timeout_s: Optional[float] = None  # kill a job after this long (a `crashed` row)
    fresh_compile_cache: bool = True  # each job compiles cold: compile_s is not a cache hit


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    task: str = "bench"
    extra: Dict[str, Any] = field(default_factory=dict)  # free-form notes, kept in the record


def total_steps(train) -> int:
    """Optimizer steps a run takes: unmeasured warmup, then measured steps."""
    return train.warmup_steps + train.steps


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


register()


def override_word(key: str, value: str) -> str:
    """key=VALUE as a shell word Hydra reads back as the string VALUE: plain where it is,
    else in Hydra's double quotes (a backslash escapes only before a quote)."""
    import re
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain = f"{key}={value}"
    if re.fullmatch(r"[\w./+@:-]+", value):
        try:
            if OverridesParser.create().parse_override(plain).value() == value:
                return plain  # (not 1e3, true, null: those would be typed)
        except Exception:  # noqa: BLE001 - quoted below
            pass
    quoted = re.sub(r'(\\*)("|$)', lambda m: m.group(1) * 2 + ("\\" + m.group(2)
                                                                 if m.group(2) else ""), value)
    return shlex.quote(f'{key}="{quoted}"')
