"""Hugging Face transformers: a ``TrainerCallback`` that attaches a probe to ``Trainer.train``.

    from probes.hf import TraindxCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TraindxCallback(run="bert-1", allow=["lr_scale", "set_lr"])])

or, with ``probes.hf.register()`` called once, by name: ``TrainingArguments(report_to=["traindx"])``
(settings then come from ``TRAINDX_*`` variables: ``TRAINDX_SERVER``, ``TRAINDX_RUN``, ``TRAINDX_ALLOW``).

What it does, event by event:

- ``on_train_begin``: attaches ``probes.attach(model, optimizer, ...)`` to the torch optimizer inside
  accelerate's wrapper, with the Trainer's LR scheduler (an lr fix then scales its base rates too: the
  Trainer's schedules recompute the rate from them every step) and accelerate's GradScaler, if any; and
  with the run's config, so that runs can be compared: the ``TrainingArguments`` (``args.*``, their
  tokens redacted as transformers redacts them), the model's config (``model.*``) and the schedule the
  Trainer worked out (``trainer.*``), under any ``config=`` given to the callback, which wins.
- every training forward: keeps a reference to the model's ``loss`` output (no host sync).
- ``on_optimizer_step`` (after ``optimizer.step()``, before the gradients are zeroed): one probe step per
  optimizer step, with the mean loss of its micro-batches; under ``gradient_accumulation_steps=k`` the
  gradient statistics are those of the accumulated gradient, as the optimizer used it.
- ``on_log``: the Trainer's logs (``learning_rate``, ``grad_norm``, evaluation metrics, ...) at the
  current step; ``eval_*`` keys arrive as ``val_*`` so the rules that read validation series see them.
- ``on_train_end``: closes the probe.

The Trainer clips gradients (``max_grad_norm``, 1.0 by default) before the optimizer step, so gradient
statistics are of clipped gradients; the pre-clip global norm reaches the server as ``grad_norm``
through the logs. This module imports transformers; ``import probes`` does not.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from transformers import TrainerCallback

from .collect import guarded
from .probe import Probe, attach
from .run_config import as_mapping

__all__ = ["TraindxCallback", "register", "run_config"]


def _env_allow() -> list[str]:
    return [a.strip() for a in os.environ.get("TRAINDX_ALLOW", "").split(",") if a.strip()]


class TraindxCallback(TrainerCallback):
    """Attach a traindx probe to ``Trainer.train``; keyword arguments go to ``probes.attach``."""

    def __init__(self, **attach_kwargs: Any) -> None:
        if "allow" not in attach_kwargs and _env_allow():
            attach_kwargs["allow"] = _env_allow()
        self.attach_kwargs = attach_kwargs
        self.probe: Probe | None = None
        self._losses: list[torch.Tensor] = []
        self._hook: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.probe is not None or model is None:
            return
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        given = self.attach_kwargs.get("config")
        found = run_config(args, model, state)
        mapping = as_mapping(given) if given is not None else {}
        settings = {"scheduler": lr_scheduler, "scaler": getattr(optimizer, "scaler", None), **self.attach_kwargs,
                    # not a mapping: passed on as given, for probes.attach to refuse it
                    "config": {**found, **mapping} if mapping is not None else given}
        self.probe = attach(model, inner if isinstance(inner, torch.optim.Optimizer) else None, **settings)
        self._losses = []
        self._hook = model.register_forward_hook(guarded(self.probe, "hf loss hook", self._keep_loss))

    def _keep_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return  # evaluation forwards are not training steps
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach())

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.probe is None:
            return
        loss = torch.stack(self._losses).mean() if self._losses else None
        self._losses = []
        self.probe.step(loss=loss)

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.probe is None or not logs:
            return
        values = {}
        for key, value in logs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
                continue
            if key == "loss":
                key = "hf/loss"  # the Trainer's average over its logging window; 'loss' is per step
            elif key.startswith("eval_"):
                key = "val_" + key[len("eval_"):]
            values[key] = value
        if values:
            self.probe.log(**values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        probe, self.probe = self.probe, None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if probe is not None:
            probe.close()


# Label maps: one key per class once flattened (a thousand for ImageNet), and no hyper-parameter; their size is kept.
_MODEL_CONFIG_LEFT_OUT = ("id2label", "label2id")


def run_config(args: Any, model: torch.nn.Module | None, state: Any = None) -> dict[str, Any]:
    """What the Trainer knows about the run at its start, for ``probes.attach(config=...)``: its arguments,
    the model's config, and the schedule it worked out (``trainer.*``: total optimizer steps, epochs,
    batch size across devices). Never raises: a piece that cannot be read is left out."""
    config: dict[str, Any] = {}
    try:
        # to_sanitized_dict: what transformers' own TensorBoard callback logs as hparams, tokens redacted
        config["args"] = args.to_sanitized_dict()
    except Exception:  # noqa: BLE001 - an args object of another kind: nothing from it
        pass
    try:
        model_config = getattr(model, "config", None)
        if model_config is not None and callable(getattr(model_config, "to_dict", None)):
            found = model_config.to_dict()
            labels = found.get("id2label")
            config["model"] = {k: v for k, v in found.items() if k not in _MODEL_CONFIG_LEFT_OUT}
            if isinstance(labels, Mapping):
                config["model"]["num_labels"] = len(labels)
    except Exception:  # noqa: BLE001
        pass
    if state is not None:  # the train dataloader is not built yet at on_train_begin: its schedule is
        config["trainer"] = {k: getattr(state, k) for k in ("max_steps", "num_train_epochs", "train_batch_size")
                             if getattr(state, k, None) is not None}
    return config


def register(name: str = "traindx") -> None:
    """Make ``TrainingArguments(report_to=[name])`` add a ``TraindxCallback`` configured from TRAINDX_*.

    transformers looks integrations up by name in ``transformers.integrations.integration_utils.INTEGRATION_TO_CALLBACK``
    and instantiates the class with no arguments; this adds one entry to that table.
    """
    from transformers.integrations import integration_utils

    integration_utils.INTEGRATION_TO_CALLBACK[name] = TraindxCallback
