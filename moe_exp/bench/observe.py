"""What a run records beyond its speed: the held-out loss, the gradient norm, NVML's
figures and train.profile's trace (the loop measures them; these put them in the record,
each null with its reason)."""
from __future__ import annotations

import math
from pathlib import Path

import torch


def record_profile(cfg, rec: dict, res, device: torch.device, out_dir: Path | None) -> None:
    """NVML's figures; train.profile's trace, table, shares and memory snapshot (written by
    rank 0 into the run's dir)."""
    from .profile import FIELDS, write

    gpu = dict(res.gpu)
    rec["null_reasons"].update(gpu.pop("null_reasons", {}))
    rec.update(gpu)
    rec.update(dict.fromkeys(FIELDS))
    if res.profiler is not None and out_dir is not None:
        rec.update(write(res.profiler, res.memory_snapshot, out_dir, device.type == "cuda"))
    for k in FIELDS:
        if rec[k] is None:
            rec["null_reasons"][k] = (
                "train.profile=false" if not cfg.train.profile else
                "on CUDA only" if k == "memory_snapshot" else "written by rank 0 only")


SPIKE = 10  # a step's gradient norm this many times the run's median: the summary warns


def record_grad_norm(cfg, rec: dict, res) -> None:
    """Every step's gradient norm before clipping, their median, and the largest spike."""
    import statistics

    norms = [g if math.isfinite(g) else None for g in res.grad_norms]
    seen = [g for g in norms if g is not None]
    rec.update(grad_norms=norms if seen else None,
               grad_norm=statistics.median(seen) if seen else None, grad_norm_spike=None)
    if not seen:
        rec["null_reasons"]["grad_norm"] = rec["null_reasons"]["grad_norms"] = (
            "optim.grad_clip=0: the norm is computed only to clip" if cfg.optim.grad_clip <= 0
            else "no finite gradient norm (fp16 overflow steps)")
    for i in range(3, len(norms)):  # the first step at SPIKE x the median of the 20 before
        before = [g for g in norms[max(i - 20, 0):i] if g is not None]
        if norms[i] is not None and before and norms[i] > SPIKE * statistics.median(before):
            rec["grad_norm_spike"] = [i, norms[i] / statistics.median(before)]
            break
    if rec["grad_norm_spike"] is None:
        rec["null_reasons"]["grad_norm_spike"] = f"no step's norm reached {SPIKE}x the median " \
                                                 "of the 20 steps before it"


def record_eval(cfg, rec: dict, res) -> None:
    """The held-out loss, its curve, its gap to the floor, and the time to train.target_loss
    (steps x the median measured step: compile and evals left out)."""
    t, why = cfg.train, rec["null_reasons"]
    curve = res.eval_losses
    rec.update(eval_losses=curve or None, eval_loss=curve[-1][1] if curve else None)
    if not curve:
        why["eval_loss"] = why["eval_losses"] = (
            "train.eval_sequences=0" if not t.eval_sequences else
            "data=tokens: no held-out split (data.heldout=true holds the file's last "
            "train.eval_sequences sequences out of training)")
    floor = rec["loss_floor"]
    rec["eval_gap"] = rec["eval_loss"] - floor if None not in (rec["eval_loss"], floor) else None
    if rec["eval_gap"] is None:
        why["eval_gap"] = why.get("eval_loss") or why["loss_floor"]
    n = res.steps_to_target
    rec["steps_to_target"] = n
    rec["seconds_to_target"] = n * rec["step_time_ms"] / 1e3 if n and rec["step_time_ms"] \
        else None
    if n is None:
        best = min((v for _, v in curve), default=None)
        why["steps_to_target"] = why["seconds_to_target"] = (
            "train.target_loss not set" if t.target_loss is None else
            f"eval loss {best:.4f} at best in {len(res.losses)} steps: train.target_loss="
            f"{t.target_loss} not reached")


def record_checkpoints(rec: dict, ckpt, res) -> None:
    """The checkpoints' figures (bench.checkpoint) and the share of the measured window
    their saves blocked (tokens_per_s_wall holds that time; the median step does not)."""
    figures, why = ckpt.figures()
    rec.update(figures, resumed_from_step=ckpt.resumed["step"] if ckpt.resumed else None)
    rec["checkpoint_share"] = res.checkpoint_s / res.wall_s if ckpt.root and res.wall_s \
        else None
    why.setdefault("checkpoint_share", why.get("checkpoint_saves") or "no measured window")
    if rec["resumed_from_step"] is None:
        why["resumed_from_step"] = "train.resume_from=null"
    for k, v in why.items():
        if rec.get(k) is None:
            rec["null_reasons"][k] = v
