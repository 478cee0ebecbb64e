"""Retention: export a run as JSON lines, delete it, keep the data directory under its size cap, and
delete runs nobody has heard from for longer than the age limit.

An export is a file ``traindx import`` loads back: the run's events as ``IngestBatch`` lines (the same
form a probe's FileSink writes, with deterministic batch ids, so importing it twice stores it once),
followed by ``{"record": ...}`` lines with what the server derived (anomalies, fixes, audit), which an
import skips because the rules derive them again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

import orjson

from ..errors import ApiError
from ..read.queries import STALE_AFTER_S, require_run
from ..store import Store, unpack_quantiles

log = logging.getLogger("traindx.server")

EXPORT_BATCH_EVENTS = 500  # well inside MAX_EVENTS_PER_BATCH and the ingest body limit
WARN_FRACTION = 0.8  # warn from 80% of the cap: room for the runs in flight while someone cleans up
_RUN_TABLES = ("scalars", "stats", "messages", "anomalies", "fixes", "audit", "rule_state", "embedding_tables",
               "batches", "runs")
_STAT_FIELDS = ("numel", "norm", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_frac", "dead_frac",
                "saturated_frac", "update_ratio")


# -- export --------------------------------------------------------------------------------------------
def _events(conn: sqlite3.Connection, run: str, row: sqlite3.Row) -> Iterator[dict[str, Any]]:
    """The run's events in step order, rebuilt from the tables they were stored in."""
    if row["start"]:
        yield orjson.loads(row["start"])
    times: dict[int, float] = {}
    scalars = conn.execute("SELECT step, name, value, time FROM scalars WHERE run=? ORDER BY step, rowid", (run,))
    stats = conn.execute(f"SELECT step, collection, tensor, {', '.join(_STAT_FIELDS)}, quantiles FROM stats WHERE run=? "
                         "ORDER BY step, collection, rowid", (run,))
    messages = conn.execute("SELECT step, time, level, text FROM messages WHERE run=? ORDER BY step, rowid", (run,))
    # Three cursors merged by step, so the export reads a run of any size in constant memory.
    heads: dict[str, Any] = {"scalars": next(scalars, None), "stats": next(stats, None),
                             "messages": next(messages, None)}
    fallback_time = row["created_at"] or 0.0
    while any(v is not None for v in heads.values()):
        step = min(v[0] for v in heads.values() if v is not None)
        if heads["scalars"] is not None and heads["scalars"][0] == step:
            values: dict[str, float | None] = {}
            t = heads["scalars"][3]
            while heads["scalars"] is not None and heads["scalars"][0] == step:
                _, name, value, t = heads["scalars"]
                values[name] = value
                heads["scalars"] = next(scalars, None)
            times[step] = t
            fallback_time = t
            yield {"kind": "scalars", "step": step, "time": t, "values": values}
        while heads["stats"] is not None and heads["stats"][0] == step:
            collection = heads["stats"][1]
            rows = []
            while heads["stats"] is not None and heads["stats"][0] == step and heads["stats"][1] == collection:
                r = heads["stats"]
                rows.append({"name": r[2], **{f: r[3 + i] for i, f in enumerate(_STAT_FIELDS) if r[3 + i] is not None}})
                if r[-1] is not None:
                    rows[-1]["quantiles"] = unpack_quantiles(r[-1])
                heads["stats"] = next(stats, None)
            # The stats table keeps no time of its own: the step's scalars carry it (approximate otherwise).
            yield {"kind": "tensor_stats", "step": step, "time": times.get(step, fallback_time),
                   "collection": collection, "rows": rows}
        while heads["messages"] is not None and heads["messages"][0] == step:
            _, t, level, text = heads["messages"]
            yield {"kind": "message", "step": step, "time": t, "level": level, "text": text}
            heads["messages"] = next(messages, None)
    if row["ended"]:
        yield {"kind": "run_end", "step": row["last_step"] or 0, "time": row["last_seen"], "reason": "closed"}


def _records(conn: sqlite3.Connection, run: str) -> Iterator[dict[str, Any]]:
    for table, record in (("anomalies", "anomaly"), ("fixes", "fix"), ("audit", "audit")):
        for r in conn.execute(f"SELECT * FROM {table} WHERE run=? ORDER BY rowid", (run,)):
            yield {"record": record, **{k: r[k] for k in r.keys()}}


def export_run(store: Store, run: str, out: IO[bytes]) -> dict[str, int]:
    """Write ``run`` to ``out`` as JSON lines; return counts of batches, events and records written."""
    conn = store.read()
    conn.execute("BEGIN")  # one snapshot: a run still streaming exports consistently
    try:
        row = require_run(conn, run)
        prefix = "x" + hashlib.sha256(run.encode()).hexdigest()[:20]
        n_batches = n_events = n_records = 0
        events: list[dict] = []

        def flush() -> None:
            nonlocal n_batches, n_events
            out.write(orjson.dumps({"batch_id": f"{prefix}{n_batches:08d}", "run": run, "seq": n_batches,
                                    "events": events}) + b"\n")
            n_batches += 1
            n_events += len(events)
            events.clear()

        for ev in _events(conn, run, row):
            events.append(ev)
            if len(events) >= EXPORT_BATCH_EVENTS:
                flush()
        if events:
            flush()
        for rec in _records(conn, run):
            out.write(orjson.dumps(rec) + b"\n")
            n_records += 1
    finally:
        conn.execute("COMMIT")
    return {"batches": n_batches, "events": n_events, "records": n_records}


# -- delete --------------------------------------------------------------------------------------------
def delete_run(store: Store, run: str, *, force: bool = False, engine: Any = None) -> dict[str, int]:
    """Delete every row of ``run`` in one transaction; return rows deleted per table.

    A run still streaming is refused (409) unless ``force``: its next batch would bring it back half.
    """
    def write(conn: sqlite3.Connection) -> dict[str, int]:
        row = require_run(conn, run)
        idle = time.time() - (row["last_seen"] or 0)
        if not force and not row["ended"] and idle < STALE_AFTER_S:
            raise ApiError(409, "run_active", f"run {run!r} is still streaming (last heard {idle:.0f}s ago); "
                           "stop the job first, or pass force=true / --force")
        counts = {t: conn.execute(f"DELETE FROM {t} WHERE run=?", (run,)).rowcount for t in _RUN_TABLES}
        if engine is not None:
            engine.forget(run)  # its rule state lives in memory too (this runs in the writer thread)
        log.warning("traindx: run %r deleted (%s)", run, ", ".join(f"{k}={v}" for k, v in counts.items() if v))
        return counts

    counts = store.write(write)
    store.write(_vacuum, alone=True)
    return counts


def _vacuum(conn: sqlite3.Connection) -> None:
    """Give the freed pages back to the disk (auto_vacuum=INCREMENTAL, set on new stores).

    The pragma frees one page per step, and Python's ``execute`` steps once: ``executescript`` steps it
    to the end, outside a transaction, so the writer's empty one is closed around it.
    """
    conn.execute("COMMIT")
    try:
        conn.executescript("PRAGMA incremental_vacuum; PRAGMA wal_checkpoint(TRUNCATE);")
    finally:
        conn.execute("BEGIN IMMEDIATE")


# -- size cap ------------------------------------------------------------------------------------------
def dir_bytes(path: Path) -> int:
    total = 0
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


class SizeGuard:
    """Measures the data directory (at most once a second) against its cap."""

    def __init__(self, data_dir: Path, max_bytes: int | None, *, every_s: float = 1.0) -> None:
        self.data_dir = Path(data_dir)
        self.max_bytes = max_bytes
        self.every_s = every_s
        self._measured = -1e9
        self._bytes = 0
        self._warned = False

    def used(self, *, fresh: bool = False) -> int:
        now = time.monotonic()
        if fresh or now - self._measured >= self.every_s:
            self._bytes = dir_bytes(self.data_dir)
            self._measured = now
        return self._bytes

    def warning(self, *, fresh: bool = False) -> str | None:
        if self.max_bytes is None:
            return None
        used = self.used(fresh=fresh)
        if used < WARN_FRACTION * self.max_bytes:
            self._warned = False
            return None
        msg = (f"the data directory {self.data_dir} holds {used / 1e6:.1f} MB, {100 * used / self.max_bytes:.0f}% "
               f"of its cap of {self.max_bytes / 1e6:.1f} MB; export and delete old runs "
               "(traindx export RUN --jsonl FILE; traindx delete RUN)"
               + (": ingest is refused until then" if used >= self.max_bytes else ""))
        if not self._warned:
            log.warning("traindx: %s", msg)
            self._warned = True
        return msg

    def check_ingest(self) -> None:
        """Raise 507 at the cap: the probes keep their batches in their spools, nothing is lost yet."""
        if self.max_bytes is not None and self.used() >= self.max_bytes:
            raise ApiError(507, "data_dir_full", self.warning() or "the data directory is at its size cap",
                           headers={"Retry-After": "30"})


# -- age limit -----------------------------------------------------------------------------------------
def runs_older_than(store: Store, max_age_s: float, now: float | None = None) -> list[str]:
    """Runs last heard from more than ``max_age_s`` seconds ago (never one still streaming)."""
    cutoff = (time.time() if now is None else now) - max(max_age_s, STALE_AFTER_S)
    rows = store.read().execute("SELECT run FROM runs WHERE coalesce(last_seen, created_at, 0) < ? ORDER BY run",
                                (cutoff,)).fetchall()
    return [r["run"] for r in rows]


class AgeSweeper:
    """Deletes the runs older than the age limit: once at start, then every ``every_s`` seconds, on a
    thread of its own (a deletion goes through the store's writer like any other write)."""

    def __init__(self, store: Store, max_age_s: float, *, engine: Any = None, every_s: float | None = None) -> None:
        self.store, self.max_age_s, self.engine = store, max_age_s, engine
        # Often enough that a run outlives its limit by a tenth of it at most, and at most hourly.
        self.every_s = every_s if every_s is not None else min(max(max_age_s / 10, 60.0), 3600.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="traindx-retention", daemon=True)

    def start(self) -> "AgeSweeper":
        self._thread.start()
        return self

    def sweep(self) -> list[str]:
        deleted = []
        for run in runs_older_than(self.store, self.max_age_s):
            try:
                delete_run(self.store, run, engine=self.engine)
                deleted.append(run)
            except ApiError as e:  # it came back to life, or went, since it was listed
                log.info("traindx: retention left run %r: %s", run, e.message)
        return deleted

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a failed sweep is tried again at the next; the server goes on
                log.exception("traindx: the retention sweep failed")
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
