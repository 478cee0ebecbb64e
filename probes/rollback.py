"""In-memory snapshots of the model and optimizer, for the ``rollback`` fix action.

A job opts in by allowing the action with a period: ``probes.attach(..., allow={"rollback": {"every": 25}})``.
Every ``every`` steps, at the step boundary, the probe checks that the step's loss and every weight are
finite (one host sync) and, if so, copies the model's and optimizer's state to host memory. The
``keep`` (default 2) newest good snapshots are kept, the oldest dropped first; a step whose loss or weights
are not finite is never kept, so after a NaN the last good snapshot stays the one from before it.

Two older states are kept besides them, since the newest ones hold the damage of a fault that went on
for longer than ``keep * every`` steps before anyone acted: the first good snapshot (the state before a
fault that was there from the start, a learning rate 10x too high, say) and the one with the lowest loss
(the state before a fault that came later and kept hurting, batches with corrupt labels, say).

Cost, paid only by jobs that allow rollback: at most ``keep + 2`` copies of the parameters, buffers and
optimizer state (SGD with momentum: 2x the parameters; Adam: 3x) in host memory (the first and the best
are often among the newest, and are then not copied twice), and on each snapshot step one device->host
copy of that state plus one sync. Nothing happens on the other steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

import torch

DEFAULT_KEEP = 2
MAX_KEEP = 4
# A snapshot step whose mean recent loss is more than this many times the last kept snapshot's is not
# good either: the run is diverging, and keeping it would push out the state from before. Same 3x as the
# loss_divergence rule's default ratio. After DIVERGED_LIMIT refusals in a row the new level is accepted,
# so a run that settled elsewhere (after a fix, say) does not keep an ever older snapshot.
DIVERGED_RATIO = 3.0
DIVERGED_LIMIT = 4
# Hyperparameters that a rollback leaves as they are now: a fix applied after the snapshot (a lower
# learning rate, say) must survive the restore of the state it was applied to.
_SETTINGS = ("lr", "momentum", "betas", "weight_decay", "eps", "dampening", "nesterov", "initial_lr")


@dataclass
class Snapshot:
    step: int  # the state after this step's optimizer update
    loss: float | None
    model: dict[str, torch.Tensor]
    optimizer: dict | None
    nbytes: int


def _to_host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v) for v in x)
    return x


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class RollbackBuffer:
    """The last ``keep`` good snapshots of one model and optimizer, taken every ``every`` steps."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *, every: int,
                 keep: int = DEFAULT_KEEP) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"rollback 'every' must be a positive number of steps, got {every!r}")
        if not 1 <= keep <= MAX_KEEP:
            raise ValueError(f"rollback 'keep' must be 1..{MAX_KEEP}, got {keep!r}")
        self.model, self.optimizer, self.every = model, optimizer, every
        self.snapshots: deque[Snapshot] = deque(maxlen=keep)  # the newest
        self.first: Snapshot | None = None  # the first good one: from before a fault present from the start
        self.best: Snapshot | None = None  # the lowest loss: from before a fault that came later
        self.refused = 0  # snapshot steps whose state was not finite, or diverged
        self._diverged = 0  # refusals in a row for divergence

    @classmethod
    def from_allow(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                   bounds: Mapping[str, Any] | None) -> RollbackBuffer | None:
        if bounds is None:
            return None
        every = bounds.get("every", 50)
        keep = bounds.get("keep", DEFAULT_KEEP)
        return cls(model, optimizer, every=int(every) if isinstance(every, float) else every,
                   keep=int(keep) if isinstance(keep, float) else keep)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def keep(self, step: int, loss: Any, recent: list[Any] | None = None) -> bool:
        """Snapshot the state after ``step`` if it is good; True when it was kept. ``recent`` are the losses
        of the steps since the last sample (the probe's buffer), for a less noisy divergence test."""
        params = [p.detach() for p in self.model.parameters()]
        checks = [torch.isfinite(p).all() for p in params if p.is_floating_point()]
        loss_value: float | None = None
        if isinstance(loss, torch.Tensor):
            checks.append(torch.isfinite(loss.detach()).all())
        elif isinstance(loss, (int, float)):
            loss_value = float(loss)
            if not math.isfinite(loss_value):
                self.refused += 1
                return False
        # The one host sync of a snapshot step.
        if checks and not bool(torch.stack(checks).all()):
            self.refused += 1
            return False
        if isinstance(loss, torch.Tensor):
            # The probe keeps a CPU scalar loss as a float, any other as a tensor (probe._held).
            recent = recent or []
            tensors = [v.detach().float().mean() for v in recent if isinstance(v, torch.Tensor)]
            values = [float(v) for v in recent if not isinstance(v, torch.Tensor)]
            if tensors:
                values += torch.stack(tensors).tolist()
            loss_value = math.fsum(values) / len(values) if values else float(loss.detach().float().mean())
            if not math.isfinite(loss_value):
                self.refused += 1
                return False
        last = self.snapshots[-1].loss if self.snapshots else None
        if (last is not None and loss_value is not None and last > 0 and loss_value > DIVERGED_RATIO * last
                and self._diverged < DIVERGED_LIMIT):
            self._diverged += 1
            self.refused += 1
            return False
        self._diverged = 0
        model_state = _to_host(self.model.state_dict())
        opt_state = _to_host(self.optimizer.state_dict()) if self.optimizer is not None else None
        snap = Snapshot(step, loss_value, model_state, opt_state, _nbytes(model_state) + _nbytes(opt_state))
        self.snapshots.append(snap)
        if self.first is None:
            self.first = snap
        # The newest on a tie: a plateau's latest state is as good and has learned more.
        if self.best is None or (loss_value is not None and (self.best.loss is None or loss_value <= self.best.loss)):
            self.best = snap
        return True

    def kept(self) -> list[Snapshot]:
        """Every snapshot kept, oldest first: the newest ones, the first and the best."""
        by_step = {s.step: s for s in (self.first, self.best, *self.snapshots) if s is not None}
        return [by_step[k] for k in sorted(by_step)]

    def latest(self, before_step: int | None = None) -> Snapshot | None:
        for snap in reversed(self.kept()):
            if before_step is None or snap.step < before_step:
                return snap
        return None

    def drop_after(self, step: int) -> None:
        """Forget the snapshots newer than ``step`` (after a rollback to it: they hold the state abandoned)."""
        while self.snapshots and self.snapshots[-1].step > step:
            self.snapshots.pop()
        if self.first is not None and self.first.step > step:
            self.first = None
        if self.best is not None and self.best.step > step:
            # The lowest loss among what is left, the newest on a tie; a snapshot without a loss never wins.
            self.best = max((s for s in self.kept() if s.step <= step),
                            key=lambda s: (-(s.loss if s.loss is not None else math.inf), s.step), default=None)

    def restore(self, snap: Snapshot, *, settings: bool = False) -> None:
        """Load ``snap``. The optimizer's hyperparameters stay as they are now unless ``settings``, which
        restores those of the snapshot too (the learning rate the run was healthy at, say)."""
        self.model.load_state_dict(snap.model)
        opt = self.optimizer
        if opt is not None and snap.optimizer is not None and settings:
            opt.load_state_dict(_to_host(snap.optimizer))
        elif opt is not None and snap.optimizer is not None:
            settings = [{k: g[k] for k in _SETTINGS if k in g} for g in opt.param_groups]
            # A copy: load_state_dict may keep the tensors it is given, and the snapshot must stay as it was.
            opt.load_state_dict(_to_host(snap.optimizer))
            for group, kept in zip(opt.param_groups, settings):
                for k, v in kept.items():
                    if isinstance(group.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                        group[k].fill_(v)
                    else:
                        group[k] = v

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.kept())
