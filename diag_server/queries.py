"""Read queries shared by the HTTP routes, the MCP tools and the CLI: one function per question."""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import orjson

from schemas.enums import AnomalyKind, AnomalyStatus, FixStatus, Severity
from schemas.records import (Anomaly, AnomalyPage, AuditEntry, AuditTrail, Fix, FixList, Run, RunList, RunSummary,
                             Series, SeriesPoint)

from .errors import ApiError
from .store import STAT_COLUMNS, Store

# A run that has sent nothing (not even a heartbeat) for this long is 'stale': its job is gone or stuck.
STALE_AFTER_S = 30.0
MAX_PAGE = 500


def _json(text: str | None, default: Any) -> Any:
    return orjson.loads(text) if text else default


def _run(row: sqlite3.Row, open_anomalies: int, now: float) -> Run:
    start = _json(row["start"], {})
    status = "ended" if row["ended"] else ("stale" if now - row["last_seen"] > STALE_AFTER_S else "active")
    return Run(run=row["run"], status=status, created_at=row["created_at"], last_seen=row["last_seen"],
               last_step=row["last_step"] or 0, device=start.get("device", ""),
               total_params=start.get("total_params", 0), allow=start.get("allow", []), open_anomalies=open_anomalies)


def require_run(conn: sqlite3.Connection, run: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM runs WHERE run=?", (run,)).fetchone()
    if row is None:
        known = [r[0] for r in conn.execute("SELECT run FROM runs ORDER BY last_seen DESC LIMIT 20")]
        raise ApiError(404, "unknown_run", f"no run named {run!r}; known runs: {', '.join(known) or 'none yet'}")
    return row


def list_runs(store: Store) -> RunList:
    conn, now = store.read(), time.time()
    counts = dict(conn.execute("SELECT run, count(*) FROM anomalies WHERE status='open' GROUP BY run").fetchall())
    rows = conn.execute("SELECT * FROM runs ORDER BY last_seen DESC").fetchall()
    return RunList(runs=[_run(r, counts.get(r["run"], 0), now) for r in rows])


def run_summary(store: Store, run: str) -> RunSummary:
    conn = store.read()
    row = require_run(conn, run)
    by_kind = dict(conn.execute("SELECT kind, count(*) FROM anomalies WHERE run=? AND status='open' GROUP BY kind",
                                (run,)).fetchall())
    fixes = dict(conn.execute("SELECT status, count(*) FROM fixes WHERE run=? GROUP BY status", (run,)).fetchall())
    latest = {r[0]: r[1] for r in conn.execute(
        "SELECT name, value FROM scalars s WHERE run=? AND step=(SELECT max(step) FROM scalars WHERE run=s.run "
        "AND name=s.name) GROUP BY name", (run,))}
    return RunSummary(run=_run(row, sum(by_kind.values()), time.time()), latest=latest,
                      anomalies_by_kind=by_kind, fixes_by_status=fixes)


def _anomaly(r: sqlite3.Row) -> Anomaly:
    return Anomaly(id=r["id"], run=r["run"], kind=r["kind"], severity=r["severity"], status=r["status"],
                   first_step=r["first_step"], last_step=r["last_step"], resolved_step=r["resolved_step"],
                   tensors=_json(r["tensors"], []), message=r["message"], evidence=_json(r["evidence"], {}),
                   rule=r["rule"], created_at=r["created_at"], updated_at=r["updated_at"],
                   snapshot=_json(r["snapshot"], []) if "snapshot" in r.keys() else [])


def anomalies(store: Store, run: str, *, kind: AnomalyKind | None = None, severity: Severity | None = None,
              status: AnomalyStatus | None = None, min_step: int | None = None, max_step: int | None = None,
              offset: int = 0, limit: int = 50) -> AnomalyPage:
    conn = store.read()
    require_run(conn, run)
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(422, "invalid_parameter", f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    if offset < 0:
        raise ApiError(422, "invalid_parameter", f"offset must be >= 0, got {offset}")
    where, args = ["run=?"], [run]
    for col, value in (("kind", kind), ("severity", severity), ("status", status)):
        if value is not None:
            where.append(f"{col}=?")
            args.append(value.value)
    if min_step is not None:
        where.append("last_step>=?")
        args.append(min_step)
    if max_step is not None:
        where.append("first_step<=?")
        args.append(max_step)
    clause = " AND ".join(where)
    total = conn.execute(f"SELECT count(*) FROM anomalies WHERE {clause}", args).fetchone()[0]
    # Open and critical first: what an agent should look at before anything else.
    rows = conn.execute(
        f"SELECT * FROM anomalies WHERE {clause} ORDER BY status='open' DESC, "
        "CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, first_step, seq LIMIT ? OFFSET ?",
        [*args, limit, offset]).fetchall()
    nxt = offset + len(rows)
    return AnomalyPage(run=run, anomalies=[_anomaly(r) for r in rows], total=total, offset=offset,
                       next_offset=nxt if nxt < total else None)


def get_anomaly(conn: sqlite3.Connection, run: str, anomaly_id: str) -> Anomaly:
    require_run(conn, run)
    row = conn.execute("SELECT * FROM anomalies WHERE run=? AND id=?", (run, anomaly_id)).fetchone()
    if row is None:
        ids = [r[0] for r in conn.execute("SELECT id FROM anomalies WHERE run=? ORDER BY seq DESC LIMIT 10", (run,))]
        raise ApiError(404, "unknown_anomaly", f"run {run!r} has no anomaly {anomaly_id!r}; recent: "
                       f"{', '.join(ids) or 'none'}")
    return _anomaly(row)


def fix_from_row(r: sqlite3.Row) -> Fix:
    return Fix(id=r["id"], run=r["run"], anomaly_id=r["anomaly_id"], action=r["action"], params=_json(r["params"], {}),
               rationale=r["rationale"], expected_effect=r["expected_effect"] or "", risk=r["risk"], live=bool(r["live"]),
               rank=r["rank"], status=r["status"], reason=r["reason"], requested_by=r["requested_by"],
               created_at=r["created_at"], updated_at=r["updated_at"], applied_step=r["applied_step"],
               before=_json(r["before"], {}), after=_json(r["after"], {}))


def get_fix(conn: sqlite3.Connection, run: str, fix_id: str) -> Fix:
    require_run(conn, run)
    row = conn.execute("SELECT * FROM fixes WHERE run=? AND id=?", (run, fix_id)).fetchone()
    if row is None:
        raise ApiError(404, "unknown_fix", f"run {run!r} has no fix {fix_id!r}; call propose_fix for an anomaly first")
    return fix_from_row(row)


def fixes(store: Store, run: str, *, status: FixStatus | None = None, anomaly_id: str | None = None) -> FixList:
    conn = store.read()
    require_run(conn, run)
    where, args = ["run=?"], [run]
    if status is not None:
        where.append("status=?")
        args.append(status.value)
    if anomaly_id is not None:
        where.append("anomaly_id=?")
        args.append(anomaly_id)
    rows = conn.execute(f"SELECT * FROM fixes WHERE {' AND '.join(where)} ORDER BY seq", args).fetchall()
    return FixList(run=run, fixes=[fix_from_row(r) for r in rows])


def audit(store: Store, run: str) -> AuditTrail:
    conn = store.read()
    require_run(conn, run)
    rows = conn.execute("SELECT * FROM audit WHERE run=? ORDER BY time, rowid", (run,)).fetchall()
    return AuditTrail(run=run, entries=[AuditEntry(run=r["run"], time=r["time"], actor=r["actor"], action=r["action"],
                                                   fix_id=r["fix_id"], detail=_clean(_json(r["detail"], {})))
                                        for r in rows])


def _clean(detail: dict) -> dict:
    """Audit details may nest (before/after); flatten them into the Params shape."""
    out: dict[str, Any] = {}
    for k, v in detail.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[f"{k}.{k2}"] = v2 if not isinstance(v2, dict) else orjson.dumps(v2).decode()
        else:
            out[k] = v
    return out


def series(store: Store, run: str, name: str, *, max_points: int = 500, collection: str | None = None,
           field: str = "norm") -> Series:
    """A scalar series (``loss``, ``sys/step_time``, ...) or, with ``collection``, one tensor's statistic."""
    conn = store.read()
    require_run(conn, run)
    if collection is None:
        rows = conn.execute("SELECT step, value FROM scalars WHERE run=? AND name=? ORDER BY step", (run, name)).fetchall()
    else:
        if field not in STAT_COLUMNS:
            raise ApiError(422, "invalid_parameter", f"field must be one of {', '.join(STAT_COLUMNS)}")
        rows = conn.execute(f"SELECT step, {field} FROM stats WHERE run=? AND collection=? AND tensor=? ORDER BY step",
                            (run, collection, name)).fetchall()
    points = [SeriesPoint(step=r[0], value=r[1]) for r in rows]
    downsampled = len(points) > max_points
    if downsampled:
        stride = -(-len(points) // max_points)
        points = points[::stride]
    return Series(run=run, name=name, points=points, downsampled=downsampled)
