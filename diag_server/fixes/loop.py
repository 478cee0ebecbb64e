"""The fix loop: propose (from the registry's proposers), apply, revert, status, and the job's acks.

Deciding (which fix, with what parameters) happens on the server; acting happens in the job
(probes.fixes), and the two meet only through commands on the ingest reply and the job's
acknowledgements.
"""

from __future__ import annotations

import sqlite3
import time

import orjson

from schemas.enums import FixStatus
from schemas.events import FixAck
from schemas.records import Fix, FixList

from ..errors import ApiError
from ..read.queries import STALE_AFTER_S, fix_from_row, get_anomaly, get_fix, require_run
from ..store import Store
from .candidates import ACK_INTERVALS, ACK_MIN_STEPS, IRREVERSIBLE, _advice
from .registry import PROPOSERS


# -- the loop: propose, apply, revert ----------------------------------------------------------------
def propose(store: Store, run: str, anomaly_id: str, actor: str) -> FixList:
    def write(conn: sqlite3.Connection) -> FixList:
        a = get_anomaly(conn, run, anomaly_id)
        allowed = set(require_run_allow(conn, run))
        cands = PROPOSERS.get(a.kind, lambda *_: [])(conn, a) or [_advice(a)]
        # What can repair the run comes first; among those, what the job allows: a proposal it would reject
        # is worth less to the agent.
        cands.sort(key=lambda c: (not c.repairs, c.action.value not in allowed and c.live))
        existing = {(r["action"], r["params"]): r for r in conn.execute(
            "SELECT * FROM fixes WHERE run=? AND anomaly_id=?", (run, anomaly_id))}
        now, out = time.time(), []
        for rank, c in enumerate(cands, 1):
            params = orjson.dumps(c.params, option=orjson.OPT_SORT_KEYS).decode()
            row = existing.get((c.action.value, params))
            if row is not None:  # proposing twice gives the same fix ids
                conn.execute("UPDATE fixes SET rank=?, updated_at=? WHERE id=?", (rank, now, row["id"]))
                out.append(row["id"])
                continue
            rationale = c.rationale
            if c.live and c.action.value not in allowed:
                rationale += (f" This job does not allow '{c.action.value}' yet: attach the probe with "
                              f"allow=[..., '{c.action.value}'] to let it be applied.")
            status = FixStatus.proposed if c.live else FixStatus.advice
            cur = conn.execute(
                "INSERT INTO fixes(run, anomaly_id, action, params, rationale, expected_effect, risk, live, rank, "
                "status, requested_by, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run, anomaly_id, c.action.value, params, rationale, c.expected_effect, c.risk, int(c.live), rank,
                 status.value, actor, now, now))
            fix_id = f"f-{cur.lastrowid}"
            conn.execute("UPDATE fixes SET id=? WHERE seq=?", (fix_id, cur.lastrowid))
            _audit(conn, run, actor, "proposed", fix_id, {"action": c.action.value, "anomaly_id": anomaly_id})
            out.append(fix_id)
        rows = {r["id"]: r for r in conn.execute(
            f"SELECT * FROM fixes WHERE id IN ({','.join('?' * len(out))})", out)}
        return FixList(run=run, fixes=[fix_from_row(rows[i]) for i in out])

    return store.write(write)


def require_run_allow(conn: sqlite3.Connection, run: str) -> list[str]:
    row = require_run(conn, run)
    return orjson.loads(row["start"]).get("allow", []) if row["start"] else []


def apply(store: Store, run: str, fix_id: str, actor: str) -> Fix:
    def write(conn: sqlite3.Connection) -> Fix:
        fix = get_fix(conn, run, fix_id)
        if fix.status in (FixStatus.pending, FixStatus.applied, FixStatus.effective, FixStatus.ineffective):
            return fix  # idempotent: applying twice applies once
        if not fix.live:
            raise ApiError(409, "not_live", f"{fix_id} is advice ({fix.action.value}): it needs a change to the "
                           "training code and a restart, so it cannot be applied to the running job")
        if fix.status not in (FixStatus.proposed, FixStatus.rejected, FixStatus.failed, FixStatus.expired,
                              FixStatus.reverted):
            raise ApiError(409, "stale_fix", f"{fix_id} is {fix.status.value} and cannot be applied")
        row = require_run(conn, run)
        now = time.time()
        if row["ended"] or now - row["last_seen"] > STALE_AFTER_S:
            why = ("the job has ended" if row["ended"] else
                   f"the job has not been heard from for {now - row['last_seen']:.0f}s")
            conn.execute("UPDATE fixes SET status='expired', reason=?, updated_at=? WHERE id=?",
                         (f"not sent: {why}", now, fix_id))
            _audit(conn, run, actor, "apply_refused", fix_id, {"reason": why})
            raise ApiError(409, "job_unavailable", f"{fix_id} was not sent: {why}. Nothing was changed.")
        conn.execute("UPDATE fixes SET status='pending', pending_op='apply', reason=NULL, requested_by=?, "
                     "updated_at=?, verify=? WHERE id=?",
                     (actor, now, orjson.dumps({"requested_at_step": row["last_step"]}).decode(), fix_id))
        _audit(conn, run, actor, "apply_requested", fix_id, {"action": fix.action.value})
        conn.execute("DELETE FROM fix_acks WHERE fix_id=? AND op='apply'", (fix_id,))  # the ranks answer anew
        return get_fix(conn, run, fix_id)

    return store.write(write)


def revert(store: Store, run: str, fix_id: str, actor: str) -> Fix:
    def write(conn: sqlite3.Connection) -> Fix:
        fix = get_fix(conn, run, fix_id)
        if fix.status == FixStatus.pending:
            now = time.time()
            conn.execute("UPDATE fixes SET status='proposed', pending_op=NULL, updated_at=? WHERE id=?", (now, fix_id))
            _audit(conn, run, actor, "apply_cancelled", fix_id, {})
            return get_fix(conn, run, fix_id)
        if fix.status not in (FixStatus.applied, FixStatus.effective, FixStatus.ineffective):
            raise ApiError(409, "not_applied", f"{fix_id} is {fix.status.value}: only an applied fix can be reverted")
        if fix.action in IRREVERSIBLE:
            raise ApiError(409, "irreversible", f"{fix_id} ({fix.action.value}) cannot be undone: the job discards "
                           "the state a rollback replaces. Roll back again or apply another fix instead.")
        row = require_run(conn, run)
        now = time.time()
        if row["ended"] or now - row["last_seen"] > STALE_AFTER_S:
            why = ("the job has ended" if row["ended"] else
                   f"the job has not been heard from for {now - row['last_seen']:.0f}s")
            _audit(conn, run, actor, "revert_refused", fix_id, {"reason": why})
            raise ApiError(409, "job_unavailable", f"{fix_id} cannot be reverted: {why}. Nothing was changed.")
        conn.execute("UPDATE fixes SET pending_op='revert', updated_at=? WHERE id=?", (now, fix_id))
        _audit(conn, run, actor, "revert_requested", fix_id, {})
        conn.execute("DELETE FROM fix_acks WHERE fix_id=? AND op='revert'", (fix_id,))
        return get_fix(conn, run, fix_id)

    return store.write(write)


def status(store: Store, run: str, fix_id: str) -> Fix:
    """Where a fix stands. A command the job will not pick up (it ended, went silent for STALE_AFTER_S, or
    kept stepping without acknowledging) is expired here, with the reason, rather than left waiting."""
    conn = store.read()
    fix = get_fix(conn, run, fix_id)
    row = conn.execute("SELECT pending_op, verify FROM fixes WHERE run=? AND id=?", (run, fix_id)).fetchone()
    if row["pending_op"] is None or _why_unanswered(require_run(conn, run), row, time.time()) is None:
        return fix

    def write(conn: sqlite3.Connection) -> Fix:
        fresh = conn.execute("SELECT pending_op, verify FROM fixes WHERE run=? AND id=?", (run, fix_id)).fetchone()
        why = _why_unanswered(require_run(conn, run), fresh, time.time()) if fresh["pending_op"] else None
        if why is not None:
            expire(conn, run, fix_id, fresh["pending_op"], why)
        return get_fix(conn, run, fix_id)

    return store.write(write)


def _why_unanswered(run_row: sqlite3.Row, fix_row: sqlite3.Row, now: float) -> str | None:
    if run_row["ended"]:
        return "the job ended before it picked the command up"
    if now - run_row["last_seen"] > STALE_AFTER_S:
        return f"the job has not been heard from for {now - run_row['last_seen']:.0f}s (stale after {STALE_AFTER_S:.0f}s)"
    # Counted from the first reply that carried the command to the job (ingest.pending_commands): a job
    # stepping faster than its probe sends can run many steps between the request and its next batch.
    verify = orjson.loads(fix_row["verify"]) if fix_row["verify"] else {}
    asked_at = verify.get("sent_at_step")
    if isinstance(verify.get("scheduled_step"), int):  # a multi-rank job's ranks hold it until that step
        asked_at = max(asked_at or 0, verify["scheduled_step"])
    if fix_row["pending_op"] == "apply" and isinstance(asked_at, int):
        start = orjson.loads(run_row["start"]) if run_row["start"] else {}
        interval = int((start.get("config") or {}).get("interval") or 50)
        limit = max(ACK_INTERVALS * interval, ACK_MIN_STEPS)
        if (run_row["last_step"] or 0) > asked_at + limit:
            return (f"the job ran {run_row['last_step'] - asked_at} steps since it received the command without "
                    "acknowledging it (is its probe too old to know this action?)")
    return None


def schedule(conn: sqlite3.Connection, run: str, ack: FixAck, now: float) -> None:
    """A rank holds the command for the step every rank applies it after: the job's answer is due from
    that step on (_why_unanswered), not from when the command went out. Every rank says the same step."""
    row = conn.execute("SELECT verify FROM fixes WHERE id=? AND run=? AND pending_op=?",
                       (ack.fix_id, run, ack.op)).fetchone()
    if row is None:
        return
    verify = orjson.loads(row["verify"]) if row["verify"] else {}
    if verify.get("scheduled_step") == ack.step:
        return
    conn.execute("UPDATE fixes SET verify=?, updated_at=? WHERE id=?",
                 (orjson.dumps({**verify, "scheduled_step": ack.step}).decode(), now, ack.fix_id))
    _audit(conn, run, "job", "scheduled", ack.fix_id, {"op": ack.op, "step": ack.step})


def expire(conn: sqlite3.Connection, run: str, fix_id: str, op: str, why: str) -> None:
    """Give up on a command: an apply becomes expired (nothing changed in the job); a revert leaves the fix
    as it was (still applied), with the reason."""
    now = time.time()
    if op == "apply":
        conn.execute("UPDATE fixes SET status='expired', pending_op=NULL, reason=?, updated_at=? WHERE id=?",
                     (f"not applied: {why}", now, fix_id))
    else:
        conn.execute("UPDATE fixes SET pending_op=NULL, reason=?, updated_at=? WHERE id=?",
                     (f"not reverted: {why}", now, fix_id))
    _audit(conn, run, "server", "expired", fix_id, {"op": op, "reason": why})


def _audit(conn: sqlite3.Connection, run: str, actor: str, action: str, fix_id: str | None, detail: dict) -> None:
    conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                 (run, time.time(), actor, action, fix_id, orjson.dumps(detail).decode()))
