"""Change notifications for one run, as server-sent events, so the dashboard redraws without reloading.

The store has one writer and many readers; a reader learns that someone committed from SQLite's
``PRAGMA data_version``, which changes exactly when another connection commits. So a stream costs one
cheap pragma per tick while nothing happens, and one small query when something did.
"""

from __future__ import annotations

import sqlite3
from typing import AsyncIterator

import anyio
import orjson

# How stale a chart may be: a commit shows on an open page within one tick and one redraw (the dashboard's
# goal: 0.5 s from the event being stored). A tick costs one PRAGMA read per open page.
TICK_S = 0.1


def _snapshot(conn: sqlite3.Connection, run: str) -> dict | None:
    row = conn.execute("SELECT last_step, ended FROM runs WHERE run=?", (run,)).fetchone()
    if row is None:
        return None
    a = conn.execute("SELECT count(*), coalesce(sum(status='open'), 0), coalesce(max(updated_at), 0) "
                     "FROM anomalies WHERE run=?", (run,)).fetchone()
    f = conn.execute("SELECT count(*), coalesce(max(updated_at), 0) FROM fixes WHERE run=?", (run,)).fetchone()
    # the last sampled step: per-tensor charts (heat maps, distributions) change only when it does
    stats = conn.execute("SELECT coalesce(max(step), -1) FROM stats WHERE run=?", (run,)).fetchone()[0]
    return {"run": run, "last_step": row[0] or 0, "ended": bool(row[1]), "anomalies": a[0], "open_anomalies": a[1],
            "anomalies_updated": a[2], "fixes": f[0], "fixes_updated": f[1], "stats_step": stats}


async def run_updates(db_path: str, run: str, tick: float = TICK_S) -> AsyncIterator[dict]:
    """Yield an ``update`` event now, then each time the run's steps, anomalies or fixes change."""
    conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
    try:
        version, last, n = None, None, 0
        while True:
            now_version = conn.execute("PRAGMA data_version").fetchone()[0]
            if now_version != version:
                version = now_version
                snap = _snapshot(conn, run)
                if snap is not None and snap != last:
                    last, n = snap, n + 1
                    yield {"event": "update", "id": str(n), "data": orjson.dumps({**snap, "seq": n}).decode()}
            await anyio.sleep(tick)
    finally:
        conn.close()
