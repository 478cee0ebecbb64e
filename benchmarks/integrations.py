"""Costs of the integrations, each measured side by side with its baseline in one run.

1. AMP: the probe's per-step cost with ``scaler=`` (it compares the GradScaler's scale on device each
   step) against the same probe without it, on a CPU bf16-autocast loop with a GradScaler.
2. Prometheus: ``GET /metrics`` on a store with many runs, against ``GET /health`` on the same app.

Repeats alternate between the two arms and the figures are medians. Run:
    PYTHONPATH=. python benchmarks/integrations.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import probes  # noqa: E402
from probes.sinks import MemorySink  # noqa: E402


def amp_loop(steps: int, with_scaler: bool) -> float:
    """Seconds per step of a tiny AMP loop with a probe attached (interval 50: mostly unsampled steps)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    probe = probes.attach(model, opt, run="bench-amp", sink=MemorySink(), scaler=scaler if with_scaler else None)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        probe.step(loss=loss)
    dt = (time.perf_counter() - t0) / steps
    probe.close()
    return dt


def observe_cost(calls: int) -> float:
    """Seconds per ``ScalerWatch.observe`` call: the watch's whole per-step cost, without the loop's noise."""
    from probes.amp import ScalerWatch

    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # creates the scale tensor, as the first scaler.scale(loss) does
    watch = ScalerWatch(scaler)
    t0 = time.perf_counter()
    for i in range(calls):
        watch.observe(i)
    dt = (time.perf_counter() - t0) / calls
    watch.flush({}, None)
    return dt


def metrics_scrape(runs: int, repeats: int) -> tuple[float, float]:
    from fastapi.testclient import TestClient

    from diag_server.api import create_app
    from diag_server.pipeline.ingest import ingest
    from diag_server.pipeline.services import Services, Settings
    from schemas.events import IngestBatch

    with tempfile.TemporaryDirectory() as tmp:
        services = Services(Settings(data_dir=Path(tmp)))
        for r in range(runs):
            events = [{"kind": "scalars", "step": s, "time": time.time(), "values": {"loss": 1.0 / (s + 1)}}
                      for s in range(200)]
            ingest(services.store, services.engine,
                   IngestBatch.model_validate({"batch_id": uuid.uuid4().hex, "run": f"run-{r}", "seq": 0,
                                               "events": events}))
        app = create_app(services=services)  # the token: services.settings.token, generated in the data dir
        with TestClient(app, base_url=f"http://127.0.0.1:{services.settings.port}",
                        headers={"authorization": f"Bearer {services.settings.token}"}) as client:
            metrics, health = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                assert client.get("/metrics").status_code == 200
                metrics.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                assert client.get("/health").status_code == 200
                health.append(time.perf_counter() - t0)
    return statistics.median(metrics), statistics.median(health)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, repeats = (300, 5) if args.quick else (2000, 9)
    amp_loop(50, True)  # warm up kernels and lazy imports
    arms: dict[str, list[float]] = {"plain": [], "watched": [], "plain again": []}
    order = list(arms)
    for r in range(repeats):  # rotate which arm goes first, so drifting load favours none
        for name in order[r % 3:] + order[:r % 3]:
            arms[name].append(amp_loop(steps, name == "watched"))
    p, w, a = (statistics.median(arms[k]) for k in ("plain", "watched", "plain again"))
    print(f"AMP loop, {steps} steps x {repeats}: {p * 1e6:.0f} us/step without scaler=, {w * 1e6:.0f} us/step "
          f"with scaler= (ratio {w / p:.3f}); the same arm twice (A/A, the noise floor): ratio {a / p:.3f}")
    o = statistics.median(observe_cost(steps) for _ in range(repeats))
    print(f"the watch alone (ScalerWatch.observe, once per step): {o * 1e6:.1f} us/step = "
          f"{100 * o / p:.2f}% of that loop's step")
    runs = 50 if args.quick else 200
    m, h = metrics_scrape(runs, 20 if args.quick else 50)
    print(f"GET /metrics with {runs} runs: {m * 1e3:.1f} ms median vs GET /health {h * 1e3:.1f} ms "
          f"(ratio {m / h:.1f})")


if __name__ == "__main__":
    main()
