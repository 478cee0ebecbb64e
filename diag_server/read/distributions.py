"""A tensor's value distribution over steps: its quantiles as the probe estimated them, within its exact min and
max, for the dashboard's distributions chart (GET /v1/runs/{run}/distribution)."""

from __future__ import annotations

import sqlite3

import orjson

from schemas.events import QUANTILE_LEVELS
from schemas.records import Distribution, DistributionPoint

from ..errors import ApiError
from ..store import Store, unpack_quantiles
from .queries import require_run

COLLECTIONS = ("weights", "gradients", "activations")  # the collections whose rows carry quantiles


def tensors(conn: sqlite3.Connection, run: str, collection: str, rank: int) -> list[str]:
    """The collection's tensors in forward order: the row order of its first sampled step, then any later.
    (Found from the (run, collection, tensor, step) index without reading rows: the rank is not in it, and
    the ranks of a run measure the same tensors.)"""
    first = conn.execute("SELECT min(step) FROM stats WHERE run=? AND collection=?", (run, collection)).fetchone()[0]
    if first is None:
        return []
    order = [r[0] for r in conn.execute("SELECT tensor FROM stats WHERE run=? AND step=? AND collection=? AND rank=? "
                                        "ORDER BY rowid", (run, first, collection, rank))]
    seen = set(order)
    order += [r[0] for r in conn.execute("SELECT DISTINCT tensor FROM stats WHERE run=? AND collection=?",
                                         (run, collection)) if r[0] not in seen]
    return order


def distribution(store: Store, run: str, *, collection: str, tensor: str | None = None, rank: int = 0,
                 max_points: int = 300) -> Distribution:
    """``tensor``'s distribution (the collection's first tensor by default) as ``rank`` measured it. Past
    ``max_points`` sampled steps, neighbouring steps share a point: the bucket's lowest min and highest max
    (a spike survives), the mean of its last sampled step and the quantiles of the last that has them."""
    if collection not in COLLECTIONS:
        raise ApiError(422, "invalid_parameter", f"collection must be one of {', '.join(COLLECTIONS)}, got "
                       f"{collection!r}")
    if max_points < 2:
        raise ApiError(422, "invalid_parameter", f"max_points must be >= 2, got {max_points}")
    conn = store.read()
    start = orjson.loads(require_run(conn, run)["start"] or "{}")
    names = tensors(conn, run, collection, rank)
    if tensor is None:
        tensor = names[0] if names else ""
    elif tensor not in names:
        raise ApiError(404, "unknown_tensor", f"run {run!r} has no {collection} tensor {tensor!r} (rank {rank}); "
                       f"it has: {', '.join(names[:20]) or 'none'}" + (" ..." if len(names) > 20 else ""))
    where, args = "run=? AND collection=? AND tensor=? AND rank=?", (run, collection, tensor, rank)
    n, first, last = conn.execute(f"SELECT count(*), min(step), max(step) FROM stats WHERE {where}", args).fetchone()
    width = 1 if n <= max_points else max(-(-(last - first + 1) // max_points), 1)
    bucket = f"(step - {int(first or 0)}) / {int(width)}"
    # The bucket's last sampled step (a bare column beside max() takes that row's values), its extremes, and
    # its last quantiles (the probe sends them on fewer steps than the statistics).
    lasts = conn.execute(f"SELECT {bucket} AS b, max(step), mean FROM stats WHERE {where} GROUP BY b ORDER BY b",
                         args).fetchall()
    extremes = {b: (lo, hi) for b, lo, hi in conn.execute(
        f"SELECT {bucket} AS b, min(min), max(max) FROM stats WHERE {where} GROUP BY b", args)}
    quantiles = {b: q for b, _, q in conn.execute(
        f"SELECT {bucket} AS b, max(step), quantiles FROM stats WHERE {where} AND quantiles IS NOT NULL GROUP BY b",
        args)}
    points = []
    for b, step, mean in lasts:
        lo, hi = extremes.get(b, (None, None))
        points.append(DistributionPoint(step=step, min=lo, max=hi, mean=mean,
                                        quantiles=unpack_quantiles(quantiles.get(b)) or []))
    sample = (start.get("config") or {}).get("quantile_sample")
    sent = any(p.quantiles for p in points)
    return Distribution(run=run, collection=collection, tensor=tensor, tensors=names, levels=list(QUANTILE_LEVELS),
                        sample=sample if sent and isinstance(sample, int) and sample >= 0 else None,
                        points=points, downsampled=width > 1)
