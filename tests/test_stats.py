"""probes.stats: the CPU paths (the native fused pass, and the torch passes used without it) give the
numbers a straightforward torch computation gives."""

from __future__ import annotations

import importlib
import math
import shutil
import sys
import types
import sysconfig
from pathlib import Path

import pytest
import torch

import probes
import probes.stats
from probes.collect import _activation_stats
from probes.stats import _segment_stats, alive_units, rows_from_stats, tensor_stats


def test_a_stale_build_of_the_kernel_is_ignored(monkeypatch, caplog):
    stale = types.ModuleType("probes._fastats")  # an older build: no VERSION, other arguments
    monkeypatch.setitem(sys.modules, "probes._fastats", stale)
    monkeypatch.setattr(probes, "_fastats", stale, raising=False)
    try:
        importlib.reload(probes.stats)
        assert probes.stats._fastats is None and "old build" in caplog.text
        assert rows_from_stats(["a"], probes.stats.host_stats([torch.ones(3)]))[0]["mean"] == 1.0
    finally:
        monkeypatch.undo()
        importlib.reload(probes.stats)
    assert (probes.stats._fastats is None) == (sys.modules.get("probes._fastats") is None)


def test_the_native_kernel_is_built_where_a_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the install keeps the torch path")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers: the install keeps the torch path")
    assert probes.stats._fastats is not None, "pip install -e . should have built probes/_fastats.c"


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
    # longer than the kernel's block (2048), NaN/Inf in a later block, -0.0 counted as zero
    "nan in a later block": torch.cat([torch.randn(5000), torch.tensor([float("nan"), -0.0, float("-inf")]),
                                       torch.randn(3000)]),
    "bfloat16": torch.randn(300).bfloat16(),
    "a view with an offset": torch.randn(50)[7:],
    "a strided 1-d view": torch.randn(90)[::3],
    "a negative view": torch._neg_view(torch.randn(40)),
    "sparse": torch.randn(6, 4).relu().to_sparse(),
    "large values": torch.tensor([3e18, -2e18, 1.0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cpu_paths_match_torch(name, path):
    torch.manual_seed(0)
    t = CASES[name]
    row = rows_from_stats([name], tensor_stats([t]).tolist())[0]
    ref = _reference(t.to_dense() if t.is_sparse else t)
    for key, want in ref.items():
        got = row[key]
        if want is None or isinstance(want, int):
            assert got == want, key
        else:
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), key


def test_cpu_paths_agree_with_the_segmented_path_on_a_mixed_batch(path):
    torch.manual_seed(1)
    ts = [t for t in CASES.values() if not t.is_sparse] + [torch.empty(0), torch.randn(64, 128)]
    fast = tensor_stats(ts)
    assert fast.shape == (8, len(ts))
    for i, t in enumerate(ts):
        if t.numel() == 0:
            assert fast[:, i].tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf, 0.0]
            continue
        seg = _segment_stats([t.float() if t.dtype in (torch.float16, torch.bfloat16) else t])[:, 0].double()
        assert torch.allclose(fast[:, i], seg, rtol=1e-4, atol=1e-4, equal_nan=True), i


def test_squares_beyond_float_range_give_no_norm_but_keep_the_moments(path):
    t = torch.tensor([1e30, -1e30, 0.0])
    row = rows_from_stats(["big"], tensor_stats([t]).tolist())[0]
    assert row["norm"] is None and (row["nan_count"], row["inf_count"]) == (0, 0)
    assert (row["min"], row["max"], row["zero_frac"]) == pytest.approx((-1e30, 1e30, 1 / 3))


def test_no_tensors_no_stats():
    assert tensor_stats([]).shape == (8, 0)


@pytest.mark.parametrize("shape, dim", [((64, 320), 1), ((8, 16, 5, 5), 1), ((4, 10, 24), 2), ((3, 7), 1)])
def test_dead_units_are_counted_along_the_unit_dimension(shape, dim, path):
    torch.manual_seed(2)
    y = torch.relu(torch.randn(shape))
    index = [slice(None)] * len(shape)
    index[dim] = slice(0, 3)
    y[tuple(index)] = 0.0  # the first three units never fire
    want = int((y.amax(dim=[d for d in range(y.dim()) if d != dim]) > 0).sum())
    assert want <= shape[dim] - 3
    assert alive_units(y, dim) == want
    assert alive_units(y.double(), dim) == want
    dead = _activation_stats(y, torch.nn.ReLU())[8]
    assert dead == pytest.approx(1 - want / shape[dim])


def test_a_non_contiguous_activation_counts_its_own_units(path):
    y = torch.relu(torch.randn(320, 64)).t()  # (64, 320), a transposed view
    y[:, :5] = 0.0
    assert alive_units(y, 1) == int((y.amax(dim=0) > 0).sum()) == 315
