"""Checks before any work: every mistake, then what this machine cannot do or is not ready for.

validate() runs them in those two passes. A mistake's status is invalid, what this machine
cannot do is skipped, and what it is not ready for is error. Each failure is one line naming
the key and what is allowed. Checks of one thing live with it: the device's in hardware.py,
token files' in data/tokens.py, W&B's in tracking.py; memory bounds in bench/flops.py."""
from __future__ import annotations

import importlib.util
import json
import os

import torch
from omegaconf import OmegaConf

from .config import (CHOICES, CONF, FLOPS, FSDP2, MAX_STEPS, ConfigError, NotReady,
                     NothingLeft, Unsupported, data_ranks, default_choices, env_source, ep_size,
                     TP_OPTIONS, experts_whole, group_options, no_such_key, tp_size)
from .ranks import rank_env, world_size


def _get(cfg, dotted: str):
    return OmegaConf.select(cfg, dotted)


def not_one_of(value, allowed) -> str:
    return f"'{value}' is not one of: {', '.join(allowed)}"


def check_choices(cfg) -> None:
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            env = env_source(cfg, key)  # (the user set the variable, not the key)
            raise ConfigError(env or key, not_one_of(value, allowed) +
                              (f" (it sets {key})" if env else ""))


def check_resolves(cfg) -> None:
    """Check every ${...} resolves; whatever read one that does not would raise a traceback."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raw = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            raw = raw.get(part) if isinstance(raw, dict) else None
        what = f"'{raw}' does not resolve" if isinstance(raw, str) else "does not resolve"
        raise ConfigError(key, f"{what}: {(str(e).splitlines() or [''])[0]}") from None


def check_complete(cfg) -> None:
    """Check every key of the schema is there.

    `~key` deletes any key, and whatever read a deleted key would raise."""
    import dataclasses

    from omegaconf import DictConfig

    for group, node in [("", cfg), *cfg.items_ex(resolve=False)]:
        typ = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if typ is None or not dataclasses.is_dataclass(typ):
            continue
        for f in dataclasses.fields(typ):
            if f.name not in node:
                key = f"{group}.{f.name}".lstrip(".")
                raise ConfigError(key, f"cannot be deleted (~{key}): runs read it; set a "
                                  "value instead")


def check_known_keys(cfg) -> None:
    """Refuse keys a `+` override added inside a typed group, such as `+train.foo=1`.

    Hydra lets `+` add any key, and nothing would read them."""
    import dataclasses

    from omegaconf import DictConfig

    for group, node in [("", cfg), *cfg.items()]:
        typ = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if typ is None or not dataclasses.is_dataclass(typ):
            continue
        known = {f.name for f in dataclasses.fields(typ)}
        for key in node:
            if key not in known:
                raise ConfigError(f"{group}.{key}".lstrip("."), no_such_key(group, typ))


def check_finite(cfg) -> None:
    """Check there is no nan or inf anywhere and no integer past int64.

    Every range check below is a comparison, which nan passes."""
    import math

    def walk(node, path):
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for k, v in items:
            key = f"{path}.{k}" if path else str(k)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(key, f"must be a finite number, got {v}")
            if isinstance(v, int) and not -2**63 <= v < 2**63:  # (torch's int64)
                raise ConfigError(key, f"must fit in 64 bits, got {v}")
            walk(v, key)

    walk(OmegaConf.to_container(cfg, resolve=True), "")


def check_ranges(cfg, prefix: str = "") -> None:
    """Check each key's declared range, its Knob.check in config.py, where an option reads it.

    prefix limits the check to the keys that start with it; sweep. is a sweep's own settings."""
    from .config import KNOBS

    get = lambda k: OmegaConf.select(cfg, k, throw_on_missing=False)  # noqa: E731
    for key, knob in KNOBS.items():
        if not key.startswith(prefix) or not knob.check or \
                knob.read_by and not any(r.holds(get) for r in knob.read_by):
            continue
        value = get(key)
        for r in knob.check:
            if why := r.error(value):
                raise ConfigError(key, why)


def check_model(m) -> None:
    if not str(m.name).strip():
        raise ConfigError("model.name", "empty: it labels every result; name the model")
    if m.attention_type == "mla":
        check_mla(m)
    elif m.head_dim is not None:
        if m.head_dim < 2 or m.head_dim % 2:
            raise ConfigError("model.head_dim", f"must be an even number >= 2 (RoPE rotates "
                              f"pairs) or null (hidden_size / num_heads), got {m.head_dim}")
    elif m.hidden_size % m.num_heads:
        raise ConfigError("model.hidden_size", f"{m.hidden_size} is not divisible by "
                          f"model.num_heads={m.num_heads} (or set model.head_dim)")
    elif (m.hidden_size // m.num_heads) % 2:
        raise ConfigError("model.num_heads", f"head dim {m.hidden_size // m.num_heads} must be "
                          "even for RoPE")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError("model.num_kv_heads", f"{m.num_kv_heads} must divide "
                          f"model.num_heads={m.num_heads}")
    if m.num_experts > 0 and not 1 <= m.top_k <= m.num_experts:
        raise ConfigError("model.top_k", f"must be in 1..num_experts={m.num_experts}, got {m.top_k}")
    if m.num_experts > 0 and m.routing == "skewed":
        if m.top_k == m.num_experts:
            raise ConfigError("model.routing", f"skewed: with top_k = num_experts = {m.top_k} "
                              "every token goes to every expert; use learned or balanced")
        most = m.num_experts / m.top_k  # every token on the busiest
        if not 1 <= m.routing_skew <= most:
            raise ConfigError("model.routing_skew", f"must be in 1..num_experts / top_k = "
                              f"{most:g} (the busiest expert gets every token at most), got "
                              f"{m.routing_skew}")
    if m.num_experts > 0:
        check_moe_options(m)


def check_mla(m) -> None:
    if m.qk_rope_head_dim < 2 or m.qk_rope_head_dim % 2:
        raise ConfigError("model.qk_rope_head_dim", f"must be an even number >= 2 (RoPE "
                          f"rotates pairs), got {m.qk_rope_head_dim}")


def check_moe_options(m) -> None:
    """Check the architecture options of a MoE model, one with model.num_experts > 0."""
    if m.first_k_dense >= m.num_layers:
        raise ConfigError("model.first_k_dense", f"must be below model.num_layers="
                          f"{m.num_layers} (a model with no MoE block: model.num_experts=0), got "
                          f"{m.first_k_dense}")
    if m.capacity_factor is not None and not 0 < m.capacity_factor <= m.num_experts:
        raise ConfigError("model.capacity_factor", f"must be in (0, num_experts="
                          f"{m.num_experts}] (1.0: the balanced share) or null (dropless), got "
                          f"{m.capacity_factor}")
    if m.pad_to_capacity and m.dispatch != "padded":
        raise ConfigError("model.pad_to_capacity", f"runs the padded kernel; this run has "
                          f"model.dispatch={m.dispatch} (set model.dispatch=padded)")
    g = m.n_groups
    if g > 1:
        if m.num_experts % g or m.num_experts // g < 2:
            raise ConfigError("model.n_groups", f"must divide model.num_experts={m.num_experts} "
                              f"into groups of 2 or more (a group's score is its best two "
                              f"experts'), got {g}")
        if m.topk_groups > g:
            raise ConfigError("model.topk_groups", f"must be in 1..n_groups={g}, got "
                              f"{m.topk_groups}")
        if m.top_k > m.topk_groups * (m.num_experts // g):
            raise ConfigError("model.top_k", f"{m.top_k} experts do not fit in topk_groups="
                              f"{m.topk_groups} groups of {m.num_experts // g}")


def check_train(cfg) -> None:
    micro = (cfg.train.steps + cfg.train.warmup_steps) * cfg.train.grad_accum_steps
    if micro > MAX_STEPS:  # (the data is sized for every micro-batch of the run)
        raise ConfigError("train.grad_accum_steps", f"{cfg.train.grad_accum_steps:,} x ("
                          "train.steps + train.warmup_steps) = "
                          f"{micro:,} micro-batches: at most {MAX_STEPS:,}")
    _check_eval(cfg.train, cfg.data)
    if cfg.train.profile:
        if cfg.train.steps <= cfg.train.profile_steps:
            raise ConfigError("train.steps", f"must exceed train.profile_steps="
                              f"{cfg.train.profile_steps} (the profiled steps are untimed), "
                              f"got {cfg.train.steps}")
    if cfg.train.compile != "off" and cfg.train.warmup_steps < 1:
        raise ConfigError("train.warmup_steps", f"must be >= 1 with train.compile="
                          f"{cfg.train.compile} (the first step compiles: it must not be measured)")
    # inductor's config reads it when imported (a ValueError mid-run): by torch.compile, and
    # by torch.use_deterministic_algorithms, which every run calls
    name = "TORCHINDUCTOR_COMPILE_THREADS"
    key, v = (f"{name} (environment)", os.environ[name]) if name in os.environ else \
        (f"hardware.env.{name}", (cfg.hardware.env or {}).get(name, "1"))
    if not str(v).strip().isdigit() or int(v) < 1:
        raise ConfigError(key, f"must be a whole number >= 1 (compile workers), got {v!r}")
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} exceeds model.max_seq_len="
                          f"{cfg.model.max_seq_len}")


def _check_eval(t, data) -> None:
    if t.target_loss is None:
        return
    if not (t.eval_every and t.eval_sequences and (data.source == "markov" or data.heldout)):
        raise ConfigError("train.target_loss", "is checked on the eval steps: it needs "
                          "train.eval_every > 0, train.eval_sequences > 0 and a held-out set "
                          f"(data=markov, or data.heldout=true); got {t.eval_every}, "
                          f"{t.eval_sequences}, data={data.source}")


def check_precision(cfg) -> None:
    p, hw = cfg.precision.name, cfg.hardware
    names = CHOICES["precision.name"]
    for key, what in (("peak_flops", hw.peak_flops), ("precisions", hw.precisions)):
        if bad := [k for k in what if k not in names]:
            raise ConfigError(f"hardware.{key}", f"'{bad[0]}' is not a precision (allowed: "
                              f"{', '.join(names)})")
    for key, peak in hw.peak_flops.items():
        if why := FLOPS.error(peak):
            raise ConfigError(f"hardware.peak_flops.{key}", why)
    if cfg.precision.autocast_dtype not in (None, "bfloat16", "float16"):
        raise ConfigError("precision.autocast_dtype", "must be null, bfloat16 or float16")
    # The name labels every result: its autocast dtype (and, without autocast, its tf32) may
    # not say otherwise. TF32 beside autocast only touches the matmuls autocast leaves in
    # fp32, and grad_scaler is a knob of its own: both stay free there.
    shipped = OmegaConf.load(CONF / "precision" / f"{p}.yaml")
    keys = ("autocast_dtype",) + (("tf32",) if shipped.autocast_dtype is None else ())
    show = lambda v: "null" if v is None else str(v).lower()  # noqa: E731 - as in YAML
    for key in keys:
        value = shipped[key]
        if cfg.precision[key] != value:
            raise ConfigError(f"precision.{key}", f"must be {show(value)} for precision={p}, got "
                              f"{show(cfg.precision[key])} (choose the precision option that "
                              "means it)")


def precision_here(cfg) -> None:
    p, hw = cfg.precision.name, cfg.hardware
    if p not in hw.precisions:
        raise Unsupported("precision", f"precision={p} is not supported on hardware={hw.name} "
                          f"(supported: {', '.join(hw.precisions)})")
    if p == "tf32" and hw.device != "cuda":  # (torch has no TF32 elsewhere: the run
        # would be fp32 labelled tf32)
        raise Unsupported("precision", f"precision=tf32 needs a CUDA GPU (compute capability "
                          f">= 8.0); this run's device is {hw.device}")
    if p == "fp8":
        if hw.device != "cuda" or not torch.cuda.is_available() or \
                torch.cuda.get_device_capability(0) < (8, 9):
            raise Unsupported("precision", "precision=fp8 needs a CUDA GPU with compute "
                              "capability >= 8.9 (H100, H200, L4, RTX 40xx)")
        if importlib.util.find_spec("torchao") is None:
            raise Unsupported("precision", "precision=fp8 needs torchao: pip install torchao")


def compile_here(cfg) -> None:
    if cfg.train.compile == "reduce-overhead" and cfg.hardware.device != "cuda":
        raise Unsupported("train.compile", "reduce-overhead is torch.compile with CUDA graphs: "
                          f"it needs a CUDA GPU; this run's device is {cfg.hardware.device} "
                          "(elsewhere it is train.compile=default under another name)")


def attention_here(cfg) -> None:
    """A train.attention kernel this device or dtype cannot run: skipped before any work."""
    from .optimizations.attention import attention_unsupported
    from .optimizations.precision import DTYPES

    name, device = cfg.train.attention, cfg.hardware.device
    cap = torch.cuda.get_device_capability(0) if name in ("flash", "cudnn") and \
        device == "cuda" and torch.cuda.is_available() else None
    why = attention_unsupported(name, device, DTYPES.get(cfg.precision.autocast_dtype,
                                                         torch.float32), cap)
    if why:
        raise Unsupported("train.attention", why)


def check_mla_kernel(cfg) -> None:
    """SDPA's flash and cuDNN kernels take q/k and value heads of one size only."""
    m, name = cfg.model, cfg.train.attention
    if m.attention_type != "mla" or name not in ("flash", "cudnn"):
        return
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if qk != m.v_head_dim:
        raise ConfigError("train.attention", f"{name} needs q/k and value heads of one size; "
                          f"MLA's are {qk} (model.qk_nope_head_dim + qk_rope_head_dim) and "
                          f"{m.v_head_dim} (model.v_head_dim): use auto, efficient or math")


def check_dispatch(cfg) -> None:
    """model.dispatch=grouped needs grouped_mm's aligned strides."""
    if cfg.model.dispatch != "grouped" or cfg.model.num_experts == 0:
        return
    from .model.moe import grouped_aligned
    from .optimizations.precision import DTYPES

    dtype, m = DTYPES.get(cfg.precision.autocast_dtype, torch.float32), cfg.model
    odd = [k for k in ("hidden_size", "ffn_hidden_size") if not grouped_aligned(dtype, m[k])]
    if odd:
        raise ConfigError("model.dispatch", f"grouped needs 16-byte strides (grouped_mm): "
                          f"model.{odd[0]}={m[odd[0]]} is not a multiple of "
                          f"{16 // dtype.itemsize} at precision={cfg.precision.name}; use "
                          "model.dispatch=auto, loop or padded")


def dispatch_here(cfg) -> None:
    """Check an explicit model.dispatch=grouped runs here; auto picks what does.

    It is probed on CPU only: a CUDA probe here would open a context on GPU 0 in every rank
    and launcher."""
    if cfg.model.dispatch != "grouped" or cfg.model.num_experts == 0:
        return
    from .model.moe import grouped_compiles, grouped_mm_supported
    from .optimizations.precision import DTYPES

    dtype, why = DTYPES.get(cfg.precision.autocast_dtype, torch.float32), None
    if cfg.train.compile != "off" and not grouped_compiles(dtype):
        why = "compiled, grouped_mm runs in bf16 only"
    elif cfg.hardware.device == "cpu" and not grouped_mm_supported("cpu", dtype):
        why = f"grouped_mm does not run on this CPU in {str(dtype).replace('torch.', '')}"
    if why:
        raise Unsupported("model.dispatch", f"grouped at precision={cfg.precision.name}: {why}; "
                          "use model.dispatch=auto, loop or padded")


def check_parallel(cfg) -> None:
    from .tasks import TASKS

    p, hw, m = cfg.parallel, cfg.hardware, cfg.model
    n, own = hw.devices, TASKS[cfg.task].own_ranks
    if p.name == "none" and n != 1 and not own:
        raise ConfigError("hardware.devices", f"parallel=none runs one rank; got hardware."
                          f"devices={n} (use parallel=ddp, fsdp, hsdp, expert or expert_fsdp)")
    launched = world_size(n)
    if p.name == "none" and launched > 1 and not own:
        raise ConfigError("parallel", f"launched as {launched} ranks (torchrun), but "
                          "parallel=none runs one: set parallel=ddp, fsdp, hsdp, expert or "
                          "expert_fsdp")
    env = rank_env()
    local = env and env.local_world
    if local is not None and local != n:  # (the record's config and hash say devices)
        raise ConfigError("hardware.devices", f"torchrun's LOCAL_WORLD_SIZE is {local} (ranks "
                          f"on this node), but hardware.devices={n}: set hardware.devices={local}")
    if p.name in ("expert", "expert_fsdp"):
        if m.num_experts == 0:
            raise ConfigError("parallel", f"parallel={p.name} needs an MoE model "
                              f"(model={m.name} is dense: model.num_experts=0)")
        if m.pad_to_capacity and m.capacity_factor is not None:
            raise ConfigError("model.pad_to_capacity", f"not under parallel={p.name}: its "
                              "all-to-all sends the kept rows (no static shapes); leave it out")
        ep = ep_size(p, launched)
        if (launched if experts_whole(p) else data_ranks(p, launched)) % ep:
            ranks = (f"hardware.devices={n}" if launched == n else
                     f"world size {launched} (torchrun's WORLD_SIZE)")
            tp = "" if tp_size(p) == 1 or experts_whole(p) else f" over parallel.tp={p.tp}"
            raise ConfigError("parallel.expert_parallel_size", f"must divide the {ranks}{tp}, "
                              f"got {ep}")
        if m.num_experts % ep:
            raise ConfigError("parallel.expert_parallel_size", f"model.num_experts="
                              f"{m.num_experts} is not divisible by the expert-parallel size {ep}")
    if p.name == "ddp" and p.static_graph and p.accum_no_sync and cfg.train.grad_accum_steps > 1:
        raise ConfigError("parallel.static_graph", "not with train.grad_accum_steps > 1 and "
                          "parallel.accum_no_sync=true: DDP's static graph breaks under no_sync "
                          "(pytorch/pytorch#143580: a crash, then gradients never reduced); "
                          "set parallel.accum_no_sync=false or static_graph=false")
    _check_hook(cfg)
    _check_tp(cfg, launched)
    _check_pp(cfg, launched)
    _check_cp(cfg, launched)
    _check_hsdp(cfg, launched)
    if p.name in FSDP2:
        if p.cpu_offload and cfg.optim.name == "muon":
            raise ConfigError("parallel.cpu_offload", "not with optim=muon: its Newton-Schulz "
                              "step gathers whole matrices on the GPU (allowed: false)")
        if cfg.precision.name in ("fp16", "fp8"):
            raise ConfigError("precision", f"parallel={p.name} supports precision fp32, tf32 "
                              f"and bf16 here, not {cfg.precision.name}")


def _check_hook(cfg) -> None:
    """Check DDP's parallel.comm_hook and powersgd_rank; check_unread refuses them elsewhere."""
    p = cfg.parallel
    if p.name == "ddp" and p.comm_hook == "powersgd" and cfg.precision.grad_scaler:
        raise ConfigError("parallel.comm_hook", "powersgd not with loss scaling "
                          "(precision.grad_scaler): an overflowed step's inf stays in "
                          "PowerSGD's error feedback, and every later step is skipped (use "
                          "parallel.comm_hook=fp16 or bf16, or precision=bf16)")


def _check_tp(cfg, world: int) -> None:
    """parallel.tp: it divides the world and every size it splits."""
    from .config import tp_splits

    p, m, n = cfg.parallel, cfg.model, cfg.hardware.devices
    if p.async_tp and p.name in TP_OPTIONS:  # (elsewhere refused as unread)
        if cfg.hardware.device != "cuda":
            raise Unsupported("parallel.async_tp", f"needs CUDA GPUs (symmetric memory); "
                              f"this run's device is {cfg.hardware.device} (allowed: false)")
        if p.tp == 1:
            raise ConfigError("parallel.async_tp", "needs parallel.tp > 1 (allowed: false)")
    if tp_size(p) == 1:
        return
    if world % p.tp:
        ranks = f"hardware.devices={n}" if world == n else f"world size {world} (WORLD_SIZE)"
        raise ConfigError("parallel.tp", f"must divide the {ranks}, got {p.tp}")
    for key, size in tp_splits(m, p.tp):
        if size % p.tp:
            raise ConfigError("parallel.tp", f"must divide {key}={size} (it splits it over "
                              f"the tensor-parallel ranks), got {p.tp}")
    if p.sequence_parallel and cfg.train.seq_len % p.tp:
        raise ConfigError("parallel.sequence_parallel", f"train.seq_len={cfg.train.seq_len} "
                          f"does not split over parallel.tp={p.tp} ranks: set a multiple of "
                          f"{p.tp} or parallel.sequence_parallel=false")
    if p.name == "expert_fsdp" and p.etp not in (0, 1, p.tp):
        raise ConfigError("parallel.etp", f"must be 0 (split over the tp ranks) or 1 (whole), "
                          f"or parallel.tp={p.tp}, got {p.etp}")
    if experts_whole(p) and not p.sequence_parallel:
        raise ConfigError("parallel.etp", "1 runs the MoE on each rank's sequence shard: it "
                          "needs parallel.sequence_parallel=true")
    if experts_whole(p) and ep_size(p, world) % p.tp:
        raise ConfigError("parallel.expert_parallel_size", f"with parallel.etp=1 it counts "
                          f"the tp ranks: a multiple of parallel.tp={p.tp}, got "
                          f"{ep_size(p, world)}")
    if p.async_tp and cfg.train.compile == "off":
        raise ConfigError("parallel.async_tp", "needs train.compile (inductor fuses the TP "
                          "collectives with their matmuls; allowed: false)")
    if cfg.optim.name == "muon":
        raise ConfigError("parallel.tp", "not with optim=muon yet: its Newton-Schulz step "
                          "would see each rank's columns only (allowed: 1)")
    if p.cpu_offload:
        raise ConfigError("parallel.cpu_offload", "not with parallel.tp > 1 (allowed: false)")


def _check_pp(cfg, world: int) -> None:
    """parallel.pp: the stages divide the world and split the blocks; the micro-batches
    split train.micro_batch_size and suit the schedule."""
    from .config import pp_microbatches, pp_size, pp_stages, stages_per_rank

    p, n, layers = cfg.parallel, cfg.hardware.devices, cfg.model.num_layers
    if pp_size(p) == 1:
        return
    if world % (p.pp * tp_size(p)):
        ranks = f"hardware.devices={n}" if world == n else f"world size {world} (WORLD_SIZE)"
        by = f" x parallel.tp={p.tp}" if tp_size(p) > 1 else ""
        raise ConfigError("parallel.pp", f"parallel.pp={p.pp}{by} must divide the {ranks}")
    per_rank, single = stages_per_rank(p), p.pp_schedule in ("gpipe", "1f1b")
    if single != (per_rank == 1):
        raise ConfigError("parallel.pp_stages_per_rank", f"parallel.pp_schedule="
                          f"{p.pp_schedule} runs {'one stage' if single else 'at least 2'} "
                          f"a rank, got {per_rank} (allowed: null; gpipe and 1f1b run one, "
                          "interleaved_1f1b and zero_bubble more)")
    stages = p.pp * per_rank
    if stages > layers:
        raise ConfigError("parallel.pp", f"{stages} stages ({p.pp} ranks x {per_rank} a rank) "
                          f"for model.num_layers={layers} blocks: at most one stage a block")
    if p.pp_split is not None and p.pp_balance != "blocks":
        raise ConfigError("parallel.pp_balance", "splits the blocks where parallel.pp_split "
                          f"is null; got both (pp_balance={p.pp_balance}, pp_split="
                          f"{list(p.pp_split)})")
    first = pp_stages(cfg)
    if p.pp_split is not None and (len(first) != stages or any(
            b <= a for a, b in zip(first, first[1:])) or first[-1] >= layers):
        raise ConfigError("parallel.pp_split", f"needs {stages - 1} increasing first blocks "
                          f"of the stages after the first, each in 1..{layers - 1} (model."
                          f"num_layers={layers}), got {list(p.pp_split)}")
    micro, mbs = pp_microbatches(p), cfg.train.micro_batch_size
    if mbs % micro:
        raise ConfigError("parallel.pp_microbatches", f"must divide train.micro_batch_size="
                          f"{mbs} (each is a part of it), got {micro}")
    if p.pp_schedule == "1f1b" and micro < p.pp:
        raise ConfigError("parallel.pp_microbatches", f"1f1b needs at least one a stage "
                          f"(parallel.pp={p.pp}), got {micro}")
    rounds = max(1, micro // p.pp)
    if not single and micro % rounds:
        raise ConfigError("parallel.pp_microbatches", f"{p.pp_schedule} runs them in rounds "
                          f"of parallel.pp={p.pp}: fewer than pp or a multiple of "
                          f"{micro // rounds}, got {micro}")
    if p.reshard_after_forward and p.pp_schedule == "zero_bubble":
        raise ConfigError("parallel.reshard_after_forward", "zero_bubble computes weight "
                          "gradients after FSDP2 resharded the weights (wrong gradients): set "
                          "false (allowed: false)")
    if p.pp_schedule == "zero_bubble" and cfg.train.activation_checkpointing == "selective":
        raise ConfigError("train.activation_checkpointing", "zero_bubble's split backward "
                          "(inputs, then weights) runs twice over a block, which torch's "
                          "selective checkpointing refuses (allowed: none, full)")
    if p.reshard_after_forward and p.name == "expert_fsdp" and \
            cfg.train.activation_checkpointing == "selective":
        raise ConfigError("parallel.reshard_after_forward", "with parallel.pp > 1, selective "
                          "checkpointing and expert_fsdp's sharded experts, the recompute "
                          "finds the experts gathered where the forward gathered them: set "
                          "false (allowed: false)")
    if cfg.optim.name == "muon":
        raise ConfigError("optim", "muon not with parallel.pp > 1 yet: its Newton-Schulz "
                          "round-robin assumes every rank holds every matrix (allowed: adamw)")


def _check_cp(cfg, world: int) -> None:
    """parallel.cp: it divides the ranks left by tp and pp, and splits each sequence into
    2 x cp chunks (x tp under sequence parallel)."""
    from .config import cp_size, pp_size

    p, n, seq = cfg.parallel, cfg.hardware.devices, cfg.train.seq_len
    if cp_size(p) == 1:
        return
    if world % (p.cp * tp_size(p) * pp_size(p)):
        ranks = f"hardware.devices={n}" if world == n else f"world size {world} (WORLD_SIZE)"
        by = "".join(f" x parallel.{k}={v}" for k, v in (("tp", tp_size(p)), ("pp", pp_size(p)))
                     if v > 1)
        raise ConfigError("parallel.cp", f"parallel.cp={p.cp}{by} must divide the {ranks}")
    split = 2 * p.cp * (tp_size(p) if p.sequence_parallel else 1)
    if seq % split:
        raise ConfigError("parallel.cp", f"train.seq_len={seq} does not split into {split} "
                          f"equal chunks (2 x parallel.cp={p.cp}"
                          f"{' x parallel.tp' if split > 2 * p.cp else ''}): set a multiple "
                          f"of {split}")
    if cfg.train.attention != "auto":
        raise ConfigError("train.attention", f"parallel.cp={p.cp} runs its own attention "
                          "(SDPA over the gathered keys, a lower-right causal mask): allowed "
                          f"auto, got {cfg.train.attention}")
    if experts_whole(p):
        raise ConfigError("parallel.etp", "1 not with parallel.cp > 1 yet (allowed: 0)")
    if cfg.optim.name == "muon":
        raise ConfigError("parallel.cp", "not with optim=muon yet: its Newton-Schulz "
                          "round-robin assumes the data ranks' mesh (allowed: 1)")


def _check_hsdp(cfg, world: int) -> None:
    """Check parallel=hsdp's mesh, replicate x data ranks / replicate: replicate divides the
    data ranks (the world, or world / parallel.tp)."""
    from .config import hsdp_mesh

    p, n = cfg.parallel, cfg.hardware.devices
    if p.name != "hsdp":
        return
    ranks = f"hardware.devices={n}" if world == n else f"world size {world} (WORLD_SIZE)"
    if tp_size(p) > 1:
        ranks = f"data ranks ({ranks} / parallel.tp={p.tp})"
    replicate = hsdp_mesh(p, n, world)[0]
    if data_ranks(p, world) % replicate:
        got = p.replicate or f"null ({replicate}: world size // hardware.devices)"
        raise ConfigError("parallel.replicate", f"must divide the {ranks}, got {got}")


def parallel_here(cfg) -> None:
    p, hw, n = cfg.parallel, cfg.hardware, cfg.hardware.devices
    if p.name == "ddp" and p.comm_hook == "bf16" and hw.device == "cuda" and \
            p.backend in ("auto", "nccl"):  # (distributed.backend's choice)
        import torch.cuda.nccl as nccl

        if nccl.version() < (2, 10):  # (torch's bf16_compress_hook: NCCL > 2.9.6)
            raise Unsupported("parallel.comm_hook", f"bf16 needs NCCL >= 2.10 (bf16 "
                              f"all-reduce); this torch has {nccl.version()}")
    if p.name in FSDP2 and p.cpu_offload and hw.device != "cuda":
        raise Unsupported("parallel.cpu_offload", "FSDP CPU offload needs GPUs (it moves "
                          "parameters between GPU and CPU memory)")
    if hw.device == "cpu" and n > (os.cpu_count() or 1):
        raise Unsupported("hardware.devices", f"{n} ranks asked for, this machine has "
                          f"{os.cpu_count()} CPU cores (one gloo rank per core at most)")
    if p.backend == "nccl" and hw.device != "cuda":
        raise Unsupported("parallel.backend", "nccl needs CUDA GPUs; on CPU use gloo (or auto)")


def check_comm_from(cfg) -> None:
    """Read hardware.comm_from's record where the task's plan uses it: all of it checked."""
    from .config import KNOBS

    if cfg.hardware.comm_from and KNOBS["hardware.comm_from"].used_in(cfg.task):
        from .plan.roofline import comm_curves

        try:
            comm_curves(cfg.hardware.comm_from)
        except ValueError as e:
            raise ConfigError("hardware.comm_from", str(e)) from None


def check_calibration(cfg) -> None:
    """Read hardware.calibration's file where the task's plan uses it; auto only where this
    machine is the hardware planned."""
    from .config import KNOBS

    value = cfg.hardware.calibration
    if not value or not KNOBS["hardware.calibration"].used_in(cfg.task):
        return
    if value == "auto":
        here = "cuda" if torch.cuda.is_available() else "cpu"
        if cfg.hardware.device not in ("auto", here):
            raise ConfigError("hardware.calibration", f"auto is this machine's ({here}), not "
                              f"hardware={cfg.hardware.name}'s ({cfg.hardware.device}): name "
                              "a calibration made there (a file, or a shipped name)")
        return
    from .plan.calibration import CalibrationError, load, path_of

    try:
        load(path_of(value))
    except CalibrationError as e:
        raise ConfigError("hardware.calibration", str(e)) from None


def check_data(cfg, overrides=()) -> None:
    d = cfg.data
    for key, on in (("prefetch_factor", d.prefetch_factor is not None),
                    ("persistent_workers", d.persistent_workers)):
        if on and d.num_workers == 0:
            raise ConfigError(f"data.{key}", "needs loader workers: data.num_workers > 0 (0 "
                              "loads in the training process)")
    if d.name in ("markov", "tokens") and d.name != d.source:  # a label, not the source
        if _chosen(overrides, "data.source"):
            raise ConfigError("data.source", f"set by the data group: pick data={d.source} "
                              f"instead (data={d.name} is chosen, and labels the run)")
        raise ConfigError("data.name", f"'{d.name}' only labels the run; the data would come "
                          f"from data.source={d.source}: pick the group instead, data={d.name}")
    if d.source == "markov":
        vocab = cfg.model.vocab_size
        if d.branching > vocab >= 1 and not _chosen(overrides, "data.branching"):
            raise ConfigError("model.vocab_size", f"{vocab} is smaller than data.branching="
                              f"{d.branching} (the Markov chain's next tokens per token): set "
                              f"data.branching <= {vocab} too")
        if not 1 <= d.branching <= vocab:
            raise ConfigError("data.branching", f"must be in 1..model.vocab_size, got {d.branching}")
    if d.source == "tokens":
        from .data.tokens import check_token_file

        check_token_file(cfg)


def unread_keys(cfg, overrides=()) -> dict[str, tuple[tuple[str, ...], str, ConfigError]]:
    """Keys set that only another option reads, by each key's Knob.read_by in config.py.

    Returns key -> (the keys whose choice picks that option, the group first; the option
    that reads it; the error a run gives). A key is set where the command line sets it, or
    where it differs from its default unless Knob.unread == "keep" says a preset may have
    set it. At the value its group's chosen option gives it, such as logger=none's mode:
    disabled, it is no mistake."""
    from .config import DEFAULTS, KNOBS, TASKS

    out = {}
    get = lambda k: OmegaConf.select(cfg, k, throw_on_missing=False)  # noqa: E731
    for key, knob in KNOBS.items():
        if knob.unread_ok:
            continue
        if not knob.used_in(cfg.task):  # (only where the command line sets it: presets and
            if _chosen(overrides, key):  # the hardware's resolution fill keys for all tasks)
                value = OmegaConf.select(cfg, key, throw_on_missing=False,
                                         throw_on_resolution_failure=False)
                users = " or ".join(t for t in TASKS if knob.used_in(t))
                out[key] = (("task",), f"task={users}", ConfigError(
                    key, f"read by task={users} only; this run has task={cfg.task} (use "
                    f"task={users.split(' or ')[0]} {_shown(key, value)})"))
            continue
        if not knob.read_by or any(r.holds(get) for r in knob.read_by):
            continue
        value = get(key)
        chosen = _chosen(overrides, key)
        if not chosen and (knob.unread == "keep" or value == DEFAULTS[key]) or \
                _option_gives(cfg, key, value):
            continue
        r = knob.read_by[0]
        picks = tuple(dict.fromkeys(x for r in knob.read_by for x in (r.group, r.key)))
        now = ", ".join(f"{x.key}={get(x.key)}" for x in knob.read_by)
        use = f" (use {r.first()} {_shown(key, value)})" if r.values else ""
        out[key] = (picks, " or ".join(x.option() for x in knob.read_by), ConfigError(
            key, f"read by {' or '.join(x.option() for x in knob.read_by)} only; this run "
            f"has {now}{use}"))
    return out


def _shown(key: str, value) -> str:
    """key=value as the command line would give it."""
    from .config import override_word

    return override_word(key, value) if isinstance(value, str) else f"{key}=" + (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else
        json.dumps(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value))


def _option_gives(cfg, key: str, value) -> bool:
    """Whether the group's chosen option sets the key to this value.

    The option is the file under conf/ that <group>.name names."""
    group, leaf = key.split(".", 1)
    name = OmegaConf.select(cfg, f"{group}.name", default=None)
    path = CONF / group / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        return False
    own = OmegaConf.load(path)
    return leaf in own and own[leaf] == value


def check_unread(cfg, overrides=(), in_sweep: bool = False) -> None:
    """Refuse a key its group's chosen option does not read: surely another option was meant.

    A sweep job whose command line picks the group may leave it unread, since a sweep over
    both options gives the key to every job; sweep.checks refuses a sweep where no job reads
    it."""
    for picks, _, err in unread_keys(cfg, overrides).values():
        if not (in_sweep and any(_chosen(overrides, k) for k in picks)):
            raise err


def check_groups(cfg, overrides=(), in_sweep: bool = False) -> None:
    """Refuse model.topk_groups set on the command line where model.n_groups=1 reads none.

    A preset's value (tiny_deepseek's 2) is no mistake with n_groups=1 set after it, nor a
    sweep job's whose command line sweeps n_groups."""
    m = cfg.model
    if m.num_experts and m.n_groups == 1 and m.topk_groups != 1 and \
            _chosen(overrides, "model.topk_groups") and \
            not (in_sweep and _chosen(overrides, "model.n_groups")):
        raise ConfigError("model.topk_groups", f"read with model.n_groups > 1 only (group-"
                          f"limited routing); this run has model.n_groups=1 (set model."
                          f"n_groups, or leave model.topk_groups={m.topk_groups} out)")


def _chosen(overrides, group: str) -> bool:
    """Whether the command line picks the group's option with group=..."""
    return any(o.lstrip("+").split("=", 1)[0] == group for o in overrides)


def check_rendezvous(cfg) -> None:
    """Check a rank of a run with ranks has MASTER_ADDR and MASTER_PORT for its rendezvous.

    A process with RANK and WORLD_SIZE set joins torch's env:// rendezvous. Without them the
    environment is not ready, status error; this is checked after the config's mistakes."""
    from .tasks import TASKS

    if rank_env() is not None and TASKS[cfg.task].ranked(cfg):
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise NotReady(missing[0], f"RANK and WORLD_SIZE are set (a rank of torchrun or "
                           f"SLURM), but {' and '.join(missing)} not: set them (the rank-0 "
                           "host and a free port), or unset RANK and WORLD_SIZE to let "
                           "moe_exp launch its own ranks")


def check_workers(cfg) -> None:
    """Skip a run with more loader workers than this machine has cores.

    That is a limit of this machine, so it is checked after the config's mistakes."""
    n, env = cfg.data.num_workers, rank_env()
    ranks = env.local_world if env and env.local_world else cfg.hardware.devices  # here
    if n * ranks > (os.cpu_count() or 1):
        each = f" per rank x {ranks} ranks on this machine" if ranks > 1 else ""
        raise Unsupported("data.num_workers", f"{n} loader workers asked for{each}, this "
                          f"machine has {os.cpu_count()} CPU cores (a worker per core at most)")


def check_model_label(overrides) -> None:
    """Refuse a model.name that is another preset's name.

    model.name labels a custom model; another preset's name would label these sizes as that
    preset's in every table."""
    items = dict(o.lstrip("+").split("=", 1) for o in overrides if "=" in o)
    name = items.get("model.name")
    if name is None or name not in group_options("model"):
        return
    chosen = items.get("model") or default_choices()["model"]
    if name != chosen:
        raise ConfigError("model.name", f"'{name}' is another preset's name; these are "
                          f"model={chosen}'s sizes: pick model={name}, or name them anew")


def _gib(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def check_memory(cfg) -> None:
    """Skip a run whose memory lower bound exceeds hardware.memory_gib.

    The bounds are bench.flops': fp32 weights, gradients and optimizer state as sharded,
    then with them the activations no setting avoids. For task=comm it is the largest
    message's buffers (tasks/comm.py). A GPU holds one rank; a CPU's memory, all of which memory_gib counts,
    holds this machine's ranks together."""
    from .bench.flops import activation_lower_bound, state_lower_bound
    from .tasks import TASKS

    mem, m, p, n = cfg.hardware.memory_gib, cfg.model, cfg.parallel, cfg.hardware.devices
    if mem is None:
        return
    local = n if cfg.hardware.device == "cpu" else 1
    where = f"{n} CPU ranks together" if local > 1 else "one device"
    task = TASKS[cfg.task]
    if not task.trains:  # (task=comm checks its buffers: CommTask.check_here)
        return
    world = world_size(n) if p.name != "none" else 1
    need = state_lower_bound(cfg, world) * local / 2**30
    if need > mem:
        raise Unsupported("model", f"model={m.name} needs >= {_gib(need)} GiB on {where} for "
                          f"fp32 weights, gradients and optimizer state (optim="
                          f"{cfg.optim.name}) under parallel={p.name}; "
                          f"hardware={cfg.hardware.name} has {_gib(mem)} GiB (shard it: "
                          "parallel=fsdp or expert_fsdp over more devices, or a smaller model)")
    act = activation_lower_bound(cfg) * local / 2**30
    if need + act > mem and task.model:  # (tune_batch's probes check their own)
        t = cfg.train
        raise Unsupported("train.micro_batch_size", f"{t.micro_batch_size} x seq_len "
                          f"{t.seq_len} needs >= {_gib(act)} GiB of activations per step "
                          f"(the loss's fp32 log-probabilities, each layer's input) besides "
                          f"{_gib(need)} GiB of weights and optimizer state; hardware="
                          f"{cfg.hardware.name} has {_gib(mem)} GiB (a smaller "
                          "train.micro_batch_size, with train.grad_accum_steps for the batch)")


def validate(cfg, overrides=(), in_sweep: bool = False) -> None:
    """Raise on the first problem: every mistake first, then what this machine cannot do.

    A mistake raises ConfigError, status invalid, whatever else is wrong. Then come what this
    machine cannot do, Unsupported and skipped, and what it is not ready for, NotReady and
    error. Run after hardware.resolve(). in_sweep marks a sweep's job, see check_unread. Each
    task's own checks are its Task's, under tasks/."""
    from .hardware import check_device, device_here
    from .tasks import TASKS
    from .tracking import check_logger, logger_ready

    check_known_keys(cfg)
    check_model_label(overrides)
    check_finite(cfg)
    check_choices(cfg)
    check_ranges(cfg)
    check_device(cfg)
    check_model(cfg.model)
    check_train(cfg)
    check_precision(cfg)
    check_dispatch(cfg)
    check_mla_kernel(cfg)
    check_parallel(cfg)
    check_unread(cfg, overrides, in_sweep)
    check_groups(cfg, overrides, in_sweep)
    check_data(cfg, overrides)
    check_comm_from(cfg)
    check_calibration(cfg)
    task = TASKS[cfg.task]
    try:
        task.check(cfg)
    except NothingLeft as e:  # (not a mistake: said once every mistake is looked for)
        left = e
    else:
        left = None
    check_logger(cfg)
    if left is not None:
        raise left
    if not task.here:  # (planned for the hardware named, on fake tensors: this machine
        return logger_ready(cfg)  # need not have it)
    # what this machine cannot do, or is not ready for (a sweep's row says which)
    device_here(cfg)
    precision_here(cfg)
    compile_here(cfg)
    attention_here(cfg)
    dispatch_here(cfg)
    parallel_here(cfg)
    task.check_here(cfg)
    check_workers(cfg)
    check_memory(cfg)
    check_rendezvous(cfg)
    logger_ready(cfg)
