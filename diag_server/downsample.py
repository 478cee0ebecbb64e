"""Server-side downsampling that keeps spikes.

Plain striding (every k-th point) drops exactly what a person looks for in a long run: a one-step
gradient spike or a NaN. Here the steps are cut into equal buckets and each bucket keeps its smallest
and its largest value (the "min/max" decimation that plotting tools such as Plotly-Resampler and
uPlot's own examples use for long series), and a non-finite value (null) always survives in place of
the bucket's minimum, so a chart still shows where the run broke.
"""

from __future__ import annotations

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


def bucket_max(values: Sequence[float | None]) -> float | None:
    """A heat-map cell: the largest finite value of its bucket (a spike stays visible), null if none."""
    finite = [v for v in values if v is not None]
    return max(finite) if finite else None
