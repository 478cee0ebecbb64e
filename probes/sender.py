"""The background sender: batches events, delivers them through a sink, spools what cannot be delivered.

The training thread only appends to a bounded queue (``put``); it never waits on the network. When the
server is away (or asks for a pause with 429/503 + Retry-After), batches go to a spool file in order and
are replayed, oldest first, once it answers; a new batch is never sent while older ones wait. Every batch
has an id, so a batch replayed after it was in fact stored counts once.

A slow server is waited on, not taken for an absent one: while the sink waits for an answer, full batches
move from the queue to the spool (behind the batch in flight, written there first), so the queue stays
within its bound however long the answer takes. ``flush``/``close`` wait until everything is delivered or
their timeout ends, whatever the server does, with one exception: a process that has not reached any
server yet (refused, unreachable, or refusing the token from the start) stops waiting after
``NO_SERVER_GRACE_S``, so that a job run with no server at all does not sit out its timeout at the end.
What is still undelivered when ``close`` returns is named in one log line, with the command that delivers it.

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
# A flush gives up this soon when no server has answered this process at all: the job ran with none.
# Long enough for two more tries (backing off 0.5 s, then 1 s) in case one was starting just then.
NO_SERVER_GRACE_S = 1.5
NO_SERVER = frozenset({"away", "auth", "error"})  # failures that say nobody (right) is there, unlike slow/busy
STOP_GRACE_S = 1.0  # close(): how long past its timeout the sender thread gets to finish its last batch
LOG_AGAIN_S = 60.0  # the same kind of trouble is logged again at most this often (never once per batch)


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
        self._spool_closed = False
        self._spool_lock = threading.Lock()  # close() may spool from the job's thread while we hang
        self._pending_batches = 0  # in our spool and not delivered yet (for close's last word)
        self._pending_events = 0
        self._inflight_batch: dict | None = None  # the batch this round of the loop delivers
        self._inflight_at: int | None = None  # where it was written ahead in our spool, when it was
        self._last_scan = time.monotonic()
        self._queue: deque[dict] = deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool_offset = 0  # bytes of our own spool already delivered
        self._spooled = False
        self._orphans = self._find_orphan_spools()
        self._failures = 0
        self._reached = False  # a server has answered this process (stored, or refused as malformed, a batch)
        self._trouble: str | None = None  # the kind of the last failure (SinkError.kind); None once delivered
        self._trouble_text = ""
        self._logged: dict[str, float] = {}  # kind of trouble -> when it was last logged
        self._server_asked_pause = False  # the current back-off is the server's Retry-After
        self._next_try = 0.0
        self._last_contact = 0.0
        self._stop = False
        self._abandoned = False
        self._inflight = 0
        if hasattr(sink, "while_waiting"):
            sink.while_waiting = self._while_waiting  # type: ignore[attr-defined]
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

        Waits up to ``timeout`` seconds for a server that is slow, busy (its Retry-After is honoured) or away
        for a while. Returns early, False, only when no server has answered this process at all (refused,
        unreachable, refusing the token) for ``NO_SERVER_GRACE_S``: what is left is safe in the spool.
        """
        start = time.monotonic()
        deadline = start + timeout
        with self._cond:
            if not self._server_asked_pause:
                self._next_try = 0.0  # try now, even while backing off (not when the server asked for the pause)
            self._cond.notify()
            while self._queue or self._inflight or self.pending_spool:
                now = time.monotonic()
                if now >= deadline:
                    break
                if not self._reached and self._trouble in NO_SERVER and now - start >= NO_SERVER_GRACE_S:
                    break
                self._cond.wait(min(0.05, deadline - now))
            return not self._queue and not self._inflight and not self.pending_spool

    def close(self, timeout: float = 10.0) -> None:
        """Flush (``timeout``), stop the sender thread, and say in one line what is still undelivered."""
        start = time.monotonic()
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(max(start + timeout - time.monotonic(), 0.0) + STOP_GRACE_S)
        if self._thread.is_alive():
            self._abandoned = True  # what the thread meets from now on is for nobody: it stays quiet
            # The server is still on a batch: keep what is here in the spool for the next probe (or traindx
            # import) rather than lose it with the process. The batch in flight may be stored too: its id
            # makes the second copy count for nothing.
            with self._cond:
                events, self._queue = list(self._queue), deque()
                inflight = self._inflight_batch
                rest = self._new_batch(events) if events else None
            try:
                if inflight is not None and inflight["events"]:
                    self._spool_inflight(inflight)
                if rest is not None:
                    self._spool(rest)
            except Exception:  # noqa: BLE001
                log.warning("traindx: could not spool the last events at close", exc_info=True)
        self._say_undelivered(time.monotonic() - start)
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

    def _say_undelivered(self, waited: float) -> None:
        """One line, when something is left: how much, why, where it is and what delivers it."""
        orphans = len(self._orphans)
        if not self._pending_batches and not orphans and not self.dropped:
            return
        where = getattr(self.sink, "server", None) or type(self.sink).__name__
        why = self._trouble_text or "no answer yet"
        parts = []
        if self._pending_batches:
            path = self.spool_path.absolute()
            data = os.environ.get("TRAINDX_DATA")
            command = f"traindx import {path}" + (f" --data {data}" if data else "")
            parts.append(f"{self._pending_events} events in {self._pending_batches} batches not delivered to {where} "
                         f"in {waited:.0f} s ({why}); they are kept in {path}: the next probe started with spool "
                         f"directory {self.spool_dir.absolute()} sends them, or `{command}` stores them now")
        if orphans:
            parts.append(f"{orphans} spool file(s) of earlier jobs in {self.spool_dir.absolute()} wait too")
        if self.dropped:
            parts.append(f"{self.dropped} events were dropped (queue or spool full)")
        log.warning("traindx: run %s: %s", self.run, "; ".join(parts))

    # -- sender-thread side ---------------------------------------------------------------------------
    def _new_batch(self, events: list[dict]) -> dict:
        """A batch with the next sequence number; called with ``_cond`` held."""
        batch = {"batch_id": uuid.uuid4().hex, "run": self.run, "seq": self._seq, "events": events}
        if self.rank:  # a one-process run sends the batch it always did; the server reads a missing rank as 0
            batch["rank"] = self.rank
        self._seq += 1
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._stop and len(self._queue) < self.max_batch:
                    self._cond.wait(self.flush_interval)
                events = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch))]
                stop = self._stop
                self._report_drops(events)
                # Made here, under the lock, so that close() sees it (to spool it) from the moment it leaves the queue.
                self._inflight_batch = self._new_batch(events) if events else None
                self._inflight_at = None
                self._inflight = len(events)
            try:
                self._tick(self._inflight_batch, final=stop)
            except Exception:  # noqa: BLE001 - the sender thread must never die
                log.exception("traindx: sender error; events of this batch were spooled if possible")
            with self._cond:
                self._inflight = 0
                self._inflight_batch = None
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

    def _tick(self, batch: dict | None, *, final: bool = False) -> None:
        now = time.monotonic()
        if batch is None:
            if self.pending_spool:
                if now < self._next_try:
                    return  # backing off; the spool is replayed when the delay is over
            elif final or now - self._last_contact < self.heartbeat:
                return
            with self._cond:
                batch = self._new_batch([])  # a heartbeat (it fetches the job's commands), or a replay's turn
        if not self._spooled and not self._orphans and now - self._last_scan > ORPHAN_RESCAN_S:
            self._last_scan = now
            self._orphans = self._find_orphan_spools()
        if now < self._next_try or not self._drain_spools():
            if batch["events"]:
                self._spool_inflight(batch)
            return
        if self._inflight_at is not None:
            return  # written ahead into the spool while the replay waited on the server, and delivered with it
        self._deliver(batch, new=bool(batch["events"]))

    def _deliver(self, batch: dict, *, new: bool) -> bool:
        """Send one batch; on failure a new one (not yet in the spool) is spooled. True when the server has it."""
        try:
            reply = self.sink.send(batch)
        except RejectedBatch as e:
            self.rejected += 1
            self.rejected_events += len(batch.get("events") or ())
            self._answered()
            log.warning("traindx: %s", e)
            return True
        except SinkError as e:
            self._failed(e)
            if new:
                self._spool_inflight(batch)  # a no-op when it was written ahead already
            return False
        self._answered()
        if new and self._inflight_at is not None:
            self._skip_written_ahead()
        self.sent_batches += 1
        commands = reply.get("commands") if isinstance(reply, dict) else None
        if isinstance(commands, list) and commands and self.on_commands is not None:
            # Only well-formed commands reach the job; what to do with them is the job's decision.
            self.on_commands([c for c in commands[:MAX_COMMANDS_PER_REPLY] if isinstance(c, dict)])
        captures = reply.get("captures") if isinstance(reply, dict) else None
        if isinstance(captures, list) and captures and self.on_commands is not None:
            self.on_commands([{**c, "op": "capture"} for c in captures[:MAX_COMMANDS_PER_REPLY] if isinstance(c, dict)])
        return True

    def _answered(self) -> None:
        self._reached = True
        self._trouble, self._trouble_text = None, ""
        self._failures = 0
        self._next_try = 0.0
        self._server_asked_pause = False
        self._last_contact = time.monotonic()

    def _failed(self, err: SinkError) -> None:
        asked = err.retry_after
        kind = getattr(err, "kind", "away")
        now = time.monotonic()
        if ((self._failures == 0 or kind != self._trouble) and now - self._logged.get(kind, -LOG_AGAIN_S) >= LOG_AGAIN_S
                and not self._abandoned):
            self._logged[kind] = now
            what = {"away": "server unreachable", "slow": "server slow", "busy": "server busy",
                    "auth": "server refused us", "error": "server error"}.get(kind, "server trouble")
            log.warning("traindx: %s (%s); the events wait in %s and are sent when it answers", what, err,
                        self.spool_path)
        self._trouble, self._trouble_text = kind, f"{kind}: {err}"
        self._failures += 1
        delay = min(0.25 * 2 ** min(self._failures, 5), 5.0)
        self._server_asked_pause = asked is not None
        if asked is not None:  # the server's back-pressure: honour it
            delay = max(delay, asked)
        self._next_try = now + delay

    def _while_waiting(self) -> None:
        """The sink waits for the server's answer (sender thread): keep the queue within its bound by moving
        full batches to the spool, behind the batch in flight, written there first so that order holds."""
        if len(self._queue) < self.max_batch:
            return
        with self._cond:
            chunks = []
            while len(self._queue) >= self.max_batch:
                chunks.append(self._new_batch([self._queue.popleft() for _ in range(self.max_batch)]))
            inflight = self._inflight_batch
        if inflight is not None and inflight["events"]:
            self._spool_inflight(inflight)
        for batch in chunks:
            self._spool(batch)

    def _spool_inflight(self, batch: dict) -> None:
        """Spool the round's batch once (close() and a long wait may both want to)."""
        with self._spool_lock:
            if self._inflight_at is None or batch is not self._inflight_batch:
                at = self._spool_locked(batch)
                if batch is self._inflight_batch:
                    self._inflight_at = at if at is not None else -1

    def _skip_written_ahead(self) -> None:
        """The batch written ahead into the spool was delivered after all: replay starts past it."""
        with self._spool_lock:
            if self._inflight_at == -1:  # written ahead into a full spool, and counted as dropped: it was not
                self.dropped -= len(self._inflight_batch["events"])
            elif self._inflight_at == self._spool_offset and self._spool_fh is not None:
                self._spool_offset += len(dumps(self._inflight_batch)) + 1
                self._pending_batches -= 1
                self._pending_events -= len(self._inflight_batch["events"])
            # (anywhere else, it is replayed: its id makes the second copy count for nothing)

    def _spool(self, batch: dict) -> None:
        with self._spool_lock:
            self._spool_locked(batch)

    def _spool_locked(self, batch: dict) -> int | None:
        """Append one batch as one line; the offset it was written at, or None when it was dropped."""
        line = dumps(batch) + b"\n"
        try:
            if self._spool_closed:
                raise ValueError("the spool is closed")
            if self._spool_fh is None:
                self.spool_dir.mkdir(parents=True, exist_ok=True)
                self._spool_fh = open(self.spool_path, "ab")
                _try_lock(self._spool_fh)  # held while we live: our spool is no orphan
            size = self._spool_fh.tell()
            if size + len(line) > self.max_spool_bytes:
                line, kept = self._fit(batch, self.max_spool_bytes - size)
                self.dropped += len(batch["events"]) - kept
                if not kept:
                    return None
                batch = {**batch, "events": batch["events"][:kept]}
            # One write of a whole line, flushed: a crash can tear only the last line, which replay skips.
            self._spool_fh.write(line)
            self._spool_fh.flush()
            self._spooled = True
            self.spooled_batches += 1
            self._pending_batches += 1
            self._pending_events += len(batch["events"])
            return size
        except (OSError, ValueError) as e:
            self.dropped += len(batch["events"])
            if not self._abandoned:
                log.warning("traindx: cannot write spool %s: %s", self.spool_path, e)
            return None

    def _fit(self, batch: dict, room: int) -> tuple[bytes, int]:
        """The line of ``batch``'s first events that fits in ``room`` bytes, and how many it keeps: a spool
        near its limit keeps what fits, not nothing. The batch in flight is kept whole or not at all while
        the sender lives (its offset in the spool is how a late delivery of it is skipped on replay)."""
        events = batch["events"]
        if batch is self._inflight_batch and not self._abandoned or room <= 0:
            return b"", 0
        lo, hi = 0, len(events) - 1  # the whole batch does not fit: find the most that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(dumps({**batch, "events": events[:mid]})) + 1 <= room:
                lo = mid
            else:
                hi = mid - 1
        return (dumps({**batch, "events": events[:lo]}) + b"\n", lo) if lo else (b"", 0)

    def _close_spool(self) -> None:
        with self._spool_lock:
            fh, self._spool_fh = self._spool_fh, None
            self._spool_closed = True
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
        if not self._spooled:
            return True
        try:
            with open(self.spool_path, "rb") as fh:
                while True:
                    before = self._spool_offset
                    done, self._spool_offset = self._replay(fh, self._spool_offset, own=True)
                    if not done:
                        return False
                    with self._spool_lock:
                        # Lines appended while we replayed (a long wait spools the queue; close() may spool from
                        # the job's thread) are replayed too before the file is emptied; only a tail that is no
                        # whole line even now, under the writers' lock (a write that failed half-way), is given up.
                        if self._spool_offset > before or self._whole_line_at(fh, self._spool_offset):
                            if self._spool_offset < os.fstat(fh.fileno()).st_size:
                                continue
                        if self._spool_fh is not None:
                            self._spool_fh.truncate(0)  # append mode: the next line goes at the new end
                            self._spool_fh.seek(0)
                        self._spooled = False
                        self._spool_offset = 0
                        self._pending_batches = self._pending_events = 0
                        return True
        except FileNotFoundError:
            with self._spool_lock:
                self._spooled = False
                self._spool_offset = 0
                self._pending_batches = self._pending_events = 0
            return True

    @staticmethod
    def _whole_line_at(fh, offset: int) -> bool:  # noqa: ANN001
        fh.seek(offset)
        return fh.readline().endswith(b"\n")

    def _replay(self, fh, offset: int, *, own: bool = False) -> tuple[bool, int]:  # noqa: ANN001
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
            if not self._deliver(batch, new=False):
                return False, offset
            offset += len(line)
            if own:
                with self._spool_lock:
                    self._pending_batches -= 1
                    self._pending_events -= len(batch["events"])
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
