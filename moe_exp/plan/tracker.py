"""The plan's memory tracker: torch's MemTracker, keeping the step's peak only.

Under FSDP2 it is FSDPMemTracker. A plan's fake step and a bench run's real step on CPU are
tracked alike."""
from __future__ import annotations

import torch

from ..config import FSDP2


class _PeakOnly:
    """A tracker mixin that keeps the step's peak only.

    MemTracker updates every module's own peak at every op, a loop over the modules that
    costs a big model's plan much of its time, and a plan does not read those peaks. Where
    torch's tracker lacks these internals, its own update runs. While `hidden`, the ops
    run untracked (a compiled plan's fused ops: plan/compiled.py)."""

    hidden = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.hidden:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        if not all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            return super()._update_peak_stats(peak_state)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # (tensor parallel's split experts run on their shards' local views, which
        # functional_call swaps in: not leaves, no grad hooks; their gradients reach the
        # DTensor shards, tracked and hooked on the module above)
        import warnings

        leaves = all(p.is_leaf for p in module.parameters())
        with warnings.catch_warnings():  # (it reads their .grad: None, with a warning)
            warnings.filterwarnings("ignore", message=".*not a leaf Tensor")
            return super()._track_module_params_and_buffers(module,
                                                            install_grad_hooks and leaves)

    def restart_peak(self) -> None:
        """The peak from now on: what is live now (a step's phases each have their own)."""
        if all(hasattr(self, a) for a in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap")):
            for dev, snap in self._curr_mem_snap.items():
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)


def _lenient(tracker, split: bool) -> None:
    """A pipeline's tracker: its schedule runs backwards inside the model's forward, so a
    module's forward can end after a backward took it off ModTracker's stack, which then
    raises ("The Module hierarchy tracking is wrong"). The hierarchy is not read here: its
    forward ends are let pass, and a module's later calls in a step (each micro-batch's)
    keep its first call's figures. split: the schedule splits its backwards (zero
    bubble's), see `enter`."""
    mods = tracker._mod_tracker

    def pop(w_mod, name, is_bw):
        def fn(*args):
            if mods._user_post_bw_hook is not None and is_bw:
                mods._user_post_bw_hook(w_mod(), args)
            if name in mods.parents:
                mods._active_module_cnt[name] -= 1
                if mods._active_module_cnt[name] == 0:
                    mods.parents.remove(name)
        return fn

    def pre_fw(module, inputs):  # (a stage's next micro-batch: MemTracker's per-module
        if module in tracker.memory_tracking and not mods.is_bw:  # figures are one call's)
            return None
        return real(module, inputs)

    def enter(module, inputs):  # (a stage's received activation: a leaf needing its
        # gradient, whose node torch cannot look up inside autograd.grad, zero bubble's split
        # backward; ModTracker's hook over a module's inputs does: handed on detached, the
        # module leaves the hierarchy at the backward's end, as one without such inputs)
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten(inputs)
        return mod_pre(module, tree_unflatten([a.detach() if isinstance(a, torch.Tensor)
                                               and a.requires_grad and a.is_leaf else a
                                               for a in flat], spec))

    if all(hasattr(mods, a) for a in ("_get_pop_fn", "_active_module_cnt", "parents",
                                      "_user_post_bw_hook", "_fw_pre_hook")) and \
            hasattr(tracker, "memory_tracking"):
        mods._get_pop_fn, real, mod_pre = pop, tracker._pre_fw_hook, mods._fw_pre_hook
        tracker._pre_fw_hook = pre_fw
        if split:
            mods._fw_pre_hook = enter


def step_tracker(cfg, applied, optimizer, tokens=None):
    """torch's memory tracker for the run's strategy, keeping the peak only.

    Under fsdp/hsdp it is FSDP2's own tracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    inputs = () if tokens is None else (tokens,)
    piped = getattr(applied.model, "pipelined", False)  # (its stages are each FSDP2's root:
    # MemTracker, their gathers counted as temporaries)
    if cfg.parallel.name in FSDP2 and not piped:
        tracker = type("Tracker", (_PeakOnly, FSDPMemTracker), {})(applied.model, optimizer)
        tracker.track_inputs(inputs)
    else:
        tracker = type("Tracker", (_PeakOnly, MemTracker), {})()
        tracker.track_external(applied.model, optimizer, *inputs)
        if piped:
            _lenient(tracker, cfg.parallel.pp_schedule == "zero_bubble")
    return tracker
