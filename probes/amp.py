"""Mixed precision: tell the steps a ``torch.amp.GradScaler`` skipped from real NaN/Inf faults.

With a GradScaler, a step whose scaled gradients overflow is skipped on purpose: the scaler does not
call ``optimizer.step()``, lowers its scale, and training goes on. Those gradients hold Inf/NaN, and
without a word from the probe the server would report them as a ``nonfinite`` fault. So the probe
watches the scaler and sends ``amp/skipped = 1`` at every step it skipped; the nonfinite rule ignores
the gradients of those steps (and only those).

How a skip is seen: a GradScaler only lowers its scale when it finds Inf/NaN and skips the step, and
only raises it after ``growth_interval`` clean steps, so "the scale went down since the last step" is
exactly "this step was skipped". The comparison stays on the scale's device (two tiny kernels per
step, no host sync); the flags are read with the losses, one sync per sampled step.

Call ``probe.step()`` after ``scaler.update()``, as the usual loop does::

    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update(); probe.step(loss=loss)

The gradients the probe reads there are unscaled: ``scaler.step`` unscales them in place.
"""

from __future__ import annotations

from typing import Any

import torch

AMP_SKIPPED = "amp/skipped"  # 1.0 at each step the scaler skipped; read by diag_server/rules/nonfinite.py
AMP_SCALE = "amp/scale"  # the loss scale, at sampled steps


class ScalerWatch:
    """Per-step "did the scaler skip this step?" flags, kept on device until the probe flushes."""

    def __init__(self, scaler: Any) -> None:
        if not (hasattr(scaler, "get_scale") and hasattr(scaler, "update")):
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.scaler = scaler
        self._prev: torch.Tensor | None = None
        self._flags: list[tuple[int, torch.Tensor]] = []
        self.skipped_total = 0

    def _scale(self) -> torch.Tensor | None:
        if not self.scaler.is_enabled():
            return None
        get = getattr(self.scaler, "_get_scale_async", None)  # the scale tensor, without a sync
        scale = get() if get is not None else getattr(self.scaler, "_scale", None)
        return scale if isinstance(scale, torch.Tensor) else None

    def observe(self, step: int) -> None:
        """Called once per probe step, after ``scaler.update()``."""
        scale = self._scale()
        if scale is None:
            return  # scaling disabled, or no scale() call yet: nothing was skipped
        if self._prev is None:
            # The first step: the scale starts at init_scale and only grows after growth_interval steps.
            init = getattr(self.scaler, "_init_scale", None)
            if init is None:
                self._prev = scale.detach().clone()
                return
            self._prev = torch.full((), float(init), device=scale.device)
        self._flags.append((step, scale < self._prev))
        self._prev = scale.detach().clone()  # update() changes the scale in place

    def __len__(self) -> int:
        return len(self._flags)

    def flush(self, by_step: dict[int, dict[str, float | None]], sampled_step: int | None) -> None:
        """Add ``amp/skipped`` (and, at a sampled step, ``amp/scale``) to the scalars about to be sent."""
        if self._flags:
            values = torch.stack([f for _, f in self._flags]).tolist()
            for (step, _), skipped in zip(self._flags, values):
                if skipped:
                    by_step.setdefault(step, {})[AMP_SKIPPED] = 1.0
                    self.skipped_total += 1
            self._flags = []
        if sampled_step is not None and self._prev is not None:
            by_step.setdefault(sampled_step, {})[AMP_SCALE] = float(self._prev)
