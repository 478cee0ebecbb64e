"""Retention: export a run as JSON lines, delete it, import it back; the data directory's size cap."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import orjson
import torch
from click.testing import CliRunner

import probes
from diag_server.cli import main

from tests.conftest import make_server


def _loss(data: Path, run: str) -> list[tuple[int, float]]:
    with sqlite3.connect(data / "traindx.sqlite") as conn:
        return conn.execute("SELECT step, value FROM scalars WHERE run=? AND name='loss' ORDER BY step",
                            (run,)).fetchall()


def test_export_delete_import_round_trip(server, tmp_path: Path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with probes.attach(model, opt, run="old-run", server=server.url, interval=5, spool_dir=tmp_path / "spool") as p:
        for _ in range(40):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            p.step(loss=loss)
    before = _loss(server.data_dir, "old-run")
    assert len(before) == 40

    out = tmp_path / "old-run.jsonl"
    r = CliRunner().invoke(main, ["export", "old-run", "--jsonl", str(out), "--data", str(server.data_dir)])
    assert r.exit_code == 0, r.output
    lines = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    kinds = {e["kind"] for b in lines if "events" in b for e in b["events"]}
    assert {"run_start", "scalars", "tensor_stats", "run_end"} <= kinds

    with server.client() as c:
        assert httpx.delete(f"{server.url}/v1/runs/old-run").status_code == 401  # needs the token
        assert c.delete("/v1/runs/old-run").status_code == 204
        assert c.get("/v1/runs/old-run").status_code == 404
        assert c.delete("/v1/runs/old-run").status_code == 404
    assert _loss(server.data_dir, "old-run") == []

    fresh = tmp_path / "fresh"
    for _ in range(2):  # importing twice stores it once
        r = CliRunner().invoke(main, ["import", str(out), "--data", str(fresh)])
        assert r.exit_code == 0, r.output
    assert _loss(fresh, "old-run") == before
    with sqlite3.connect(fresh / "traindx.sqlite") as conn:
        stats = conn.execute("SELECT count(*) FROM stats WHERE run='old-run'").fetchone()[0]
    assert stats > 0

    # A run still streaming is not deleted without force: its next batch would bring half of it back.
    model = torch.nn.Linear(2, 1)
    p = probes.attach(model, run="live", server=server.url, spool_dir=tmp_path / "spool")
    p.step(loss=1.0)
    assert p.flush(30)
    with server.client() as c:
        r = c.delete("/v1/runs/live")
        assert r.status_code == 409 and r.json()["error"] == "run_active"
        assert c.delete("/v1/runs/live", params={"force": "true"}).status_code == 204
    p.close(timeout=1)


def test_size_cap_warns_before_it_is_reached_and_then_refuses_ingest(tmp_path: Path) -> None:
    srv = make_server(tmp_path, "--max-data-mb", "2")
    srv.start()
    try:
        assert httpx.get(f"{srv.url}/health").json()["warnings"] == []
        (srv.data_dir / "ballast").write_bytes(b"\0" * 1_500_000)  # past 80% of the cap
        health = httpx.get(f"{srv.url}/health").json()
        [warning] = health["warnings"]
        assert "of its cap" in warning and "traindx delete" in warning
        assert health["max_data_bytes"] == 2_000_000
        batch = {"batch_id": "cap-000001", "run": "capped", "seq": 0,
                 "events": [{"kind": "scalars", "step": 0, "time": 1.0, "values": {"loss": 1.0}}]}
        with srv.client() as c:
            assert c.post("/v1/ingest", json=batch).status_code == 200  # below the cap: stored
            (srv.data_dir / "ballast").write_bytes(b"\0" * 2_500_000)
            deadline = time.monotonic() + 30
            while True:  # ingest measures the directory at most once a second
                r = c.post("/v1/ingest", json={**batch, "batch_id": "cap-000002"})
                if r.status_code != 200 or time.monotonic() > deadline:
                    break
            assert r.status_code == 507 and r.headers["retry-after"]
            assert "ingest is refused" in r.json()["message"]
    finally:
        srv.stop()


def test_runs_older_than_the_age_limit_are_deleted_and_recent_ones_kept(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`traindx serve --max-age-days 1`: a run last heard from two days ago is gone soon after start, with
    every row of it; a run from an hour ago stays."""
    monkeypatch.chdir(tmp_path)  # the probes' event files go to ./.traindx/runs
    for run in ("two-days-old", "an-hour-old"):
        p = probes.attach(torch.nn.Linear(2, 1), run=run, server=False, spool_dir=tmp_path / "spool")
        p.step(loss=1.0)
        p.close()
        r = CliRunner().invoke(main, ["import", f".traindx/runs/{run}.jsonl", "--data", str(tmp_path / "data")])
        assert r.exit_code == 0, r.output
    now = time.time()
    with sqlite3.connect(tmp_path / "data" / "traindx.sqlite") as conn:
        conn.execute("UPDATE runs SET last_seen=? WHERE run='two-days-old'", (now - 2 * 86400,))
        conn.execute("UPDATE runs SET last_seen=? WHERE run='an-hour-old'", (now - 3600,))
    srv = make_server(tmp_path, "--max-age-days", "1")
    srv.start()
    try:
        with srv.client() as c:
            deadline = time.monotonic() + 60
            while c.get("/v1/runs/two-days-old").status_code != 404 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.get("/v1/runs/two-days-old").status_code == 404
            assert c.get("/v1/runs/an-hour-old").status_code == 200
    finally:
        srv.stop()
    assert _loss(tmp_path / "data", "two-days-old") == []
    assert len(_loss(tmp_path / "data", "an-hour-old")) == 1
