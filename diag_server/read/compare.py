"""Runs side by side: one metric overlaid (by step or by time), where their configurations differ, and their
anomalies and fixes on the same axis. What the dashboard's compare view draws (GET /v1/compare)."""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson

from schemas.events import MAX_CONFIG_LIST, MAX_CONFIG_TEXT
from schemas.records import ComparedRun, ConfigDifference, RunComparison, TimedPoint

from ..errors import ApiError
from ..store import Store
from .downsample import min_max_query
from .queries import require_run, run_summary
from .views import history

MAX_COMPARED = 8  # lines one chart keeps apart (the dashboard's palette); more is a table, not an overlay
MAX_METRICS = 200
# What every run start says about the job, beside the job's own config: compared under these keys, so
# that two runs differ visibly in model size or learning rate even when neither passed config=.
_START_KEYS = (("run.total_params", "total_params"), ("run.device", "device"), ("run.world_size", "world_size"),
               ("run.torch_version", "torch_version"))


def start_config(start: dict[str, Any]) -> dict[str, Any]:
    """A run's configuration as compared: the job's ``run_config``, then what its run start says of the
    job (``run.*``: model size, device, optimizer and its first parameter group, the probe's interval)."""
    out = dict(start.get("run_config") or {})
    for key, field in _START_KEYS:
        if field in start:
            out.setdefault(key, start[field])
    opt = start.get("optimizer") or {}
    if opt.get("type"):
        out.setdefault("run.optimizer", opt["type"])
    for k, v in ((opt.get("param_groups") or [{}])[0] or {}).items():
        key = f"run.optimizer.{k}"
        if len(key) <= 256 and key.isprintable():  # a config key's bounds (RunConfig); the run start's are looser
            out.setdefault(key, _bounded(v))
    interval = (start.get("config") or {}).get("interval")
    if interval is not None:
        out.setdefault("run.interval", interval)
    return out


def _bounded(value: Any) -> Any:
    """An optimizer hyper-parameter (the run start's Params, unbounded) within a config value's bounds."""
    if isinstance(value, list) and (len(value) > MAX_CONFIG_LIST or any(isinstance(x, str) and len(x) > 256
                                                                        for x in value)):
        value = str(value)
    if isinstance(value, str) and len(value) > MAX_CONFIG_TEXT:
        return value[:MAX_CONFIG_TEXT - 1] + "…"
    return value


def _same(values: list[Any]) -> bool:
    """One value in every run: numbers compare as numbers (1 and 1.0 are the same rate), a bool only to a bool."""
    first = values[0]
    return all(type(v) is type(first) or (isinstance(v, (int, float)) and isinstance(first, (int, float))
                                           and not isinstance(v, bool) and not isinstance(first, bool))
               for v in values) and all(v == first for v in values)


def config_differences(configs: dict[str, dict[str, Any]]) -> tuple[list[ConfigDifference], int]:
    """The keys whose value is not the same in every run (a key one run lacks differs), and how many are."""
    keys = sorted({k for c in configs.values() for k in c})
    diffs, same = [], 0
    for key in keys:
        held = {run: c[key] for run, c in configs.items() if key in c}
        if len(held) == len(configs) and _same(list(held.values())):
            same += 1
        else:
            diffs.append(ConfigDifference(key=key, values=held))
    return diffs, same


def _points(conn: sqlite3.Connection, run: str, metric: str, max_points: int) -> tuple[list[TimedPoint], float, bool]:
    """The metric as rank 0 reported it, downsampled keeping spikes, with each point's seconds since the run's
    first stored scalar; and that first time."""
    first = conn.execute("SELECT min(time) FROM scalars WHERE run=? AND rank=0", (run,)).fetchone()[0]
    where, args = "run=? AND name=? AND rank=0", (run, metric)
    kept, total = min_max_query(conn, "scalars", "value", where, args, max_points)
    if not kept:
        return [], float(first or 0.0), False
    times: dict[int, float] = {}
    steps = [s for s, _ in kept]
    for i in range(0, len(steps), 500):  # SQLite's bound on one statement's parameters, with room to spare
        chunk = steps[i:i + 500]
        times.update(conn.execute(f"SELECT step, min(time) FROM scalars WHERE {where} AND step IN "
                                  f"({','.join('?' * len(chunk))}) GROUP BY step", (*args, *chunk)).fetchall())
    start = float(first if first is not None else min(times.values()))
    return ([TimedPoint(step=s, seconds=times.get(s, start) - start, value=v) for s, v in kept], start,
            len(kept) < total)


def compare(store: Store, runs: list[str], *, metric: str = "loss", max_points: int = 500,
            max_marks: int = 200) -> RunComparison:
    """``runs`` (2 to 8, in the order given; a repeated id counts once) side by side on ``metric``."""
    runs = list(dict.fromkeys(runs))
    if not 1 <= len(runs) <= MAX_COMPARED:
        raise ApiError(422, "invalid_parameter", f"compare 1 to {MAX_COMPARED} runs (repeat run=), got {len(runs)}")
    if max_points < 2:
        raise ApiError(422, "invalid_parameter", f"max_points must be >= 2, got {max_points}")
    conn = store.read()
    starts = {run: orjson.loads(require_run(conn, run)["start"] or "{}") for run in runs}  # 404 for an unknown one
    compared = []
    for run in runs:
        points, started, downsampled = _points(conn, run, metric, max_points)
        marks = history(store, run, offset=0, limit=max_marks)
        compared.append(ComparedRun(run=run_summary(store, run).run, started_at=max(started, 0.0), points=points,
                                    downsampled=downsampled, marks=marks.entries, marks_total=marks.total))
    names = sorted({r[0] for r in conn.execute(
        f"SELECT DISTINCT name FROM scalars WHERE run IN ({','.join('?' * len(runs))})", runs)},
        key=lambda n: (n != "loss", n.startswith(("sys/", "lr/")), n))
    diffs, same = config_differences({run: start_config(starts[run]) for run in runs})
    return RunComparison(metric=metric, runs=compared, metrics=names[:MAX_METRICS], config_differences=diffs,
                         config_same=same)
