"""Evidence on demand: when a critical anomaly opens, ask the job for slices of the offending tensors.

The request rides back to the probe on the ingest reply as a ``snapshot`` command (like a fix); the probe
answers at a step boundary with a bounded TensorSnapshot event, which is attached to the anomaly.
"""

from __future__ import annotations

import sqlite3

import orjson

from schemas.events import Command, TensorSnapshot

# Tensors asked for per anomaly, and values per tensor: a snapshot is evidence, not a checkpoint.
MAX_TENSORS = 4
MAX_ELEMENTS = 64


def request_snapshot(conn: sqlite3.Connection, run: str, key: str, tensors: list[str], now: float) -> str | None:
    """Queue a snapshot of ``tensors`` for the open anomaly ``key``, once per anomaly."""
    row = conn.execute("SELECT id FROM anomalies WHERE run=? AND key=? AND status='open'", (run, key)).fetchone()
    if row is None:
        return None
    if conn.execute("SELECT 1 FROM snapshots WHERE anomaly_id=?", (row[0],)).fetchone():
        return None
    ended = conn.execute("SELECT ended FROM runs WHERE run=?", (run,)).fetchone()
    if ended and ended[0]:
        return None  # nobody left to answer
    cur = conn.execute("INSERT INTO snapshots(run, anomaly_id, tensors, status, created_at, updated_at) "
                       "VALUES (?,?,?,?,?,?)", (run, row[0], orjson.dumps(tensors[:MAX_TENSORS]).decode(),
                                                 "pending", now, now))
    snap_id = f"s-{cur.lastrowid}"
    conn.execute("UPDATE snapshots SET id=? WHERE seq=?", (snap_id, cur.lastrowid))
    return snap_id


def pending(conn: sqlite3.Connection, run: str) -> list[Command]:
    rows = conn.execute("SELECT id, tensors FROM snapshots WHERE run=? AND status='pending' ORDER BY seq",
                        (run,)).fetchall()
    return [Command(fix_id=r[0], op="snapshot",
                    params={"tensors": orjson.loads(r[1]), "max_elements": MAX_ELEMENTS}) for r in rows]


def receive(conn: sqlite3.Connection, run: str, ev: TensorSnapshot, now: float) -> None:
    """Attach the job's answer to its anomaly; an answer to a request this store never made is ignored."""
    row = conn.execute("SELECT anomaly_id FROM snapshots WHERE id=? AND run=?", (ev.request_id, run)).fetchone()
    if row is None:
        return
    slices = [t.model_dump() for t in ev.tensors]
    conn.execute("UPDATE snapshots SET status='done', step=?, updated_at=? WHERE id=?", (ev.step, now, ev.request_id))
    conn.execute("UPDATE anomalies SET snapshot=?, updated_at=? WHERE id=?",
                 (orjson.dumps(slices).decode(), now, row[0]))


def expire(conn: sqlite3.Connection, run: str, now: float) -> None:
    conn.execute("UPDATE snapshots SET status='expired', updated_at=? WHERE run=? AND status='pending'", (now, run))
