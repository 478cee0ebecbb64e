"""Value distributions on sampled steps: each tensor's quantiles, estimated from a bounded, evenly spread sample.

What the dashboard draws as TensorBoard draws its distributions (bands between quantiles), at the levels
of ``schemas.events.QUANTILE_LEVELS``. Exact quantiles need a sort of the whole tensor; instead each
tensor gives at most ``SAMPLE`` of its elements, at positions spread over it by a Weyl sequence
(``i * golden ratio mod 1``), which never lines up with a tensor's rows or channels the way a plain stride
can. The positions depend only on the tensor's size, so a weight is read at the same elements every
time, and no random generator of the job's is touched. A tensor with at most ``SAMPLE`` elements is read
whole: its quantiles are exact. With 512 elements the rank error of a quantile is about sqrt(q(1-q)/512):
2.2 percentile points at the median, 1.1 at the outer levels. The exact min and max travel in the same
row (the tensor's statistics), so the outer band is never estimated.

Cost, on a sampled step at least ``MIN_STEPS_APART`` steps after the collection's last quantiles, and
on no other: one gather of ``SAMPLE`` elements per tensor and one batched sort of the samples (numpy on
the CPU, one batched sort on a device, no host sync); the (7, k) result rides in the same stacked
host copy as the statistics. On the CPU, 0.2-0.3 ms for overhead.py's MLP (8 tensors), 5-8 ms for a
100-layer MLP of 256x256 layers (200 tensors; its statistics take 3-4 ms).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from schemas.events import QUANTILE_LEVELS

SAMPLE = 512
# At most one distribution per collection every this many steps: the default sampling interval. With every
# step sampled, quantiles every step would cost 0.2-0.3 ms a collection on overhead.py's MLP (2.3 ms steps),
# for a chart that shows a few hundred columns anyway.
MIN_STEPS_APART = 100
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_MAX_CACHED = 256  # index tensors kept: one per distinct tensor size and device (activations vary with the batch)
_positions: dict[tuple[int, torch.device], torch.Tensor] = {}
_levels: dict[torch.device, torch.Tensor] = {}
try:  # on the CPU numpy sorts a (k, 1024) sample five times faster than torch.sort (3 ms against 16 for k=200)
    import numpy as np
except ImportError:  # pragma: no cover - torch does not require numpy; the torch path does the same
    np = None


def positions(numel: int, device: torch.device) -> torch.Tensor:
    """``SAMPLE`` positions in ``range(numel)`` spread evenly, on ``device`` (cached per size), ascending."""
    key = (numel, device)
    found = _positions.get(key)
    if found is None:
        if len(_positions) >= _MAX_CACHED:
            _positions.clear()
        i = torch.arange(SAMPLE, dtype=torch.float64)
        found = ((((i + 0.5) * _GOLDEN) % 1.0) * numel).long().clamp_(0, numel - 1).sort().values.to(device)
        _positions[key] = found
    return found


def _host_positions(numel: int) -> "np.ndarray":
    key = (numel, None)
    found = _positions.get(key)
    if found is None:
        found = _positions[key] = positions(numel, torch.device("cpu")).numpy()  # type: ignore[assignment]
    return found  # type: ignore[return-value]


def _host_row(t: torch.Tensor, out: "np.ndarray") -> None:
    """``t``'s sample into ``out`` (a row of ``SAMPLE`` float32), NaN past a small tensor's elements."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    x = flat.numpy()
    n = x.size
    if n > SAMPLE:
        np.take(x, _host_positions(n), out=out)
    else:
        out[:n] = x
        out[n:] = np.nan


def _host(t: torch.Tensor) -> bool:
    return np is not None and t.device.type == "cpu"


def sample(t: torch.Tensor) -> "torch.Tensor | np.ndarray":
    """At most ``SAMPLE`` of ``t``'s elements as float32, padded with NaN to ``SAMPLE``: on the CPU a numpy
    row, on a device a tensor there. (Its non-finite elements are set aside when the quantiles are taken:
    they are of the finite values, like the moments.)"""
    if _host(t):
        out = np.empty(SAMPLE, np.float32)
        _host_row(t, out)
        return out
    t = t.detach()
    n = t.numel()
    if n > SAMPLE:
        x = torch.take(t, positions(n, t.device))
        return x if x.dtype == torch.float32 else x.float()
    x = torch.full((SAMPLE,), float("nan"), device=t.device)
    x[:n] = t.reshape(-1)
    return x


def quantiles(samples: Sequence["torch.Tensor | np.ndarray"], device: torch.device | None = None
              ) -> torch.Tensor | list[list[float]]:
    """The (levels, k) quantiles of k samples (from ``sample``) with linear interpolation, as
    ``torch.quantile`` takes them, NaN where a sample has no finite value: host lists when every sample is
    a host row, else a tensor on ``device`` (the first device sample's by default)."""
    if all(not isinstance(x, torch.Tensor) for x in samples):
        return _host_quantiles(np.stack(samples))
    dev = device or next(x.device for x in samples if isinstance(x, torch.Tensor))
    x = torch.stack([x.to(dev) if isinstance(x, torch.Tensor) else torch.from_numpy(x).to(dev) for x in samples])
    return _device_quantiles(x)


def _device_quantiles(x: torch.Tensor) -> torch.Tensor:
    """``_host_quantiles`` in torch, on the samples' device. Not ``torch.nanquantile``: with the levels as a
    tensor it checks their range with a host read (a sync on CUDA), and as floats it sorts once per level."""
    x = x.masked_fill(~torch.isfinite(x), float("nan")).sort(dim=1).values  # NaN sorts last
    n = x.shape[1] - torch.isnan(x).sum(dim=1, keepdim=True)
    last = (n - 1).clamp(min=0)
    levels = _levels.get(x.device)
    if levels is None:
        levels = _levels[x.device] = torch.tensor(QUANTILE_LEVELS, dtype=torch.float64, device=x.device)
    pos = levels[None, :] * last
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, last)
    v_lo, v_hi = x.gather(1, lo), x.gather(1, hi)
    q = v_lo + (v_hi - v_lo) * (pos - lo).to(x.dtype)
    return q.masked_fill(n == 0, float("nan")).T


def _host_quantiles(a: "np.ndarray") -> list[list[float]]:
    a[~np.isfinite(a)] = np.nan
    a.sort(axis=1)  # NaN sorts last
    n = a.shape[1] - np.isnan(a).sum(axis=1)
    last = np.maximum(n - 1, 0)[:, None]
    pos = np.asarray(QUANTILE_LEVELS)[None, :] * last
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, last)
    v_lo, v_hi = np.take_along_axis(a, lo, axis=1), np.take_along_axis(a, hi, axis=1)
    q = v_lo + (v_hi - v_lo) * (pos - lo)
    q[n == 0] = np.nan
    return q.T.tolist()


def of(tensors: Sequence[torch.Tensor]) -> torch.Tensor | list[list[float]]:
    """The (levels, k) quantiles of k tensors: host lists for tensors on the CPU, else a tensor on the first
    one's device."""
    if all(_host(t) for t in tensors):
        a = np.empty((len(tensors), SAMPLE), np.float32)
        for i, t in enumerate(tensors):
            _host_row(t, a[i])
        return _host_quantiles(a)
    return quantiles([sample(t) for t in tensors])


def with_quantiles(stats: torch.Tensor | list[list[float]], q: torch.Tensor | list[list[float]]
                   ) -> torch.Tensor | list[list[float]]:
    """The statistics (fields x tensors, a device tensor or host lists) with the quantiles' rows below them."""
    if isinstance(stats, torch.Tensor):
        q = q if isinstance(q, torch.Tensor) else torch.tensor(q)
        return torch.cat([stats, q.to(stats.device, stats.dtype)])  # the statistics keep their dtype
    return [*stats, *(q.tolist() if isinstance(q, torch.Tensor) else q)]


def rows_with_quantiles(to_rows: Callable[[list[str], list[list[float]]], list[dict]]
                        ) -> Callable[[list[str], list[list[float]]], list[dict]]:
    """``to_rows`` for a stacked copy whose last rows are the quantiles (``with_quantiles``)."""
    n = len(QUANTILE_LEVELS)

    def convert(names: list[str], raw: list[list[float]]) -> list[dict]:
        rows = to_rows(names, raw[:-n])
        for i, row in enumerate(rows):
            row["quantiles"] = [v if math.isfinite(v) else None for v in (level[i] for level in raw[-n:])]
        return rows
    return convert
