"""PyTorch Lightning: one callback that attaches a probe to the module and the Trainer's optimizer.

    from probes.lightning import TraindxCallback
    trainer = L.Trainer(callbacks=[TraindxCallback(run="exp-1", allow=["lr_scale", "grad_clip"])])

What it does, hook by hook:

- ``on_fit_start``: attaches ``probes.attach(module, trainer.optimizers[0], ...)`` with the Trainer's LR
  schedulers (an lr fix then scales their base rates too) and its AMP GradScaler, if any. ``setup`` runs
  before Lightning creates the optimizers, so the probe is attached at the first hook that has them.
  The run's config, so that runs can be compared, is what Lightning's own loggers record as
  hyper-parameters (the module's ``save_hyperparameters()``, joined by the datamodule's, the module's
  winning) and the Trainer's schedule (``trainer.*``: max epochs and steps, accumulation, precision,
  clipping, devices), under any ``config=`` given to the callback, which wins.
- ``on_before_optimizer_step``: runs the active gradient fixes (grad_clip, grad_scale, skip_nonfinite)
  after backward and before the update. Lightning computes gradients inside ``optimizer.step(closure)``,
  where an optimizer step pre-hook would see the previous step's gradients.
- ``on_train_batch_end``: collects each micro-batch's loss; calls ``probe.step`` only when the Trainer
  took an optimizer step (its ``global_step`` moved), so with ``accumulate_grad_batches=k`` one probe step
  is one optimizer step, and the gradient statistics are those of the accumulated gradient. The loss
  sent is the mean over the step's micro-batches; metrics logged with ``self.log`` since the last step
  ride along.
- ``on_validation_end``: sends the validation metrics (``val_loss``, ...) at the current step.
- ``teardown``: sends what is left and closes the probe (also after an exception).

Only the first optimizer is watched; with several (manual optimization), pass the one you care about
first in ``configure_optimizers``. This module imports Lightning; ``import probes`` does not.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    import pytorch_lightning as pl  # type: ignore[no-redef]

from .probe import Probe, attach
from .run_config import as_mapping

__all__ = ["TraindxCallback", "run_config"]

# The Trainer's settings that shape a run's curves, recorded as trainer.<name>.
_TRAINER_SETTINGS = ("max_epochs", "max_steps", "accumulate_grad_batches", "precision", "gradient_clip_val",
                     "gradient_clip_algorithm", "world_size", "num_nodes", "val_check_interval")


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def run_config(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What Lightning knows about the run at its start, for ``probes.attach(config=...)``: the hyper-parameters
    its loggers record (the datamodule's, then the module's over them, as ``Trainer`` merges them for a
    logger) and the Trainer's settings under ``trainer.*``."""
    config: dict[str, Any] = {"trainer": {}}
    for name in _TRAINER_SETTINGS:
        value = getattr(trainer, name, None)
        if value is not None:
            config["trainer"][name] = value
    datamodule = getattr(trainer, "datamodule", None)
    for owner in (datamodule, pl_module):
        hparams = as_mapping(getattr(owner, "hparams", None)) if owner is not None else None
        config.update(hparams or {})
    return config


class TraindxCallback(pl.Callback):
    """Attach a traindx probe to a Lightning ``Trainer.fit``; keyword arguments go to ``probes.attach``."""

    def __init__(self, **attach_kwargs: Any) -> None:
        self.attach_kwargs = attach_kwargs
        self.probe: Probe | None = None
        self._losses: list[torch.Tensor] = []
        self._last_global_step = 0
        self._reported: dict[str, Any] = {}

    # -- attach and close -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.probe is not None:
            return
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        schedulers = [c.scheduler for c in getattr(trainer, "lr_scheduler_configs", [])]
        precision = getattr(trainer.strategy, "precision_plugin", None)
        given = self.attach_kwargs.get("config")
        mapping = as_mapping(given) if given is not None else {}
        kwargs = {"scheduler": schedulers or None, "scaler": getattr(precision, "scaler", None),
                  **self.attach_kwargs,
                  # not a mapping: passed on as given, for probes.attach to refuse it
                  "config": {**run_config(trainer, pl_module), **mapping} if mapping is not None else given}
        self.probe = attach(pl_module, optimizer, **kwargs)
        self.probe.defer_step_fixes()
        self._last_global_step = trainer.global_step
        self._losses = []

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        probe, self.probe = self.probe, None
        if probe is None:
            return
        metrics = self._changed_metrics(trainer)
        if metrics:
            probe.log(**metrics)
        probe.close()

    # -- training -----------------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        probe = self.probe
        if probe is not None and getattr(optimizer, "_optimizer", optimizer) is probe.optimizer:
            probe.before_optimizer_step()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        probe = self.probe
        if probe is None:
            return
        loss = _loss_of(outputs)
        if loss is not None:
            self._losses.append(loss)
        if trainer.global_step == self._last_global_step:
            return  # still accumulating: no optimizer step on this batch
        self._last_global_step = trainer.global_step
        step_loss = None
        if self._losses:
            total = torch.stack(self._losses).sum()
            # Automatic optimization divides each micro-batch's loss by accumulate_grad_batches before
            # backward and hands us that; undo it to send the mean over the step's micro-batches.
            k = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
            step_loss = total * k / len(self._losses)
            self._losses = []
        probe.step(loss=step_loss, **self._changed_metrics(trainer))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.probe is None or trainer.sanity_checking:
            return
        metrics = self._changed_metrics(trainer)
        if metrics:
            self.probe.log(**metrics)

    def _changed_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Scalars logged with ``self.log`` whose value object changed since we last sent them."""
        out = {}
        for name, value in trainer.callback_metrics.items():
            if name == "loss" or self._reported.get(name) is value:
                continue  # the step's loss is sent as 'loss' already
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                self._reported[name] = value
                out[name] = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                self._reported[name] = value
                out[name] = value
        return out
