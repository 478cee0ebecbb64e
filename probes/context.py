"""Execution context: where a step's time goes, per rank, on sampled steps.

The ``timeline`` collection times the phases of a sampled step (data wait, forward, backward,
optimizer) with one-shot hooks, and the gradient all-reduce with a DDP communication hook that is
registered once and does nothing but forward to the real hook on steps that are not sampled. Times are
host clock readings turned into wall-clock seconds, so spans from ranks on one host line up exactly and
ranks on different hosts line up as well as their clocks do (NTP: about a millisecond). On CUDA the
phases and the all-reduce are also timed on the device with CUDA events (``gpu_duration``).

Also here: user spans (``probe.span("preprocess")``) and the world a process belongs to.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any, Callable

import torch

from .collect import Collection, HostCopy, guarded

# User spans kept between two samples, at most; older ones are dropped (a span is ~100 bytes).
MAX_USER_SPANS = 1024


def world() -> dict:
    """rank, local_rank, world_size and host of this process: torch.distributed if it is initialised,
    else torchrun's environment variables, else a world of one."""
    rank = int(os.environ.get("RANK", "0") or 0)
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, size = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a half-initialised process group is not the probe's business
        pass
    return {"rank": rank, "world_size": max(size, 1), "local_rank": int(os.environ.get("LOCAL_RANK", "0") or 0),
            "host": socket.gethostname()}


class Clock:
    """perf_counter readings to wall-clock seconds. Re-anchored on every sample so drift cannot build up."""

    def __init__(self) -> None:
        self.anchor()

    def anchor(self) -> None:
        self.wall, self.perf = time.time(), time.perf_counter()

    def wall_of(self, perf: float) -> float:
        return max(self.wall + (perf - self.perf), 0.0)


class _CommTimes:
    """What the communication hook saw during one sampled step."""

    def __init__(self, cuda: bool) -> None:
        self.calls: list[float] = []  # when each gradient bucket was handed to the all-reduce
        self.done: list[float] = []  # when each bucket's all-reduce finished (host view)
        self.cuda = cuda
        self.gpu_start: Any = None
        self.gpu_end: Any = None


class Timeline(Collection):
    """Phase spans of a sampled step, with the all-reduce when the model is DistributedDataParallel."""

    name = "timeline"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._handles: list[Any] = []
        self._marks: dict[str, float] = {}
        self._events: dict[str, Any] = {}
        self.cuda = probe.device.type == "cuda" and torch.cuda.is_available()
        self.comm: _CommTimes | None = None  # set only while a sampled step runs
        self.comm_hooked = False
        self.grad_marks = True

    # -- arming ------------------------------------------------------------------------------------
    def arm(self, step: int) -> None:
        self._marks, self._events = {}, {}
        if self.comm_hooked:
            self.comm = _CommTimes(self.cuda)
        if self._handles:  # still on from the sampled step just before
            return
        if not self.comm_hooked and self.grad_marks and self.probe.world["world_size"] > 1:
            # Without the timed communication hook, the time from this rank's last gradient being ready
            # to the optimizer step is what it waited for the all-reduce (DDP's backward returns only
            # when the reduction is done). One-shot hooks: nothing is left behind on other steps.
            hook = guarded(self.probe, "timeline hook", self._grad_ready)
            try:
                for _, p in self.probe.params:
                    if p.requires_grad:
                        self._handles.append(p.register_post_accumulate_grad_hook(hook))
            except RuntimeError:  # a wrapper whose parameters take no such hook (some FSDP set-ups): go without
                self.grad_marks = False

    def phase_hooks(self) -> dict[str, Callable] | None:
        # The phase times are the probe's (Phases.marks); on CUDA the same boundaries get an event each.
        if not self.cuda:
            return {}
        event = self._event
        return {"fwd0": lambda *_: event("fwd0"), "fwd1": lambda *_: event("fwd1", last=True),
                "opt0": lambda *_: event("opt0"), "opt1": lambda *_: event("opt1")}

    def _grad_ready(self, _param: Any) -> None:
        """A parameter's gradient is ready: the mark keeps the last one of the step."""
        self._marks["grad"] = time.perf_counter()
        if self.cuda:
            self._event("grad", last=True)

    def _event(self, key: str, last: bool = False) -> None:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = torch.cuda.Event(enable_timing=True)
        elif not last:
            return
        ev.record()  # re-recording moves a mark that is kept at its last reading ("grad", "fwd1")

    # -- the communication hook ----------------------------------------------------------------------
    def install_comm_hook(self, model: torch.nn.Module, hook: Callable | None = None, state: Any = None) -> str | None:
        """Register a timed communication hook on a DDP model; return why not, or None when it worked.

        ``hook`` is the hook the job wants (default: plain all-reduce, what DDP does without a hook);
        the probe wraps it, so a gradient-compression hook is timed the same way.
        """
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return "the model is not DistributedDataParallel"
        if hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as hook
        inner = hook

        def timed(st, bucket):  # type: ignore[no-untyped-def]  # DDP rejects hooks annotated otherwise
            t = self.comm
            if t is None:
                return inner(st, bucket)  # not a sampled step: one attribute read, then DDP's own work
            t.calls.append(time.perf_counter())
            if t.cuda and t.gpu_start is None:
                t.gpu_start = torch.cuda.Event(enable_timing=True)
                t.gpu_start.record()
            fut = inner(st, bucket)

            def finished(f: torch.futures.Future) -> Any:
                t.done.append(time.perf_counter())
                if t.cuda:
                    # In a CUDA future's callback the current stream waits on the collective's stream,
                    # so an event recorded here marks the end of the all-reduce on the device.
                    t.gpu_end = torch.cuda.Event(enable_timing=True)
                    t.gpu_end.record()
                return f.value()

            return fut.then(finished)

        try:
            model.register_comm_hook(state, timed)
        except RuntimeError as e:  # DDP takes one hook per model: the job has registered its own
            return (f"{e}; pass your hook to probes.attach(..., comm_hook=your_hook) instead of registering it, "
                    "and the probe will time it")
        self.comm_hooked = True
        return None

    # -- collecting ----------------------------------------------------------------------------------
    def collect(self, step: int) -> list[HostCopy]:
        p, phases = self.probe, self.probe.phases.marks
        m = {"fwd0": phases.get("fwd0"), "fwd1": phases.get("fwd1_last"), "opt0": phases.get("opt0"),
             "opt1": phases.get("opt1"), **self._marks}
        self._marks = {}  # hooks kept for the next sampled step mark nothing until it is armed
        comm, self.comm = self.comm, None
        end = p.step_called or time.perf_counter()  # the user's step ended when it called probe.step()
        clock = p.clock
        clock.anchor()
        gpu = self._gpu_durations(comm)
        spans: list[dict] = []

        def add(name: str, category: str, t0: float | None, t1: float | None) -> None:
            if t0 is None or t1 is None or t1 < t0:
                return
            span = {"name": name, "category": category, "start": clock.wall_of(t0), "duration": t1 - t0}
            if name in gpu:
                span["gpu_duration"] = gpu[name]
            spans.append(span)

        begin = p.prev_end
        add("step", "step", begin, end)
        add("data_wait", "phase", begin, m.get("fwd0"))
        add("forward", "phase", m.get("fwd0"), m.get("fwd1"))
        add("backward", "phase", m.get("fwd1"), m.get("opt0"))
        add("optimizer", "phase", m.get("opt0"), m.get("opt1"))
        if comm is not None and comm.calls and comm.done:
            add("allreduce", "comm", comm.calls[0], max(comm.done))
            # Time from this rank's last bucket being ready (its own backward done) to the end of the
            # collective: waiting on the network or on slower ranks, not computing.
            add("comm_wait", "comm", comm.calls[-1], max(comm.done))
        elif "grad" in m and "opt0" in m:
            add("comm_wait", "comm", m["grad"], m["opt0"])
        spans.extend(p.take_user_spans(clock))
        if spans:
            event = {"kind": "spans", "step": step, "time": time.time(), "mode": "train", "spans": spans}
            if p.capturing:
                event["capture"] = p.capturing
            p.sender.put(event)
        return []

    def _gpu_durations(self, comm: _CommTimes | None) -> dict[str, float]:
        if not self.cuda or not self._events:
            return {}
        ev = self._events
        try:
            last = ev.get("opt1") or ev.get("opt0") or ev.get("fwd1")
            if last is not None:
                last.synchronize()  # one sync, on sampled steps only; the step's work is queued by now
            out = {}
            for name, a, b in (("forward", "fwd0", "fwd1"), ("backward", "fwd1", "opt0"), ("optimizer", "opt0", "opt1"),
                               ("comm_wait", "grad", "opt0")):
                if a in ev and b in ev:
                    out[name] = ev[a].elapsed_time(ev[b]) / 1000.0
            if comm is not None and comm.gpu_start is not None and comm.gpu_end is not None:
                comm.gpu_end.synchronize()
                out["allreduce"] = comm.gpu_start.elapsed_time(comm.gpu_end) / 1000.0
            return out
        except RuntimeError:
            return {}

    def close(self) -> None:
        self.disarm()
        self.comm = None


class UserSpan:
    """``with probe.span("preprocess"):`` times a stage of the user's own; kept until the next sample."""

    __slots__ = ("buffer", "name", "t0")

    def __init__(self, buffer: deque, name: str) -> None:
        self.buffer, self.name, self.t0 = buffer, name, 0.0

    def __enter__(self) -> UserSpan:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.buffer.append((self.name, self.t0, time.perf_counter()))


def new_user_spans() -> deque:
    return deque(maxlen=MAX_USER_SPANS)
