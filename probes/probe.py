"""The probe: attach it to a model and optimizer, call ``step()`` once per training step.

What it promises the training job: it never raises into the loop (a failure is logged once and the
probe degrades), never waits on the network, holds a bounded amount of memory, and on a step that no
collection samples does nothing but count, keep a reference to the loss, and branch.
"""

from __future__ import annotations

import atexit
import logging
import math
import operator
import os
import re
import sys
import time
import uuid
import weakref
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import torch

from . import fixes, quantiles, registry, run_config, signals
from .capture import Capture
from .agreement import Agreement
from .amp import ScalerWatch
from .collect import Collection, HostCopy, Phases
from .context import Clock, Timeline, UserSpan, new_user_spans, world
from .registry import COLLECTIONS
from .rollback import RollbackBuffer
from .sender import Sender
from .sinks import FileSink, HttpSink, Sink
from .snapshot import Snapshots
from .stats import local, sharded

log = logging.getLogger("traindx.probe")

DEFAULT_SERVER = "http://127.0.0.1:8765"
# Sample every 100th step by default, as GradTracer and smdebug do: at this interval the full default set
# costs ~0.1% of a 3 ms step of a 186k-parameter CPU MLP, against ~4% at 50 (benchmarks/overhead.py).
DEFAULT_INTERVAL = 100
DEFAULT_COLLECTIONS = ("weights", "gradients", "updates", "activations", "system", "timeline")
TRAIN = "train"
MODE_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
# After this many internal errors the probe stops sampling altogether rather than keep failing.
MAX_ERRORS = 20
# Loss tensors kept between two samples, at most; beyond it they are read early (one sync).
MAX_BUFFERED_LOSSES = 4096


def _default_run() -> str:
    env = os.environ.get("TRAINDX_RUN")
    if env:
        return env
    # Under torchrun every rank sees the same TORCHELASTIC_RUN_ID, so all ranks join one run.
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        # Whatever --rdzv-id the user gave torchrun, made a valid run id the same way on every rank.
        return "torchrun-" + re.sub(r"[^A-Za-z0-9._:\-]", "_", elastic)[:118]
    return time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


# Probes attached and not yet closed; closed at interpreter exit (see _close_at_exit).
_OPEN: weakref.WeakSet[Probe] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Close the probes the job left open, so that what they hold reaches the server (or the spool)
    instead of dying with the sender's thread, and the embeddings worker is joined before the interpreter
    tears down (a daemon thread inside an ATen operation then aborts the process). The run's end says why:
    the exit, after an uncaught exception when the job died of one."""
    # Set by the interpreter's report of an uncaught exception; in an interactive session (a REPL, a
    # notebook) it may be an earlier cell's, which did not end the job.
    interactive = hasattr(sys, "ps1") or "IPython" in sys.modules
    err = None if interactive else getattr(sys, "last_value", None)
    _close_open("exit without close()" if err is None else f"exit after {type(err).__name__}: {err}"[:256], 5.0)


def _each_open(what: str, act: Callable[[Probe], Any]) -> None:
    """``act`` on each of this process's open probes; one that fails does not stop the others."""
    for probe in list(_OPEN):
        if probe._pid == os.getpid():  # not a forked child's copy of its parent's probe
            try:
                act(probe)
            except Exception:  # noqa: BLE001 - the next probe, and the interpreter's other exit handlers
                log.warning("traindx: could not %s probe %s", what, probe.run, exc_info=True)


def _close_open(reason: str, timeout: float) -> None:
    """Close the open probes (at exit, or on SIGTERM: probes/signals.py), each ending its run with ``reason``."""
    _each_open(f"close ({reason})", lambda probe: probe.close(timeout=timeout, reason=reason))


def _flush_open(timeout: float) -> None:
    """Send what the open probes hold, leaving them open (SIGTERM under another library's handler)."""
    _each_open("flush", lambda probe: probe.flush(timeout))


atexit.register(_close_at_exit)


def _steps(what: str, value: Any, hint: str = "") -> int:
    """A sampling interval: a positive whole number of steps (a numpy integer too), else a ValueError."""
    try:
        n = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{what} must be a positive whole number of steps, got {value!r}{hint}")
    return n


def _as_float(x: Any) -> float | None:
    """A finite float, or None for NaN/Inf (the wire's null). Raises TypeError for what is not a number."""
    v = float(x.detach().float().mean().item()) if isinstance(x, torch.Tensor) else float(x)
    return v if math.isfinite(v) else None


def _held(loss: Any) -> Any:
    """What the probe keeps of a step's loss until the next report. A CPU scalar is read now, as a float:
    on the CPU that is no host sync, and a float holds no tensor. Thousands of small tensors held between
    reports fragment the allocator's heap, so that the step's own large temporaries fault in fresh pages:
    ~4 page faults a step and +120 us on a 1.5 ms ML-100k step (docs/overhead.md). Any other loss (on a
    device, or per sample) is detached and read with the others at the report: one host sync."""
    if isinstance(loss, torch.Tensor):
        # item() needs no detach (it copies the value out), and costs half of detach() inside a step
        return loss.item() if loss.is_cpu and loss.dim() == 0 else loss.detach()
    return loss


class Probe:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        run: str | None = None,
        server: str | bool | None = None,
        sink: Sink | None = None,
        interval: int = DEFAULT_INTERVAL,
        collections: Iterable[str] | Mapping[str, int] | None = None,
        allow: Iterable[str] | Mapping[str, Mapping[str, float]] = (),
        token: str | None = None,
        spool_dir: str | os.PathLike | None = None,
        flush_interval: float = 0.25,
        comm_hook: Callable | None = None,
        time_allreduce: bool = False,
        scaler: Any = None,
        scheduler: Any = None,
        fisher_modules: Iterable[str] | None = None,
        fisher_decay: float | None = None,
        fisher_max_elements: int | None = None,
        rules: Mapping[str, Mapping[str, float] | bool] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"probes.attach needs an nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        interval = _steps("interval", interval)
        # The run's own configuration (hyper-parameters, model size, data), sent once in run_start so that
        # runs can be compared; made wire-safe here, so a value the server would refuse cannot lose the run.
        self.run_config, config_dropped = run_config.flatten(config if config is not None else {})
        self.model = model
        self.optimizer = optimizer
        self.run = run or _default_run()
        from schemas.enums import RUN_ID_PATTERN  # the server refuses every batch of a run id outside it

        if not isinstance(self.run, str) or not re.fullmatch(RUN_ID_PATTERN, self.run):
            source = "run" if run else "TRAINDX_RUN"
            raise ValueError(f"{source} {self.run!r} is not a valid run id: letters, digits, '.', '_', ':' and '-', "
                             "starting with a letter or digit, at most 128 characters")
        if isinstance(flush_interval, bool) or not isinstance(flush_interval, (int, float)) or not flush_interval > 0:
            raise ValueError(f"flush_interval must be a positive number of seconds, got {flush_interval!r}")
        self.world = world()
        self.clock = Clock()
        self.interval = interval
        self.params = [(n, p) for n, p in model.named_parameters()]
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.allow = self._parse_allow(allow)
        # Options of the opt-in 'fisher' collection (probes/fisher.py); read when it is built below.
        self.fisher_modules = list(fisher_modules) if fisher_modules is not None else None
        self.fisher_decay, self.fisher_max_elements = fisher_decay, fisher_max_elements
        self.held_batch: tuple | None = None
        self.collections: list[Collection] = []
        wanted = collections if collections is not None else DEFAULT_COLLECTIONS
        items = wanted.items() if isinstance(wanted, Mapping) else ((c, None) for c in wanted)
        for name, every in items:
            if name not in COLLECTIONS:
                raise ValueError(f"unknown collection {name!r}; known: {sorted(COLLECTIONS)}")
            if every is not None:
                every = _steps(f"collection {name!r}: its interval", every, " (leave a collection out to turn it off)")
            self.collections.append(COLLECTIONS[name](self, every or interval))
        self._fixed_interval = {c.name for c in self.collections} if isinstance(wanted, Mapping) else set()

        if sink is None:
            if server is False:
                # One file per rank: ranks appending to one file could interleave their lines.
                rank = f".rank{self.world['rank']}" if self.world["world_size"] > 1 else ""
                sink = FileSink(os.path.join(os.environ.get("TRAINDX_DATA", ".traindx"), "runs", f"{self.run}{rank}.jsonl"))
            else:
                url = server if isinstance(server, str) else os.environ.get("TRAINDX_SERVER", DEFAULT_SERVER)
                sink = HttpSink(url, token=token)
        self._inbox: deque[dict] = deque()
        self.sender = Sender(sink, self.run, on_commands=self._inbox.extend, spool_dir=spool_dir,
                             flush_interval=flush_interval, rank=self.world["rank"])
        self._target = fixes.Target(model, optimizer, self)
        # An LR scheduler that recomputes the rate from its base_lrs (LambdaLR, Hugging Face's schedules)
        # would undo an lr fix at its next step; lr fixes scale its base_lrs too (probes.fixes).
        if scheduler is not None:
            self._target.schedulers = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler]
        self._amp = ScalerWatch(scaler) if scaler is not None else None  # GradScaler skips (probes.amp)
        self._applied: dict[str, fixes.Applied] = {}
        self._seen_commands: set[tuple[str, str, str]] = set()
        # With other ranks, fixes wait for the step every rank applies them at (probes/agreement.py):
        # (fix id, op, attempt) -> (the command, that step). The agreement is made at the first such command.
        self._held: dict[tuple[str, str, str], tuple[dict, int]] = {}
        self._agreement: Agreement | None | bool = False  # False: not looked for yet
        self._skipped_steps = 0
        # A snapshot that waits for a forward pass knocks on the inbox when it is done, so step() needs no
        # check of its own: the inbox check it already makes covers it.
        self._snapshots = Snapshots(model, self.params, on_ready=lambda: self._inbox.append({"op": "_snapshots"}))
        self.rules = _rule_config(rules)
        self._deferred: dict[str, tuple[fixes.Deferred, dict]] = {}  # fix_id -> (action waiting, command)
        # Snapshots for the rollback action, only when the job allows it: allow={"rollback": {"every": K}}.
        self._rollback = RollbackBuffer.from_allow(model, optimizer, self.allow.get("rollback"))

        self._step = 0
        self._closed = False
        self._errors = 0
        self._logged: set[str] = set()
        self._bad_scalars: set[str] = set()  # the job's scalars already said not to be numbers (_not_numbers)
        # The losses since the last report: their steps, and the values (probe._held). Two flat lists, so
        # that a step adds no object the garbage collector tracks (a tuple a step, held until the report,
        # made the collector's full passes over a large process come far more often).
        self._loss_steps: list[int] = []
        self._losses: list[Any] = []
        self._user_scalars: list[tuple[int, dict]] = []
        self._in_flight: list[HostCopy] = []
        self.pending_scalars: dict[str, float] = {}
        self.step_time_sum = 0.0
        self._last_step_time: float | None = None
        self.step_time_max = 0.0
        self.steps_timed = 0
        self.prev_end: float | None = None
        self.step_called: float | None = None  # when the current step() call began: the step's end
        self._due: list[Collection] = []
        self._user_spans = new_user_spans()
        self._mode = TRAIN
        self._mode_stats: dict[str, list] = {}  # mode -> [steps, time sum, time max, prev end, t0, {scalar: [sum, n]}]
        self._capture: Capture | None = None
        self._seen_captures: set[str] = set()
        self._next_due = 0
        self._quiet_until = 0  # see _arm
        self._hook_errors: deque[tuple[str, Exception]] = deque(maxlen=MAX_ERRORS)  # raised in hooks; see hook_failed
        self.phases = Phases(model, optimizer, self.hook_failed)  # the step-boundary hooks the due collections share
        self._send_run_start()
        if config_dropped:
            self._message("warning", f"config: {config_dropped} keys left out past the first "
                                     f"{len(self.run_config)} (the most a run start carries)")
        for c in self.collections:
            if getattr(c, "note", None):  # what a collection cannot see in this job (a compiled model, say)
                self.sender.put({"kind": "message", "step": 0, "time": time.time(), "level": "info", "text": c.note})
        if comm_hook is not None or time_allreduce:
            self._install_comm_hook(comm_hook)
        self._arm(0)
        self._pid = os.getpid()
        _OPEN.add(self)
        signals.install(_close_open, _flush_open)  # a job stopped with SIGTERM ends its run saying so
        self.prev_end = time.perf_counter()

    # -- public API ----------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        return self._step

    def step(self, loss: Any = None, **scalars: Any) -> None:
        """Call once per training step, after ``optimizer.step()``. Never raises."""
        if self._closed:
            return
        # A SIGTERM arriving in the middle of a step waits for its end: the step may hold values (the
        # losses being sent) in its own frame, which closing the probe from the handler would lose.
        signals.stepping += 1
        try:
            self._step_once(loss, scalars)
        finally:
            signals.stepping -= 1
            if signals.pending and not signals.stepping:
                signals.deliver()

    def _step_once(self, loss: Any, scalars: dict) -> None:
        now = time.perf_counter()
        if self._mode != TRAIN:
            self._mode_step(now, loss, scalars)
            return
        step = self._step
        try:
            if self.prev_end is not None:
                dt = now - self.prev_end
                self.step_time_sum += dt
                self.steps_timed += 1
                if dt > self.step_time_max:
                    self.step_time_max = dt
            if loss is not None:
                self._loss_steps.append(step)
                self._losses.append(_held(loss))
            if scalars:
                self._user_scalars.append((step, scalars))
            self.step_called = now
            if self._amp is not None:
                self._amp.observe(step)
            if self._rollback is not None and self._rollback.due(step):
                self._rollback.keep(step, loss, self._losses)
            if self._deferred:
                self._finish_deferred(step)
            sampled = self._due
            # A quiet step: every collection due only tracks (its hooks did the step's work) and so does the
            # next step, with the same hooks; each closes this step and opens the next in one call.
            quiet = sampled and step + 1 < self._quiet_until
            if quiet:
                for c in sampled:
                    if not c.tick(step):  # its schedule changed: arm the next step as usual
                        self._quiet_until = 0
                if self._hook_errors:
                    self._report_hook_errors()
                self._between_reports()
            elif sampled:
                if self._capture is not None:
                    self._capture.pause(True)
                self._sample(step)
                if self._capture is not None:
                    self._capture.pause(False)
                self._due = []
            else:
                self._between_reports()
            if self._capture is not None:
                self._capture.step()
                if step >= self._capture.last_step:
                    capture, self._capture = self._capture, None
                    self.sender.put(capture.finish(step))
            if self._inbox or self._held:
                self._apply_commands(step)
            self._step = step + 1
            if not (quiet and step + 1 < self._quiet_until):  # (a command may have ended the quiet steps)
                if step + 1 >= self._next_due:
                    self._arm(step + 1)
                if sampled:
                    self._release(sampled)
        except Exception as e:  # noqa: BLE001 - the training job comes first
            self._degrade("step", e)
            self._step = step + 1
        self.prev_end = time.perf_counter()

    def log(self, step: int | None = None, **scalars: Any) -> None:
        """Record scalars (validation loss, accuracy, ...) now, outside the step cadence."""
        if self._closed or not scalars:
            return
        try:
            at = max(self._step - 1 if step is None else step, 0)
            by_step: dict[int, dict] = {}
            bad: list[str] = []
            for k, v in scalars.items():
                self._put_scalar(by_step, at, k, v, bad)
            if by_step:
                self.sender.put({"kind": "scalars", "step": at, "time": time.time(), "values": by_step[at]})
            if bad:
                self._not_numbers("log", bad)
        except Exception as e:  # noqa: BLE001
            self._degrade("log", e)

    @property
    def capturing(self) -> str | None:
        """The id of the diagnostic capture running now, if any."""
        return self._capture.id if self._capture is not None else None

    @property
    def captures_done(self) -> int:
        return len(self._seen_captures) - (self._capture is not None)

    def span(self, name: str) -> UserSpan:
        """Time a stage of your own: ``with probe.span("preprocess"): ...``. Costs two clock reads; the
        spans are sent with the next sampled step and show on the run's timeline."""
        return UserSpan(self._user_spans, str(name)[:256] or "span")

    def mode(self, mode: str) -> _ModeSwitch:
        """Switch what ``step()`` measures: ``with probe.mode("eval"): ...`` (or call it, then ``mode("train")``).

        Outside ``train`` a ``step()`` call is one evaluation or inference step: the probe times it (the
        latency goes to ``sys/<mode>/step_time``, ``..._max`` and ``.../steps``, and losses to
        ``<mode>/loss``), does not count it as a training step and samples nothing in it.
        """
        if not isinstance(mode, str) or not MODE_PATTERN.match(mode):
            raise ValueError(f"a mode is 1-64 letters, digits, '_', '.', '-'; got {mode!r}")
        return _ModeSwitch(self, mode)

    def take_user_spans(self, clock: Clock) -> list[dict]:
        out = []
        while self._user_spans:
            name, t0, t1 = self._user_spans.popleft()
            out.append({"name": name, "category": "user", "start": clock.wall_of(t0), "duration": max(t1 - t0, 0.0)})
        return out

    def defer_step_fixes(self) -> None:
        """Run gradient fixes from ``before_optimizer_step()`` instead of optimizer step pre-hooks.

        For frameworks whose ``optimizer.step(closure)`` computes the gradients inside ``step`` (Lightning),
        where a pre-hook would act on the previous step's gradients. Call it right after attaching.
        """
        if self._target.deferred is None:
            self._target.deferred = {}

    def before_optimizer_step(self) -> None:
        """After backward, before the update: run the active grad_clip / grad_scale / skip_nonfinite fixes,
        then what collections read there (the embeddings collection's looked-up rows)."""
        if self._closed or self._target.deferred is None:
            return
        try:
            for fn in list(self._target.deferred.values()):
                fn()
        except Exception as e:  # noqa: BLE001
            self._degrade("before_optimizer_step", e)
        for c in self.collections:
            try:
                c.before_optimizer_step()
            except Exception as e:  # noqa: BLE001 - as an error in the collection's hooks
                self.hook_failed(f"{c.name} hook", e)

    def set_held_batch(self, inputs: Any, targets: Any, loss_fn: Any) -> None:
        """A fixed batch the 'sensitivity' action measures the loss on: ``loss_fn(model(inputs), targets)``."""
        self.held_batch = (inputs, targets, loss_fn)

    def report(self, *, file: Any = None, timeout: float = 10.0) -> str:
        """Print the run's diagnosis and return it as text.

        Asked of the server when the probe sends to one; with no server (``server=False``, or a server that
        cannot be reached) the same rules run over the run's local events in a child process
        (``traindx report``), so the job never imports the server. Never raises: a failure is described
        in the returned text.
        """
        try:
            if not self._closed:
                self.flush(timeout)
            text = self._server_report(timeout) or self._local_report()
        except Exception as e:  # noqa: BLE001 - a report must not break the job
            text = f"traindx: no report for run {self.run}: {type(e).__name__}: {e}"
        print(text, file=file or sys.stdout)
        return text

    def _server_report(self, timeout: float) -> str | None:
        sink = self.sender.sink
        if not isinstance(sink, HttpSink):
            return None
        import httpx

        try:
            auth = sink.headers.get("authorization")
            r = httpx.get(f"{sink.server}/v1/runs/{self.run}/diagnosis", timeout=timeout,
                          headers={"accept": "application/json", **({"authorization": auth} if auth else {})})
        except httpx.HTTPError:
            return None
        return r.json().get("report") if r.status_code == 200 else None

    def _local_report(self) -> str:
        """The same rules over the events kept here, run by ``traindx report`` in a child process: the
        training job never imports the server (nor needs its dependencies, ``traindx[server]``)."""
        import subprocess
        import tempfile
        from pathlib import Path

        import orjson

        sink = self.sender.sink
        batches = getattr(sink, "batches", None)
        with tempfile.TemporaryDirectory(prefix="traindx-report-") as tmp:
            if isinstance(sink, FileSink):
                path = Path(sink.path)
            elif batches is not None:  # MemorySink
                path = Path(tmp) / "events.jsonl"
                path.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in batches))
            elif self.sender.spool_path.exists():  # the server was never reached: what it would have got
                path = self.sender.spool_path
            else:
                return (f"traindx: no report for run {self.run}: the server cannot be reached and no events "
                        "are kept locally")
            cmd = [sys.executable, "-m", "diag_server.cli", "report", str(path), "--run", self.run]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            if "traindx[server]" in done.stderr or "No module named" in done.stderr:
                kept = "" if batches is not None else f"; then `traindx report {path} --run {self.run}`"
                return (f"traindx: no report for run {self.run} without a server: the rules are the server's, "
                        f"not installed here (pip install 'traindx[server]'{kept})")
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"traindx: no report for run {self.run}: {last}"
        return done.stdout.rstrip("\n")

    def set_interval(self, interval: int) -> None:
        self.interval = interval
        for c in self.collections:
            if c.name not in self._fixed_interval:
                c.interval = interval
        self._next_due = min((c.next_due(self._step + 1) for c in self.collections), default=2**62)
        self._quiet_until = 0

    def flush(self, timeout: float = 10.0) -> bool:
        """Send everything measured so far; True when it reached the server. Waits up to ``timeout`` for a
        slow, busy or restarting server; sooner only when no server has answered this job at all."""
        self._flush_scalars()
        self._drain_in_flight(wait=True)
        return self.sender.flush(timeout)

    def close(self, timeout: float = 10.0, *, reason: str = "closed") -> None:
        """Send what is left and take every hook off. Called at interpreter exit for a probe left open.

        Returns once everything is delivered, or after ``timeout`` seconds (a slow or busy server is waited
        on, a server that went away is tried again until then), or after a short grace when no server has
        answered this job at all. What is still undelivered then stays in the spool, named in one log line
        with the command that delivers it (docs/reliability.md)."""
        if self._closed:
            return
        _OPEN.discard(self)
        try:
            if self._mode != TRAIN:
                self._switch_mode(TRAIN)
            if self._capture is not None:
                capture, self._capture = self._capture, None
                self.sender.put(capture.finish(max(self._step - 1, 0)))
            self._send_user_spans(self._step)
            self._report_hook_errors()
            for c in self.collections:
                c.close()
            self.phases.disarm()
            for h in list(self._target.hooks.values()):
                h.remove()
            self._snapshots.close()
            for deferred, _ in self._deferred.values():
                deferred.cancel()
            self._flush_scalars()
            self._drain_in_flight(wait=True)
            self.sender.put({"kind": "run_end", "step": self._step, "time": time.time(), "reason": reason})
        except Exception as e:  # noqa: BLE001
            self._degrade("close", e)
        self._closed = True
        self.sender.close(timeout)

    remove = close

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- sampling ------------------------------------------------------------------------------------
    def _arm(self, step: int) -> None:
        """Arm the collections due at ``step``; note the next step any collection is due, so the steps
        in between cost one comparison. A capture records everything, every step."""
        capturing = self._capture is not None
        self._due = due = [c for c in self.collections if capturing or c.due(step)]
        self._next_due = step + 1 if capturing else min((c.next_due(step + 1) for c in self.collections),
                                                        default=2**62)
        # The quiet steps from here (see _step_once): up to the first step at which a collection due now
        # does more than track, or another one is due.
        quiet = step
        if due and not capturing:
            quiet = min(c.quiet(step) for c in due)
            if quiet > step:
                quiet = min(quiet, min((c.next_due(step + 1) for c in self.collections if c not in due),
                                       default=2**62))
        self._quiet_until = quiet
        for c in due:
            c.arm(step)
        self.phases.arm(step, due)

    def _release(self, sampled: list[Collection]) -> None:
        """Take the hooks off the collections just sampled, but for those armed again for the next step:
        with every step sampled they are registered once, not every step."""
        for c in sampled:
            if c not in self._due:
                c.disarm()
        if self.phases.step != self._step:  # not armed again for the next step
            self.phases.disarm()

    def _sample(self, step: int) -> None:
        self._report_hook_errors()  # errors in hooks since the last sampled step (they run on sampled steps)
        reporting = False
        for c in self._due:
            self._in_flight.extend(c.collect(step))
            reporting = reporting or c.reports(step)
        if reporting:  # a step that is only tracked (embeddings) sends nothing and reads no loss
            self._flush_scalars(step)
            self._drain_in_flight(wait=False)
            self._send_user_spans(step)
        else:
            self._between_reports()

    def _between_reports(self) -> None:
        """On a step that sends no report: statistics that became ready since (a CUDA copy, a report made on
        a worker thread) go now, not at the next report; a loss buffer at its bound is read early."""
        if self._in_flight:
            self._drain_in_flight(wait=False)
        if len(self._losses) >= MAX_BUFFERED_LOSSES or len(self._amp or ()) >= MAX_BUFFERED_LOSSES:
            self._flush_scalars()

    def reset_step_times(self) -> None:
        if self.steps_timed:
            self._last_step_time = self.step_time_sum / self.steps_timed
        self.step_time_sum = self.step_time_max = 0.0
        self.steps_timed = 0

    def _step_time(self) -> float | None:
        """The mean time of a training step lately: since the last report, else over the interval before."""
        return self.step_time_sum / self.steps_timed if self.steps_timed else self._last_step_time

    def _flush_scalars(self, sampled_step: int | None = None) -> None:
        """Send buffered losses and scalars. One host sync for all the loss tensors of the interval."""
        steps, losses = self._loss_steps, self._losses
        self._loss_steps, self._losses = [], []
        user, self._user_scalars = self._user_scalars, []
        by_step: dict[int, dict[str, float | None]] = {}
        tensors = [(s, v) for s, v in zip(steps, losses) if isinstance(v, torch.Tensor)]
        if tensors:
            # A non-scalar loss (per-sample values) is reported as its mean. The usual loss, a 0-d float
            # tensor on one device, is stacked as it is: two operations for the interval, not two per step.
            ts = [v for _, v in tensors]
            first = ts[0]
            if all(v.dim() == 0 and v.dtype == first.dtype and v.device == first.device for v in ts):
                values = torch.stack(ts).float().tolist()
            else:
                values = torch.stack([v.float().mean().to(first.device) for v in ts]).tolist()
            for (s, _), v in zip(tensors, values):
                by_step.setdefault(s, {})["loss"] = v if math.isfinite(v) else None
        bad: list[str] = []
        for s, v in zip(steps, losses):
            if not isinstance(v, torch.Tensor):
                self._put_scalar(by_step, s, "loss", v, bad)
        for s, values in user:
            for k, v in values.items():
                self._put_scalar(by_step, s, k, v, bad)
        if self._amp is not None:
            self._amp.flush(by_step, sampled_step)
        if self.pending_scalars and sampled_step is not None:
            by_step.setdefault(sampled_step, {}).update(self.pending_scalars)
            self.pending_scalars = {}
        now = time.time()
        self.sender.put_many({"kind": "scalars", "step": s, "time": now, "values": by_step[s]} for s in sorted(by_step))
        if bad:
            self._not_numbers("step", bad)

    @staticmethod
    def _put_scalar(by_step: dict, step: int, name: str, value: Any, bad: list[str]) -> None:
        if value is None:  # no value this step (a validation loss computed every N steps): nothing to send
            return
        try:
            by_step.setdefault(step, {})[name] = _as_float(value)
        except (TypeError, ValueError, RuntimeError):
            bad.append(name)

    def _not_numbers(self, where: str, names: list[str]) -> None:
        """Scalars the job passed that are not numbers: dropped and said once per name, as a warning. The
        job's values, not a failure of the probe: they do not count towards switching sampling off."""
        new = sorted(set(names) - self._bad_scalars)
        if not new:
            return
        self._bad_scalars.update(new)
        try:
            self._message("warning", f"probe.{where}(): not a number, dropped: {', '.join(new)} (pass a float, "
                                     "a 0-d tensor, or None for no value)")
        except Exception:  # noqa: BLE001
            pass

    def _drain_in_flight(self, *, wait: bool) -> None:
        keep = []
        for hc in self._in_flight:
            if wait or hc.done():
                self.sender.put(hc.event())
            else:
                keep.append(hc)
        self._in_flight = keep

    # -- fixes ---------------------------------------------------------------------------------------
    @staticmethod
    def _parse_allow(allow: Iterable[str] | Mapping[str, Mapping[str, float]]) -> dict[str, dict]:
        from schemas.enums import FixAction

        items = allow.items() if isinstance(allow, Mapping) else ((a, {}) for a in allow)
        out = {}
        for action, bounds in items:
            name = action.value if isinstance(action, FixAction) else str(action)
            if name not in FixAction.__members__:
                raise ValueError(f"unknown fix action {name!r}; known: {sorted(FixAction.__members__)}")
            out[name] = dict(bounds)
        return out

    def _apply_commands(self, step: int, boundary: bool = True) -> None:
        """The commands picked up, after training step ``step`` (``boundary``) or an eval step's; then the
        fixes held for a step every rank applies them at, after that step."""
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd.get("op") == "capture":
                self._start_capture(cmd, step)
                continue
            if cmd.get("op") == "_snapshots":
                for ev in self._snapshots.poll():
                    self.sender.put(ev)
                continue
            key = (str(cmd.get("fix_id")), str(cmd.get("op", "apply")), str(cmd.get("attempt", 1)))
            if key in self._seen_commands:
                continue  # the server resends until it sees our ack; apply once (a new attempt is a new request)
            self._seen_commands.add(key)
            if key[1] == "snapshot":
                ev = self._snapshots.request(cmd, step)
                if ev is not None:
                    self.sender.put(ev)
                continue
            agreement = self._ranks_agreement()
            if agreement is None:
                self.sender.put(self._run_command(cmd, step))
                continue
            try:
                at = agreement.propose(key, step, self._step_time())
            except Exception as e:  # noqa: BLE001 - the store is the process group's: failing, nothing is applied
                self.sender.put(self._refusal(cmd, step, f"the ranks could not agree on a step: {e}"))
                continue
            self._held[key] = (cmd, at)
            if step < at:  # the server waits for the answer from then on
                self.sender.put({"kind": "fix_ack", "step": at, "time": time.time(), "fix_id": key[0], "op": key[1],
                                 "status": "scheduled"})
        if boundary:
            for key, (cmd, at) in list(self._held.items()):
                if step >= at:
                    del self._held[key]
                    self.sender.put(self._agreed(key, cmd, step, at))

    def _ranks_agreement(self) -> Agreement | None:
        if self._agreement is False:
            self._agreement = Agreement.for_job(self.run, self.world["world_size"])
        return self._agreement

    def _agreed(self, key: tuple[str, str, str], cmd: dict, step: int, at: int) -> dict:
        """A held command after the step the ranks agreed on: applied, or refused by all of them alike."""
        try:
            why = self._agreement.verdict(key, step, at)
        except Exception as e:  # noqa: BLE001
            why = f"the ranks could not agree: {e}"
        if why is None:
            return self._run_command(cmd, step)
        return self._refusal(cmd, step, f"not applied: {why} (every rank applies a fix after the same step, "
                                        "or none does); ask again")

    @staticmethod
    def _refusal(cmd: dict, step: int, reason: str) -> dict:
        return {"kind": "fix_ack", "step": step, "time": time.time(), "fix_id": str(cmd.get("fix_id")),
                "op": cmd.get("op", "apply"), "status": "rejected" if cmd.get("op", "apply") == "apply" else "failed",
                "reason": reason}

    def _run_command(self, cmd: dict, step: int) -> dict:
        fix_id, op, action = str(cmd.get("fix_id")), cmd.get("op", "apply"), str(cmd.get("action"))
        ack = {"kind": "fix_ack", "step": step, "time": time.time(), "fix_id": fix_id, "op": op}
        if op == "revert":
            applied = self._applied.pop(fix_id, None)
            if applied is None:
                return {**ack, "status": "failed", "reason": "nothing to revert: the fix was not applied by this job"}
            if applied.undo is None:
                return {**ack, "status": "failed", "reason": f"{action!r} cannot be undone"}
            try:
                restored = applied.undo()
            except Exception as e:  # noqa: BLE001
                return {**ack, "status": "failed", "reason": f"revert failed: {e}"}
            return {**ack, "status": "reverted", "before": _wire(applied.after), "after": _wire(restored or applied.before)}
        if action not in self.allow:
            return {**ack, "status": "rejected",
                    "reason": f"this job does not allow {action!r} (allowed: {sorted(self.allow) or 'none'})"}
        try:
            applied = registry.apply(action, self._target, cmd.get("params") or {}, self.allow[action], fix_id)
        except fixes.FixRejected as e:
            return {**ack, "status": "rejected", "reason": str(e)}
        except Exception as e:  # noqa: BLE001
            return {**ack, "status": "failed", "reason": f"{type(e).__name__}: {e}"}
        if isinstance(applied, fixes.Deferred):
            self._deferred[fix_id] = (applied, cmd)
            return {"kind": "message", "step": step, "time": time.time(), "level": "info",
                    "text": f"fix {fix_id} ({action}) waits for the next forward pass to see what to change"}
        return self._applied_ack(ack, action, applied)

    def _applied_ack(self, ack: dict, action: str, applied: fixes.Applied) -> dict:
        self._applied[ack["fix_id"]] = applied
        log.warning("traindx: applied fix %s (%s) at step %d: %s -> %s", ack["fix_id"], action, ack["step"],
                    applied.before, applied.after)
        return {**ack, "status": "applied", "before": _wire(applied.before), "after": _wire(applied.after)}

    def _finish_deferred(self, step: int) -> None:
        """Complete actions that waited for a forward pass (at the step boundary after it), and acknowledge."""
        for fix_id, (deferred, cmd) in list(self._deferred.items()):
            action = str(cmd.get("action"))
            ack = {"kind": "fix_ack", "step": step, "time": time.time(), "fix_id": fix_id, "op": "apply"}
            try:
                applied = deferred.finish()
            except fixes.FixRejected as e:
                applied, ack = None, {**ack, "status": "rejected", "reason": str(e)}
            except Exception as e:  # noqa: BLE001
                deferred.cancel()
                applied, ack = None, {**ack, "status": "failed", "reason": f"{type(e).__name__}: {e}"}
            if applied is None and "status" not in ack:
                deferred.waited += 1
                if deferred.waited < deferred.max_steps:
                    continue
                deferred.cancel()
                ack = {**ack, "status": "failed",
                       "reason": f"the module did not run in {deferred.max_steps} steps, so nothing was changed"}
            del self._deferred[fix_id]
            self.sender.put(ack if applied is None else self._applied_ack(ack, action, applied))

    # -- setup and failure ---------------------------------------------------------------------------
    def _send_run_start(self) -> None:
        opt = None
        if self.optimizer is not None:
            groups = []
            for g in self.optimizer.param_groups:
                groups.append({k: _hyper(v) for k, v in g.items() if k != "params" and _hyper(v) is not None})
            opt = {"type": type(self.optimizer).__name__, "param_groups": groups}
        self.sender.put({
            "kind": "run_start", "step": 0, "time": time.time(),
            "modules": [{"name": n, "type": type(m).__name__} for n, m in self.model.named_modules() if n],
            "params": [_param_info(n, p) for n, p in self.params],
            "total_params": sum(p.numel() for _, p in self.params),
            "optimizer": opt, "torch_version": torch.__version__, "device": str(self.device),
            "world_size": self.world["world_size"], "rank": self.world["rank"],
            "local_rank": self.world["local_rank"], "host": self.world["host"], "allow": sorted(self.allow),
            "config": {"interval": self.interval, "collections": [c.name for c in self.collections],
                       "amp_scaler": self._amp is not None, "quantile_sample": quantiles.SAMPLE, **self.rules},
            "run_config": self.run_config,
        })

    # -- execution context: modes, user spans, captures, the all-reduce ------------------------------------
    def _install_comm_hook(self, hook: Callable | None) -> None:
        timeline = next((c for c in self.collections if isinstance(c, Timeline)), None)
        try:
            if timeline is not None:
                why = timeline.install_comm_hook(self.model, hook)
                if why is not None and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                    self._message("warning", f"all-reduce timing is off: {why}")
            elif hook is not None:
                self.model.register_comm_hook(None, hook)
        except Exception as e:  # noqa: BLE001
            self._degrade("comm_hook", e)

    def _message(self, level: str, text: str) -> None:
        log.warning("traindx: %s", text)
        self.sender.put({"kind": "message", "step": self._step, "time": time.time(), "level": level, "text": text[:4000]})

    def _send_user_spans(self, step: int) -> None:
        if self._user_spans:
            self.clock.anchor()
            self.sender.put({"kind": "spans", "step": step, "time": time.time(), "mode": self._mode,
                             "spans": self.take_user_spans(self.clock)})

    def _start_capture(self, cmd: dict, step: int) -> None:
        capture_id = str(cmd.get("capture_id"))
        if capture_id in self._seen_captures or self._mode != TRAIN:
            return  # the server resends until it has our result: an eval block starts it afterwards
        self._seen_captures.add(capture_id)
        if self._capture is not None:
            self._message("warning", f"capture {capture_id} waits: capture {self._capture.id} is still running")
            self._seen_captures.discard(capture_id)
            return
        steps = max(1, min(int(cmd.get("steps") or 1), 100))
        self._capture = Capture(self, capture_id, steps, bool(cmd.get("profile", True)), step + 1)
        self._next_due = self._quiet_until = 0  # arm every collection from the next step on
        log.warning("traindx: capture %s: recording everything for steps %d-%d", capture_id, step + 1, step + steps)

    def _suspend(self) -> None:
        """Take the one-shot hooks of the armed collections off (for eval steps in between)."""
        for c in self._due:
            c.disarm()
        self.phases.disarm()

    def _switch_mode(self, mode: str) -> None:
        if mode == self._mode:
            return
        old = self._mode
        if old == TRAIN:
            self._suspend()
        else:
            self._flush_mode(old)
        self._mode = mode
        now = time.perf_counter()
        if mode == TRAIN:
            self._arm(self._step)
            self.prev_end = now  # the eval block is not the next training step's data wait
        else:
            self._mode_stats[mode] = [0, 0.0, 0.0, now, now, {}]

    def _mode_step(self, now: float, loss: Any, scalars: dict) -> None:
        try:
            st = self._mode_stats[self._mode]
            dt = now - st[3]
            st[0] += 1
            st[1] += dt
            st[2] = max(st[2], dt)
            values = dict(scalars)
            if loss is not None:
                values["loss"] = loss
            bad = []
            for k, v in values.items():
                if v is None:  # no value this step
                    continue
                try:
                    x = v.detach().float() if isinstance(v, torch.Tensor) else float(v)  # summed on device
                except (TypeError, ValueError, RuntimeError):
                    bad.append(k)
                    continue
                acc = st[5].setdefault(k, [0.0, 0])
                acc[0] += x
                acc[1] += 1
            if bad:
                self._not_numbers("step", bad)
            if self._inbox:
                self._apply_commands(self._step, boundary=False)
        except Exception as e:  # noqa: BLE001
            self._degrade("mode_step", e)
        self._mode_stats[self._mode][3] = time.perf_counter()

    def _flush_mode(self, mode: str) -> None:
        st = self._mode_stats.pop(mode, None)
        if not st or not st[0]:
            return
        n, total, worst, _, t0, acc = st
        values: dict[str, float | None] = {f"sys/{mode}/step_time": total / n, f"sys/{mode}/step_time_max": worst,
                                           f"sys/{mode}/steps": float(n)}
        for k, (s, c) in acc.items():
            values[f"{mode}/{k}"] = _as_float(s / c)  # one host read per scalar per block
        at = max(self._step - 1, 0)
        self.sender.put({"kind": "scalars", "step": at, "time": time.time(), "values": values})
        self.clock.anchor()
        self._user_spans.append((mode, t0, time.perf_counter()))
        self.sender.put({"kind": "spans", "step": at, "time": time.time(), "mode": mode,
                         "spans": self.take_user_spans(self.clock)})

    def hook_failed(self, where: str, err: Exception) -> None:
        """An error inside one of the probe's hooks (or on its embeddings worker), kept for the next sampled
        step (or close()) to report: a hook runs inside the job's forward or optimizer step, where the probe
        must neither raise nor take hooks off. Thread-safe (a deque append)."""
        self._hook_errors.append((where, err))

    def _report_hook_errors(self) -> None:
        while self._hook_errors:
            self._degrade(*self._hook_errors.popleft())

    def _degrade(self, where: str, err: Exception) -> None:
        self._errors += 1
        if where not in self._logged:
            self._logged.add(where)
            log.warning("traindx: probe error in %s (%s: %s); the training job is not affected",
                        where, type(err).__name__, err, exc_info=err)  # its traceback, even when reported later
            try:
                self.sender.put({"kind": "message", "step": self._step, "time": time.time(), "level": "error",
                                 "text": f"probe error in {where}: {type(err).__name__}: {err}"[:4000]})
            except Exception:  # noqa: BLE001
                pass
        if self._errors >= MAX_ERRORS and self.collections:
            log.warning("traindx: %d probe errors; sampling switched off for this run", self._errors)
            for c in self.collections:
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
            self.phases.disarm()
            self.collections = []
            self._due = []
            self._next_due = 2**62
            self._quiet_until = 0


class _ModeSwitch:
    """Returned by ``probe.mode(m)``: the mode is switched at once; leaving a ``with`` block switches back."""

    def __init__(self, probe: Probe, mode: str) -> None:
        self.probe, self.previous = probe, probe._mode
        try:
            probe._switch_mode(mode)
        except Exception as e:  # noqa: BLE001
            probe._degrade("mode", e)

    def __enter__(self) -> Probe:
        return self.probe

    def __exit__(self, *exc: Any) -> None:
        try:
            self.probe._switch_mode(self.previous)
        except Exception as e:  # noqa: BLE001
            self.probe._degrade("mode", e)


def _rule_config(rules: Mapping[str, Mapping[str, float] | bool] | None) -> dict:
    """``{"dead_relu": {"threshold": 0.8}, "oscillating_loss": False}`` -> the run start's flat config keys."""
    out: dict[str, Any] = {}
    disabled = []
    for rule, setting in (rules or {}).items():
        if setting is False:
            disabled.append(str(rule))
        elif isinstance(setting, Mapping):
            for param, value in setting.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"rules[{rule!r}][{param!r}] must be a number, got {value!r}")
                out[f"rules.{rule}.{param}"] = float(value)
        elif setting is not True:
            raise ValueError(f"rules[{rule!r}] must be a dict of parameters, or False to disable it")
    if disabled:
        out["rules.disable"] = disabled
    return out


def _param_info(name: str, p: torch.Tensor) -> dict:
    info = {"name": name, "shape": list(p.shape), "numel": p.numel(), "trainable": p.requires_grad,
            "dtype": str(p.dtype).replace("torch.", "")}
    if sharded(p):  # FSDP2: this rank holds one shard, and its statistics are of that shard
        info["local_numel"] = local(p).numel()
        info["placements"] = ", ".join(str(x) for x in p.placements)[:256]
    return info


def _hyper(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.item())
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float, str)):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return [float(x) for x in v]
    return None


def _wire(values: Mapping) -> dict:
    """Fix before/after values in the wire's Params form (lists of numbers or strings, scalars)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, (list, tuple)):
            out[k] = [x if isinstance(x, (str, int, float)) and not isinstance(x, bool) else str(x) for x in v]
        else:
            out[k] = v
    return out


def attach(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> Probe:
    """Attach a probe to ``model`` (and ``optimizer``); see ``Probe`` for the keyword options."""
    return Probe(model, optimizer, **kwargs)
