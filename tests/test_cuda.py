"""The CUDA paths of the probe: segmented statistics with an asynchronous copy, and memory statistics.

Skipped where there is no GPU (CI never has one); run on a GPU machine with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

import probes
from probes.sinks import MemorySink
from probes.stats import rows_from_stats, tensor_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_segmented_statistics_on_cuda_match_the_cpu_path():
    ts = [torch.randn(300, 70), torch.tensor([1.0, float("nan"), 0.0, float("inf")]), torch.zeros(5)]
    cpu = rows_from_stats(["a", "b", "c"], tensor_stats(ts).tolist())
    gpu = rows_from_stats(["a", "b", "c"], tensor_stats([t.cuda() for t in ts]).cpu().tolist())
    for c, g in zip(cpu, gpu):
        for key, value in c.items():
            if isinstance(value, float):
                assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
            else:
                assert g[key] == value, key


def test_probe_on_a_cuda_model_reports_memory_and_stats():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sink = MemorySink()
    with probes.attach(model, opt, run="cuda", sink=sink, interval=5) as probe:
        for _ in range(12):
            x = torch.randn(128, 64, device="cuda")
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
    events = sink.events
    assert events[0]["device"].startswith("cuda")
    grads = [e for e in events if e["kind"] == "tensor_stats" and e["collection"] == "gradients"]
    assert [e["step"] for e in grads] == [0, 5, 10]
    assert all(r["norm"] is not None and r["norm"] > 0 for e in grads for r in e["rows"])
    mem = [e["values"] for e in events if e["kind"] == "scalars" and "sys/cuda_allocated_mb" in e["values"]]
    assert mem and all(v["sys/cuda_reserved_mb"] >= v["sys/cuda_allocated_mb"] for v in mem)
    assert all(v["sys/cuda_fragmentation_mb"] >= 0 for v in mem)
