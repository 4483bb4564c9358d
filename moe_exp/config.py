"""Typed schemas for every config group, registered in Hydra's ConfigStore.

The root schema, `run_schema`, sits first in `conf/run.yaml`'s defaults list, so
every group option and every command-line override is merged into these
dataclasses: an unknown key or a wrong type is rejected by Hydra before any work.
Choices among strings, such as `train.compile`, are checked in `validate.py`.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from .knobs import (Knob, Range, Reads, above, at_least, at_most, declarations, defaults, group,
                    knob, unhashed_groups)

CONF = Path(__file__).parent / "conf"  # the config groups' option files, and run.yaml


class ConfigError(Exception):
    """A user's configuration mistake: key and what is allowed, shown as one line."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class Unsupported(ConfigError):
    """A valid request this hardware or install cannot do: a `skipped` row in a sweep."""


class NothingLeft(Unsupported):
    """A resumed run whose checkpoint is at its last step: nothing to do. A `skipped` row
    that says so; a single run exits 0 (nothing_left)."""

    WHAT = "nothing left to train"


def nothing_left(rec: dict) -> bool:
    """Whether a record is that of a resumed run that had nothing left to train."""
    return rec.get("status") == "skipped" and NothingLeft.WHAT in str(rec.get("error"))


class NotReady(ConfigError):
    """A valid request this environment is not set up for yet, such as one needing a W&B login.

    It is an `error` row, which a resumed sweep runs again."""


def no_such_key(group: str, typ) -> str:
    """What a key not in `group`, whose schema dataclass is typ, gets told."""
    import dataclasses

    where = f"in {group}" if group else "at the top level"
    known = sorted(f.name for f in dataclasses.fields(typ))
    return f"no such key {where} (known: {', '.join(known)})"


def group_options(group: str) -> List[str]:
    """The options of a config group: its files under conf/."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def override_texts(node) -> List[str]:
    """Hydra's overrides, hydra.overrides.task, as written, without resolving them.

    A `${...}` in one is the value's, for the job to resolve; resolved where the list is
    read, it might fail."""
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.to_container(node, resolve=False)]


def env_source(cfg, key: str) -> str | None:
    """The environment variable a key's value is read from by `${oc.env:NAME,...}`, or None."""
    import re

    from omegaconf import OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if node is None or not OmegaConf.is_interpolation(node, leaf):
        return None
    m = re.fullmatch(r"\$\{oc\.env:(\w+)(,.*)?\}", str(node._get_node(leaf)._value()))
    return m.group(1) if m else None


def default_choices() -> Dict[str, str]:
    """{group: option} of run.yaml's defaults list: the groups every run has."""
    from omegaconf import OmegaConf

    return {k: v for d in OmegaConf.load(CONF / "run.yaml").defaults if not isinstance(d, str)
            for k, v in d.items()}

MAX_STEPS = 10_000_000  # steps, and micro-batches of a run: a benchmark, not a long training
MAX_POSITIONS = 2**20  # model.max_seq_len (the model builds its RoPE table for each)
SEEDS = 2**32  # (numpy's range, the narrowest a seed goes to)
MAX_MEMORY_GIB = 2**20  # 1 PiB a device: a larger value could overflow a byte count mid-run
MAX_DEVICES = 16_384  # ranks: a plan's FSDP2 set-up costs ~12 ms a rank on 2 CPU cores (tiny_moe)
MAX_BATCH = 65_536  # requests a generated batch holds
MAX_REQUESTS = 1_000_000  # a simulated request stream (each a record of its own)
MAX_BANDWIDTH = 1e16  # bytes/s: 10 PB/s, past any link or memory
MAX_FLOPS = 1e20  # FLOP/s a device: past any accelerator
MAX_BUCKET_MB = 2**20  # DDP takes the bytes as a C++ int64: a larger value could overflow it
RANKED = ("ddp", "fsdp", "expert", "expert_fsdp", "hsdp")  # parallel options with several ranks
BANDWIDTH = Range(1, MAX_BANDWIDTH, note="bytes/s or null")
FLOPS = Range(1, MAX_FLOPS, note="FLOP/s or null")  # hardware.peak_flops.<precision>
MEMORY = Range(0, MAX_MEMORY_GIB, lo_open=True, note="GiB (per device) or null")
MOE = Reads("model.num_experts", positive=True, what="a MoE model")
ROUTINGS = ("learned", "balanced", "skewed")  # model.routing (model/moe.py: Router)
GQA = Reads("model.attention_type", ("gqa",), what="model.attention_type=gqa")
MLA = Reads("model.attention_type", ("mla",), what="model.attention_type=mla")
CAPACITY = Reads("model.capacity_factor", positive=True, what="token capacity")
DDP = Reads("parallel.name", ("ddp",))
FSDP2 = ("fsdp", "expert_fsdp", "hsdp")  # parallel options that shard with FSDP2
FSDP = Reads("parallel.name", FSDP2)
HOOKS = ("none", "fp16", "bf16", "powersgd")  # DDP communication hooks
EXPERT = Reads("parallel.name", ("expert", "expert_fsdp"))
MUON, WANDB = Reads("optim.name", ("muon",)), Reads("logger.name", ("wandb",))
ATTENTION = ("auto", "flash", "efficient", "math", "cudnn", "flex")
SCHEDULES = ("cosine", "linear", "constant", "wsd", "onecycle")
BOTH = ("bench", "comm")  # keys task=comm reads too (task=tune_batch reads bench's: Knob)
COMM_TASK = ("comm",)
PROFILE = Reads("train.profile", positive=True, what="train.profile=true")
CHECKPOINT = Reads("train.checkpoint_every", positive=True, what="checkpointing")
TUNE_TASK = ("tune_batch",)
INFER_TASK = ("infer",)
BATCHING = ("static", "dynamic", "continuous")
SERVING = Reads("infer.batching", BATCHING, what="a served stream (infer.batching=static, "
                "dynamic or continuous)")
PLAN_TASK = ("plan",)  # reads what bench reads (knobs.LIKE_BENCH)
CALIBRATE_TASK = ("calibrate",)  # reads the hardware group
TASKS = BOTH + TUNE_TASK + INFER_TASK + PLAN_TASK + CALIBRATE_TASK
PLANNED = ("bench", "tune_batch")  # runs that plan their step (train.plan): read the plan's keys


@dataclass
class ModelConfig:
    name: str = knob("tiny_moe", "labels the model in every result", column="model",
                     summary="model")
    hidden_size: int = knob(128, "model width", check=at_least(1))
    num_layers: int = knob(2, "transformer blocks", check=at_least(1))
    num_heads: int = knob(4, "attention heads", check=at_least(1))
    num_kv_heads: int = knob(2, "key/value heads (grouped-query attention)", check=at_least(1))
    ffn_hidden_size: int = knob(256, "per expert (or of the dense FFN when num_experts=0)",
                                check=at_least(1))
    num_experts: int = knob(8, "routed experts per layer; 0 = a dense SwiGLU FFN",
                            check=at_least(0))
    top_k: int = knob(2, "experts per token", read_by=MOE, unread="keep")
    vocab_size: int = knob(256, "vocabulary size", check=at_least(2))
    max_seq_len: int = knob(128, "longest sequence (RoPE table length)", check=(
        at_least(1), at_most(MAX_POSITIONS, "(the model builds its RoPE table for every "
                                            "position)")))
    rope_theta: float = knob(10000.0, "RoPE base", check=above(0))
    norm_eps: float = knob(1e-5, "RMSNorm epsilon", check=above(0))
    init_std: float = knob(0.02, "weights' initial standard deviation", check=above(0))
    aux_loss_coef: float = knob(0.01, "Switch load-balancing loss weight", read_by=MOE,
                                unread="keep", check=at_least(0))
    seq_aux_loss_coef: float = knob(0.0, "the balance loss per sequence's weight (DeepSeek-V3's "
                                    "sequence-wise loss: 0.0001); beside aux_loss_coef's batch "
                                    "one", read_by=MOE, unread="keep", since=0.0, check=at_least(0))
    z_loss_coef: float = knob(0.001, "router z-loss weight", read_by=MOE, unread="keep",
                              check=at_least(0))
    dispatch: str = knob("auto", "expert matmuls: grouped (grouped_mm) | padded (bmm) | loop | "
                         "auto (the fastest that runs here: model.moe.resolve_dispatch)",
                         choices=("auto", "grouped", "padded", "loop"), read_by=MOE,
                         unread="keep")
    routing: str = knob("learned", "which experts tokens go to: learned (the router's top-k) | "
                        "balanced (every expert the same number, every step) | skewed (the "
                        "busiest gets model.routing_skew x the mean); weights stay the router's",
                        choices=ROUTINGS, read_by=MOE, unread="keep", since="learned",
                        off="learned")
    routing_skew: float = knob(2.0, "with model.routing=skewed: the busiest expert's load over "
                               "the mean (1 to num_experts / top_k)", since=2.0, unread="keep",
                               read_by=Reads("model.routing", ("skewed",),
                                             what="model.routing=skewed"))
    attention_type: str = knob("gqa", "grouped-query attention | mla (multi-head latent "
                               "attention, DeepSeek-V2/V3)", choices=("gqa", "mla"), since="gqa")
    head_dim: Optional[int] = knob(None, "per attention head; null = hidden_size / num_heads "
                                   "(Qwen3 sets it apart)", since=None, read_by=GQA)
    qk_norm: bool = knob(False, "RMSNorm of each head's q and k before RoPE (Qwen3)", since=False,
                         read_by=GQA)
    q_lora_rank: Optional[int] = knob(None, "MLA: the rank of q's projection; null = full rank",
                                      since=None, read_by=MLA,
                                      check=at_least(1, "or null (full rank)"))
    kv_lora_rank: int = knob(512, "MLA: the shared key/value latent's size", since=512,
                             read_by=MLA, check=at_least(1))
    qk_nope_head_dim: int = knob(128, "MLA: per head, the q/k dims without RoPE", since=128,
                                 read_by=MLA, check=at_least(1))
    qk_rope_head_dim: int = knob(64, "MLA: per head, the q/k dims with RoPE (k's shared by all "
                                 "heads)", since=64, read_by=MLA)
    v_head_dim: int = knob(128, "MLA: per head, the value dims", since=128, read_by=MLA,
                           check=at_least(1))
    num_shared_experts: int = knob(0, "always-on experts beside the routed ones (DeepSeek)",
                                   read_by=MOE, unread="keep", since=0, check=at_least(0))
    shared_ffn_hidden_size: Optional[int] = knob(
        None, "each shared expert's FFN size; null = ffn_hidden_size", unread="keep", since=None,
        read_by=Reads("model.num_shared_experts", positive=True,
        what="shared experts"), check=at_least(1, "or null (ffn_hidden_size)"))
    first_k_dense: int = knob(0, "the first k blocks have a dense FFN (DeepSeek)", read_by=MOE,
                              unread="keep", since=0, check=at_least(0))
    dense_ffn_hidden_size: Optional[int] = knob(
        None, "the FFN size of the first_k_dense blocks; null = ffn_hidden_size", unread="keep",
        since=None, read_by=Reads("model.first_k_dense", positive=True,
        what="dense first layers"), check=at_least(1, "or null (ffn_hidden_size)"))
    score_func: str = knob("softmax", "router scores: softmax over experts (Mixtral, Qwen3) | "
                           "sigmoid per expert (DeepSeek-V3)", choices=("softmax", "sigmoid"),
                           read_by=MOE, unread="keep", since="softmax")
    route_norm: bool = knob(True, "renormalise the chosen experts' weights to sum 1",
                            read_by=MOE, unread="keep", since=True)
    route_scale: float = knob(1.0, "multiplies the routed experts' weights (DeepSeek-V3: 2.5)",
                              read_by=MOE, unread="keep", since=1.0, check=above(0))
    n_groups: int = knob(1, "group-limited routing: the experts in n_groups groups; each token "
                         "picks among its topk_groups best (DeepSeek-V3)", read_by=MOE,
                         unread="keep", since=1, check=at_least(1))
    topk_groups: int = knob(1, "with model.n_groups > 1: the groups each token may use",
                            read_by=MOE, unread="keep", since=1, check=at_least(1))
    bias_update_rate: float = knob(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): after each "
                                   "step every expert's routing bias moves this much toward "
                                   "equal load; 0 = off (DeepSeek-V3: 0.001)", read_by=MOE,
                                   unread="keep", since=0.0, check=at_least(0, "(0: off)"))
    capacity_factor: Optional[float] = knob(
        None, "token capacity: an expert takes at most capacity_factor x tokens x top_k / "
        "num_experts of a micro-batch's choices, the rest are dropped (their tokens pass "
        "through the residual); null = dropless", read_by=MOE, unread="keep", since=None)
    drop_policy: str = knob("score", "which choices an over-full expert drops: score (the lowest "
                            "routing weights) | position (the latest tokens)",
                            choices=("score", "position"), read_by=CAPACITY, since="score")
    pad_to_capacity: bool = knob(False, "every expert padded to its capacity: static shapes "
                                 "(compiled code, CUDA graphs); runs model.dispatch=padded",
                                 read_by=CAPACITY, since=False)


@dataclass
class PrecisionConfig:
    name: str = knob("fp32", "the precision option (labels the run)",
                     choices=("fp32", "tf32", "fp16", "bf16", "fp8"), off="fp32",
                     column="precision", summary="precision", summary_off=True)
    autocast_dtype: Optional[str] = knob(None, "bfloat16 | float16 | null (no autocast)")
    grad_scaler: bool = knob(False, "fp16 loss scaling")
    tf32: bool = knob(False, "TF32 tensor-core matmuls for fp32 (CUDA only)")
    fp8_recipe: str = knob("tensorwise", "torchao Float8LinearConfig recipe",
                           choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                           read_by=Reads("precision.name", ("fp8",)))
    router_dtype: str = knob("compute", "the MoE router's gate matmul: compute (autocast's "
                             "dtype) | fp32", choices=("compute", "fp32"), read_by=MOE,
                             since="compute")


TP_OPTIONS = ("fsdp", "expert_fsdp", "hsdp")  # the parallel options parallel.tp composes with
PP_OPTIONS = ("fsdp", "expert_fsdp", "hsdp")  # and parallel.pp (each stage FSDP2's root)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
CP_OPTIONS = ("fsdp", "expert_fsdp", "hsdp")  # and parallel.cp (FSDP2 over dp x cp)
PP = Reads("parallel.pp", positive=True, above=1, what="pipeline parallel")


@dataclass
class ParallelConfig:
    name: str = knob("none", "the parallel option", choices=("none",) + RANKED, off="none",
                     column="parallel", recorded_in=INFER_TASK)
    backend: str = knob("auto", "auto (nccl on CUDA, gloo on CPU) | nccl | gloo",
                        choices=("auto", "nccl", "gloo"), tasks=BOTH, unread_ok=True,
                        read_by=(Reads("parallel.name", RANKED), Reads("task", COMM_TASK)))
    timeout_s: float = knob(120.0, "a collective waiting longer fails the run (never a hang)",
                            tasks=BOTH, unread_ok=True,
                            read_by=(Reads("parallel.name", RANKED), Reads("task",
                            COMM_TASK)), check=Range(1, 10**9, note="seconds"))
    expert_parallel_size: Optional[int] = knob(None, "ranks experts are sharded over; "
                                               "null = all (all data ranks under tp)",
                                               read_by=EXPERT, check=at_least(1,
                                               "or null (all ranks)"))
    tp: int = knob(1, "tensor-parallel ranks: heads, FFN columns, experts' FFN columns and the "
                   "vocab split over them (dp = world / tp)", since=1,
                   read_by=Reads("parallel.name", TP_OPTIONS), column="tp",
                   check=at_least(1, "(1 = off)"))
    etp: int = knob(0, "experts under tp (expert_fsdp): 0 = split over the tp ranks like the "
                    "FFN (etp = tp); 1 = whole, expert parallel over the tp ranks too", since=0,
                    read_by=Reads("parallel.name", ("expert_fsdp",)), column="etp",
                    check=Range(0, 1024))
    sequence_parallel: bool = knob(True, "with tp > 1, norms and the residual stream sharded "
                                   "on the sequence (reduce-scatter + all-gather for all-reduce)",
                                   since=True, read_by=Reads("parallel.name", TP_OPTIONS),
                                   column="sp")
    async_tp: bool = knob(False, "with tp > 1 and train.compile: inductor's async TP, each "
                          "TP all-gather and reduce-scatter split and overlapped with its "
                          "matmul on symmetric memory (CUDA only)", since=False,
                          read_by=Reads("parallel.name", TP_OPTIONS), column="async_tp")
    cp: int = knob(1, "context-parallel ranks: each sequence split over them (2 x cp "
                   "load-balanced chunks), attention over the keys all-gathered (1 = off)",
                   since=1, read_by=Reads("parallel.name", CP_OPTIONS), column="cp",
                   check=at_least(1, "(1 = off)"))
    pp: int = knob(1, "pipeline stages: the blocks split into pp stages on as many ranks, "
                   "each stage's ranks data parallel over world / pp (1 = off)", since=1,
                   read_by=Reads("parallel.name", PP_OPTIONS), column="pp",
                   check=at_least(1, "(1 = off)"))
    pp_schedule: str = knob("1f1b", "the pipeline schedule: gpipe | 1f1b | interleaved_1f1b | "
                            "zero_bubble (interleaved, the backward split into input and "
                            "weight parts)", choices=PP_SCHEDULES, since="1f1b", read_by=PP,
                            column="pp_schedule")
    pp_microbatches: Optional[int] = knob(None, "micro-batches a rank's train.micro_batch_size "
                                          "is split into for the pipeline; null = its stages",
                                          since=None, read_by=PP, column="pp_microbatches",
                                          check=at_least(1, "or null (the stages)"))
    pp_split: Optional[List[int]] = knob(None, "the first block of each stage after the "
                                         "first; null = split by parallel.pp_balance",
                                         since=None, read_by=PP, column="pp_split")
    pp_balance: str = knob("blocks", "how stages split the blocks where parallel.pp_split "
                           "is null: blocks = as many a stage (the first ones one more); "
                           "flops = as many training FLOPs a stage, the LM head's on the last; "
                           "time = as much planned time a stage (each block's, at "
                           "hardware.calibration's rates or the profile's roofline)",
                           choices=("blocks", "flops", "time"), since="blocks", read_by=PP,
                           column="pp_balance")
    pp_stages_per_rank: Optional[int] = knob(None, "stages a rank holds (looped: rank r holds "
                                             "r, r + pp, ...); null = 2 for the interleaved "
                                             "schedules, else 1", since=None, read_by=PP,
                                             column="pp_stages_per_rank",
                                             check=at_least(1, "or null"))
    bucket_cap_mb: float = knob(25.0, "DDP's gradient bucket size", read_by=DDP, check=Range(0,
                                MAX_BUCKET_MB, lo_open=True, note="MB"))
    gradient_as_bucket_view: bool = knob(True, "DDP's gradients as views of its buckets",
                                         read_by=DDP)
    static_graph: bool = knob(False, "DDP's static graph", read_by=DDP)
    comm_hook: str = knob("none", "DDP's gradient all-reduce: none (fp32) | fp16 | bf16 "
                          "(compressed casts) | powersgd (low-rank)", choices=HOOKS,
                          read_by=DDP, off="none", since="none", column="comm_hook")
    powersgd_rank: int = knob(1, "PowerSGD's matrix approximation rank", since=1,
                              read_by=Reads("parallel.comm_hook", ("powersgd",),
                                            what="parallel.comm_hook=powersgd"), check=at_least(1))
    # HSDP's 2-D mesh (replicate x shard): null = shard over one machine's hardware.devices
    # ranks, replicate across machines (FSDP1's HYBRID_SHARD; 1 replica on one machine)
    replicate: Optional[int] = knob(None, "HSDP replica groups (each shards over world / "
                                    "replicate ranks); null = one per machine",
                                    read_by=Reads("parallel.name",
                                    ("hsdp",)), since=None, check=at_least(1,
                                    "or null (one replica per machine)"))
    # with train.grad_accum_steps > 1, reduce gradients on the last micro-step only (DDP
    # no_sync, FSDP2 set_requires_gradient_sync); false: on every micro-step
    accum_no_sync: bool = knob(True, "with grad accumulation, reduce on the last micro-step "
                               "only", read_by=Reads("parallel.name", ("ddp",) + FSDP2),
                               unread_ok=True)
    reshard_after_forward: bool = knob(True, "FSDP2 frees gathered parameters after forward",
                                       read_by=FSDP)
    cpu_offload: bool = knob(False, "FSDP2 CPUOffloadPolicy (GPUs only)", read_by=FSDP)
    # 0 = FSDP2's default (implicit: backward prefetches the next block, forward relies on
    # the CPU running ahead); N >= 1 = each block explicitly issues the all-gathers of the
    # next N blocks in forward and backward (more overlap, more memory)
    prefetch: int = knob(0, "FSDP2 blocks to prefetch explicitly; 0 = its default",
                         read_by=FSDP, since=0, check=at_least(0, "(0 = FSDP2's default)"))
    # (several ranks only; left out of the step-time figures)
    profile_steps: int = knob(2, "the last N steps run under torch.profiler (comm time)",
                              read_by=Reads("parallel.name",
                              RANKED), unread_ok=True, check=at_least(0))


def tp_size(p) -> int:
    """The tensor-parallel size: parallel.tp where the option reads it, else 1."""
    return p.tp if p.name in TP_OPTIONS else 1


def pp_size(p) -> int:
    """The pipeline stages' ranks: parallel.pp where the option reads it, else 1."""
    return p.pp if p.name in PP_OPTIONS else 1


def cp_size(p) -> int:
    """The context-parallel size: parallel.cp where the option reads it, else 1."""
    return p.cp if p.name in CP_OPTIONS else 1


def seq_part(cfg) -> int:
    """The tokens of a sequence one rank holds: train.seq_len, over parallel.cp."""
    return cfg.train.seq_len // cp_size(cfg.parallel)


def data_ranks(p, world: int) -> int:
    """The ranks that take their own data: tensor-parallel ranks share theirs, a
    pipeline's stages theirs, and context-parallel ranks theirs (each a part of it)."""
    return world // tp_size(p) // pp_size(p) // cp_size(p)


def mesh_coords(p, world: int, rank: int) -> dict:
    """A rank's index along each dim of the run's mesh (config.mesh_dims), outer first."""
    out = {}
    for dim, n in reversed(mesh_dims(p, world, world)):
        rank, out[dim] = divmod(rank, n)
    return dict(reversed(out.items()))


def data_rank(p, world: int, rank: int) -> int:
    """Which of the data ranks' batches a rank takes: its index over the mesh's data dims
    (not pp, cp or tp)."""
    dims, at, index = mesh_dims(p, world, world), mesh_coords(p, world, rank), 0
    for dim, n in dims:
        if dim not in ("pp", "cp", "tp"):
            index = index * n + at[dim]
    return index


def pp_stages(cfg) -> list[int]:
    """The pipeline's stages as their first blocks: parallel.pp_split's, else the blocks
    split over pp x stages per rank by parallel.pp_balance: evenly (the first stages take
    one more where they do not), or by each block's training FLOPs and the head's. (time
    is resolved into pp_split before a run, plan/blocks.py; until then, as flops.)"""
    p, m = cfg.parallel, cfg.model
    n = p.pp * stages_per_rank(p)
    if p.pp_split is not None:
        return [0, *p.pp_split]
    if p.pp_balance in ("flops", "time"):
        from .shapes import block_flops, head_flops

        return list(balanced(tuple(block_flops(m, cfg.train.seq_len)), head_flops(m), n))
    size, extra = divmod(m.num_layers, n)
    return [i * size + min(i, extra) for i in range(n)]


@functools.lru_cache(maxsize=256)
def balanced(weights: tuple, tail: float, n: int) -> tuple[int, ...]:
    """The first blocks of n contiguous stages of `weights` (one block at least each; the
    last stage also carries `tail`) whose largest stage weighs least (a partition by
    dynamic programming; of equal ones, the earliest cuts)."""
    size, at = len(weights), [0.0]
    for w in weights:
        at.append(at[-1] + w)
    cost = lambda j, i: at[i] - at[j] + (tail if i == size else 0.0)  # noqa: E731
    best = {(0, 0): (0.0, None)}
    for s in range(1, n + 1):
        for i in range(s, size - (n - s) + 1):
            best[s, i] = min((max(best[s - 1, j][0], cost(j, i)), j)
                             for j in range(s - 1, i) if (s - 1, j) in best)
    first, i = [], size
    for s in range(n, 0, -1):
        i = best[s, i][1]
        first.append(i)
    return tuple(first[::-1])


def stages_per_rank(p) -> int:
    return p.pp_stages_per_rank or (2 if p.pp_schedule in ("interleaved_1f1b", "zero_bubble")
                                    else 1)


def pp_microbatches(p) -> int:
    return p.pp_microbatches or p.pp * stages_per_rank(p)


def record_pp_columns(rec: dict, cfg, figures: tuple) -> None:
    """A record's pipeline columns, their nulls resolved as the run resolves them; at
    pp = 1 these, pp_schedule, pp_balance and `figures` (the task's pipeline figures)
    null, with why."""
    p, cols = cfg.parallel, ("pp_microbatches", "pp_stages_per_rank", "pp_split")
    if pp_size(p) > 1:
        rec.update(zip(cols, (pp_microbatches(p), stages_per_rank(p), pp_stages(cfg)[1:])))
        return
    for k in (*figures, *cols, "pp_schedule", "pp_balance"):
        rec[k] = None
        rec["null_reasons"][k] = "parallel.pp=1: no pipeline"


def routing_copies(p) -> int:
    """How many ranks route the same tokens: the tensor-parallel ones, each with the whole
    gathered sequence, unless each routes its own shard (parallel.etp=1); a pipeline's
    stages each hold the counts of every stage (parallel.pp's model sums them)."""
    return (1 if experts_whole(p) else tp_size(p)) * pp_size(p)


def experts_whole(p) -> bool:
    """parallel.etp=1 under tensor parallel: experts kept whole, expert parallel over the
    tp ranks too (each takes its sequence shard's tokens)."""
    return tp_size(p) > 1 and p.name == "expert_fsdp" and p.etp == 1


def ep_size(p, world: int) -> int:
    """Expert parallel's size: parallel.expert_parallel_size, or every data rank (and each
    one's tp ranks where the experts are whole under tensor parallel: parallel.etp=1)."""
    return p.expert_parallel_size or data_ranks(p, world) * (tp_size(p) if experts_whole(p)
                                                            else 1)


def mesh_dims(p, devices: int, world: int) -> list[tuple[str, int]]:
    """The run's device mesh, (name, size) outer dim first, its dims named as torchtitan's:
    pp, dp_replicate, dp_shard and tp; expert parallel's dp and ep (dp x ep is its
    dp_shard)."""
    tp, data = tp_size(p), data_ranks(p, world)
    pp = [("pp", pp_size(p))] if pp_size(p) > 1 else []
    cp = [("cp", cp_size(p))] if cp_size(p) > 1 else []
    tp = [("tp", tp)] if tp > 1 else []
    if p.name == "ddp":
        return [("dp_replicate", world)]
    if p.name == "hsdp":
        return pp + list(zip(("dp_replicate", "dp_shard"), hsdp_mesh(p, devices, world))) + \
            cp + tp
    if p.name in ("expert", "expert_fsdp"):  # (cp outside ep: ep x tp stays one group)
        ep = ep_size(p, world) // (tp_size(p) if experts_whole(p) else 1)
        return pp + [("dp", data // ep)] + cp + [("ep", ep)] + tp
    if p.name == "fsdp":
        return pp + [("dp_shard", data)] + cp + tp
    return []


def group_dim(ranks: tuple, dims: list[tuple[str, int]]) -> str:
    """The mesh dims a collective's group spans, named: 'tp', 'dp_shard', 'world'.

    A group spans a run of adjacent dims: its size is theirs and its ranks step by the
    innermost one's stride. Expert parallel's dp x ep is its dp_shard; ep x tp, etp=1's
    expert-parallel group, is ep_tp."""
    sizes = [n for _, n in dims]
    for i in range(len(dims)):
        for j in range(len(dims) - 1, i - 1, -1):
            size = math.prod(sizes[i:j + 1])
            stride = math.prod(sizes[j + 1:])
            if size == len(ranks) > 1 and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
                names = [d for d, n in dims[i:j + 1] if n > 1]
                if names in (["dp", "ep"], ["dp", "cp", "ep"]):
                    return "dp_shard" if len(names) == 2 else "dp_shard_cp"
                return "world" if len(names) > 1 and size == math.prod(sizes) else \
                    "_".join(names)
    return "world" if len(ranks) == math.prod(sizes) else f"{len(ranks)} ranks"


def tp_splits(m, tp: int) -> list[tuple[str, int]]:
    """The model sizes tensor parallel splits, (key, size) pairs, each of which tp must
    divide: heads, the FFNs' hidden sizes (experts' and shared ones too) and the vocab."""
    sizes = [("model.num_heads", m.num_heads), ("model.vocab_size", m.vocab_size),
             ("model.ffn_hidden_size", m.ffn_hidden_size)]
    if m.attention_type != "mla":
        sizes.append(("model.num_kv_heads", m.num_kv_heads))
    if m.num_experts > 0 and m.first_k_dense and m.dense_ffn_hidden_size:
        sizes.append(("model.dense_ffn_hidden_size", m.dense_ffn_hidden_size))
    if m.num_experts > 0 and m.num_shared_experts:
        sizes.append(("model.shared_ffn_hidden_size", m.num_shared_experts *
                      (m.shared_ffn_hidden_size or m.ffn_hidden_size)))
    return sizes


def hsdp_mesh(p, devices: int, world: int) -> tuple[int, int]:
    """parallel=hsdp's (replicate, shard) mesh shape over the data ranks (tp shares them).

    replicate is as set, or else one replica per machine: world // hardware.devices."""
    replicate = p.replicate or max(1, world // devices)
    return replicate, data_ranks(p, world) // replicate


@dataclass
class HardwareConfig:
    name: str = knob("auto", "the hardware profile (labels the run)", column="hardware")
    device: str = knob("auto", "auto | cpu | cuda | hpu", choices=("auto", "cpu", "cuda", "hpu"),
                       tasks=BOTH)
    devices: int = knob(1, "ranks launched on this machine (a plan's: its world size)",
                        tasks=BOTH, column="world_size", check=Range(1, MAX_DEVICES, note="ranks"))
    memory_gib: Optional[float] = knob(None, "per device; null = read from the device",
                                       check=MEMORY, also_in=COMM_TASK)
    # null = unknown (MFU is then null)
    peak_flops: Dict[str, Optional[float]] = knob(doc="dense peak FLOP/s per device for each "
                                                  "precision", factory=dict)
    # the plan's (task=plan; a bench run's plan reads them too, unhashed there: they change
    # a prediction, not what is measured)
    spec_memory_gib: Optional[float] = knob(
        None, "the part's memory per device as CUDA reports it: a plan's where memory_gib "
        "is null (the device is not here)", since=None, tasks=PLAN_TASK, also_in=PLANNED,
        check=MEMORY)
    compute_capability: Optional[float] = knob(
        None, "the part's CUDA compute capability (9.0: Hopper): a plan's choice of the "
        "expert kernel where the device is not here", since=None, tasks=PLAN_TASK,
        also_in=PLANNED, check=Range(1.0, 100.0, note="major.minor or null"))
    memory_bandwidth: Optional[float] = knob(
        None, "device memory bytes/s (the plan's roofline)", since=None, tasks=PLAN_TASK,
        check=BANDWIDTH, also_in=PLANNED)
    link_bandwidth: Optional[float] = knob(
        None, "bytes/s each way per device between the devices of a node (NVLink)",
        since=None, tasks=PLAN_TASK, check=BANDWIDTH, also_in=PLANNED)
    network_bandwidth: Optional[float] = knob(
        None, "bytes/s each way per device between nodes (its NIC)", since=None,
        tasks=PLAN_TASK, check=BANDWIDTH, also_in=PLANNED)
    comm_from: Optional[str] = knob(
        None, "a task=comm record (its metrics.json or run dir): the plan's collectives "
        "take the times it measured, not the bandwidths'", since=None, tasks=PLAN_TASK,
        also_in=PLANNED)
    calibration: Optional[str] = knob(
        None, "the plan's time at the rates a task=calibrate run measured: its file, a "
        "shipped name (h100) or auto (this machine's, made on first use); null: the "
        "datasheet's peaks, a floor", since=None, tasks=PLAN_TASK, also_in=PLANNED)
    devices_per_node: int = knob(8, "devices that share a node's links (a plan's group "
                                 "within one uses link_bandwidth)", since=8, tasks=PLAN_TASK,
                                 check=at_least(1), also_in=PLANNED)
    precisions: List[str] = knob(doc="precisions this hardware runs",
                                 factory=lambda: ["fp32", "fp16", "bf16"])
    cudnn_benchmark: bool = knob(True, "cuDNN autotuning")
    deterministic: bool = knob(False, "deterministic algorithms")
    env: Dict[str, str] = knob(doc="environment variables set for the run", factory=dict,
                               tasks=BOTH)
    # glibc malloc keeps freed memory for reuse instead of returning it (big tensors are not
    # page-faulted in again each step: faster CPU steps; the CPU peak RSS then also counts
    # memory malloc kept)
    malloc_retain: bool = knob(False, "glibc malloc keeps freed memory (faster CPU steps)")
    pin_ranks: bool = knob(True, "each CPU rank bound to cores of its own, where the ranks' "
                           "threads fit this machine's", since=True, tasks=BOTH,
                           not_in=PLAN_TASK, unread_ok=True,
                           read_by=(Reads("parallel.name", RANKED), Reads("task", COMM_TASK)))


@dataclass
class DataConfig:
    name: str = knob("markov", "labels the data (the group option)", column="data")
    source: str = knob("markov", "markov (synthetic, learnable) | tokens (memory-mapped file)",
                       choices=("markov", "tokens"))
    path: Optional[str] = knob(None, "token file made by `python -m moe_exp.data prepare`",
                               read_by=Reads("data.source", ("tokens",)))
    branching: int = knob(4, "markov: successors per token (entropy = log(branching) nats)",
                          read_by=Reads("data.source", ("markov",)))
    heldout: bool = knob(False, "tokens: hold the file's last train.eval_sequences sequences "
                         "out of training, for eval_loss", read_by=Reads("data.source",
                                                                         ("tokens",)), since=False)
    num_workers: int = knob(0, "loader worker processes per rank", check=at_least(0))
    pin_memory: bool = knob(True, "pinned host memory (CUDA only)")
    prefetch_factor: Optional[int] = knob(None, "batches each worker loads ahead "
                                          "(needs num_workers > 0)", check=at_least(1, "or null"))
    persistent_workers: bool = knob(False, "workers kept between epochs (needs "
                                    "num_workers > 0)")


@dataclass
class OptimConfig:
    name: str = knob("adamw", "the optimizer option", choices=("adamw", "muon"), off="adamw",
                     column="optim", summary="optim")
    lr: float = knob(3e-3, "peak learning rate", check=above(0))
    schedule: str = knob("cosine", "lr after warmup: cosine | linear (down to lr * "
                         "min_lr_ratio) | constant | wsd (warmup, stable, decay) | onecycle "
                         "(torch's OneCycleLR)", choices=SCHEDULES, since="cosine",
                         column="lr_schedule")
    min_lr_ratio: float = knob(0.1, "cosine, linear and wsd decay to lr * min_lr_ratio",
                               read_by=Reads("optim.schedule", ("cosine", "linear", "wsd"),
                                             what="optim.schedule=cosine, linear or wsd"),
                               check=Range(0, 1.0))
    lr_warmup_steps: int = knob(5, "linear warmup steps", read_by=Reads(
        "optim.schedule", tuple(s for s in SCHEDULES if s != "onecycle"),
        what="optim.schedule=cosine, linear, constant or wsd"), check=at_least(0))
    decay_ratio: float = knob(0.2, "wsd: the share of the steps after warmup that decay",
                              read_by=Reads("optim.schedule", ("wsd",), what="optim.schedule=wsd"),
                              since=0.2, check=Range(0, 1.0, lo_open=True))
    pct_start: float = knob(0.3, "onecycle: the share of the steps rising to lr (from lr/25; "
                            "then down to lr/25e4)", since=0.3,
                            read_by=Reads("optim.schedule", ("onecycle",),
                                          what="optim.schedule=onecycle"), check=Range(0, 1.0,
                                          lo_open=True, hi_open=True))
    weight_decay: float = knob(0.1, "decoupled weight decay", check=at_least(0))
    beta1: float = knob(0.9, "AdamW's beta1", check=Range(0, 1.0, hi_open=True))
    beta2: float = knob(0.95, "AdamW's beta2", check=Range(0, 1.0, hi_open=True))
    eps: float = knob(1e-8, "AdamW's epsilon", check=above(0))
    grad_clip: float = knob(1.0, "gradient norm clip; 0 = none", check=at_least(0, "(0 = off)"))
    impl: str = knob("auto", "AdamW's: auto | fused | foreach | for-loop",
                     choices=("auto", "fused", "foreach", "for-loop"))
    # muon only (AdamW keeps the embeddings, head and norms: beta1/beta2/eps/impl above)
    momentum: float = knob(0.95, "Muon's momentum", read_by=MUON, unread="drop", check=Range(0, 1.0,
                           hi_open=True))
    nesterov: bool = knob(True, "Muon's Nesterov momentum", read_by=MUON, unread="drop")
    ns_steps: int = knob(5, "Muon's Newton-Schulz iterations", read_by=MUON, unread="drop",
                         check=Range(1, 20))


@dataclass
class LoggerConfig:
    name: str = knob("wandb", "the tracker option", choices=("wandb", "none"))
    project: str = knob("moe_exp", "W&B project", read_by=WANDB, unread="keep")
    mode: str = knob("offline", "W&B mode", choices=("offline", "online", "disabled"),
                     read_by=WANDB, unread="keep")
    entity: Optional[str] = knob(None, "W&B entity", read_by=WANDB, unread="keep")
    group: Optional[str] = knob(None, "W&B group", read_by=WANDB, unread="keep")
    tags: List[str] = knob(doc="W&B tags", factory=list, read_by=WANDB, unread="keep")


@dataclass
class TrainConfig:
    steps: int = knob(20, "measured steps", check=(at_least(1), at_most(MAX_STEPS)))
    warmup_steps: int = knob(3, "run first, excluded from timing (compile, allocator growth)",
                             check=(at_least(0), at_most(MAX_STEPS)))
    micro_batch_size: int = knob(8, "sequences per micro-batch per rank", column="micro_batch_size",
                                 check=at_least(1))
    grad_accum_steps: int = knob(1, "micro-batches per optimizer step", column="grad_accum_steps",
                                 check=at_least(1))
    seq_len: int = knob(128, "tokens per sequence", column="seq_len", check=at_least(1))
    activation_checkpointing: str = knob("none", "none | full | selective",
                                         choices=("none", "full", "selective"), off="none",
                                         column="activation_checkpointing", summary="ac")
    compile: str = knob("off", "torch.compile mode (task=infer: of the decode step)", off="off",
                        tasks=("bench",) + INFER_TASK,
                        choices=("off", "default", "reduce-overhead", "max-autotune",
                                 "max-autotune-no-cudagraphs"), column="compile", summary="compile")
    attention: str = knob("auto", "attention kernel: auto (SDPA picks) | flash | efficient | "
                          "math | cudnn (that SDPA backend only) | flex (FlexAttention, "
                          "compiled)", choices=ATTENTION, off="auto", since="auto",
                          column="attention", summary="attention")
    # torchtitan's gc_freq: Python's automatic collections at random points of random steps
    # become one full collection every N steps
    gc_every: int = knob(0, "0 = Python's automatic GC; N = automatic GC off, generations "
                         "0-1 collected every N steps", since=0, column="gc_every",
                         check=at_least(0))
    seed: int = knob(0, "seed of the weights and the data", tasks=("bench",) + INFER_TASK,
                     check=Range(0, SEEDS - 1))
    log_every: int = knob(5, "steps between loss reads (each read waits for the device)",
                          check=at_least(1))
    eval_sequences: int = knob(16, "held-out sequences eval_loss is measured on (0: none)",
                               since=16, check=Range(0, MAX_STEPS))
    eval_every: int = knob(0, "steps between eval_loss measurements (0: at the end only)",
                           since=0, check=Range(0, MAX_STEPS))
    target_loss: Optional[float] = knob(None, "eval loss to reach: the record's steps and "
                                        "seconds to it (needs train.eval_every)", since=None,
                                        check=above(0, "(a loss)"))
    profile: bool = knob(False, "torch.profiler trace of the last train.profile_steps steps "
                         "(untimed): trace.json, profile.txt, profile_shares", since=False,
                         not_in=PLAN_TASK)
    profile_steps: int = knob(2, "steps train.profile traces (the run's last; untimed)",
                              read_by=PROFILE, since=2, check=at_least(1), not_in=PLAN_TASK)
    checkpoint_every: int = knob(0, "save a checkpoint (torch.distributed.checkpoint) every N "
                                 "steps, and on SIGTERM (0: off)", off=0, since=0,
                                 column="checkpoint_every", check=at_least(0, "(0 = off)"),
                                 not_in=PLAN_TASK)
    checkpoint_dir: Optional[str] = knob(None, "where checkpoints go (null: checkpoints/ in "
                                         "the run's dir; a path: <path>/<run>/)",
                                         read_by=CHECKPOINT, since=None, not_in=PLAN_TASK)
    checkpoint_async: bool = knob(False, "save in the background (DCP's async_save): the "
                                  "step waits only for the copy to host memory",
                                  read_by=CHECKPOINT, off=False, since=False,
                                  column="checkpoint_async", not_in=PLAN_TASK)
    checkpoint_keep: int = knob(1, "the latest checkpoints kept (0: all)", read_by=CHECKPOINT,
                                since=1, check=at_least(0, "(0 = all)"), not_in=PLAN_TASK)
    plan: bool = knob(True, "trace the step first (task=plan) and record its prediction "
                      "beside the measurement (planned_peak_gib, planned_peak_error); the "
                      "pre-flight skips a run whose planned peak exceeds the memory",
                      since=True)
    plan_depth: str = knob("auto", "blocks a plan traces: auto = two small depths of a model "
                           "of 8 or more blocks, its figures extrapolated to the whole; full = "
                           "every block", choices=("auto", "full"), tasks=(),
                           also_in=PLAN_TASK + PLANNED, since="auto")  # (unhashed: auto
    # gives full's figures, tests/test_plan.py checks it)
    resume_from: Optional[str] = knob(None, "continue from a checkpoint: its step_* dir, a dir "
                                      "of them (the latest) or the run dir that holds them",
                                      since=None, not_in=PLAN_TASK)


@dataclass
class TuneConfig:
    """task=tune_batch: the micro-batch search, probing from train.micro_batch_size."""
    multiple: int = knob(1, "micro-batch sizes probed are multiples of this (the search's "
                         "resolution)", tasks=TUNE_TASK, since=1, check=at_least(1))
    max_micro_batch: int = knob(4096, "the doubling stops here", tasks=TUNE_TASK, since=4096)
    goal: str = knob("fastest", "fastest: stop once tokens/s stops rising (the two largest "
                     "micro-batches that fit under 5% above the best before them); largest: "
                     "search on to the largest that fits", choices=("fastest", "largest"),
                     tasks=TUNE_TASK, since="largest", unread="drop")
    max_seconds: Optional[float] = knob(None, "stop probing after this long, the best probe "
                                        "so far the answer; null: no limit", tasks=TUNE_TASK,
                                        since=None, check=above(0, "seconds or null"),
                                        unread="drop")


@dataclass
class InferConfig:
    """task=infer: greedy generation with a KV cache; see docs/inference.md."""
    batch_size: int = knob(8, "requests generated together", tasks=INFER_TASK, since=8,
                           check=Range(1, MAX_BATCH))
    prompt_len: int = knob(64, "tokens per prompt (held-out walks of the data)",
                           tasks=INFER_TASK, since=64, check=Range(1, MAX_POSITIONS))
    new_tokens: int = knob(32, "tokens generated per request", tasks=INFER_TASK, since=32,
                           check=Range(1, MAX_POSITIONS))
    batches: int = knob(3, "measured batches (after infer.warmup)", tasks=INFER_TASK, since=3,
                        check=Range(1, MAX_REQUESTS))
    warmup: int = knob(1, "unmeasured batches first", tasks=INFER_TASK, since=1,
                       check=Range(0, MAX_REQUESTS))
    checkpoint: Optional[str] = knob(None, "weights from a checkpoint (train.checkpoint_every's"
                                     " step_* dir, a dir of them or a run dir); null: the "
                                     "seed's initialization", tasks=INFER_TASK, since=None)
    experts_resident: Optional[int] = knob(None, "experts per MoE layer in device memory, the "
                                           "rest in host memory (an LRU cache, accounted); "
                                           "null: all", tasks=INFER_TASK, since=None)
    prefetch: int = knob(0, "experts loaded ahead for the next MoE layer, its router's guess "
                         "from this layer's input", tasks=INFER_TASK, since=0,
                         read_by=Reads("infer.experts_resident", positive=True,
                                       what="expert residency"), check=at_least(0))
    usage_threshold: float = knob(0.0, "drop experts whose share of a layer's tokens in the "
                                  "warmup batches is below this (selective loading)",
                                  tasks=INFER_TASK, since=0.0, check=Range(0, 1.0, hi_open=True))
    eval_sequences: int = knob(16, "held-out sequences (prompt_len + new_tokens long) the "
                               "eval loss is measured on (0: none)", tasks=INFER_TASK, since=16,
                               check=Range(0, MAX_REQUESTS))
    quantize: str = knob("none", "weights through torchao: none | int8 (weight-only) | fp8 "
                         "(weights and activations; GPUs with fp8)", choices=("none", "int8",
                                                                             "fp8"),
                         tasks=INFER_TASK, off="none", since="none")
    batching: str = knob("none", "serve a simulated request stream: static | dynamic | "
                         "continuous batching, on a clock of measured costs (none: fixed batches"
                         " only)", choices=("none",) + BATCHING, tasks=INFER_TASK, off="none",
                         since="none")
    max_batch_size: int = knob(8, "the most requests a batch holds", read_by=SERVING,
                               tasks=INFER_TASK, since=8, check=Range(1, MAX_BATCH))
    timeout_ms: float = knob(50.0, "dynamic batching: a batch leaves when its oldest request "
                             "waited this long", tasks=INFER_TASK, since=50.0,
                             read_by=Reads("infer.batching", ("dynamic",),
                                           what="infer.batching=dynamic"),
                             check=Range(0, 3_600_000, note="ms"))
    arrival_rate: float = knob(20.0, "requests a second (Poisson arrivals)", read_by=SERVING,
                               tasks=INFER_TASK, since=20.0,
                               check=Range(1e-6, 1e9, note="requests/s"))
    requests: int = knob(64, "requests in the stream", read_by=SERVING, tasks=INFER_TASK,
                         since=64, check=Range(1, MAX_REQUESTS))
    length_spread: float = knob(0.5, "prompt and output lengths uniform in [L(1 - spread), L] "
                                "(L: prompt_len, new_tokens)", read_by=SERVING,
                                tasks=INFER_TASK, since=0.5, check=Range(0, 1.0, hi_open=True))


@dataclass
class CommConfig:
    """task=comm: collective latency and bus bandwidth over message sizes."""
    ops: List[str] = knob(doc="collectives measured; send (a pipeline's hand-off) where "
                          "named", tasks=COMM_TASK, factory=lambda: [
                              "all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
    min_bytes: int = knob(1024, "smallest message", tasks=COMM_TASK, check=at_least(4))
    max_bytes: int = knob(64 * 2**20, "largest message", tasks=COMM_TASK)
    factor: int = knob(4, "each size is the previous one times this", tasks=COMM_TASK,
                       check=at_least(2))
    iters: int = knob(10, "timed repetitions per size (median reported; send: mean)",
                      tasks=COMM_TASK, check=at_least(1))
    warmup: int = knob(3, "untimed repetitions first", tasks=COMM_TASK, check=at_least(0))
    dtype: str = knob("float32", "element type", choices=("float32", "bfloat16", "float16"),
                      tasks=COMM_TASK)


@dataclass
class SweepConfig:
    """How a multirun, -m, runs its jobs and builds its table; not part of the config hash."""
    name: Optional[str] = knob(None, "preset name; the W&B group defaults to it + the sweep dir")
    # e.g. {precision: bf16}; empty (or null) = the ok row with the fewest optimizations on.
    # (set it with ++sweep.baseline={...}; {} not null: Hydra cannot add keys to a null)
    baseline: Optional[Dict[str, Any]] = knob(doc="the baseline row's values", factory=dict)
    baseline_by: List[str] = knob(doc="one baseline per value of these columns",
                                  factory=lambda: ["model"])
    repeats: int = knob(1, "runs per combination: the table reports median and spread",
                        check=at_least(1))
    resume: bool = knob(False, "skip jobs whose records are already in the sweep dir")
    isolate: bool = knob(True, "each job in its own process (a crash becomes a crashed row)")
    remeasure_loaded: bool = knob(False, "at a grid sweep's end, run once more each job "
                                  "measured while other processes used the CPU "
                                  "(cpu_other_load over 15%): its new record replaces the "
                                  "old, kept as metrics.loaded.json")
    job_timeout_s: Optional[float] = knob(None, "kill a job after this long (a crashed row)",
                                          check=above(0, "seconds or null"))
    fresh_compile_cache: bool = knob(True, "each job compiles cold: compile_s is no cache hit")
    vary_init: bool = knob(False, "repeat i initializes the model from train.seed + i (the "
                           "data stays): the repeats' eval-loss spread is the noise loss_ok uses")
    init_offset: int = knob(0, "set by the sweep (vary_init): this run's init seed is "
                            "train.seed + this")
    global_batch: Optional[int] = knob(None, "+sweep=layouts: sequences a step every layout "
                                       "keeps; null = hardware.devices x train."
                                       "micro_batch_size x train.grad_accum_steps",
                                       check=at_least(1, "or null"))
    plan_workers: int = knob(2, "+sweep=layouts: plans run at once, each in a process of "
                             "its own (a plan keeps one core busy)", check=Range(1, 256))


@dataclass
class RunConfig:
    model: ModelConfig = group(ModelConfig, "the transformer's shape and routing",
                               reads_in=INFER_TASK)
    precision: PrecisionConfig = group(PrecisionConfig, "mixed precision", reads_in=INFER_TASK)
    parallel: ParallelConfig = group(ParallelConfig, "DDP, FSDP2, expert parallel")
    hardware: HardwareConfig = group(HardwareConfig, "the device profile",
                                     reads_in=INFER_TASK + CALIBRATE_TASK)
    data: DataConfig = group(DataConfig, "the data source and loader", reads_in=INFER_TASK)
    optim: OptimConfig = group(OptimConfig, "AdamW or Muon and the schedule")
    logger: LoggerConfig = group(LoggerConfig, "W&B or none", hashed=False, reads_in=TASKS)
    train: TrainConfig = group(TrainConfig, "the measured loop")
    sweep: SweepConfig = group(SweepConfig, "how a multirun runs", hashed=False,
                               reads_in=TASKS)
    comm: CommConfig = group(CommConfig, "task=comm's collectives")
    tune: TuneConfig = group(TuneConfig, "task=tune_batch's micro-batch search")
    infer: InferConfig = group(InferConfig, "task=infer's generation")
    task: str = knob("bench", "what a run does: bench (train and measure) | comm (collectives)"
                     " | tune_batch (the largest and the fastest micro-batch that fit)"
                     " | infer (generate with a KV cache) | plan (a training step's memory"
                     " and time, traced on fake tensors: docs/plan.md) | calibrate (this"
                     " device's kernel rates, for a plan's time)",
                     choices=TASKS, tasks=TASKS, column="task")
    extra: Dict[str, Any] = field(default_factory=dict, metadata={  # free-form notes
        "knob": Knob("free-form labels, kept in the record", tasks=TASKS), "hashed": False})


KNOBS = declarations(RunConfig)  # {dotted key: its declaration}
DEFAULTS = defaults(RunConfig)  # {dotted key: its schema default}
# Allowed values of string-valued keys, checked by validate.py (one place, one message).
CHOICES: Dict[str, List[str]] = {k: list(d.choices) for k, d in KNOBS.items() if d.choices}
UNHASHED = unhashed_groups(RunConfig)  # groups that do not change what is measured
# record column -> the value that means that optimization is off (the table's baseline)
OFF = {(k.split(".")[0] if k.endswith(".name") else k.split(".")[-1]): d.off
       for k, d in KNOBS.items() if d.off is not None}


def total_steps(train) -> int:
    """Optimizer steps a run takes: unmeasured warmup, then measured steps."""
    return train.warmup_steps + train.steps


def register() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunConfig)


register()


def override_word(key: str, value: str) -> str:
    """key=VALUE as a shell word that Hydra reads back as the string VALUE.

    It is plain where that reads back so, else in Hydra's double quotes, where a backslash
    escapes only before a quote."""
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


def typed(cfg_dict: dict) -> RunConfig:
    """A resolved config dict, from pipeline.container, as the schema's dataclasses.

    That is what a task reads: what OmegaConf.to_object makes of the structured config, built
    directly (its merge re-checks every type, 90 ms a run; validation has checked them). Run
    after validation, which rejects what the schema does not hold."""
    import dataclasses

    out = {}
    for f in dataclasses.fields(RunConfig):
        value = copy.deepcopy(cfg_dict.get(f.name, _default(f)))
        out[f.name] = f.default_factory(**value) if "group" in f.metadata else value
    return RunConfig(**out)


def _default(f):
    import dataclasses

    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def unrecorded(task: str) -> list[str]:
    """The record columns of the knobs `task` does not read; they are null in its record."""
    return [k.column for k in KNOBS.values() if k.column and not k.records(task)]


def plain(node) -> dict:
    """A config group as a plain dict, from a schema dataclass or an OmegaConf node."""
    import dataclasses

    from omegaconf import OmegaConf

    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) \
        else dict(node)
