"""A small real training run that streams to a traindx server, for the dashboard's tests and screenshot.

A two-layer MLP learns a noisy linear map on the CPU, one step every few milliseconds, with the probe
sampling every ``interval`` steps. ``inject`` breaks it on purpose while it runs, the way a person's job
would break: ``"lr_spike"`` raises the learning rate (gradients explode, the loss diverges), ``"nan"``
makes the reported loss NaN for a few steps.
"""

from __future__ import annotations

import threading
import time

import torch

import probes

ALLOW = ["lr_scale", "set_lr", "grad_clip", "skip_nonfinite"]


class LiveRun:
    def __init__(self, server: str, run: str, *, interval: int = 5, step_sleep: float = 0.004, seed: int = 0,
                 max_steps: int = 100_000, token: str | None = None, lr: float = 0.02, hidden: int = 32) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 32),
                                         torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.x = torch.randn(512, 16)
        self.y = self.x @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1)
        # what a person would pass as the run's config: it tells runs apart on the compare page
        config = {"optimizer": {"name": "SGD", "lr": lr}, "model": {"hidden": hidden, "layers": 3},
                  "data": {"examples": 512, "batch_size": 32}, "seed": seed}
        self.probe = probes.attach(self.model, self.opt, run=run, server=server, interval=interval, allow=ALLOW,
                                   flush_interval=0.1, token=token, config=config)
        self.step_sleep, self.max_steps = step_sleep, max_steps
        self._nan_steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-run", daemon=True)

    @property
    def step(self) -> int:
        return self.probe.step_count

    def start(self) -> "LiveRun":
        self._thread.start()
        return self

    def inject(self, fault: str, *, steps: int = 10, factor: float = 200.0) -> None:
        if fault == "nan":
            self._nan_steps = steps
        elif fault == "lr_spike":
            for g in self.opt.param_groups:
                g["lr"] *= factor
        else:
            raise ValueError(f"unknown fault {fault!r}")

    def wait_steps(self, n: int, timeout: float = 60.0) -> None:
        target, deadline = self.step + n, time.monotonic() + timeout
        while self.step < target and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set() and i < self.max_steps:
            idx = torch.randint(0, len(self.x), (32,))
            loss = torch.nn.functional.mse_loss(self.model(self.x[idx]), self.y[idx])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            reported = loss
            if self._nan_steps > 0:
                self._nan_steps -= 1
                reported = loss * float("nan")
            self.probe.step(loss=reported, accuracy=float(torch.exp(-loss.detach())))
            i += 1
            time.sleep(self.step_sleep)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.probe.close()
