"""The background sender: batches events, delivers them through a sink, spools what cannot be delivered.

The training thread only appends to a bounded queue (``put``); it never waits on the network. When the
server is away, batches go to a spool file in order and are replayed, oldest first, once it answers.
Every batch has an id, so a batch replayed after it was in fact stored counts once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable

import orjson

from .sinks import RejectedBatch, Sink, SinkError, dumps

log = logging.getLogger("traindx.probe")


def default_spool_dir() -> Path:
    return Path(os.environ.get("TRAINDX_SPOOL", os.path.join(".traindx", "spool")))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Sender:
    def __init__(
        self,
        sink: Sink,
        run: str,
        *,
        on_commands: Callable[[list[dict]], None] | None = None,
        spool_dir: str | os.PathLike | None = None,
        max_queue: int = 50_000,
        max_batch: int = 2_000,
        flush_interval: float = 0.25,
        heartbeat: float = 1.0,
        max_spool_bytes: int = 256 << 20,
        rank: int = 0,
    ) -> None:
        self.sink = sink
        self.run = run
        self.rank = rank
        self.on_commands = on_commands
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.flush_interval = flush_interval
        self.heartbeat = heartbeat
        self.max_spool_bytes = max_spool_bytes
        self.spool_dir = Path(spool_dir) if spool_dir is not None else default_spool_dir()
        self.spool_path = self.spool_dir / f"{run}.{os.getpid()}.{uuid.uuid4().hex[:8]}.spool"
        self.dropped = 0  # events lost to a full queue or spool; reported to the server in a message
        self.rejected = 0  # batches the server refused as malformed
        self.sent_batches = 0
        self._reported_dropped = 0
        self._queue: deque[dict] = deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool_offset = 0  # bytes of our own spool already delivered
        self._spooled = False
        self._orphans = self._find_orphan_spools()
        self._failures = 0
        self._next_try = 0.0
        self._last_contact = 0.0
        self._stop = False
        self._inflight = 0
        self._thread = threading.Thread(target=self._loop, name=f"traindx-sender-{run}", daemon=True)
        self._thread.start()

    # -- training-thread side -------------------------------------------------------------------------
    def put(self, event: dict) -> None:
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self.dropped += 1
                return
            self._queue.append(event)
            if len(self._queue) >= self.max_batch:
                self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is delivered or spooled. True when delivered."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.notify()
            while (self._queue or self._inflight) and time.monotonic() < deadline:
                self._cond.wait(0.05)
            return not self._queue and not self._inflight and not self._spooled

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        try:
            self.sink.close()
        except Exception:  # noqa: BLE001 - closing must not raise into the job
            pass

    @property
    def pending_spool(self) -> bool:
        return self._spooled or bool(self._orphans)

    # -- sender-thread side ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._stop and len(self._queue) < self.max_batch:
                    self._cond.wait(self.flush_interval)
                events = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                self._inflight = len(events)
                stop = self._stop
            try:
                self._report_drops(events)
                self._tick(events)
            except Exception:  # noqa: BLE001 - the sender thread must never die
                log.exception("traindx: sender error; events of this batch were spooled if possible")
            with self._cond:
                self._inflight = 0
                self._cond.notify_all()
            if stop:
                return

    def _report_drops(self, events: list[dict]) -> None:
        if self.dropped > self._reported_dropped:
            n = self.dropped - self._reported_dropped
            self._reported_dropped = self.dropped
            events.append({"kind": "message", "step": 0, "time": time.time(), "level": "warning",
                           "text": f"probe dropped {n} events (queue or spool full); {self.dropped} in all"})

    def _tick(self, events: list[dict]) -> None:
        now = time.monotonic()
        if not events and now - self._last_contact < self.heartbeat:
            return
        batch = {"batch_id": uuid.uuid4().hex, "run": self.run, "seq": self._seq, "events": events}
        if self.rank:  # a one-process run sends the batch it always did; the server reads a missing rank as 0
            batch["rank"] = self.rank
        self._seq += 1
        if now < self._next_try or not self._drain_spools():
            if events:
                self._spool(batch)
            return
        self._deliver(batch, spool_on_failure=bool(events))

    def _deliver(self, batch: dict, *, spool_on_failure: bool) -> bool:
        try:
            reply = self.sink.send(batch)
        except RejectedBatch as e:
            self.rejected += 1
            log.warning("traindx: %s", e)
            return True
        except SinkError as e:
            self._failed(e)
            if spool_on_failure:
                self._spool(batch)
            return False
        self._failures = 0
        self._next_try = 0.0
        self._last_contact = time.monotonic()
        self.sent_batches += 1
        commands = reply.get("commands") if isinstance(reply, dict) else None
        if commands and self.on_commands is not None:
            self.on_commands(commands)
        captures = reply.get("captures") if isinstance(reply, dict) else None
        if captures and self.on_commands is not None:
            self.on_commands([{**c, "op": "capture"} for c in captures])
        return True

    def _failed(self, err: Exception) -> None:
        if self._failures == 0:
            log.warning("traindx: server unreachable (%s); spooling to %s", err, self.spool_path)
        self._failures += 1
        self._next_try = time.monotonic() + min(0.25 * 2 ** min(self._failures, 5), 5.0)

    def _spool(self, batch: dict) -> None:
        line = dumps(batch) + b"\n"
        try:
            size = self.spool_path.stat().st_size if self._spooled else 0
            if size + len(line) > self.max_spool_bytes:
                self.dropped += len(batch["events"])
                return
            self.spool_dir.mkdir(parents=True, exist_ok=True)
            with open(self.spool_path, "ab") as fh:
                fh.write(line)
            self._spooled = True
        except OSError as e:
            self.dropped += len(batch["events"])
            log.warning("traindx: cannot write spool %s: %s", self.spool_path, e)

    def _drain_spools(self) -> bool:
        """Replay spooled batches, oldest first. True when nothing is left to replay."""
        while self._orphans:
            if not self._replay(self._orphans[0], 0, own=False):
                return False
            self._orphans.pop(0)
        if self._spooled:
            return self._replay(self.spool_path, self._spool_offset, own=True)
        return True

    def _replay(self, path: Path, offset: int, *, own: bool) -> bool:
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return True
        with fh:
            fh.seek(offset)
            for line in fh:
                try:
                    batch = orjson.loads(line)
                except orjson.JSONDecodeError:  # a torn last line from a crash: nothing to replay
                    offset += len(line)
                    continue
                if not self._deliver(batch, spool_on_failure=False):
                    if own:
                        self._spool_offset = offset
                    return False
                offset += len(line)
        path.unlink(missing_ok=True)
        if own:
            self._spooled = False
            self._spool_offset = 0
        return True

    def _find_orphan_spools(self) -> list[Path]:
        """Spool files left by probes of this run whose process is gone: replay them before our own."""
        try:
            candidates = sorted(self.spool_dir.glob(f"{self.run}.*.spool"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        orphans = []
        for p in candidates:
            parts = p.name[len(self.run) + 1:].split(".")
            if parts and parts[0].isdigit() and not _pid_alive(int(parts[0])):
                orphans.append(p)
        return orphans
