"""The background thread that folds and reports the queued path's CPU tables, and the report it hands back.

For CPU tables where torch's intra-op threads leave a core free, folds and reports run on one background
thread: ATen releases the GIL inside its operations, so they overlap the training thread while that core
is free. A report made there reaches the sender at the first step after it is finished, like a CUDA copy
still in flight. On CUDA they stay inline: their kernels are asynchronous already.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable

import torch

from ..collect import HostCopy

# At most this many folds are queued or running; past that the training thread waits for them and folds
# inline (back-pressure: the queued copies stay within (MAX_JOBS + 2) x the state module's FLUSH_VALUES
# bound, counting the queue being filled and the spare buffer a fold hands back).
MAX_JOBS = 2
# The worker thread ends after this many idle seconds (a probe never closed leaves no thread behind for
# long); the next fold starts another.
WORKER_IDLE_S = 30.0


def spare_core() -> bool:
    """Whether torch's intra-op threads leave a core of this process free (the worker then competes with
    nobody of ours; with every core busy it only adds context switches)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class Worker:
    """One background thread that runs a collection's folds and reports in order, for CPU tables: ATen
    releases the GIL inside its operations, so their compute overlaps the training thread on another
    core. Bounded: submit() refuses a job while MAX_JOBS are queued or running (the caller then waits and
    runs it itself). A job's error goes to ``on_error`` (the probe's hook_failed: reported at its next
    step, like an error in one of its hooks); it never reaches the training loop from here."""

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self.on_error = on_error
        self._cond = threading.Condition()
        self.jobs: deque[Callable[[], None]] = deque()  # the first one is running
        self.thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stop = False

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def submit(self, job: Callable[[], None]) -> bool:
        with self._cond:
            if len(self.jobs) >= MAX_JOBS or self._stop:
                return False
            self.jobs.append(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="traindx-embeddings", daemon=True)
                self.thread.start()
            self._cond.notify_all()
        return True

    def wait(self) -> None:
        """Until every submitted job has finished (at once on the worker itself: its own job is running)."""
        if self.on_thread():
            return
        with self._cond:
            while self.jobs:
                self._cond.wait()

    def close(self) -> None:
        self.wait()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self.thread
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        self._ident = threading.get_ident()
        while True:
            with self._cond:
                while not self.jobs:
                    if self._stop or (not self._cond.wait(WORKER_IDLE_S) and not self.jobs):
                        self.thread, self._ident = None, None  # idents are reused by later threads
                        return
                job = self.jobs[0]
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - for the training thread, which degrades
                self.on_error(e)
            with self._cond:
                self.jobs.popleft()
                self._cond.notify_all()


class LateReport(HostCopy):
    """A report that the worker packs (its rows are decoded when it is sent, on the training thread: pure
    Python on the worker would hold the GIL): done once the worker got to it. A report that failed
    becomes an error message, so that sending it never raises."""

    def __init__(self, collection: str, step: int, names: list[str]) -> None:
        self.collection, self.step, self.names = collection, step, names
        self.time = time.time()
        self.host, self.ready = None, None
        self.raw: list[float] | None = None
        self.to_rows: Callable[[list[str], list[float]], list[dict]] | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def event(self) -> dict:
        if self.finished.wait(timeout=60.0) and self.raw is not None and self.to_rows is not None:
            return {"kind": "tensor_stats", "step": self.step, "time": self.time,
                    "collection": self.collection, "rows": self.to_rows(self.names, self.raw)}
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "not finished in 60 s"
        return {"kind": "message", "step": self.step, "time": self.time, "level": "error",
                "text": f"traindx: the {self.collection} report of step {self.step} was not made ({why})"[:4000]}
