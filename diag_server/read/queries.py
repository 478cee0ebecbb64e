"""Read queries shared by the HTTP routes, the MCP tools and the CLI: one function per question."""

from __future__ import annotations

import sqlite3
import time
from typing import Any, Iterable

import orjson

from schemas.enums import AnomalyKind, AnomalyStatus, FixStatus, Severity
from schemas.events import MAX_EMBEDDING_ROWS, EmbeddingSummary
from schemas.records import (Anomaly, AnomalyPage, AuditEntry, AuditPage, AuditTrail, EmbeddingTable, EmbeddingTables,
                             Fix, FixList, FixPage, Run, RunList, RunMessage, RunPage, RunSummary, Series, SeriesPoint)

from ..errors import ApiError
from ..store import STAT_COLUMNS, Store

# A run that has sent nothing (not even a heartbeat) for this long is 'stale': its job is gone or stuck.
STALE_AFTER_S = 30.0
MAX_PAGE = 500
# A run's summary shows its latest messages, at most this many (with the total).
MESSAGES_SHOWN = 20


def _json(text: str | None, default: Any) -> Any:
    return orjson.loads(text) if text else default


def _run(row: sqlite3.Row, open_anomalies: int, now: float) -> Run:
    start = _json(row["start"], {})
    status = "ended" if row["ended"] else ("stale" if now - row["last_seen"] > STALE_AFTER_S else "active")
    return Run(run=row["run"], status=status, created_at=row["created_at"], last_seen=row["last_seen"],
               last_step=row["last_step"] or 0, device=start.get("device", ""),
               total_params=start.get("total_params", 0), allow=start.get("allow", []), open_anomalies=open_anomalies)


def filters(first: tuple[str, Any], *, equal: Iterable[tuple[str, Any]] = (), at_least: Iterable[tuple[str, Any]] = (),
            at_most: Iterable[tuple[str, Any]] = ()) -> tuple[list[str], list[Any]]:
    """A WHERE clause's terms and arguments: ``first`` always, then each filter whose value is not None."""
    where, args = [f"{first[0]}=?"], [first[1]]
    for op, pairs in (("=", equal), (">=", at_least), ("<=", at_most)):
        for col, value in pairs:
            if value is not None:
                where.append(f"{col}{op}?")
                args.append(getattr(value, "value", value))  # an enum member's value
    return where, args


def require_run(conn: sqlite3.Connection, run: str) -> sqlite3.Row:
    row = conn.execute("SELECT * FROM runs WHERE run=?", (run,)).fetchone()
    if row is None:
        known = [r[0] for r in conn.execute("SELECT run FROM runs ORDER BY last_seen DESC LIMIT 20")]
        raise ApiError(404, "unknown_run", f"no run named {run!r}; known runs: {', '.join(known) or 'none yet'}")
    return row


def check_page(offset: int, limit: int | None) -> None:
    """The same paging rules on every list: ``offset >= 0``, ``1 <= limit <= MAX_PAGE`` (None: all)."""
    if limit is not None and not 1 <= limit <= MAX_PAGE:
        raise ApiError(422, "invalid_parameter", f"limit must be between 1 and {MAX_PAGE}, got {limit}")
    if offset < 0:
        raise ApiError(422, "invalid_parameter", f"offset must be >= 0, got {offset}")


def next_offset(offset: int, returned: int, total: int) -> int | None:
    nxt = offset + returned
    return nxt if nxt < total else None


def run_page(store: Store, *, status: str | None = None, offset: int = 0, limit: int | None = None,
             search: str | None = None, open_anomalies: bool | None = None) -> RunPage:
    """Runs, most recently active first. ``search``: runs whose id contains it (any case); ``open_anomalies``:
    only runs with (True) or without (False) an open anomaly."""
    check_page(offset, limit)
    conn, now = store.read(), time.time()
    counts = dict(conn.execute("SELECT run, count(*) FROM anomalies WHERE status='open' GROUP BY run").fetchall())
    where, args = ("WHERE instr(lower(run), ?) > 0", [search.lower()]) if search else ("", [])
    rows = conn.execute(f"SELECT * FROM runs {where} ORDER BY last_seen DESC", args).fetchall()
    runs = [_run(r, counts.get(r["run"], 0), now) for r in rows]
    if status is not None:  # active/stale is computed from last_seen, so it filters here rather than in SQL
        runs = [r for r in runs if r.status == status]
    if open_anomalies is not None:
        runs = [r for r in runs if (r.open_anomalies > 0) == open_anomalies]
    page = runs[offset:None if limit is None else offset + limit]
    return RunPage(runs=page, total=len(runs), offset=offset, next_offset=next_offset(offset, len(page), len(runs)))


def list_runs(store: Store) -> RunList:
    return RunList(runs=run_page(store).runs)


def run_summary(store: Store, run: str) -> RunSummary:
    conn = store.read()
    row = require_run(conn, run)
    by_kind = dict(conn.execute("SELECT kind, count(*) FROM anomalies WHERE run=? AND status='open' GROUP BY kind",
                                (run,)).fetchall())
    fixes = dict(conn.execute("SELECT status, count(*) FROM fixes WHERE run=? GROUP BY status", (run,)).fetchall())
    latest = {r[0]: r[1] for r in conn.execute(
        "SELECT name, value FROM scalars s WHERE run=? AND step=(SELECT max(step) FROM scalars WHERE run=s.run "
        "AND name=s.name) GROUP BY name", (run,))}
    messages = [RunMessage(step=r["step"], time=r["time"], level=r["level"], text=r["text"], rank=r["rank"])
                for r in conn.execute("SELECT step, time, level, text, rank FROM messages WHERE run=? ORDER BY rowid DESC "
                                      "LIMIT ?", (run, MESSAGES_SHOWN)).fetchall()[::-1]]
    total = conn.execute("SELECT count(*) FROM messages WHERE run=?", (run,)).fetchone()[0]
    return RunSummary(run=_run(row, sum(by_kind.values()), time.time()), latest=latest,
                      anomalies_by_kind=by_kind, fixes_by_status=fixes, messages=messages, messages_total=total,
                      config=_json(row["start"], {}).get("run_config", {}))


def _anomaly(r: sqlite3.Row) -> Anomaly:
    return Anomaly(id=r["id"], run=r["run"], kind=r["kind"], severity=r["severity"], status=r["status"],
                   first_step=r["first_step"], last_step=r["last_step"], resolved_step=r["resolved_step"],
                   tensors=_json(r["tensors"], []), message=r["message"], evidence=_json(r["evidence"], {}),
                   rule=r["rule"], created_at=r["created_at"], updated_at=r["updated_at"],
                   snapshot=_json(r["snapshot"], []) if "snapshot" in r.keys() else [])


def anomalies(store: Store, run: str, *, kind: AnomalyKind | None = None, severity: Severity | None = None,
              status: AnomalyStatus | None = None, min_step: int | None = None, max_step: int | None = None,
              offset: int = 0, limit: int = 50, min_step_time: float | None = None) -> AnomalyPage:
    conn = store.read()
    require_run(conn, run)
    check_page(offset, limit)
    where, args = filters(("run", run), equal=(("kind", kind), ("severity", severity), ("status", status)),
                          at_least=(("last_step", min_step),), at_most=(("first_step", max_step),))
    if min_step_time is not None:
        # A latency threshold: the slowest step of a sampling interval ('sys/step_time_max', reported at
        # the interval's last step) reached it while the anomaly held.
        where.append("EXISTS (SELECT 1 FROM scalars s WHERE s.run=anomalies.run AND s.name='sys/step_time_max' "
                     "AND s.value>=? AND s.step>=anomalies.first_step AND s.step<=anomalies.last_step+?)")
        args.extend([min_step_time, _interval(conn, run)])
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
               scheduled_step=_json(r["verify"], {}).get("scheduled_step") if r["pending_op"] else None,
               before=_json(r["before"], {}), after=_json(r["after"], {}))


def get_fix(conn: sqlite3.Connection, run: str, fix_id: str) -> Fix:
    require_run(conn, run)
    row = conn.execute("SELECT * FROM fixes WHERE run=? AND id=?", (run, fix_id)).fetchone()
    if row is None:
        raise ApiError(404, "unknown_fix", f"run {run!r} has no fix {fix_id!r}; call propose_fix for an anomaly first")
    return fix_from_row(row)


def fixes(store: Store, run: str, *, status: FixStatus | None = None, anomaly_id: str | None = None) -> FixList:
    page = fix_page(store, run, status=status, anomaly_id=anomaly_id)
    return FixList(run=run, fixes=page.fixes)


def fix_page(store: Store, run: str, *, status: FixStatus | None = None, anomaly_id: str | None = None,
             kind: AnomalyKind | None = None, severity: Severity | None = None, min_step: int | None = None,
             max_step: int | None = None, offset: int = 0, limit: int | None = None) -> FixPage:
    """The run's fixes in the order they were proposed. ``kind``, ``severity`` and the step range filter on
    the anomaly each fix is for, with the same meaning as in ``anomalies``."""
    conn = store.read()
    require_run(conn, run)
    check_page(offset, limit)
    where, args = filters(("f.run", run), equal=(("f.status", status), ("a.kind", kind), ("a.severity", severity),
                                                 ("f.anomaly_id", anomaly_id)),
                          at_least=(("a.last_step", min_step),), at_most=(("a.first_step", max_step),))
    frm = f"FROM fixes f LEFT JOIN anomalies a ON a.id=f.anomaly_id WHERE {' AND '.join(where)}"
    total = conn.execute(f"SELECT count(*) {frm}", args).fetchone()[0]
    rows = conn.execute(f"SELECT f.* {frm} ORDER BY f.seq LIMIT ? OFFSET ?",
                        [*args, -1 if limit is None else limit, offset]).fetchall()
    return FixPage(run=run, fixes=[fix_from_row(r) for r in rows], total=total, offset=offset,
                   next_offset=next_offset(offset, len(rows), total))


def audit(store: Store, run: str) -> AuditTrail:
    return AuditTrail(run=run, entries=audit_page(store, run).entries)


def audit_page(store: Store, run: str, *, fix_id: str | None = None, offset: int = 0,
               limit: int | None = None) -> AuditPage:
    conn = store.read()
    require_run(conn, run)
    check_page(offset, limit)
    where, args = "run=?" + (" AND fix_id=?" if fix_id is not None else ""), [run] + ([fix_id] if fix_id is not None else [])
    total = conn.execute(f"SELECT count(*) FROM audit WHERE {where}", args).fetchone()[0]
    rows = conn.execute(f"SELECT * FROM audit WHERE {where} ORDER BY time, rowid LIMIT ? OFFSET ?",
                        [*args, -1 if limit is None else limit, offset]).fetchall()
    return AuditPage(run=run, entries=[AuditEntry(run=r["run"], time=r["time"], actor=r["actor"], action=r["action"],
                                                   fix_id=r["fix_id"], detail=_clean(_json(r["detail"], {})))
                                        for r in rows],
                      total=total, offset=offset, next_offset=next_offset(offset, len(rows), total))


def _interval(conn: sqlite3.Connection, run: str) -> int:
    start = _json(require_run(conn, run)["start"], {})
    return int(start.get("config", {}).get("interval") or 50)


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


# Collections whose rows, on a model sharded with FSDP2, each rank sends for the shard it holds
# (probes/stats.py local): read whole, they are merged across the ranks step by step.
SHARDED_COLLECTIONS = ("weights", "gradients", "updates")
# The shards' rows of one (tensor, step), merged into the whole tensor's: sizes and counts add up, squared
# norms add up, means and second moments are weighted by each shard's finite elements, extremes are the
# extremes. An update ratio is ||sum of updates|| / ||sum of weights||, the weights' norm of a shard being
# its update's norm over its ratio. A shard's null (a NaN in it) makes the whole tensor's norm null; an
# empty shard (numel 0) counts for nothing.
_MERGED_STATS = """(SELECT run, collection, tensor, step, numel,
    CASE WHEN norms = rows_ THEN sqrt(sq) END AS norm,
    s1 / fin AS mean, sqrt(max(s2 / fin - (s1 / fin) * (s1 / fin), 0.0)) AS std, min, max, nan_count, inf_count,
    zeros / nullif(numel, 0) AS zero_frac, NULL AS dead_frac, NULL AS saturated_frac,
    CASE WHEN ratios = rows_ THEN CASE WHEN sq = 0 THEN 0.0 ELSE sqrt(sq) / nullif(sqrt(wsq), 0) END END AS update_ratio
  FROM (SELECT run, collection, tensor, step, count(*) AS rows_, sum(numel) AS numel, count(norm) AS norms,
          sum(norm * norm) AS sq, min(min) AS min, max(max) AS max, sum(nan_count) AS nan_count,
          sum(inf_count) AS inf_count, sum(zero_frac * numel) AS zeros,
          nullif(sum(CASE WHEN mean IS NOT NULL THEN numel - nan_count - inf_count END), 0) AS fin,
          sum(mean * (numel - nan_count - inf_count)) AS s1,
          sum((std * std + mean * mean) * (numel - nan_count - inf_count)) AS s2,
          count(CASE WHEN update_ratio > 0 OR norm = 0 THEN 1 END) AS ratios,
          sum(CASE WHEN update_ratio > 0 THEN (norm / update_ratio) * (norm / update_ratio) ELSE 0 END) AS wsq
        FROM stats GROUP BY run, collection, tensor, step))"""


def sharded(conn: sqlite3.Connection, run: str) -> bool:
    """Whether the run's model is sharded across its ranks (FSDP2): its run_start lists a parameter with
    a ``local_numel`` (null for the others). A pattern test on the stored JSON: this runs with every chart's query."""
    row = conn.execute("""SELECT start GLOB '*"local_numel":[0-9]*' FROM runs WHERE run=?""", (run,)).fetchone()
    return bool(row and row[0])


def stats_table(conn: sqlite3.Connection, run: str, collection: str | None, rank: int | None = None) -> str:
    """What to read a collection's rows from: ``stats`` itself, or, for all ranks of a sharded run's
    weights, gradients and updates, their shards merged into whole tensors (one row per tensor and step)."""
    if rank is None and collection in SHARDED_COLLECTIONS and sharded(conn, run):
        return _MERGED_STATS
    return "stats"


def series(store: Store, run: str, name: str, *, max_points: int = 500, collection: str | None = None,
           field: str = "norm", min_step: int | None = None, max_step: int | None = None,
           rank: int | None = None) -> Series:
    """A scalar series (``loss``, ``sys/step_time``, ...) or, with ``collection``, one tensor's statistic,
    within the step range, downsampled to at most ``max_points`` keeping each bucket's min and max.
    In a distributed run every rank's points are returned unless ``rank`` picks one; a sharded model's
    (FSDP2) weights, gradients and updates are the whole tensors', merged from the ranks' shards."""
    from .downsample import min_max_query

    conn = store.read()
    require_run(conn, run)
    if max_points < 2:
        raise ApiError(422, "invalid_parameter", f"max_points must be >= 2, got {max_points}")
    lo, hi = (0 if min_step is None else min_step), (2**63 - 1 if max_step is None else max_step)
    only, extra = ("", ()) if rank is None else (" AND rank=?", (int(rank),))
    if collection is None:
        kept, total = min_max_query(conn, "scalars", "value", "run=? AND name=? AND step BETWEEN ? AND ?" + only,
                                    (run, name, lo, hi, *extra), max_points)
    else:
        if field not in STAT_COLUMNS:
            raise ApiError(422, "invalid_parameter", f"field must be one of {', '.join(STAT_COLUMNS)}")
        table = stats_table(conn, run, collection, rank)
        kept, total = min_max_query(conn, table, field,
                                    "run=? AND collection=? AND tensor=? AND step BETWEEN ? AND ?" + only,
                                    (run, collection, name, lo, hi, *extra), max_points)
    return Series(run=run, name=name, points=[SeriesPoint(step=s, value=v) for s, v in kept],
                  downsampled=len(kept) < total)


def embeddings(store: Store, run: str, *, table: str | None = None, rows: int = 20) -> EmbeddingTables:
    """The run's embedding tables as their latest reports described them, every list cut to ``rows``; ``table``
    picks one (its parameter name, or its module's: 'item' for 'item.weight')."""
    if not 0 <= rows <= MAX_EMBEDDING_ROWS:
        raise ApiError(422, "invalid_parameter", f"rows must be in [0, {MAX_EMBEDDING_ROWS}], got {rows}")
    conn = store.read()
    require_run(conn, run)
    found = conn.execute("SELECT name, rank, step, summary FROM embedding_tables WHERE run=? ORDER BY name, rank",
                         (run,)).fetchall()
    if table is not None:
        names = sorted({r["name"] for r in found})
        found = [r for r in found if r["name"] in (table, f"{table}.weight")]
        if not found:
            raise ApiError(404, "unknown_table", f"run {run!r} reported no embedding table {table!r}; it reported: "
                           + (", ".join(names) if names else "none (is the embeddings collection on?)"))
    tables = []
    for r in found:
        summary = orjson.loads(r["summary"])
        for key in ("zombies", "rarest", "conflicted", "dead_ids", "nonfinite_ids"):
            summary[key] = summary.get(key, [])[:rows]
        tables.append(EmbeddingTable(name=r["name"], rank=r["rank"], step=r["step"],
                                     summary=EmbeddingSummary.model_validate(summary)))
    return EmbeddingTables(run=run, rows=rows, tables=tables)
