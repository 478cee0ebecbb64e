"""Read queries for charts and the timeline: several series at once, per-layer heat maps, the run's history.

They sit beside ``queries`` (one function per question, shared by the HTTP routes, the dashboard and the
client) and downsample on the server, so a long run costs the browser the same as a short one.
"""

from __future__ import annotations

import sqlite3
from typing import Literal

import orjson

from schemas.records import Heatmap, HistoryEntry, RunHistory, Series, SeriesPoint, SeriesSet

from .downsample import min_max_query
from ..errors import ApiError
from .queries import check_page, next_offset, require_run, stats_table
from ..store import STAT_COLUMNS, Store

MAX_SERIES = 64  # series in one SeriesSet: a chart with more lines than this is unreadable anyway
HistoryType = Literal["anomaly", "resolved", "fix", "verdict"]
_STEP_MAX = 2**63 - 1


def _stat_field(field: str) -> str:
    if field not in STAT_COLUMNS:
        raise ApiError(422, "invalid_parameter", f"field must be one of {', '.join(STAT_COLUMNS)}, got {field!r}")
    return field


def _range(min_step: int | None, max_step: int | None) -> tuple[int, int]:
    return (0 if min_step is None else min_step), (_STEP_MAX if max_step is None else max_step)


def _series(conn: sqlite3.Connection, run: str, name: str, table: str, column: str, where: str,
            args: list[object], max_points: int) -> Series:
    kept, total = min_max_query(conn, table, column, where, args, max_points)
    return Series(run=run, name=name, points=[SeriesPoint(step=s, value=v) for s, v in kept],
                  downsampled=len(kept) < total)


def scalar_set(store: Store, run: str, *, names: list[str] | None = None, prefix: str | None = None,
               min_step: int | None = None, max_step: int | None = None, max_points: int = 500) -> SeriesSet:
    """Scalar series by name and/or name prefix (``sys/`` for the system series); all of them when neither
    is given. Each is downsampled on its own, keeping spikes."""
    conn = store.read()
    require_run(conn, run)
    lo, hi = _range(min_step, max_step)
    picks, args = [], []
    if names:
        picks.append(f"name IN ({','.join('?' * len(names))})")
        args.extend(names)
    if prefix:
        picks.append("substr(name, 1, ?)=?")
        args.extend([len(prefix), prefix])
    where = "run=?" + (" AND (" + " OR ".join(picks) + ")" if picks else "")
    found = [r[0] for r in conn.execute(f"SELECT DISTINCT name FROM scalars WHERE {where}", [run, *args])]
    order = sorted(found, key=lambda n: (names.index(n) if names and n in names else len(names or ()), n))
    return SeriesSet(run=run, series=[
        _series(conn, run, n, "scalars", "value", "run=? AND name=? AND step BETWEEN ? AND ?", [run, n, lo, hi],
                max_points) for n in order[:MAX_SERIES]])


def stat_set(store: Store, run: str, *, collection: str, field: str = "norm", tensors: list[str] | None = None,
             min_step: int | None = None, max_step: int | None = None, max_points: int = 500) -> SeriesSet:
    """One statistic (``update_ratio`` of ``updates``, ``norm`` of ``gradients``, ...) of each tensor of a
    collection, one series per tensor, in the order the probe reported them (forward order)."""
    conn = store.read()
    require_run(conn, run)
    col = _stat_field(field)
    lo, hi = _range(min_step, max_step)
    # Forward order is the row order of the first sampled step of the collection.
    first = conn.execute("SELECT min(step) FROM stats WHERE run=? AND collection=?", (run, collection)).fetchone()[0]
    order = [r[0] for r in conn.execute("SELECT tensor FROM stats WHERE run=? AND collection=? AND step=? ORDER BY rowid",
                                        (run, collection, first))] if first is not None else []
    order += [r[0] for r in conn.execute("SELECT DISTINCT tensor FROM stats WHERE run=? AND collection=?",
                                         (run, collection)) if r[0] not in order]
    if tensors:
        order = [t for t in order if t in tensors]
    table = stats_table(conn, run, collection)  # a sharded model's shards, merged into whole tensors
    return SeriesSet(run=run, series=[
        _series(conn, run, t, table, col, "run=? AND collection=? AND tensor=? AND step BETWEEN ? AND ?",
                [run, collection, t, lo, hi], max_points) for t in order[:MAX_SERIES]])


def heatmap(store: Store, run: str, *, collection: str = "gradients", field: str = "norm",
            min_step: int | None = None, max_step: int | None = None, max_steps: int = 200) -> Heatmap:
    """A tensors x steps matrix of one statistic; past ``max_steps`` sampled steps, neighbouring steps share
    a column (equal-width on the step axis) holding their largest value, so a one-step spike in one layer
    still shows. SQLite groups the cells; rows are tensors in forward order."""
    conn = store.read()
    require_run(conn, run)
    if max_steps < 1:
        raise ApiError(422, "invalid_parameter", f"max_steps must be >= 1, got {max_steps}")
    col = _stat_field(field)
    lo, hi = _range(min_step, max_step)
    # '+step': the step range must not pick the (run, step) index, which holds every collection's rows; the
    # (run, collection, tensor, step) one reads a quarter of them (a 100-layer run: 350 ms -> 150 ms).
    where, args = "run=? AND collection=? AND +step BETWEEN ? AND ?", (run, collection, lo, hi)
    n_steps, first, last = conn.execute(f"SELECT count(DISTINCT step), min(step), max(step) FROM stats WHERE {where}",
                                        args).fetchone()
    if not n_steps:
        return Heatmap(run=run, collection=collection, field=field, tensors=[], steps=[], values=[])
    tensors = [r[0] for r in conn.execute(f"SELECT tensor FROM stats WHERE {where} AND step=? ORDER BY rowid",
                                          (*args, first))]
    tensors += [r[0] for r in conn.execute(f"SELECT DISTINCT tensor FROM stats WHERE {where}", args)
                if r[0] not in tensors]
    width = 1 if n_steps <= max_steps else max(-(-(last - first + 1) // max_steps), 1)
    table = stats_table(conn, run, collection)  # a sharded model's shards, merged into whole tensors
    cells = conn.execute(f"SELECT tensor, (step - ?) / ?, max({col}), min(step) FROM {table} WHERE {where} "
                         "GROUP BY tensor, 2", (first, width, *args)).fetchall()
    columns = sorted({c[1] for c in cells})
    index = {b: j for j, b in enumerate(columns)}
    starts: dict[int, int] = {}
    values: dict[str, list[float | None]] = {t: [None] * len(columns) for t in tensors}
    for tensor, b, value, step in cells:
        values[tensor][index[b]] = value
        starts[b] = min(starts.get(b, step), step)
    return Heatmap(run=run, collection=collection, field=field, tensors=tensors, steps=[starts[b] for b in columns],
                   values=[values[t] for t in tensors], downsampled=len(columns) < n_steps)


def _step_at(conn: sqlite3.Connection, run: str, when: float) -> int:
    """The last step the job had reported by ``when``: audit entries carry a time, the chart a step."""
    row = conn.execute("SELECT max(step) FROM scalars WHERE run=? AND time<=?", (run, when)).fetchone()
    return row[0] or 0


def history(store: Store, run: str, *, type: HistoryType | None = None, min_step: int | None = None,
            max_step: int | None = None, offset: int = 0, limit: int | None = None) -> RunHistory:
    """Anomalies (when each began and cleared), fixes (apply and revert requests, the job's answers) and
    the server's verdicts, on the step axis, oldest first. Proposals are left out: they change nothing."""
    conn = store.read()
    require_run(conn, run)
    check_page(offset, limit)
    entries: list[HistoryEntry] = []
    for a in conn.execute("SELECT * FROM anomalies WHERE run=? ORDER BY seq", (run,)):
        entries.append(HistoryEntry(step=a["first_step"], time=a["created_at"], type="anomaly", ref=a["id"],
                                    label=f"{a['kind']} ({a['severity']})", status=a["severity"]))
        if a["resolved_step"] is not None:
            entries.append(HistoryEntry(step=a["resolved_step"], time=a["updated_at"], type="resolved", ref=a["id"],
                                        label=f"{a['kind']} cleared", status="resolved"))
    actions = dict(conn.execute("SELECT id, action FROM fixes WHERE run=?", (run,)).fetchall())
    for r in conn.execute("SELECT * FROM audit WHERE run=? AND fix_id IS NOT NULL AND action!='proposed' "
                          "ORDER BY time, rowid", (run,)):
        detail = orjson.loads(r["detail"]) if r["detail"] else {}
        verdict = r["action"] == "verdict"
        status = detail.get("status") if verdict else r["action"]
        step = detail.get("step")
        entries.append(HistoryEntry(
            step=step if isinstance(step, int) and step >= 0 else _step_at(conn, run, r["time"]), time=r["time"],
            type="verdict" if verdict else "fix", ref=r["fix_id"], status=status, actor=r["actor"],
            label=f"{r['fix_id']} {actions.get(r['fix_id'], '')}: {status}"))
    lo, hi = _range(min_step, max_step)
    entries = [e for e in entries if lo <= e.step <= hi and (type is None or e.type == type)]
    entries.sort(key=lambda e: (e.step, e.time))
    page = entries[offset:None if limit is None else offset + limit]
    return RunHistory(run=run, entries=page, total=len(entries), offset=offset,
                      next_offset=next_offset(offset, len(page), len(entries)))
