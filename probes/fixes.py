"""Fix actions as the job applies them, between two steps, within the bounds the job allowed.

Each action validates its parameters against bounds (the job's, which the server cannot widen),
applies itself, and returns the values before and after, plus an ``undo`` for ``revert_fix``. The
actions of other modules build on the helpers here; probes/registry.py lists them all (ACTIONS).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from .stats import sharded

Undo = Callable[[], dict]


class FixRejected(Exception):
    """The job will not apply this fix: not allowed, or a parameter out of bounds."""


@dataclass
class Applied:
    before: dict
    after: dict
    undo: Undo | None = None


@dataclass
class Deferred:
    """An action that needs what the next forward pass shows (which units are dead, say). The probe calls
    ``finish()`` at each step boundary until it returns an ``Applied`` (or raises ``FixRejected``), then
    acknowledges; after ``max_steps`` boundaries without one it calls ``cancel()`` and reports a failure."""

    finish: Callable[[], Applied | None]
    cancel: Callable[[], None]
    max_steps: int = 5
    waited: int = 0


@dataclass
class Target:
    """What an action may change: the model, its optimizer, and the probe itself."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    probe: Any
    hooks: dict[str, Any] = field(default_factory=dict)  # fix_id -> optimizer hook handle
    # LR schedulers whose base_lrs an lr fix scales too, so that their next step does not undo it.
    schedulers: list[Any] = field(default_factory=list)
    # When set (Probe.defer_step_fixes), gradient fixes run from Probe.before_optimizer_step, not as
    # optimizer step pre-hooks: fix_id -> function.
    deferred: dict[str, Callable[[], None]] | None = None


def number(params: Mapping, key: str, lo: float, hi: float, default: float | None = None) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FixRejected(f"parameter {key!r} must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise FixRejected(f"parameter {key!r}={value} is outside the job's bounds [{lo}, {hi}]")
    return float(value)


def need_optimizer(t: Target) -> torch.optim.Optimizer:
    if t.optimizer is None:
        raise FixRejected("this action needs the optimizer; pass it to probes.attach(model, optimizer)")
    return t.optimizer


def _groups(opt: torch.optim.Optimizer, params: Mapping) -> list[int]:
    groups = params.get("groups")
    if groups is None:
        return list(range(len(opt.param_groups)))
    if not isinstance(groups, list) or not all(isinstance(g, (int, float)) and int(g) == g for g in groups):
        raise FixRejected("parameter 'groups' must be a list of param-group indices")
    bad = [int(g) for g in groups if not 0 <= int(g) < len(opt.param_groups)]
    if bad:
        raise FixRejected(f"no param group {bad}; the optimizer has {len(opt.param_groups)}")
    return [int(g) for g in groups]


def _set_lrs(opt: torch.optim.Optimizer, lrs: dict[int, float]) -> None:
    for i, lr in lrs.items():
        group = opt.param_groups[i]
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _scale_base_lrs(t: Target, before: dict[int, float], after: dict[int, float]) -> Callable[[], None]:
    """Scale each scheduler's base_lrs by after/before, so a LambdaLR-style schedule keeps its shape."""
    saved = []
    for sched in t.schedulers:
        base = getattr(sched, "base_lrs", None)
        if not isinstance(base, list):
            continue
        saved.append((base, list(base)))
        for i, lr in before.items():
            if i < len(base) and lr > 0:
                base[i] = base[i] * after[i] / lr

    def restore() -> None:
        for base, old in saved:
            base[:] = old

    return restore


def _lr_change(t: Target, params: Mapping, new_lr: Callable[[float], float]) -> Applied:
    opt = need_optimizer(t)
    idx = _groups(opt, params)
    before = {i: float(opt.param_groups[i]["lr"]) for i in idx}
    after = {i: new_lr(lr) for i, lr in before.items()}
    _set_lrs(opt, after)
    restore_schedulers = _scale_base_lrs(t, before, after)

    def undo() -> dict:
        _set_lrs(opt, before)
        restore_schedulers()
        return {"lr": [before[i] for i in idx]}

    return Applied({"lr": [before[i] for i in idx]}, {"lr": [after[i] for i in idx]}, undo)


def lr_scale(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    factor = number(params, "factor", bounds.get("min_factor", 1e-4), bounds.get("max_factor", 10.0))
    return _lr_change(t, params, lambda lr: lr * factor)


def set_lr(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    lr = number(params, "lr", bounds.get("min_lr", 0.0), bounds.get("max_lr", 10.0))
    return _lr_change(t, params, lambda _: lr)


class _DeferredHandle:
    def __init__(self, hooks: dict, key: str) -> None:
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def _step_pre_hook(t: Target, fix_id: str, fn: Callable[[], None]) -> Undo:
    opt = need_optimizer(t)

    def hook(*_: Any) -> None:  # a step pre-hook that returns anything but None replaces the step's args
        fn()

    if t.deferred is not None:
        t.deferred[fix_id] = fn
        handle: Any = _DeferredHandle(t.deferred, fix_id)
    else:
        handle = opt.register_step_pre_hook(hook)
    t.hooks[fix_id] = handle

    def undo() -> dict:
        handle.remove()
        t.hooks.pop(fix_id, None)
        return {}

    return undo


def _trainable(t: Target) -> list[torch.nn.Parameter]:
    opt = need_optimizer(t)
    return [p for g in opt.param_groups for p in g["params"]]


def _refuse_if_sharded(ps: list[torch.nn.Parameter], what: str, instead: str) -> None:
    """A fix whose arithmetic spans a whole gradient cannot run on a sharded model (FSDP2's DTensor): there it
    is an all-reduce, which every rank must enter at the same step, and a fix reaches each rank at its own."""
    if any(sharded(p) for p in ps):
        raise FixRejected(f"the model is sharded across ranks (FSDP2): {what} needs an all-reduce that every rank "
                          f"enters at the same step, and a live fix reaches each rank at its own step; {instead}")


def grad_clip(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    ps = _trainable(t)
    if "clip_value" not in params:  # clipping each value is element-wise: a shard can do it alone
        _refuse_if_sharded(ps, "clipping by the global gradient norm",
                           "call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) in the training loop "
                           "before optimizer.step(), or clip by value (clip_value)")
    if "clip_value" in params:
        value = number(params, "clip_value", bounds.get("min_value", 1e-8), bounds.get("max_value", 1e6))
        undo = _step_pre_hook(t, fix_id, lambda: torch.nn.utils.clip_grad_value_(ps, value))
        return Applied({"clip_value": None}, {"clip_value": value}, undo)
    if "relative" in params:
        factor = number(params, "relative", bounds.get("min_relative", 0.1), bounds.get("max_relative", 100.0))
        window = int(number(params, "window", 1, 100_000)) if "window" in params else RELATIVE_CLIP_WINDOW
        cap = (number(params, "max_norm", bounds.get("min_norm", 1e-8), bounds.get("max_norm", 1e6))
               if "max_norm" in params else None)
        undo = _step_pre_hook(t, fix_id, _relative_clip(ps, factor, window, cap))
        return Applied({"max_norm": None}, {"relative": factor, "window": window, "max_norm": cap}, undo)
    max_norm = number(params, "max_norm", bounds.get("min_norm", 1e-8), bounds.get("max_norm", 1e6))
    undo = _step_pre_hook(t, fix_id, lambda: torch.nn.utils.clip_grad_norm_(ps, max_norm))
    return Applied({"max_norm": None}, {"max_norm": max_norm}, undo)


# Steps of gradient-norm history a relative clip compares with: long enough that a spike every few steps
# leaves the median alone, short enough to follow the norm down as training converges (the repair suite's
# healthy norm falls by a third between steps 100-150 and the last 50 of 800: measurement here).
RELATIVE_CLIP_WINDOW = 100


def _relative_clip(ps: list[torch.nn.Parameter], factor: float, window: int, cap: float | None) -> Callable[[], None]:
    """Clip the global gradient norm at ``factor`` x the median of the last ``window`` steps' norms (before
    clipping), and at ``cap`` when given (until the history says more, the first steps have only that).
    After AutoClip (Seetharaman et al., MLSP 2020), which clips at a low percentile of the norms seen so far:
    a fixed threshold set from early training lets spikes through once the gradients have shrunk. No host
    sync: the history is a tensor on the gradients' device."""
    ring: torch.Tensor | None = None
    seen = 0

    def clip() -> None:
        nonlocal ring, seen
        grads = [p.grad for p in ps if p.grad is not None]
        if not grads:
            return
        device = grads[0].device
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach(), 2.0).to(device)
                                                     for g in grads]), 2.0)
        if ring is None:
            ring = torch.zeros(window, device=device, dtype=norm.dtype)
        ring[seen % window] = norm
        seen += 1
        limit = factor * torch.nanmedian(ring[:min(seen, window)])
        if cap is not None:
            limit = limit.clamp(max=cap)
        coef = (limit / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.device))

    return clip


def skip_nonfinite(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    ps = _trainable(t)
    # Skipping on the one rank whose shard went NaN would step the other shards alone.
    _refuse_if_sharded(ps, "skipping a step whose gradients are not finite",
                       "check torch.isfinite on the gradients' total norm (torch.nn.utils.clip_grad_norm_ returns "
                       "it) in the training loop, and skip optimizer.step() on every rank when it is not finite")
    probe = t.probe

    def guard() -> None:
        grads = [p.grad for p in ps if p.grad is not None]
        # One host sync per step: the price of this fix, paid only while it is active.
        if grads and not torch.stack([torch.isfinite(g).all() for g in grads]).all().item():
            for p in ps:
                p.grad = None  # optimizers skip parameters without a gradient: the step is a no-op
            probe._skipped_steps += 1

    undo = _step_pre_hook(t, fix_id, guard)
    return Applied({"skip_nonfinite": False}, {"skip_nonfinite": True}, undo)


def _matching(t: Target, pattern: Any) -> list[tuple[str, torch.nn.Parameter]]:
    # A list of names or globs (as an anomaly's tensors come) matches any of them.
    patterns = pattern if isinstance(pattern, list) and pattern else [pattern]
    if not all(isinstance(x, str) and x for x in patterns):
        raise FixRejected("parameter 'pattern' must be a parameter name or glob, e.g. 'encoder.*', or a list of them")
    found = [(n, p) for n, p in t.model.named_parameters()
             if any(fnmatch.fnmatchcase(n, x) or n.startswith(x + ".") for x in patterns)]
    if not found:
        raise FixRejected(f"no parameter matches {pattern!r}")
    return found


def grad_scale(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    factor = number(params, "factor", bounds.get("min_factor", 1e-4), bounds.get("max_factor", 100.0))
    found = _matching(t, params.get("pattern"))

    def scale() -> None:
        for _, p in found:
            if p.grad is not None:
                p.grad.mul_(factor)

    undo = _step_pre_hook(t, fix_id, scale)
    names = [n for n, _ in found]
    return Applied({"grad_scale": 1.0, "params": names}, {"grad_scale": factor, "params": names}, undo)


def _freeze(t: Target, params: Mapping, flag: bool) -> Applied:
    found = _matching(t, params.get("pattern") or params.get("module"))
    before = {n: p.requires_grad for n, p in found}
    for _, p in found:
        p.requires_grad_(flag)
        if not flag:
            p.grad = None

    def undo() -> dict:
        for n, p in found:
            p.requires_grad_(before[n])
        return {"requires_grad": [before[n] for n, _ in found]}

    names = [n for n, _ in found]
    return Applied({"params": names, "requires_grad": [before[n] for n in names]},
                   {"params": names, "requires_grad": [flag] * len(names)}, undo)


def freeze(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    return _freeze(t, params, False)


def unfreeze(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    """Let the parameters train again: requires_grad on, and, for those the optimizer does not hold (a
    layer left out when it was built), a new param group with the optimizer's defaults (or ``lr``)."""
    applied = _freeze(t, params, True)
    opt = t.optimizer
    if opt is None:
        return applied
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    names = applied.after["params"]
    by_name = dict(t.model.named_parameters())
    missing = [n for n in names if id(by_name[n]) not in held]
    if not missing:
        return applied
    group: dict[str, Any] = {"params": [by_name[n] for n in missing]}
    if "lr" in params:
        group["lr"] = number(params, "lr", bounds.get("min_lr", 0.0), bounds.get("max_lr", 10.0))
    opt.add_param_group(group)
    added = opt.param_groups[-1]
    undo_flags = applied.undo

    def undo() -> dict:
        opt.param_groups[:] = [g for g in opt.param_groups if g is not added]
        for p in added["params"]:
            opt.state.pop(p, None)
        return {**(undo_flags() if undo_flags else {}), "in_optimizer": False}

    applied.after["added_to_optimizer"] = missing
    applied.after["group_lr"] = float(added["lr"])
    applied.undo = undo
    return applied


def rollback(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    """Restore the newest good snapshot (taken before ``before_step`` when given, and not before ``min_step``
    when given): the model's weights and buffers and the optimizer's state, keeping its current
    hyperparameters (``settings=true``: those of the snapshot too; with ``lr``, then that learning rate for
    every group). Training goes on with the next batch, so the batches since the snapshot (the one that
    broke the run among them) are skipped."""
    buf = getattr(t.probe, "_rollback", None)
    if buf is None:
        raise FixRejected("this job keeps no snapshots to roll back to: allow it with a period, e.g. "
                          "probes.attach(..., allow={'rollback': {'every': 50}, ...})")
    before_step = params.get("before_step")
    if before_step is not None:
        before_step = int(number(params, "before_step", 0, 2**53))
    snap = buf.latest(before_step)
    kept = [s.step for s in buf.kept()]
    if snap is None:
        raise FixRejected("no good snapshot" + (f" from before step {before_step}" if before_step is not None else "")
                          + f" is kept (kept: steps {kept or 'none'}; one is taken every {buf.every} steps "
                          "when the loss and weights are finite)")
    min_step = params.get("min_step")
    if min_step is not None and snap.step < int(number(params, "min_step", 0, 2**53)):
        raise FixRejected(f"the newest snapshot from before step {before_step} is from step {snap.step}, older than "
                          f"step {int(min_step)}: rolling back that far would lose more than it saves (kept: steps "
                          f"{kept})")
    max_back = bounds.get("max_steps_back")
    now = t.probe.step_count
    if isinstance(max_back, (int, float)) and now - snap.step > max_back:
        raise FixRejected(f"the newest usable snapshot is {now - snap.step} steps back; this job allows "
                          f"at most {max_back}")
    settings = params.get("settings", False)
    if not isinstance(settings, bool):
        raise FixRejected("parameter 'settings' must be true or false")
    new_lr = number(params, "lr", bounds.get("min_lr", 0.0), bounds.get("max_lr", 10.0)) if "lr" in params else None
    lr_now = [float(g["lr"]) for g in t.optimizer.param_groups] if t.optimizer is not None else []
    buf.restore(snap, settings=settings)
    if new_lr is not None and t.optimizer is not None:
        _set_lrs(t.optimizer, {i: new_lr for i in range(len(t.optimizer.param_groups))})
    # Newer snapshots hold the state just abandoned: a second rollback must not return to it.
    buf.drop_after(snap.step)
    lr_after = [float(g["lr"]) for g in t.optimizer.param_groups] if t.optimizer is not None else []
    return Applied({"step": now, "snapshots": kept, "lr": lr_now},
                   {"restored_step": snap.step, "skipped_steps": now - snap.step, "snapshot_loss": snap.loss,
                    "snapshot_bytes": snap.nbytes, "lr": lr_after}, None)


def set_probe(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    interval = int(number(params, "interval", bounds.get("min_interval", 1), bounds.get("max_interval", 100000)))
    probe = t.probe
    old = probe.interval
    probe.set_interval(interval)

    def undo() -> dict:
        probe.set_interval(old)
        return {"interval": old}

    return Applied({"interval": old}, {"interval": interval}, undo)
