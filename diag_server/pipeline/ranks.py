"""The rank dimension of a run: which processes it has, their spans, and fixes that every rank must take.

Called from ingest, inside its write transaction (so in the store's writer thread). A run of one
process is rank 0 of a world of 1, and everything here reduces to what a one-process run did before.
"""

from __future__ import annotations

import sqlite3

from schemas.events import FixAck, RunStart, Spans


def touch(conn: sqlite3.Connection, run: str, rank: int, now: float, last_step: int) -> None:
    conn.execute("INSERT INTO ranks(run, rank, last_seen, last_step) VALUES (?,?,?,?) ON CONFLICT(run, rank) DO UPDATE "
                 "SET last_seen=excluded.last_seen, last_step=max(last_step, excluded.last_step)",
                 (run, rank, now, last_step))


def started(conn: sqlite3.Connection, run: str, rank: int, ev: RunStart) -> bool:
    """Record one rank's run_start; True when it should also be the run's start (rank 0, or the first seen)."""
    conn.execute("UPDATE ranks SET local_rank=?, host=?, world_size=?, ended=0 WHERE run=? AND rank=?",
                 (ev.local_rank, ev.host, ev.world_size, run, rank))
    row = conn.execute("SELECT start FROM runs WHERE run=?", (run,)).fetchone()
    return rank == 0 or row is None or not row[0]


def world_size(conn: sqlite3.Connection, run: str) -> int:
    row = conn.execute("SELECT max(world_size), count(*) FROM ranks WHERE run=?", (run,)).fetchone()
    return max(int(row[0] or 1), int(row[1] or 1))


def ended(conn: sqlite3.Connection, run: str, rank: int) -> bool:
    """Mark one rank ended; True when every rank of the run has ended (the run has)."""
    conn.execute("UPDATE ranks SET ended=1 WHERE run=? AND rank=?", (run, rank))
    done = conn.execute("SELECT count(*) FROM ranks WHERE run=? AND ended=1", (run,)).fetchone()[0]
    return done >= world_size(conn, run)


def store_spans(conn: sqlite3.Connection, run: str, rank: int, events: list[Spans]) -> list[dict]:
    rows, out = [], []
    for ev in events:
        for s in ev.spans:
            rows.append((run, rank, ev.step, ev.mode, s.name, s.category, s.start, s.duration, s.gpu_duration))
            out.append({"step": ev.step, "mode": ev.mode, "name": s.name, "category": s.category, "start": s.start,
                        "duration": s.duration, "gpu_duration": s.gpu_duration, "capture": ev.capture})
    conn.executemany("INSERT INTO spans(run, rank, step, mode, name, category, start, duration, gpu_duration) "
                     "VALUES (?,?,?,?,?,?,?,?,?)", rows)
    return out


# -- fixes in a run of many processes ----------------------------------------------------------------
def commands_for(conn: sqlite3.Connection, rank: int, commands: list) -> list:
    """Drop the commands this rank has already acknowledged (the others may still be waiting for theirs)."""
    if not commands:
        return commands
    done = {(r[0], r[1]) for r in conn.execute(
        f"SELECT fix_id, op FROM fix_acks WHERE rank=? AND fix_id IN ({','.join('?' * len(commands))})",
        (rank, *[c.fix_id for c in commands]))}
    return [c for c in commands if (c.fix_id, c.op) not in done]


def gather_ack(conn: sqlite3.Connection, run: str, rank: int, ack: FixAck) -> FixAck | None:
    """Record one rank's ack. Return the ack that settles the fix once every rank has answered, else None.

    In data-parallel training a fix must reach every replica: a learning rate changed on one rank only
    would make the replicas drift apart. So the fix stays pending until all ranks acknowledge, and it
    counts as applied only if all of them applied it; otherwise the first refusal, naming its rank.
    """
    conn.execute("INSERT OR REPLACE INTO fix_acks(fix_id, op, rank, status, reason) VALUES (?,?,?,?,?)",
                 (ack.fix_id, ack.op, rank, ack.status, ack.reason))
    world = world_size(conn, run)
    if world <= 1:
        return ack
    rows = conn.execute("SELECT rank, status, reason FROM fix_acks WHERE fix_id=? AND op=? ORDER BY rank",
                        (ack.fix_id, ack.op)).fetchall()
    if len(rows) < world:
        return None
    bad = [r for r in rows if r["status"] not in ("applied", "reverted")]
    if not bad:
        return ack if rank == 0 else ack.model_copy(update={"reason": None})
    r = bad[0]
    applied = [str(x["rank"]) for x in rows if x["status"] in ("applied", "reverted")]
    return ack.model_copy(update={"status": r["status"], "reason": (
        f"rank {r['rank']}: {r['reason'] or r['status']}"
        + (f"; ranks {', '.join(applied)} did apply it, so the replicas now differ: revert it" if applied else ""))})
