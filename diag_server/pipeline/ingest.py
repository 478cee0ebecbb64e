"""Ingest: validate a probe's batch, store it whole (or not at all), run the rules, answer with commands."""

from __future__ import annotations

import operator
import sqlite3
import time
from typing import Any

import orjson
from pydantic import ValidationError

from schemas.events import (CaptureResult, Command, FixAck, IngestBatch, IngestReply, LayerProfiles, RunStart,
                            Scalars, Spans, TensorSnapshot, TensorStats)

from . import captures, evidence, ranks
from .. import fixes
from ..compression.recipe import store_profiles
from .engine import Engine, loss_median
from ..errors import ApiError
from ..rules import Observations
from ..store import STAT_COLUMNS, Store, add_message, pack_quantiles

MAX_BODY_BYTES = 32 << 20  # a full batch of the largest events fits well inside this
DEFAULT_INTERVAL = 100  # the probe's default (probes.DEFAULT_INTERVAL), for runs that sent no run_start
_stat_values = operator.itemgetter("name", *STAT_COLUMNS)  # a row dict -> its stats table columns



def parse_batch(body: bytes) -> IngestBatch:
    """Parse and validate a request body; raise ApiError(400/413/422) saying what is wrong."""
    if len(body) > MAX_BODY_BYTES:
        raise ApiError(413, "body_too_large", f"the body is {len(body)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
    try:
        return IngestBatch.model_validate(data)
    except ValidationError as e:
        raise ApiError(422, "invalid_batch", f"the batch does not match the IngestBatch schema "
                       f"({e.error_count()} problem(s)); nothing was stored", validation_details(e)) from None


def validation_details(e: ValidationError, limit: int = 20) -> list[str]:
    out = []
    for err in e.errors()[:limit]:
        where = ".".join(str(x) for x in err["loc"]) or "(body)"
        out.append(f"{where}: {err['msg']}")
    if e.error_count() > limit:
        out.append(f"... and {e.error_count() - limit} more")
    return out


def ingest(store: Store, engine: Engine, batch: IngestBatch) -> IngestReply:
    return store.write(lambda conn: _ingest(conn, engine, batch, time.time()))


def _ingest(conn: sqlite3.Connection, engine: Engine, batch: IngestBatch, now: float) -> IngestReply:
    run, rank = batch.run, batch.rank
    if batch.events and conn.execute("SELECT 1 FROM batches WHERE batch_id=?", (batch.batch_id,)).fetchone():
        return _reply(conn, run, rank, accepted=0, duplicate=True)
    _touch_run(conn, run, now)
    ranks.touch(conn, run, rank, now, max((ev.step for ev in batch.events), default=0))
    if not batch.events:  # a heartbeat: the probe asks for commands
        return _reply(conn, run, rank, accepted=0)
    conn.execute("INSERT INTO batches(batch_id, run, seq, received, events) VALUES (?,?,?,?,?)",
                 (batch.batch_id, run, batch.seq, now, len(batch.events)))
    obs = Observations(run=run, interval=_interval(conn, run), rank=rank)
    last_step = max(ev.step for ev in batch.events)
    # The batch's data is stored before anything in it that reads the store is handled: a fix_ack looks up
    # the losses of the steps before it, and with fast steps those are in this very batch.
    _store_data(conn, run, rank, batch.events, obs)
    conn.execute("UPDATE runs SET last_step=max(last_step, ?) WHERE run=?", (last_step, run))
    span_events: list[Spans] = []
    for ev in batch.events:
        if isinstance(ev, (Scalars, TensorStats)):
            continue
        if isinstance(ev, RunStart):
            if ranks.started(conn, run, rank, ev):
                conn.execute("UPDATE runs SET start=?, ended=0 WHERE run=?", (ev.model_dump_json(), run))
            obs.interval = int(ev.config.get("interval") or DEFAULT_INTERVAL)  # type: ignore[arg-type]
        elif isinstance(ev, FixAck) and ev.status == "scheduled":
            fixes.schedule(conn, run, ev, now)
        elif isinstance(ev, FixAck):
            settled = ranks.gather_ack(conn, run, rank, ev)
            if settled is not None:
                _apply_ack(conn, run, settled, now)
        elif isinstance(ev, Spans):
            span_events.append(ev)
        elif isinstance(ev, CaptureResult):
            captures.record(conn, run, rank, ev, now)
        elif isinstance(ev, LayerProfiles):
            store_profiles(conn, run, ev)
        elif isinstance(ev, TensorSnapshot):
            evidence.receive(conn, run, ev, now)
        elif ev.kind == "message":
            add_message(conn, run, ev.step, ev.time, ev.level, ev.text, rank)
        elif ev.kind == "run_end":
            if ev.reason != "closed":  # closed at exit or on a signal, not by the job: say how it ended
                # an exception ended it: an error; a signal (a scheduler's preemption, kill): a warning
                level = ("error" if ev.reason.startswith("exit after") else
                         "warning" if ev.reason.startswith("killed by") else "info")
                add_message(conn, run, ev.step, ev.time, level, f"the job ended: {ev.reason}", rank)
            if not ranks.ended(conn, run, rank):
                continue
            conn.execute("UPDATE runs SET ended=1 WHERE run=?", (run,))
            _expire_pending(conn, run, "the job ended before it picked the fix up", now)
            captures.expire(conn, run, now)
            evidence.expire(conn, run, now)
    obs.spans = ranks.store_spans(conn, run, rank, span_events)
    obs.world_size = ranks.world_size(conn, run)
    engine.process(conn, obs, now)
    return _reply(conn, run, rank, accepted=len(batch.events))


def _store_data(conn: sqlite3.Connection, run: str, rank: int, events: list, obs: Observations) -> None:
    """Store a batch's scalars and tensor statistics, and gather them into ``obs`` for the rules."""
    scalar_rows: list[tuple[Any, ...]] = []
    stat_rows: list[tuple[Any, ...]] = []
    table_rows: list[tuple[Any, ...]] = []
    for ev in events:
        if isinstance(ev, Scalars):
            for name, value in ev.values.items():
                scalar_rows.append((run, ev.step, name, value, ev.time, rank))
                obs.scalars.setdefault(name, []).append((ev.step, value))
        elif isinstance(ev, TensorStats):
            # A row's fields as validated, copied; only an embedding summary (a nested model) needs a dump.
            rows = [dict(r.__dict__) if r.embedding is None else r.model_dump() for r in ev.rows]
            collection = ev.collection.value
            obs.stats.setdefault(collection, {})[ev.step] = rows
            stat_rows.extend((run, ev.step, collection, *_stat_values(r), rank, pack_quantiles(r.get("quantiles")))
                             for r in rows)
            # an embedding table's latest summary, for GET /v1/runs/{run}/embeddings (older reports: the rules')
            table_rows.extend((run, rank, r["name"], ev.step, orjson.dumps(r["embedding"]))
                              for r in rows if r.get("embedding") is not None)
    for series in obs.scalars.values():  # events of one batch may interleave steps
        series.sort(key=lambda p: p[0])
    conn.executemany("INSERT INTO scalars(run, step, name, value, time, rank) VALUES (?,?,?,?,?,?)", scalar_rows)
    conn.executemany(f"INSERT INTO stats(run, step, collection, tensor, {', '.join(STAT_COLUMNS)}, rank, quantiles) "
                     f"VALUES ({', '.join('?' * (6 + len(STAT_COLUMNS)))})", stat_rows)
    conn.executemany("INSERT INTO embedding_tables(run, rank, name, step, summary) VALUES (?,?,?,?,?) "
                     "ON CONFLICT(run, rank, name) DO UPDATE SET step=excluded.step, summary=excluded.summary "
                     "WHERE excluded.step >= embedding_tables.step", table_rows)


def _reply(conn: sqlite3.Connection, run: str, rank: int, **kw: Any) -> IngestReply:
    return IngestReply(**kw, commands=ranks.commands_for(conn, rank, pending_commands(conn, run)),
                       captures=captures.pending_for(conn, run, rank))


def _touch_run(conn: sqlite3.Connection, run: str, now: float) -> None:
    conn.execute("INSERT INTO runs(run, created_at, last_seen) VALUES (?,?,?) "
                 "ON CONFLICT(run) DO UPDATE SET last_seen=excluded.last_seen", (run, now, now))


def _interval(conn: sqlite3.Connection, run: str) -> int:
    row = conn.execute("SELECT start FROM runs WHERE run=?", (run,)).fetchone()
    if row and row[0]:
        return int(orjson.loads(row[0]).get("config", {}).get("interval") or DEFAULT_INTERVAL)
    return DEFAULT_INTERVAL


def pending_commands(conn: sqlite3.Connection, run: str) -> list[Command]:
    """The commands waiting for the job, handed out with this reply. The first time an apply goes out,
    the run's step is kept (``sent_at_step``): the job is given a few intervals from *then* to acknowledge
    (fixes.status), not from the request, which may come long before the job's next batch."""
    rows = conn.execute("SELECT id, action, params, pending_op, verify FROM fixes WHERE run=? AND pending_op IS NOT "
                        "NULL ORDER BY seq", (run,)).fetchall()
    for r in rows:
        verify = orjson.loads(r["verify"]) if r["verify"] else {}
        if r["pending_op"] == "apply" and "sent_at_step" not in verify:
            step = conn.execute("SELECT last_step FROM runs WHERE run=?", (run,)).fetchone()[0] or 0
            conn.execute("UPDATE fixes SET verify=? WHERE id=?",
                         (orjson.dumps({**verify, "sent_at_step": step}).decode(), r["id"]))
    return [Command(fix_id=r["id"], op=r["pending_op"], action=r["action"], params=orjson.loads(r["params"]),
                    attempt=_attempt(conn, run, r["id"], r["pending_op"])) for r in rows] + evidence.pending(conn, run)


def _attempt(conn: sqlite3.Connection, run: str, fix_id: str, op: str) -> int:
    """How many times ``op`` was asked for this fix (its audit trail's requests; 1 at least)."""
    n = conn.execute("SELECT count(*) FROM audit WHERE run=? AND fix_id=? AND action=?",
                     (run, fix_id, f"{op}_requested")).fetchone()[0]
    return max(int(n), 1)


def _apply_ack(conn: sqlite3.Connection, run: str, ack: FixAck, now: float) -> None:
    row = conn.execute("SELECT status, anomaly_id FROM fixes WHERE id=? AND run=?", (ack.fix_id, run)).fetchone()
    if row is None:
        return  # an ack for a fix this store never issued (an imported file, say): nothing to update
    detail = {"op": ack.op, "status": ack.status, "step": ack.step, "reason": ack.reason}
    if ack.op == "revert":
        status = "reverted" if ack.status == "reverted" else row["status"]
        conn.execute("UPDATE fixes SET status=?, pending_op=NULL, reason=coalesce(?, reason), updated_at=? WHERE id=?",
                     (status, ack.reason, now, ack.fix_id))
    elif ack.status == "applied":
        loss_before = _recent_loss(conn, run, ack.step)
        conn.execute("UPDATE fixes SET status='applied', pending_op=NULL, applied_step=?, before=?, after=?, "
                     "verify=?, reason=NULL, updated_at=? WHERE id=?",
                     (ack.step, orjson.dumps(ack.before).decode(), orjson.dumps(ack.after).decode(),
                      orjson.dumps({"loss_before": loss_before}).decode(), now, ack.fix_id))
    else:
        conn.execute("UPDATE fixes SET status=?, pending_op=NULL, reason=?, updated_at=? WHERE id=?",
                     (ack.status, ack.reason, now, ack.fix_id))
    conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                 (run, now, "job", ack.status, ack.fix_id,
                  orjson.dumps({**detail, "before": ack.before, "after": ack.after}).decode()))


def _recent_loss(conn: sqlite3.Connection, run: str, step: int, window: int = 50) -> float | None:
    return loss_median(conn, run, max(step - window, 0), step)


def _expire_pending(conn: sqlite3.Connection, run: str, reason: str, now: float) -> None:
    ids = [r[0] for r in conn.execute("SELECT id FROM fixes WHERE run=? AND pending_op IS NOT NULL", (run,))]
    for fix_id in ids:
        conn.execute("UPDATE fixes SET status=CASE WHEN pending_op='apply' THEN 'expired' ELSE status END, "
                     "pending_op=NULL, reason=?, updated_at=? WHERE id=?", (reason, now, fix_id))
        conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                     (run, now, "server", "expired", fix_id, orjson.dumps({"reason": reason}).decode()))
