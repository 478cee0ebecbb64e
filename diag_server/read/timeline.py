"""The run's end-to-end timeline across ranks, as a record and as a Chrome trace / Perfetto JSON file.

The Chrome trace is the Trace Event Format: one process per rank (``pid`` = rank, named with its
host), one thread per kind of span (step, phases, communication, user stages), complete events
(``ph: "X"``) with ``ts``/``dur`` in microseconds from the run's first span. It opens in
ui.perfetto.dev and chrome://tracing.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from schemas.records import RankInfo, Timeline, TimelineSpan

from ..errors import ApiError
from .queries import filters, require_run
from ..rules.base import median
from ..store import Store

MAX_SPANS = 200_000
LANES = {"step": 0, "phase": 1, "comm": 2, "user": 3}
LANE_NAMES = {0: "step", 1: "phases", 2: "communication", 3: "user stages"}
PHASE_SAMPLES = 20  # recent sampled steps behind each rank's median phase times


def rank_infos(conn: sqlite3.Connection, run: str) -> list[RankInfo]:
    out = []
    for r in conn.execute("SELECT * FROM ranks WHERE run=? ORDER BY rank", (run,)).fetchall():
        steps = [s[0] for s in conn.execute("SELECT DISTINCT step FROM spans WHERE run=? AND rank=? AND mode='train' "
                                            "ORDER BY step DESC LIMIT ?", (run, r["rank"], PHASE_SAMPLES))]
        phases: dict[str, list[float]] = {}
        if steps:
            for name, dur in conn.execute(
                    f"SELECT name, duration FROM spans WHERE run=? AND rank=? AND mode='train' AND category!='user' "
                    f"AND step IN ({','.join('?' * len(steps))})", (run, r["rank"], *steps)):
                phases.setdefault(name, []).append(dur)
        out.append(RankInfo(rank=r["rank"], local_rank=r["local_rank"] or 0, host=r["host"] or "",
                            world_size=r["world_size"] or 1, last_step=r["last_step"] or 0, ended=bool(r["ended"]),
                            phases={k: median(v) for k, v in sorted(phases.items())}))
    return out


def timeline(store: Store, run: str, *, min_step: int | None = None, max_step: int | None = None,
             limit: int = 20_000) -> Timeline:
    if not 1 <= limit <= MAX_SPANS:
        raise ApiError(422, "invalid_parameter", f"limit must be between 1 and {MAX_SPANS}, got {limit}")
    conn = store.read()
    require_run(conn, run)
    where, args = filters(("run", run), at_least=(("step", min_step),), at_most=(("step", max_step),))
    # The latest spans when there are more than the limit: the recent past is what a person looks at.
    rows = conn.execute(f"SELECT * FROM spans WHERE {' AND '.join(where)} ORDER BY step DESC, rank, start LIMIT ?",
                        [*args, limit + 1]).fetchall()
    truncated = len(rows) > limit
    rows = sorted(rows[:limit], key=lambda r: (r["start"], r["rank"]))
    spans = [TimelineSpan(rank=r["rank"], step=r["step"], mode=r["mode"], name=r["name"], category=r["category"],
                          start=r["start"], duration=r["duration"], gpu_duration=r["gpu_duration"]) for r in rows]
    return Timeline(run=run, ranks=rank_infos(conn, run), spans=spans, truncated=truncated)


def chrome_trace(tl: Timeline) -> dict[str, Any]:
    """The timeline in the Trace Event Format (JSON object form)."""
    origin = min((s.start for s in tl.spans), default=0.0)
    events: list[dict[str, Any]] = []
    hosts = {r.rank: r.host for r in tl.ranks}
    for rank in sorted({s.rank for s in tl.spans} | set(hosts)):
        label = f"rank {rank}" + (f" ({hosts[rank]})" if hosts.get(rank) else "")
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, name in LANE_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}})
    for s in tl.spans:
        args: dict[str, Any] = {"step": s.step, "mode": s.mode}
        if s.gpu_duration is not None:
            args["gpu_ms"] = s.gpu_duration * 1e3
        events.append({"name": s.name, "cat": s.category, "ph": "X", "ts": round((s.start - origin) * 1e6, 3),
                       "dur": round(s.duration * 1e6, 3), "pid": s.rank, "tid": LANES[s.category], "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run": tl.run, "origin_unix_s": origin, "truncated": tl.truncated,
                          "source": "traindx: sampled steps only; ts in microseconds from origin_unix_s"}}
