"""The probe survives an absent server: the run finishes, events wait in the spool, and reach the
server once it is started, each exactly once."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import torch

import probes
from tests.conftest import ROOT, make_server


def _train(run: str, url: str, spool, steps: int = 200) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.attach(model, opt, run=run, server=url, interval=10, spool_dir=spool, flush_interval=0.05) as probe:
        for _ in range(steps):
            x = torch.randn(16, 8)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
        probe.close(timeout=2)


def _train_in_process(run: str, url: str, spool, steps: int) -> None:
    code = ("import sys; sys.path.insert(0, %r); from tests.test_spool import _train; "
            "_train(%r, %r, %r, steps=%d)") % (str(ROOT), run, url, str(spool), steps)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_events_wait_in_the_spool_and_arrive_once(tmp_path):
    srv = make_server(tmp_path)
    spool = tmp_path / "spool"
    t0 = time.monotonic()
    _train_in_process("offline", srv.url, spool, 200)  # nobody listens on that port yet
    assert time.monotonic() - t0 < 60, "an absent server does not hold the job up"
    files = list(spool.glob("offline.*.spool"))
    assert files, "the batches were spooled"
    srv.start()
    try:
        # A later probe of the same run replays the dead process's spool first.
        _train_in_process("offline", srv.url, spool, 20)
        for f in files:
            assert not f.exists()
        steps = [p["step"] for p in httpx.get(f"{srv.url}/v1/runs/offline/series/loss", headers=srv.headers,
                                                 params={"max_points": 10000}).json()["points"]]
        # 200 steps from the first process and 20 from the second, each loss stored once.
        assert len(steps) == 220
        assert sorted(steps) == sorted(list(range(200)) + list(range(20)))
    finally:
        srv.stop()


def test_file_sink_then_traindx_import(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINDX_DATA", str(tmp_path / "local"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with probes.attach(model, opt, run="filed", server=False, interval=5) as probe:
        for _ in range(30):
            opt.zero_grad()
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
    events_file = tmp_path / "local" / "runs" / "filed.jsonl"
    assert events_file.exists()
    data = tmp_path / "store"
    cmd = [sys.executable, "-m", "diag_server.cli", "import", str(events_file), "--data", str(data)]
    first = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    again = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    assert "0 already present" in first.stdout and "0 batch(es) stored" in again.stdout
    srv = make_server(tmp_path)
    srv.data_dir = data
    srv.start()
    try:
        pts = httpx.get(f"{srv.url}/v1/runs/filed/series/loss", params={"max_points": 1000},
                        headers=srv.headers).json()["points"]
        assert [p["step"] for p in pts] == list(range(30))
    finally:
        srv.stop()
