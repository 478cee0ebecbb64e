"""Per-tensor statistics, computed batched on the tensors' device.

On CUDA all tensors of a collection are flattened into one buffer and reduced by segment, so the cost
is a fixed handful of kernels per collection, not per tensor, and the result is one stacked (8, k)
tensor: one copy to the host, asynchronous, read a step later. On the CPU, where a read costs no sync,
each tensor is read once by a fused native pass (``cpu_row``).

Moments (mean, std, min, max) are over the finite elements; ``norm`` is the true L2 norm, so it is
null when any element is NaN or infinite. ``nan_count`` / ``inf_count`` say which.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

# The argument layout of probes/_fastats.c this code calls (its FASTATS_VERSION).
KERNEL_VERSION = 19
try:  # the fused passes (probes/_fastats.c), built by setup.py where a C compiler is; else the torch path
    from . import _fastats
except ImportError:  # pragma: no cover - exercised by the tests with _fastats set to None
    _fastats = None
if _fastats is not None and getattr(_fastats, "VERSION", None) != KERNEL_VERSION:  # a stale build: its arguments differ
    logging.getLogger("traindx.probe").warning(
        "traindx: probes/_fastats is an old build (reinstall: pip install -e .); using torch operations")
    _fastats = None

# Rows of the stacked result.
_SUM, _SUMSQ, _NAN, _INF, _ZERO, _MIN, _MAX, _COUNT = range(8)
# Flatten at most this many elements at once, so a big model never doubles its memory.
CHUNK_ELEMENTS = 1 << 24
# A float32 sum of ones is exact up to 2**24 (the CPU path counts non-zeros as a dot of signs below it).
EXACT_COUNT = 1 << 24


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor: FSDP2 shards each parameter and its gradient across the ranks."""
    return hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (see ``sharded``), else ``t`` itself.
    Statistics are taken over it, so that one rank never waits on the others (a DTensor's own reductions
    are collectives) and each row describes what its rank holds: its ``numel`` is the shard's."""
    return t.to_local() if sharded(t) else t


def _segment_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    lengths = torch.tensor([t.numel() for t in tensors], device=flat.device)
    seg = torch.repeat_interleave(torch.arange(len(tensors), device=flat.device), lengths)
    k = len(tensors)
    finite = torch.isfinite(flat)
    xf = torch.where(finite, flat, torch.zeros((), device=flat.device))
    out = torch.zeros(8, k, device=flat.device)
    out[_SUM].index_add_(0, seg, xf)
    out[_SUMSQ].index_add_(0, seg, xf * xf)
    out[_NAN].index_add_(0, seg, torch.isnan(flat).float())
    out[_INF].index_add_(0, seg, torch.isinf(flat).float())
    out[_ZERO].index_add_(0, seg, (flat == 0).float())
    inf = torch.tensor(float("inf"), device=flat.device)
    out[_MIN] = torch.full((k,), float("inf"), device=flat.device).scatter_reduce(
        0, seg, torch.where(finite, flat, inf), reduce="amin")
    out[_MAX] = torch.full((k,), float("-inf"), device=flat.device).scatter_reduce(
        0, seg, torch.where(finite, flat, -inf), reduce="amax")
    out[_COUNT] = lengths.float()
    return out


def _cpu_stats(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The CPU path, as host lists (the rows of ``tensor_stats``): one row per tensor (``cpu_row``)."""
    cols = [cpu_row(t) for t in tensors]
    return [list(row) for row in zip(*cols)] if cols else [[] for _ in range(8)]


_NATIVE = (torch.float32, torch.float64)


def native(t: torch.Tensor) -> bool:
    """Whether the native kernel can read ``t`` in place: a contiguous float32/float64 CPU tensor."""
    return (_fastats is not None and t.is_cpu and (t.dtype is torch.float32 or t.dtype is torch.float64)
            and t.layout is torch.strided and t.is_contiguous() and not t.is_neg())


def copy_norms(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> list[float] | None:
    """Copy each of ``src`` into ``dst`` and return their L2 norms, one pass per tensor; None (nothing
    copied) unless the native kernel can read them all (see ``native``)."""
    if not all(native(t) for t in (*dst, *src)):
        return None
    return [math.sqrt(_fastats.copy_sumsq(d.data_ptr(), s.data_ptr(), s.numel(), s.dtype == torch.float64))
            for d, s in zip(dst, src)]


def diff_norms(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[float]:
    """||a_i - b_i|| for tensors the native kernel reads (``copy_norms`` said so), one pass each."""
    return [math.sqrt(_fastats.diff_sumsq(x.data_ptr(), y.data_ptr(), x.numel(), x.dtype == torch.float64))
            for x, y in zip(a, b)]


def cpu_row(t: torch.Tensor) -> list[float]:
    """The eight raw sums of one CPU tensor (a column of ``tensor_stats``).

    With the native kernel (``probes/_fastats.c``) a float32/float64 tensor is read once, NaN/Inf masked
    in the same pass: 7x faster than the torch path on the MLP of benchmarks/overhead.py (39 vs 270 us
    for its 8 parameters), whose cost is mostly the calls, not the arithmetic. Without it, finite tensors
    (the usual case) take five unmasked vectorised torch passes (``finite_stats``) and only a tensor
    with NaN/Inf takes the masked segment path.
    """
    if native(t):
        return _fastats.stats(t.data_ptr(), t.numel(), t.dtype == torch.float64)
    t = t.detach()
    if t.numel() == 0:
        return [0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf, 0.0]
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype not in _NATIVE:
        t = t.float()  # half, bfloat16, integers: a float32 copy
    if _fastats is not None:
        return cpu_row(t.contiguous().resolve_neg())  # a copy only where the layout needs one
    row = finite_stats(t)
    # None: a NaN or Inf in it, or squares beyond float range
    return row if row is not None else _segment_stats([t])[:, 0].tolist()


def outside(y: torch.Tensor, lo: float, hi: float) -> int:
    """How many elements of a float CPU tensor are <= lo or >= hi (a bounded activation's saturated ones)."""
    y = y.contiguous()  # a copy only where the layout needs one
    if native(y):
        return _fastats.outside(y.data_ptr(), y.numel(), lo, hi, y.dtype == torch.float64)
    return int(((y <= lo) | (y >= hi)).sum().item())


def alive_units(y: torch.Tensor, dim: int) -> int:
    """How many units along ``dim`` of a float CPU tensor are > 0 for some sample (the rest are dead)."""
    y = y.contiguous()  # a copy only where the layout needs one
    if native(y):
        shape = y.shape
        return _fastats.alive(y.data_ptr(), math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]),
                              y.dtype == torch.float64)
    peak = y.amax(dim=[d for d in range(y.dim()) if d != dim])
    return int((peak > 0).sum().item())


def finite_stats(t: torch.Tensor) -> list[float] | None:
    """The eight raw sums of a non-empty float CPU tensor by five unmasked torch passes, or None when its
    sum of squares is not finite (a NaN or Inf in it): then only the masked passes are right.

    ``count_nonzero``, ``aminmax`` and ``vector_norm`` are slower on the CPU than sign+dot, amin+amax and
    dot (measured on torch 2.13: 150 vs 205 us for the 186k-parameter MLP of benchmarks/overhead.py),
    and the float32 dot is also closer to a float64 sum of squares than ``vector_norm`` is."""
    flat = t.reshape(-1)
    n = flat.numel()
    sumsq = torch.dot(flat, flat).item()
    if not math.isfinite(sumsq):
        return None
    if n < EXACT_COUNT:
        sign = torch.sign(flat)
        nonzero = torch.dot(sign, sign).item()
    else:
        nonzero = torch.count_nonzero(flat).item()
    return [flat.sum().item(), sumsq, 0.0, 0.0, n - nonzero, flat.amin().item(), flat.amax().item(), float(n)]


def tensor_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return a (8, k) tensor of raw per-tensor sums for ``tensors``, on their device.

    On CUDA every tensor is reduced in one segmented pass (a fixed handful of kernels, no host sync);
    on the CPU one pass per tensor is cheaper (see ``cpu_row``).
    """
    stats = host_stats(tensors)
    if isinstance(stats, torch.Tensor):
        return stats
    return torch.tensor(stats, dtype=torch.float64).reshape(8, len(tensors))


def host_stats(tensors: Sequence[torch.Tensor]) -> torch.Tensor | list[list[float]]:
    """``tensor_stats`` as the probe wants it: on the CPU already host lists (rows of ``tensor_stats``),
    on CUDA the (8, k) tensor on the device, to be copied to the host asynchronously."""
    if not tensors or not tensors[0].is_cuda:
        return _cpu_stats(tensors)
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for t in tensors:
        if chunks[-1] and size + t.numel() > CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(t)
        size += t.numel()
    parts = [_segment_stats(c) for c in chunks if c]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def rows_from_stats(names: Sequence[str], raw: list[list[float]]) -> list[dict]:
    """Turn the host copy of ``tensor_stats`` into StatRow dicts (the wire form)."""
    rows = []
    for i, name in enumerate(names):
        n = raw[_COUNT][i]
        nan, inf = int(raw[_NAN][i]), int(raw[_INF][i])
        finite_n = n - nan - inf
        s, ss = raw[_SUM][i], raw[_SUMSQ][i]
        mean = s / finite_n if finite_n else None
        var = max(ss / finite_n - mean * mean, 0.0) if finite_n else None
        rows.append({
            "name": name,
            "numel": int(n),
            "norm": _finite(math.sqrt(ss)) if nan == 0 and inf == 0 else None,
            "mean": _finite(mean) if mean is not None else None,
            "std": _finite(math.sqrt(var)) if var is not None else None,
            "min": _finite(raw[_MIN][i]),
            "max": _finite(raw[_MAX][i]),
            "nan_count": nan,
            "inf_count": inf,
            "zero_frac": raw[_ZERO][i] / n if n else None,
        })
    return rows
