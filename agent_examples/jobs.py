"""Seeded training jobs with a fault, shared by the demo, the tests and the recorded agent sessions.

Each is a real PyTorch training loop with the probe attached; the same seed gives the same run.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import probes

# What the demo job lets the server change. A job that allows nothing is read-only.
DEMO_ALLOW = ("lr_scale", "set_lr", "grad_clip", "skip_nonfinite")


@dataclass
class JobResult:
    run: str
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.time() at the end of each step
    error: BaseException | None = None

    def median(self, lo: int, hi: int) -> float:
        window = [x for x in self.losses[lo:hi] if x == x]
        return statistics.median(window) if window else float("nan")


def regression_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 1))


def lr_spike_job(*, run: str, steps: int = 1500, fault_step: int | None = 500, fault_lr: float = 0.1,
                 lr: float = 0.01, pace: float = 0.004, seed: int = 0, interval: int = 10,
                 allow: tuple[str, ...] = DEMO_ALLOW, probe_kwargs: dict[str, Any] | None = None,
                 attach: bool = True, stop: threading.Event | None = None) -> JobResult:
    """An MLP regression trained with SGD+momentum; at ``fault_step`` a scheduler bug sets the learning
    rate 10x too high, the loss jumps ~100x and the gradients start to explode. ``pace`` seconds of
    sleep per step stand in for a real model's compute, so an agent has time to act."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(seed + 1)
    w = torch.linspace(-1, 1, 16)
    model = regression_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    result = JobResult(run=run)
    probe = probes.attach(model, opt, run=run, interval=interval, allow=list(allow), **(probe_kwargs or {})) \
        if attach else None
    try:
        for step in range(steps):
            if stop is not None and stop.is_set():
                break
            if step == fault_step:
                for group in opt.param_groups:
                    group["lr"] = fault_lr  # the fault: a warm-up schedule that forgot to divide
            x = torch.randn(64, 16, generator=data)
            y = (x @ w).unsqueeze(1) + 0.3 * torch.sin(3 * x[:, :1])
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            if pace:
                time.sleep(pace)  # stands for a real model's compute: part of the step, not data wait
            if probe is not None:
                probe.step(loss=loss)
            result.losses.append(loss.item())
            result.lrs.append(float(opt.param_groups[0]["lr"]))
            result.times.append(time.time())
    except BaseException as e:  # noqa: BLE001 - reported to the caller, who runs us in a thread
        result.error = e
    finally:
        if probe is not None:
            probe.close()
    return result
