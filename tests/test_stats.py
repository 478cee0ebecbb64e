"""probes.stats: the CPU fast path gives the numbers a straightforward torch computation gives."""

from __future__ import annotations

import math

import pytest
import torch

from probes.stats import _segment_stats, rows_from_stats, tensor_stats


def _reference(t: torch.Tensor) -> dict:
    x = t.detach().double().reshape(-1)
    finite = x[torch.isfinite(x)]
    n = x.numel()
    ok = finite.numel() == n
    return {"numel": n, "norm": x.norm().item() if ok else None,
            "mean": finite.mean().item() if finite.numel() else None,
            "std": finite.std(unbiased=False).item() if finite.numel() else None,
            "min": finite.min().item() if finite.numel() else None, "max": finite.max().item() if finite.numel() else None,
            "nan_count": int(torch.isnan(x).sum()), "inf_count": int(torch.isinf(x).sum()),
            "zero_frac": (x == 0).sum().item() / n if n else None}


CASES = {
    "dense": torch.randn(5, 7),
    "relu (half zeros)": torch.relu(torch.randn(300, 70)),
    "bias": torch.randn(320),
    "all zeros": torch.zeros(3),
    "scalar": torch.tensor(-3.5),
    "one element": torch.tensor([0.0]),
    "float64": torch.randn(10, dtype=torch.float64),
    "float16": torch.randn(64).half(),
    "non-contiguous": torch.randn(20, 30).t(),
    "all positive": torch.rand(100) + 1.0,
    "all negative": -torch.rand(6000) - 1.0,
    "nan and inf": torch.tensor([1.0, float("nan"), 0.0, float("inf")]),
    "all -inf": torch.full((50,), float("-inf")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_fast_path_matches_torch(name):
    torch.manual_seed(0)
    t = CASES[name]
    row = rows_from_stats([name], tensor_stats([t]).tolist())[0]
    ref = _reference(t)
    for key, want in ref.items():
        got = row[key]
        if want is None or isinstance(want, int):
            assert got == want, key
        else:
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), key


def test_cpu_fast_path_agrees_with_the_segmented_path_on_a_mixed_batch():
    torch.manual_seed(1)
    ts = list(CASES.values()) + [torch.empty(0), torch.randn(64, 128)]
    fast = tensor_stats(ts)
    assert fast.shape == (8, len(ts))
    for i, t in enumerate(ts):
        if t.numel() == 0:
            assert fast[:, i].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf, 0.0]
            continue
        seg = _segment_stats([t.float() if t.dtype == torch.float16 else t])[:, 0].double()
        assert torch.allclose(fast[:, i], seg, rtol=1e-4, atol=1e-4, equal_nan=True), i


def test_squares_beyond_float_range_give_no_norm_but_keep_the_moments():
    t = torch.tensor([1e30, -1e30, 0.0])
    row = rows_from_stats(["big"], tensor_stats([t]).tolist())[0]
    assert row["norm"] is None and (row["nan_count"], row["inf_count"]) == (0, 0)
    assert (row["min"], row["max"], row["zero_frac"]) == pytest.approx((-1e30, 1e30, 1 / 3))


def test_no_tensors_no_stats():
    assert tensor_stats([]).shape == (8, 0)
