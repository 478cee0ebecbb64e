"""Server-side downsampling that keeps spikes.

Plain striding (every k-th point) drops exactly what a person looks for in a long run: a one-step
gradient spike or a NaN. Here the steps are cut into equal buckets and each bucket keeps its smallest
and its largest value (the "min/max" decimation that plotting tools such as Plotly-Resampler and
uPlot's own examples use for long series), and a non-finite value (null) always survives in place of
the bucket's minimum, so a chart still shows where the run broke.
"""

from __future__ import annotations

import sqlite3
from typing import Sequence, TypeVar

P = TypeVar("P")


def bucket_bounds(n: int, buckets: int) -> list[tuple[int, int]]:
    """``buckets`` half-open index ranges covering ``range(n)`` as evenly as possible."""
    buckets = max(1, min(buckets, n))
    return [(i * n // buckets, (i + 1) * n // buckets) for i in range(buckets)]


def min_max(points: Sequence[tuple[int, float | None]], max_points: int) -> list[tuple[int, float | None]]:
    """At most ``max_points`` of ``points`` (sorted by step): per bucket the minimum and the maximum,
    in step order; a null (NaN/Inf on the wire) takes the minimum's place. Short input is returned as is."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    if len(points) <= max_points:
        return list(points)
    out: list[tuple[int, float | None]] = []
    for lo, hi in bucket_bounds(len(points), max_points // 2):
        chunk = points[lo:hi]
        finite = [i for i, p in enumerate(chunk) if p[1] is not None]
        nulls = [i for i, p in enumerate(chunk) if p[1] is None]
        keep: set[int] = set()
        if finite:
            keep.add(max(finite, key=lambda i: chunk[i][1]))  # type: ignore[arg-type,return-value]
            keep.add(nulls[0] if nulls else min(finite, key=lambda i: chunk[i][1]))  # type: ignore[arg-type,return-value]
        else:
            keep.add(nulls[0])
        out.extend(chunk[i] for i in sorted(keep))
    return out


def min_max_query(conn: sqlite3.Connection, table: str, column: str, where: str, args: Sequence[object],
                  max_points: int) -> tuple[list[tuple[int, float | None]], int]:
    """``min_max`` done by SQLite: (the kept points, how many there were). ``table``/``column``/``where``
    are the caller's trusted SQL; ``args`` its parameters. Steps are cut into equal-width buckets, and
    per bucket SQLite returns the step of its min (or of a null) and of its max (a bare column beside
    min()/max() takes that row's value), so a 200 000-point series never crosses into Python."""
    if max_points < 2:
        raise ValueError(f"max_points must be >= 2, got {max_points}")
    total = conn.execute(f"SELECT count(*) FROM {table} WHERE {where}", args).fetchone()[0]
    if total <= max_points:
        rows = conn.execute(f"SELECT step, {column} FROM {table} WHERE {where} ORDER BY step", args).fetchall()
        return [(r[0], r[1]) for r in rows], total
    buckets = max_points // 2
    first, last = conn.execute(f"SELECT min(step), max(step) FROM {table} WHERE {where}", args).fetchone()
    # Equal-width buckets on the step axis (the chart's x axis): a plain GROUP BY over the index range.
    width = max(-(-(last - first + 1) // buckets), 1)
    ranked = f"WITH r AS (SELECT step, {column} AS v, (step - {int(first)}) / {int(width)} AS b FROM {table} WHERE {where})"
    # Two scans, not three: a null sorts below everything as -Inf (9e999 is Inf to SQLite), so the min slot
    # holds the bucket's first null when it has one, which is what a chart should show.
    hi = {b: (s, v) for b, s, v in conn.execute(f"{ranked} SELECT b, step, max(v) FROM r GROUP BY b", args)}
    lo = {b: (s, None if v == float("-inf") else v) for b, s, v in conn.execute(
        f"{ranked} SELECT b, step, min(coalesce(v, -9e999)) FROM r GROUP BY b", args)}
    kept: dict[int, float | None] = {}
    for b in range(buckets):
        for point in (hi.get(b), lo.get(b)):
            if point is not None:
                kept[point[0]] = point[1]
    return sorted(kept.items()), total
