"""Diagnostic captures: for the next N steps a job records everything and runs torch.profiler.

A capture is requested here (HTTP, MCP), rides to every rank on its ingest replies until that rank
sends its result, and is done when every rank of the run has. Results and traces stay in the store.
"""

from __future__ import annotations

import sqlite3
import time

import orjson

from schemas.events import CaptureCommand, CaptureResult
from schemas.records import Capture, CaptureList, CaptureRank

from ..errors import ApiError
from ..read.queries import STALE_AFTER_S, require_run
from . import ranks
from ..store import Store

MAX_CAPTURE_STEPS = 100


def request(store: Store, run: str, steps: int, profile: bool, actor: str) -> Capture:
    if not 1 <= steps <= MAX_CAPTURE_STEPS:
        raise ApiError(422, "invalid_parameter", f"steps must be between 1 and {MAX_CAPTURE_STEPS}, got {steps}")

    def write(conn: sqlite3.Connection) -> Capture:
        row = require_run(conn, run)
        now = time.time()
        if row["ended"] or now - row["last_seen"] > STALE_AFTER_S:
            why = "the job has ended" if row["ended"] else f"the job has not been heard from for {now - row['last_seen']:.0f}s"
            raise ApiError(409, "job_unavailable", f"no capture was requested: {why}")
        cur = conn.execute("INSERT INTO captures(run, steps, profile, status, requested_by, created_at, updated_at) "
                           "VALUES (?,?,?,?,?,?,?)", (run, steps, int(profile), "pending", actor, now, now))
        capture_id = f"c-{cur.lastrowid}"
        conn.execute("UPDATE captures SET id=? WHERE seq=?", (capture_id, cur.lastrowid))
        conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                     (run, now, actor, "capture_requested", None,
                      orjson.dumps({"capture_id": capture_id, "steps": steps, "profile": profile}).decode()))
        return _capture(conn, run, capture_id)

    return store.write(write)


def pending_for(conn: sqlite3.Connection, run: str, rank: int) -> list[CaptureCommand]:
    rows = conn.execute("SELECT id, steps, profile FROM captures c WHERE run=? AND status IN ('pending', 'partial') "
                        "AND NOT EXISTS (SELECT 1 FROM capture_results r WHERE r.capture_id=c.id AND r.rank=?) "
                        "ORDER BY seq", (run, rank)).fetchall()
    return [CaptureCommand(capture_id=r["id"], steps=r["steps"], profile=bool(r["profile"])) for r in rows]


def record(conn: sqlite3.Connection, run: str, rank: int, ev: CaptureResult, now: float) -> None:
    row = conn.execute("SELECT id FROM captures WHERE id=? AND run=?", (ev.capture_id, run)).fetchone()
    if row is None:
        return  # a result for a capture this store never asked for (an imported file): nothing to attach to
    conn.execute(
        "INSERT OR REPLACE INTO capture_results(capture_id, run, rank, status, reason, first_step, last_step, profiled, "
        "ops, shapes, trace, trace_dropped) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (ev.capture_id, run, rank, ev.status, ev.reason, ev.step, ev.last_step, int(ev.profiled),
         orjson.dumps([o.model_dump() for o in ev.ops]).decode(),
         orjson.dumps([s.model_dump() for s in ev.shapes]).decode(), ev.trace, ev.trace_dropped))
    done = conn.execute("SELECT count(*) FROM capture_results WHERE capture_id=?", (ev.capture_id,)).fetchone()[0]
    status = "done" if done >= ranks.world_size(conn, run) else "partial"
    conn.execute("UPDATE captures SET status=?, updated_at=? WHERE id=?", (status, now, ev.capture_id))


def expire(conn: sqlite3.Connection, run: str, now: float) -> None:
    conn.execute("UPDATE captures SET status='expired', updated_at=? WHERE run=? AND status='pending'", (now, run))
    conn.execute("UPDATE captures SET status='done', updated_at=? WHERE run=? AND status='partial'", (now, run))


def _capture(conn: sqlite3.Connection, run: str, capture_id: str) -> Capture:
    row = conn.execute("SELECT * FROM captures WHERE run=? AND id=?", (run, capture_id)).fetchone()
    if row is None:
        ids = [r[0] for r in conn.execute("SELECT id FROM captures WHERE run=? ORDER BY seq DESC LIMIT 10", (run,))]
        raise ApiError(404, "unknown_capture", f"run {run!r} has no capture {capture_id!r}; recent: {', '.join(ids) or 'none'}")
    results = conn.execute("SELECT rank, status, reason, first_step, last_step, profiled, ops, shapes, "
                           "trace IS NOT NULL AS has_trace, trace_dropped FROM capture_results WHERE capture_id=? "
                           "ORDER BY rank", (capture_id,)).fetchall()
    return Capture(id=row["id"], run=run, status=row["status"], steps=row["steps"], profile=bool(row["profile"]),
                   requested_by=row["requested_by"], created_at=row["created_at"], updated_at=row["updated_at"],
                   ranks=[CaptureRank(rank=r["rank"], status=r["status"], reason=r["reason"], first_step=r["first_step"],
                                      last_step=r["last_step"], profiled=bool(r["profiled"]),
                                      ops=orjson.loads(r["ops"]), shapes=orjson.loads(r["shapes"]),
                                      trace_available=bool(r["has_trace"]), trace_dropped=r["trace_dropped"])
                          for r in results])


def get(store: Store, run: str, capture_id: str) -> Capture:
    conn = store.read()
    require_run(conn, run)
    return _capture(conn, run, capture_id)


def list_captures(store: Store, run: str) -> CaptureList:
    conn = store.read()
    require_run(conn, run)
    ids = [r[0] for r in conn.execute("SELECT id FROM captures WHERE run=? ORDER BY seq", (run,))]
    return CaptureList(run=run, captures=[_capture(conn, run, i) for i in ids])


def trace(store: Store, run: str, capture_id: str, rank: int = 0) -> bytes:
    conn = store.read()
    require_run(conn, run)
    _capture(conn, run, capture_id)
    row = conn.execute("SELECT trace, trace_dropped FROM capture_results WHERE capture_id=? AND rank=?",
                       (capture_id, rank)).fetchone()
    if row is None:
        raise ApiError(404, "no_trace", f"rank {rank} has not sent a result for {capture_id} yet")
    if row["trace"] is None:
        raise ApiError(404, "no_trace", f"rank {rank} sent no trace for {capture_id}: {row['trace_dropped'] or 'profiling was off'}")
    return row["trace"].encode()
