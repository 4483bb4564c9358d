"""train.checkpoint_every / resume_from: saves and loads the run's whole training state.

The state goes through torch.distributed.checkpoint (DCP), sharded as the run holds it:
FSDP's DTensors, and an expert parallel rank's own experts under its own keys. What a save
and a load cost is measured too.

A checkpoint is a dir `step_<steps done>` holding DCP's files, one `rank<r>.pt` per rank
with its RNG states and, written last, `loop.pt`: the step, the run's identity, the
schedule's and the scaler's state and the loss history. Without loop.pt a checkpoint is
incomplete."""
from __future__ import annotations

import shutil
import signal
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, NothingLeft

DONE = "loop.pt"
EP_KEY = ".experts.local."  # expert parallelism's shard (optimizations/parallel/expert.py)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def root(cfg, out_dir: Path) -> Path:
    """Where this run's checkpoints go: checkpoints/ in its dir, or under checkpoint_dir.

    Under train.checkpoint_dir, the subdir is named by the run dir's last two parts: a
    single run's date and time, or a sweep's time and job."""
    if cfg.train.checkpoint_dir is None:
        return out_dir / "checkpoints"
    return Path(cfg.train.checkpoint_dir).expanduser() / "-".join(out_dir.resolve().parts[-2:])


def find(path: str, key: str = "train.resume_from") -> Path:
    """The complete checkpoint that path names; `key` is the knob it came from, for errors.

    path is the checkpoint's dir, a dir whose latest complete step_* is taken, or a run dir
    whose checkpoints/ is searched the same way."""
    p = Path(path).expanduser()
    for base in (p, p / "checkpoints"):
        if (base / DONE).is_file():
            return base
        steps = sorted(x for x in base.glob("step_*") if (x / DONE).is_file())
        if steps:
            return steps[-1]
    raise ConfigError(key, f"no complete checkpoint in {p} (a step_* dir "
                      f"with {DONE}, a dir of them, or a run dir with checkpoints/)")


def meta(path: Path, key: str = "train.resume_from") -> dict:
    """A checkpoint's loop.pt, and its files checked: a ConfigError naming what is wrong.

    Read with weights_only; the DCP files its .metadata lists must be there, whole, and each
    rank's rank<r>.pt too. `key`: the knob that named the checkpoint, for the error."""
    f = path / DONE
    try:
        loop = torch.load(f, weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated, empty, garbage, an unsafe pickle
        raise ConfigError(key, f"{f} is not a checkpoint's {DONE} ({_why(e)})") from None
    why = _loop_problem(loop) or _files_problem(path)
    if why:
        raise ConfigError(key, f"{path} is not a whole checkpoint: {why}")
    return loop


def _why(e: BaseException) -> str:
    """A load's failure in a few words: torch's weights-only refusal by its reason."""
    text = str(e)
    if "WeightsUnpickler error:" in text:  # (after a paragraph on torch 2.6's default)
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0][:120]
        return f"not a torch file of plain tensors and values: {reason}"
    if isinstance(e, EOFError):
        return "empty or cut short"
    first = (text.strip().splitlines() or [""])[0][:120]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _loop_problem(loop) -> str | None:
    """What a loop.pt lacks, or None."""
    if not isinstance(loop, dict):
        return f"{DONE} holds a {type(loop).__name__}, not a run's loop state"
    step = loop.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"{DONE}'s step is {step!r}, not a count of steps"
    if not isinstance(loop.get("identity"), dict) or \
            not isinstance(loop["identity"].get("model"), dict):
        return f"{DONE} has no identity of the run that saved it"
    if not isinstance(loop.get("scheduler"), dict):
        return f"{DONE} has no schedule state"
    if not (loop.get("scaler") is None or isinstance(loop["scaler"], dict)):
        return f"{DONE}'s scaler state is a {type(loop['scaler']).__name__}"
    history = loop.get("history")
    if not isinstance(history, dict) or any(
            not isinstance(history.get(k), list) for k in ("losses", "lrs", "grad_norms")):
        return f"{DONE} has no loss history"
    return None


def _files_problem(path: Path) -> str | None:
    """What of DCP's files and the ranks' rank<r>.pt is missing or cut short, or None."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
        items = list(storage.values())
    except Exception as e:  # noqa: BLE001 - missing, truncated or not DCP's metadata
        return f"its DCP .metadata cannot be read ({_why(e)})"
    sizes: dict[str, int] = {}
    for item in items:
        end = getattr(item, "offset", 0) + getattr(item, "length", 0)
        name = getattr(item, "relative_path", None)
        if not isinstance(name, str):
            return "its DCP .metadata lists no files"
        sizes[name] = max(sizes.get(name, 0), end)
    for name, end in sorted(sizes.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size < end:
            return f"{name} holds {f.stat().st_size:,} bytes, {end:,} expected"
    if not any(path.glob("rank*.pt")):
        return "no rank<r>.pt (the ranks' RNG states)"
    return None


def identity(cfg, world: int) -> dict:
    """What a resumed run must share with the checkpoint's to continue it exactly."""
    from ..config import plain

    t, p = cfg.train, cfg.parallel
    model = plain(cfg.model)
    model.pop("dispatch")  # (how experts run, not what they are: "auto" is resolved in a run)
    return {"model": model, "optim": plain(cfg.optim), "precision": cfg.precision.name,
            "parallel": p.name, "world": world, "expert_parallel_size": p.expert_parallel_size,
            "data": cfg.data.source, "train.seed": t.seed, "train.seq_len": t.seq_len,
            "train.micro_batch_size": t.micro_batch_size,
            "train.grad_accum_steps": t.grad_accum_steps,
            "train.steps + train.warmup_steps": t.steps + t.warmup_steps}


def _differ(mine: dict, theirs: dict) -> tuple[str, str]:
    """The keys two config dicts differ in: (theirs, mine) as 'k=v, ...'."""
    keys = sorted(k for k in set(mine) | set(theirs) if theirs.get(k) != mine.get(k))
    return (", ".join(f"{k}={theirs.get(k)}" for k in keys),
            ", ".join(f"{k}={mine.get(k)}" for k in keys))


def check_dir(where: str | None) -> None:
    """train.checkpoint_dir: null (the run dir), or a dir this process can write or make."""
    import tempfile

    if where is None:
        return
    if not where.strip():
        raise ConfigError("train.checkpoint_dir", "empty: checkpoints would go into the "
                          "current dir; name a dir, or leave it out (null: the run dir's "
                          "checkpoints/)")
    d = Path(where).expanduser().absolute()
    have = next(p for p in (d, *d.parents) if p.exists())
    if not have.is_dir():
        raise ConfigError("train.checkpoint_dir", f"{have} is not a directory")
    try:  # (a file made and gone: root passes os.access on a read-only disk)
        tempfile.TemporaryFile(dir=have).close()
    except OSError as e:
        raise ConfigError("train.checkpoint_dir", f"cannot write in {have}: {e.strerror}"
                          + ("" if have == d else f" (to make {d})")) from None


def check(cfg, world: int, profiled: int) -> None:
    """Check train.checkpoint_dir, and train.resume_from, before any work.

    It must name a checkpoint that this configuration saved, early enough to leave a
    measured step."""
    t = cfg.train
    if t.checkpoint_every:
        check_dir(t.checkpoint_dir)
    if t.resume_from is None:
        return
    path = find(t.resume_from)
    m, mine = meta(path), identity(cfg, world)
    for key, value in mine.items():
        if m["identity"].get(key) != value:
            theirs = m["identity"].get(key)
            if isinstance(value, dict):  # (model, optim: the keys that differ)
                theirs, value = _differ(value, theirs or {})
            raise ConfigError("train.resume_from", f"{path} was saved with {key} {theirs}; this "
                              f"run has {value} (a resumed run continues the same one)")
    last = t.steps + t.warmup_steps - profiled
    if m["step"] >= last + profiled:  # a finished run's last checkpoint
        raise NothingLeft("train.resume_from", f"{NothingLeft.WHAT}: {path} is at step "
                          f"{m['step']}, this run's last (train.warmup_steps + train.steps ="
                          f" {last + profiled}): its record is in its run dir")
    if m["step"] >= last:
        raise ConfigError("train.resume_from", f"{path} is at step {m['step']}: no measured "
                          f"step is left before step {last} (resume from an earlier "
                          "checkpoint)")


def check_weights(cfg) -> Path:
    """The checkpoint infer.checkpoint names, checked to hold this model and to be loadable.

    It must be saved without expert parallelism, whose ranks each hold other experts."""
    path = find(cfg.infer.checkpoint, "infer.checkpoint")
    mine, theirs = identity(cfg, 1)["model"], meta(path, "infer.checkpoint")["identity"]
    if theirs["model"] != mine:
        old, new = _differ(mine, theirs["model"])
        raise ConfigError("infer.checkpoint", f"{path} holds another model ({old}; this run "
                          f"has {new})")
    if str(theirs["parallel"]).startswith("expert"):
        raise ConfigError("infer.checkpoint", f"{path} was saved under parallel="
                          f"{theirs['parallel']} (each rank's own experts): not loadable "
                          "into one process yet")
    return path


def load_weights(model, path: Path) -> float:
    """Load the model's weights from checkpoint path into one process; returns seconds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, \
        set_model_state_dict

    t0 = time.perf_counter()
    warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or")
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    return time.perf_counter() - t0


def _ep_rank(model) -> int | None:
    from ..optimizations.parallel.expert import ExpertParallel

    return next((m.rank for m in model.modules() if isinstance(m, ExpertParallel)), None)


def _rename(keys: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in keys.items()}


class Checkpointer:
    """Saves every train.checkpoint_every steps and on SIGTERM, loads train.resume_from.

    It keeps its own figures; figures() returns them."""

    def __init__(self, cfg, applied, optimizer, scheduler, out_dir: Path | None, rank: int,
                 world: int):
        t = cfg.train
        # DCP in one process warns at every save and load (async_save's in its thread) that
        # it assumes one process
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or")
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, applied.model, optimizer, \
            scheduler
        self.scaler, self.rank, self.world = applied.scaler, rank, world
        self.every, self.keep, self.asynchronous = t.checkpoint_every, t.checkpoint_keep, \
            t.checkpoint_async
        self.root = root(cfg, out_dir) if self.every and out_dir is not None else None
        ep = _ep_rank(self.model)  # each EP rank's experts: keys of their own (DCP keeps one
        # tensor per key: the ranks' different experts under one key would be one rank's)
        self.ep_key = None if ep is None else f".experts.local_ep{ep}."
        # a pipeline's ranks hold different parameters: the optimizer's groups flattened to
        # keys per parameter (one key per group would keep one rank's list), as torchtitan's
        self.flat = getattr(self.model, "pipelined", False)
        self.blocking, self.total, self.sizes, self.load_s = [], [], [], None
        self.pending, self.last_path, self.sigterm = None, None, False
        self.resumed = None  # load's loop.pt: the loop starts at its step
        self.error = None  # an async save's failure to complete, for wait() to raise
        self.group = dist.new_group(backend="gloo") if (
            self.asynchronous and self.every and dist.is_initialized()) else None
        self._handler = None

    # the state
    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer, options=self._options())
        if self.ep_key:
            model = _rename(model, EP_KEY, self.ep_key)
            optim = self._rename_optim(optim, EP_KEY, self.ep_key)
        return {"model": model, "optim": optim}

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.flat)

    def _rename_optim(self, optim: dict, old: str, new: str) -> dict:
        return _rename(optim, old, new) if self.flat else \
            {**optim, "state": _rename(optim["state"], old, new)}

    def _loop_state(self, step: int, history: dict) -> dict:
        return {"step": step, "identity": identity(self.cfg, self.world),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "history": {k: list(v) for k, v in history.items()}}

    def _rng(self) -> dict:
        return {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and
                torch.cuda.is_initialized() else None}

    # saving
    def due(self, done: int) -> bool:
        return bool(self.root and done % self.every == 0)

    def save(self, step: int, history: dict, blocking: bool = False) -> Path:
        """Save a checkpoint after `step` steps, once the previous async save has finished.

        Returns its dir; its loop.pt is written once every rank's files are."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()
        path = step_dir(self.root, step)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(self._rng(), path / f"rank{self.rank}.pt")
        state, loop = self._state(), self._loop_state(step, history)
        if self.asynchronous and not blocking:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=self.group)
            fut = getattr(fut, "upload_completion", fut)  # (torch 2.13 may wrap it)
            done = threading.Event()  # (result() returns before the callbacks have run)
            fut.add_done_callback(lambda f: self._done(f, path, loop, t0, done))
            self.pending = fut, done
        else:
            dcp.save(state, checkpoint_id=path)
            self._done(None, path, loop, t0)
        self.blocking.append(time.perf_counter() - t0)
        if self.pending is None:  # (a save that blocked: its total is its blocking time)
            self.total.append(self.blocking[-1])
        return path

    def _done(self, fut, path: Path, loop: dict, t0: float, done=None) -> None:
        """Finish a save once DCP has every rank's files, then set `done`.

        Rank 0's save returns after all ranks wrote. Finishing writes loop.pt last, takes the
        size and removes the older checkpoints."""
        try:
            if fut is None or fut.exception() is None:  # (else wait() raises it)
                self._finish(fut, path, loop, t0)
        finally:
            if done is not None:
                done.set()

    def _finish(self, fut, path: Path, loop: dict, t0: float) -> None:
        # (no lock: a save waits for the one in flight before it starts)
        if fut is not None:
            self.total.append(time.perf_counter() - t0)
        if self.rank != 0:
            return
        try:
            self._complete(path, loop)
        except Exception as e:  # noqa: BLE001 - (async: this thread's) raised by wait()
            if fut is None:
                raise
            self.error = e

    def _complete(self, path: Path, loop: dict) -> None:
        """On rank 0, once every rank's files are written: write loop.pt, take the size, prune.

        loop.pt is written atomically; checkpoints past train.checkpoint_keep are removed."""
        tmp = path / (DONE + ".tmp")
        torch.save(loop, tmp)
        tmp.replace(path / DONE)
        self.sizes.append(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        self.last_path = path
        if self.keep:
            older = sorted(x for x in self.root.glob("step_*") if x.name < path.name)
            for x in older[:max(0, len(older) - self.keep + 1)]:
                (x / DONE).unlink(missing_ok=True)  # first: a prune cut short leaves no
                shutil.rmtree(x, ignore_errors=True)  # checkpoint that looks whole

    def wait(self) -> None:
        """Wait for the async save in flight; its error, or its loop.pt's, is raised here."""
        if self.pending is not None:
            (fut, done), self.pending = self.pending, None
            fut.result()
            done.wait()
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    # loading
    def load(self, path: Path) -> dict:
        """Load checkpoint path into the model, optimizer, schedule, scaler and RNG.

        Returns its loop.pt, which holds the step and the history."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t0 = time.perf_counter()
        loop = meta(path)
        f = path / f"rank{self.rank}.pt"
        try:  # (first: damage found before the weights are overwritten)
            rng = torch.load(f, weights_only=True)
            rng["cpu"], rng["cuda"]  # noqa: B018 - both must be there
        except Exception as e:  # noqa: BLE001 - missing, cut short, not this rank's state
            raise RuntimeError(f"{f} is not a rank's RNG state ({_why(e)})") from None
        state = self._state()  # (DCP loads into these tensors, in place)
        dcp.load(state, checkpoint_id=path)
        model, optim = state["model"], state["optim"]
        if self.ep_key:
            model = _rename(model, self.ep_key, EP_KEY)
            optim = self._rename_optim(optim, self.ep_key, EP_KEY)
        set_state_dict(self.model, self.optimizer, model_state_dict=model,
                       optim_state_dict=optim, options=self._options())
        self.scheduler.load_state_dict(loop["scheduler"])
        if self.scaler and loop["scaler"]:
            self.scaler.load_state_dict(loop["scaler"])
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        self.load_s = time.perf_counter() - t0
        self.resumed = loop
        return loop

    # SIGTERM (spot preemption, SLURM's time limit): a checkpoint at the next step's end
    def __enter__(self):
        if self.root is not None and threading.current_thread() is threading.main_thread():
            self._handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True

    def __exit__(self, *exc) -> None:
        if self._handler is not None:
            signal.signal(signal.SIGTERM, self._handler)
            self._handler = None
        if exc[0] is None:
            self.wait()
        elif self.pending is not None:  # (a failed run: the save in flight may finish)
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - the run's own error is the one to report
                pass

    def stop_requested(self, agree: bool) -> bool:
        """Whether a SIGTERM came.

        With agree, every rank learns whether any rank got one. That is a collective, so it
        must be called at the same step on every rank."""
        if not agree or not dist.is_initialized():
            return self.sigterm
        from ..distributed import all_max, collective_device

        device = next(self.model.parameters()).device
        return bool(all_max([float(self.sigterm)], collective_device(device))[0])

    def figures(self) -> tuple[dict, dict]:
        """The record's checkpoint figures and their null reasons."""
        import statistics

        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        rec = {"checkpoint_saves": len(self.blocking) if self.root else None,
               "checkpoint_save_s": med(self.blocking), "checkpoint_save_total_s": med(self.total),
               "checkpoint_gib": self.sizes[-1] / 2**30 if self.sizes else None,
               "checkpoint_path": str(self.last_path) if self.last_path else None,
               "checkpoint_load_s": self.load_s}
        off = "train.checkpoint_every=0" if not self.every else \
            "no checkpoint saved (the run ended before its first)" if self.root \
            else "written by rank 0"
        why = {k: off for k, v in rec.items() if v is None}
        if self.load_s is None:
            why["checkpoint_load_s"] = "train.resume_from=null"
        if self.rank and self.root:  # (rank 0 writes the record)
            why.pop("checkpoint_load_s", None)
        return rec, why
