"""The SQLite store: one file in WAL mode, one writer thread, readers on their own connections.

As in datasette, every write is a function handed to the writer thread (``write(fn)``), so writes are
serialised without locks in callers, and each is atomic: a batch is stored whole or not at all.
Readers use a connection per thread and see the last committed state.

Group commit: the writes already waiting when the writer takes one share its transaction, each in a
savepoint of its own (one that fails is rolled back alone), and each caller hears back once that
transaction is committed. A commit writes every page the transaction touched to the WAL; the stats
index puts each tensor's rows on its own pages, so eight ranks' batches committed together write those
pages once instead of eight times (benchmarks/distributed.py --part ingest).
"""

from __future__ import annotations

import math
import queue
import sqlite3
import struct
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, TypeVar

from .schema import migrate

T = TypeVar("T")

# Writes committed together at most (see the module docstring): enough for a few dozen ranks' batches,
# few enough that one commit stays well under a second.
MAX_GROUP = 32

def pack_quantiles(values: list[float | None] | None) -> bytes | None:
    """A stats row's quantiles (StatRow.quantiles) as stored: little-endian doubles, NaN for a null; none
    sent, NULL. 56 bytes a row that has them, and the probe sends them on few of its sampled steps."""
    if not values:
        return None
    return struct.pack(f"<{len(values)}d", *(math.nan if v is None else v for v in values))


def unpack_quantiles(blob: bytes | None) -> list[float | None] | None:
    """What pack_quantiles stored, back: None for a row without quantiles, a NaN read as null."""
    if blob is None:
        return None
    return [None if v != v else v for v in struct.unpack(f"<{len(blob) // 8}d", blob)]


def add_message(conn: sqlite3.Connection, run: str, step: int, time: float, level: str, text: str,
                rank: int = 0) -> None:
    """A message about the run that is not an anomaly (RunSummary.messages): from the probe, or the server's."""
    conn.execute("INSERT INTO messages(run, step, time, level, text, rank) VALUES (?,?,?,?,?,?)",
                 (run, step, time, level, text, rank))


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
    conn.row_factory = sqlite3.Row
    # Only takes effect on a new file, so before WAL writes its header: deleted runs then give their
    # pages back to the disk (retention.delete_run).
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # durable at each WAL checkpoint; a crash loses no committed batch
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA temp_store=MEMORY")  # a savepoint's journal (group commit) in memory, not a temp file
    return conn


class Store:
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.path = str(self.data_dir / "traindx.sqlite")
        self._writer = _connect(self.path)
        try:
            self.schema_version = migrate(self._writer)
        except BaseException:
            self._writer.close()
            raise
        self._local = threading.local()
        self._jobs: queue.Queue[tuple[Callable[[sqlite3.Connection], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="traindx-store-writer", daemon=True)
        self._thread.start()

    def integrity(self) -> str:
        """'ok', or SQLite's description of what is damaged (PRAGMA quick_check)."""
        try:
            rows = self.read().execute("PRAGMA quick_check(20)").fetchall()
        except sqlite3.DatabaseError as e:
            return f"unreadable: {e}"
        return "; ".join(r[0] for r in rows)

    # -- writes --------------------------------------------------------------------------------------
    def write(self, fn: Callable[[sqlite3.Connection], T], *, alone: bool = False) -> T:
        """Run ``fn(conn)`` in the writer thread, atomically; return its result (once it is committed) or
        raise its error (nothing of it stored). ``alone``: in a transaction of its own, for a job that
        ends the transaction itself (a vacuum)."""
        fut: Future = Future()
        self._jobs.put((fn, fut, alone))
        return fut.result()

    def _write_loop(self) -> None:
        carry = None  # a job taken while gathering a group that must not join it (alone, or the stop mark)
        while True:
            job, carry = (carry if carry is not None else self._jobs.get()), None
            if job is None:
                return
            group = [job]
            while not job[2] and len(group) < MAX_GROUP:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None or nxt[2]:
                    carry = nxt
                    break
                group.append(nxt)
            self._commit(group)

    def _commit(self, group: list[tuple[Callable[[sqlite3.Connection], Any], Future, bool]]) -> None:
        conn = self._writer
        running = [(fn, fut) for fn, fut, _ in group if fut.set_running_or_notify_cancel()]
        outcomes: list[tuple[Future, Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            if group[0][2] or len(running) == 1:
                # One job: a transaction of its own (an alone job may end and begin it again itself). No
                # savepoint, whose journal would copy every page the job touches, for nothing.
                outcomes = [(fut, fn(conn), None) for fn, fut in running]
            else:
                for fn, fut in running:
                    conn.execute("SAVEPOINT job")
                    try:
                        result = fn(conn)
                    except BaseException as e:  # noqa: BLE001 - handed to its caller; the group goes on
                        conn.execute("ROLLBACK TO job")
                        conn.execute("RELEASE job")
                        outcomes.append((fut, None, e))
                    else:
                        conn.execute("RELEASE job")
                        outcomes.append((fut, result, None))
            conn.execute("COMMIT")
        except BaseException as e:  # noqa: BLE001 - the commit failed (or an alone job): nothing of the group stays
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for _, fut in running:
                fut.set_exception(e)
            return
        for fut, result, error in outcomes:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

    # -- reads ---------------------------------------------------------------------------------------
    def read(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _connect(self.path)
            self._local.conn = conn
        return conn

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)
        self._writer.close()
