"""The background sender: batches events, delivers them through a sink, spools what cannot be delivered.

The training thread only appends to a bounded queue (``put``); it never waits on the network. When the
server is away (or asks for a pause with 429/503 + Retry-After), batches go to a spool file in order and
are replayed, oldest first, once it answers; a new batch is never sent while older ones wait. Every batch
has an id, so a batch replayed after it was in fact stored counts once.

A spool file is held with an exclusive ``flock`` while its process lives. A spool whose lock can be
taken belongs to a process that died (or exited with the server away): the next probe started in the
same spool directory replays it first, whatever its run. A torn last line (a crash mid-write) is skipped.
What the queue or spool limits drop, and batches the server refuses as malformed, are counted and
reported to the server later as the scalars ``probe/dropped_events`` and ``probe/rejected_events``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

import orjson

from .sinks import RejectedBatch, Sink, SinkError, dumps

try:
    import fcntl
except ImportError:  # Windows: fall back to asking whether the writer's pid is alive
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("traindx.probe")

MAX_COMMANDS_PER_REPLY = 100  # more than any real reply carries; a reply with more is not trusted whole
ORPHAN_RESCAN_S = 30.0


def _try_lock(fh) -> bool:  # noqa: ANN001
    if fcntl is None:
        return True
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


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
        self.dropped = 0  # events lost to a full queue or spool; reported to the server later
        self.rejected = 0  # batches the server refused as malformed
        self.rejected_events = 0
        self.sent_batches = 0
        self.spooled_batches = 0
        self._reported = (0, 0)
        self._last_step = 0
        self._spool_fh = None  # our spool, opened (and locked) on first use
        self._spool_lock = threading.Lock()  # close() may spool from the job's thread while we hang
        self._inflight_batch: dict | None = None
        self._last_scan = time.monotonic()
        self._queue: deque[dict] = deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool_offset = 0  # bytes of our own spool already delivered
        self._spooled = False
        self._orphans = self._find_orphan_spools()
        self._failures = 0
        self._away_failures = 0  # deliveries that failed with no Retry-After: the server is away (flush watches it)
        self._server_asked_pause = False  # the current back-off is the server's Retry-After
        self._next_try = 0.0
        self._last_contact = 0.0
        self._stop = False
        self._inflight = 0
        self._thread = threading.Thread(target=self._loop, name=f"traindx-sender-{run}", daemon=True)
        self._thread.start()

    # -- training-thread side -------------------------------------------------------------------------
    def put(self, event: dict) -> None:
        self.put_many((event,))

    def put_many(self, events: Iterable[dict]) -> None:
        """Queue events in order, under one lock (a report's hundred losses: one lock, not a hundred); past
        the queue's bound they are dropped and counted."""
        with self._cond:
            queue, room = self._queue, self.max_queue - len(self._queue)
            for event in events:
                if room <= 0:
                    self.dropped += 1
                    continue
                queue.append(event)
                room -= 1
            if len(queue) >= self.max_batch:
                self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Deliver everything queued or spooled so far: True when it all reached the server.

        Returns early, False, when a delivery tried after the call fails: the server is away, and what
        is left is safe in the spool (a job ending during an outage does not wait out ``timeout``).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            failures_before = self._away_failures
            if not self._server_asked_pause:
                self._next_try = 0.0  # try now, even while backing off (not when the server asked for the pause)
            self._cond.notify()
            while (self._queue or self._inflight or self.pending_spool) and time.monotonic() < deadline:
                if not self._queue and not self._inflight and self._away_failures > failures_before:
                    break  # (a busy server, answering 429/503 with Retry-After, is not away: keep waiting)
                self._cond.wait(0.05)
            return not self._queue and not self._inflight and not self.pending_spool

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            # The server hangs: keep what is still here in the spool for the next probe (or traindx import)
            # rather than lose it with the process. The batch in flight may be stored twice: its id makes
            # the second copy count for nothing.
            with self._cond:
                events, self._queue = list(self._queue), deque()
                inflight = self._inflight_batch
            try:
                if inflight is not None:
                    self._spool(inflight)
                if events:
                    self._spool({"batch_id": uuid.uuid4().hex, "run": self.run, "seq": self._seq, "events": events})
            except Exception:  # noqa: BLE001
                log.warning("traindx: could not spool the last events at close", exc_info=True)
        try:
            self.sink.close()
        except Exception:  # noqa: BLE001 - closing must not raise into the job
            pass
        self._close_spool()

    @property
    def pending_spool(self) -> bool:
        return self._spooled or bool(self._orphans)

    @property
    def queued(self) -> int:
        return len(self._queue)

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
        for ev in events:
            step = ev.get("step")
            if isinstance(step, int) and step > self._last_step:
                self._last_step = step
        counts = (self.dropped, self.rejected_events)
        if counts == self._reported:
            return
        n = counts[0] - self._reported[0]
        self._reported = counts
        now = time.time()
        events.append({"kind": "scalars", "step": self._last_step, "time": now,
                       "values": {"probe/dropped_events": float(counts[0]), "probe/rejected_events": float(counts[1])}})
        if n:
            events.append({"kind": "message", "step": self._last_step, "time": now, "level": "warning",
                           "text": f"probe dropped {n} events (queue or spool full); {counts[0]} in all"})

    def _tick(self, events: list[dict]) -> None:
        now = time.monotonic()
        if not events:
            if self.pending_spool:
                if now < self._next_try:
                    return  # backing off; the spool is replayed when the delay is over
            elif now - self._last_contact < self.heartbeat:
                return
        batch = {"batch_id": uuid.uuid4().hex, "run": self.run, "seq": self._seq, "events": events}
        if self.rank:  # a one-process run sends the batch it always did; the server reads a missing rank as 0
            batch["rank"] = self.rank
        self._seq += 1
        self._inflight_batch = batch if events else None
        try:
            if not self._spooled and not self._orphans and now - self._last_scan > ORPHAN_RESCAN_S:
                self._last_scan = now
                self._orphans = self._find_orphan_spools()
            if now < self._next_try or not self._drain_spools():
                if events:
                    self._spool(batch)
                return
            self._deliver(batch, spool_on_failure=bool(events))
        finally:
            self._inflight_batch = None

    def _deliver(self, batch: dict, *, spool_on_failure: bool) -> bool:
        try:
            reply = self.sink.send(batch)
        except RejectedBatch as e:
            self.rejected += 1
            self.rejected_events += len(batch.get("events") or ())
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
        if isinstance(commands, list) and commands and self.on_commands is not None:
            # Only well-formed commands reach the job; what to do with them is the job's decision.
            self.on_commands([c for c in commands[:MAX_COMMANDS_PER_REPLY] if isinstance(c, dict)])
        captures = reply.get("captures") if isinstance(reply, dict) else None
        if isinstance(captures, list) and captures and self.on_commands is not None:
            self.on_commands([{**c, "op": "capture"} for c in captures[:MAX_COMMANDS_PER_REPLY] if isinstance(c, dict)])
        return True

    def _failed(self, err: Exception) -> None:
        asked = getattr(err, "retry_after", None)
        if self._failures == 0:
            log.warning("traindx: server %s (%s); spooling to %s", "busy" if asked is not None else "unreachable",
                        err, self.spool_path)
        self._failures += 1
        delay = min(0.25 * 2 ** min(self._failures, 5), 5.0)
        self._server_asked_pause = asked is not None
        if asked is not None:  # the server's back-pressure: honour it
            delay = max(delay, asked)
        else:
            self._away_failures += 1
        self._next_try = time.monotonic() + delay

    def _spool(self, batch: dict) -> None:
        with self._spool_lock:
            self._spool_locked(batch)

    def _spool_locked(self, batch: dict) -> None:
        line = dumps(batch) + b"\n"
        try:
            if self._spool_fh is None:
                self.spool_dir.mkdir(parents=True, exist_ok=True)
                self._spool_fh = open(self.spool_path, "ab")
                _try_lock(self._spool_fh)  # held while we live: our spool is no orphan
            size = self._spool_fh.tell()
            if size + len(line) > self.max_spool_bytes:
                self.dropped += len(batch["events"])
                return
            # One write of a whole line, flushed: a crash can tear only the last line, which replay skips.
            self._spool_fh.write(line)
            self._spool_fh.flush()
            self._spooled = True
            self.spooled_batches += 1
        except (OSError, ValueError) as e:
            self.dropped += len(batch["events"])
            log.warning("traindx: cannot write spool %s: %s", self.spool_path, e)

    def _close_spool(self) -> None:
        fh, self._spool_fh = self._spool_fh, None
        if fh is None:
            return
        try:
            empty = not self._spooled
            fh.close()
            if empty:
                self.spool_path.unlink(missing_ok=True)
        except OSError:
            pass

    def _drain_spools(self) -> bool:
        """Replay spooled batches, oldest first. True when nothing is left to replay."""
        while self._orphans:
            path, fh = self._orphans[0]
            done, _ = self._replay(fh, 0)
            if not done:
                return False
            self._orphans.pop(0)
            path.unlink(missing_ok=True)  # still under our lock: no other probe replays it again
            fh.close()
        if self._spooled:
            try:
                with open(self.spool_path, "rb") as fh:
                    done, self._spool_offset = self._replay(fh, self._spool_offset)
            except FileNotFoundError:
                done = True
            if not done:
                return False
            if self._spool_fh is not None:
                self._spool_fh.truncate(0)  # append mode: the next line goes at the new end
            self._spooled = False
            self._spool_offset = 0
        return True

    def _replay(self, fh, offset: int) -> tuple[bool, int]:  # noqa: ANN001
        """Deliver the batches from ``offset`` on; (all delivered, offset of the first one not delivered)."""
        fh.seek(offset)
        for line in fh:
            if not line.endswith(b"\n"):
                break  # a torn last line from a crash mid-write: nothing to replay
            try:
                batch = orjson.loads(line)
            except orjson.JSONDecodeError:
                offset += len(line)
                continue
            if not isinstance(batch, dict) or not isinstance(batch.get("events"), list):
                offset += len(line)
                continue
            if not self._deliver(batch, spool_on_failure=False):
                return False, offset
            offset += len(line)
        return True, offset

    def _find_orphan_spools(self) -> list[tuple[Path, object]]:
        """Spools of probes (of any run) whose process is gone, oldest first, each opened and locked by us."""
        try:
            candidates = sorted((p for p in self.spool_dir.glob("*.spool") if p != self.spool_path),
                                key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        orphans = []
        for p in candidates:
            if fcntl is None:
                parts = p.name.rsplit(".", 3)
                if len(parts) != 4 or not parts[1].isdigit() or _pid_alive(int(parts[1])):
                    continue
            try:
                fh = open(p, "rb")
            except OSError:
                continue
            # Taking the lock is the claim: the writer is gone, and no other live probe is replaying it.
            if not _try_lock(fh) or os.fstat(fh.fileno()).st_nlink == 0:
                fh.close()
                continue
            orphans.append((p, fh))
        return orphans
