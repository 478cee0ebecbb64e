"""A diagnostic capture: for the next N steps, record everything every step and run torch.profiler.

Asked for by the server (a ``capture`` entry on an ingest reply). While it runs, every collection is
due every step, tensor shapes are recorded per module, and torch.profiler records operators, kernels
and memory. At the end the operator table, the shapes and the profiler's Chrome trace go to the server
as one ``capture`` event, and the probe returns to its normal sampling.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any

import torch

from .collect import guarded

log = logging.getLogger("traindx.probe")

MAX_OPS = 50
MAX_TRACE_CHARS = 8 << 20  # the contract's limit (schemas.events.MAX_TRACE_CHARS)


def _shapes(x: Any) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for item in x[:16] for s in _shapes(item)][:64]
    if isinstance(x, dict):
        return [s for item in list(x.values())[:16] for s in _shapes(item)][:64]
    return []


class Capture:
    def __init__(self, probe: Any, capture_id: str, steps: int, profile: bool, first_step: int) -> None:
        self.probe, self.id, self.steps, self.first_step = probe, capture_id, steps, first_step
        self.last_step = first_step + steps - 1
        self.shapes: dict[str, dict] = {}
        self.error: str | None = None
        self._handles = [m.register_forward_hook(guarded(probe, "capture hook", self._on_forward(n)))
                         for n, m in probe.model.named_modules() if n and not list(m.children())]
        self.profiler = None
        if profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if probe.device.type == "cuda" and torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            try:
                self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
                self.profiler.__enter__()
                self.activities = activities
            except Exception as e:  # noqa: BLE001 - another profiler may be running: capture without it
                self.profiler, self.error = None, f"torch.profiler did not start: {type(e).__name__}: {e}"

    def _on_forward(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            if name not in self.shapes:
                self.shapes[name] = {"module": name, "type": type(module).__name__, "inputs": _shapes(args),
                                     "outputs": _shapes(out)}
        return hook

    def pause(self, paused: bool) -> None:
        """Keep the probe's own statistics out of the profile: it is the job's operators that matter."""
        if self.profiler is not None:
            try:
                self.profiler.toggle_collection_dynamic(not paused, self.activities)
            except Exception:  # noqa: BLE001 - an older torch cannot toggle; the probe's ops then show too
                pass

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def finish(self, step: int) -> dict:
        """Stop, and return the ``capture`` event (the ops, shapes and trace)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        event = {"kind": "capture", "step": self.first_step, "time": time.time(), "capture_id": self.id,
                 "last_step": max(step, self.first_step), "status": "done", "profiled": False,
                 "shapes": list(self.shapes.values())[:10000]}
        if self.error:
            event["reason"] = self.error
        if self.profiler is None:
            return event
        try:
            self.profiler.__exit__(None, None, None)
            event["ops"] = _op_table(self.profiler)
            event["profiled"] = True
            event.update(_trace(self.profiler))
        except Exception as e:  # noqa: BLE001
            event["reason"] = f"torch.profiler failed: {type(e).__name__}: {e}"
        self.profiler = None
        return event

    def abort(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.profiler is not None:
            try:
                self.profiler.__exit__(None, None, None)
            except Exception:  # noqa: BLE001
                pass
            self.profiler = None


def _op_table(prof: Any) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        device = float(getattr(e, "device_time_total", 0.0) or 0.0)
        rows.append({
            "name": str(e.key)[:512], "calls": int(e.count),
            "cpu_time_ms": float(e.cpu_time_total) / 1000.0, "self_cpu_time_ms": float(e.self_cpu_time_total) / 1000.0,
            "device_time_ms": device / 1000.0,
            "self_device_time_ms": float(getattr(e, "self_device_time_total", 0.0) or 0.0) / 1000.0,
            "cpu_memory_mb": float(getattr(e, "self_cpu_memory_usage", 0) or 0) / 2**20,
            "device_memory_mb": float(getattr(e, "self_device_memory_usage", 0) or 0) / 2**20,
        })
    rows.sort(key=lambda r: (r["self_device_time_ms"], r["self_cpu_time_ms"]), reverse=True)
    return rows[:MAX_OPS]


def _trace(prof: Any) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="traindx-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        size = os.path.getsize(path)
        if size > MAX_TRACE_CHARS:
            return {"trace_dropped": f"the trace is {size} bytes, over the {MAX_TRACE_CHARS}-byte limit; "
                                     "capture fewer steps"}
        with open(path, encoding="utf-8", errors="replace") as fh:
            return {"trace": fh.read()}
    finally:
        os.unlink(path)
