"""Nothing lost, nothing crashed: SIGKILL restarts, dead probes' spools, misbehaving servers, load."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import probes
from probes.sender import Sender
from diag_server.store import Store
from probes.sinks import HttpSink

from tests.badserver import BadServer, closed_port
from tests.conftest import ROOT, make_server


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(probe: probes.Probe, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        probe.step(loss=loss)


@pytest.fixture(scope="module")
def busy(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """One server for the tests below that need one running: it pushes back early (2 pending batches)."""
    srv = make_server(tmp_path_factory.mktemp("busy"), "--max-pending-ingest", "2")
    srv.start()
    yield srv
    srv.stop()


def _db(data_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(data_dir / "traindx.sqlite")


def _loss_counts(data_dir: Path, run: str) -> dict[int, int]:
    with _db(data_dir) as conn:
        return dict(conn.execute("SELECT step, count(*) FROM scalars WHERE run=? AND name='loss' GROUP BY step",
                                 (run,)).fetchall())


def test_sigkill_mid_run_loses_nothing_and_stores_nothing_twice(tmp_path: Path) -> None:
    srv = make_server(tmp_path)
    srv.start()
    model, opt = _model()
    probe = probes.attach(model, opt, run="killed", server=srv.url, interval=5, spool_dir=tmp_path / "spool",
                          flush_interval=0.02)
    try:
        _train(probe, model, opt, 100)
        srv.stop("kill")  # in the middle of the run, with batches in flight
        _train(probe, model, opt, 100)  # the server is down: the probe spools
        assert probe.sender.pending_spool
        srv.start()
        _train(probe, model, opt, 100)
    finally:
        probe.close(timeout=30)
    try:
        counts = _loss_counts(srv.data_dir, "killed")
        assert sorted(counts) == list(range(300)), "a step's loss is missing"
        assert set(counts.values()) == {1}, "a step's loss was stored twice"
        with _db(srv.data_dir) as conn:
            dup = conn.execute("SELECT count(*) FROM (SELECT 1 FROM stats WHERE run='killed' "
                               "GROUP BY step, collection, tensor HAVING count(*) > 1)").fetchone()[0]
            assert dup == 0
        health = httpx.get(f"{srv.url}/health").json()
        assert health["store"] == "ok" and not health["warnings"]
        assert not list((tmp_path / "spool").glob("*.spool")), "a delivered spool was left behind"
    finally:
        srv.stop()


DEAD_JOB = textwrap.dedent("""
    import os, signal, sys, torch, probes
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = probes.attach(model, opt, run="dead-job", server=sys.argv[1], interval=5, spool_dir=sys.argv[2],
                          flush_interval=0.02)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(60):
        opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()
        probe.step(loss=loss)
    probe.flush(timeout=1)  # everything is in the spool now (the server is down)
    os.kill(os.getpid(), signal.SIGKILL)  # dies without closing: its spool is an orphan
""")


def test_spool_of_a_dead_job_is_replayed_by_the_next_probe(busy, tmp_path: Path) -> None:  # noqa: ANN001
    spool = tmp_path / "spool"
    srv = busy
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    down = f"http://127.0.0.1:{closed_port()}"  # the dead job never reached a server
    proc = subprocess.run([sys.executable, "-c", DEAD_JOB, down, str(spool)], env=env, timeout=120,
                          capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    [orphan] = list(spool.glob("dead-job.*.spool"))
    with open(orphan, "ab") as fh:  # a torn last line, as a crash mid-write leaves
        fh.write(b'{"batch_id": "torn0000", "run": "dead-job", "seq": 99, "events": [{"kind": "sca')
    model, opt = _model()
    # The next job, of another run, started in the same directory, delivers the dead one's events first.
    with probes.attach(model, opt, run="next-job", server=srv.url, spool_dir=spool, flush_interval=0.02) as p:
        _train(p, model, opt, 10)
    counts = _loss_counts(srv.data_dir, "dead-job")
    assert sorted(counts) == list(range(60)) and set(counts.values()) == {1}
    assert not orphan.exists()


@pytest.mark.parametrize("mode", ["refuse", "hang", "slow", "garbage", "error", "busy", "reset"])
def test_training_is_unaffected_by_a_misbehaving_server(tmp_path: Path, mode: str) -> None:
    """The loop finishes (a probe that waited on the network would block forever on 'hang'), the probe
    never raises, its queue and spool stay within their limits, and what it had is kept in the spool."""
    with BadServer(mode, delay=5.0) as bad:
        url = f"http://127.0.0.1:{closed_port()}" if mode == "refuse" else bad.url
        model, opt = _model()
        probe = probes.attach(model, opt, run=f"bad-{mode}", sink=HttpSink(url, timeout=0.5), interval=5,
                              spool_dir=tmp_path / "spool", flush_interval=0.01)
        probe.sender.max_spool_bytes = 20_000
        _train(probe, model, opt, 150)
        assert probe.step_count == 150
        assert probe.sender.queued <= probe.sender.max_queue
        probe.close(timeout=1)
        spools = list((tmp_path / "spool").glob("*.spool"))
        assert spools and all(p.stat().st_size <= 20_000 for p in spools)
        assert probe.sender.dropped > 0 or mode == "busy" and bad.requests <= 1
        if mode == "busy":
            # Retry-After: 3600 means one request, then silence: the probe honours the back-pressure.
            assert bad.requests == 1


def test_a_server_that_is_not_an_http_url_is_refused_at_attach() -> None:
    """A server given without its scheme (``localhost:8000``) would never be reached: attach says so,
    instead of spooling every batch of the run."""
    model, opt = _model()
    with pytest.raises(ValueError, match="http"):
        probes.attach(model, opt, run="no-scheme", server="localhost:8000")
    assert HttpSink("https://example.invalid:8443/traindx/")._path == "/traindx/v1/ingest"


def test_replies_the_job_did_not_ask_for_change_nothing(tmp_path: Path) -> None:
    """A server (or something posing as one) cannot widen what the job allowed: junk commands are
    ignored and an out-of-bounds learning rate is refused by the job itself."""
    with BadServer("weird_commands") as bad:
        model, opt = _model()
        probe = probes.attach(model, opt, run="weird", sink=HttpSink(bad.url, timeout=2),
                              allow={"set_lr": {"max_lr": 0.1}}, spool_dir=tmp_path / "spool", flush_interval=0.01)
        _train(probe, model, opt, 50)
        probe.close(timeout=2)
    assert opt.param_groups[0]["lr"] == 0.01


def test_a_full_queue_is_counted_and_reported_to_the_server_later(tmp_path: Path, busy) -> None:  # noqa: ANN001
    server = busy
    gate = threading.Event()

    class Slow(HttpSink):
        def send(self, batch: dict) -> dict:
            gate.wait(30)
            return super().send(batch)

    sender = Sender(Slow(server.url), "overflow", spool_dir=tmp_path / "spool", max_queue=50, flush_interval=0.01)
    for i in range(500):
        sender.put({"kind": "scalars", "step": i, "time": 1.0, "values": {"loss": float(i)}})
    assert sender.queued <= 50 and sender.dropped >= 400
    gate.set()
    sender.put({"kind": "scalars", "step": 500, "time": 1.0, "values": {"loss": 1.0}})
    assert sender.flush(30)
    sender.close()
    with server.client() as c:
        latest = c.get("/v1/runs/overflow").json()["latest"]
    assert latest["probe/dropped_events"] == sender.dropped


def test_eight_jobs_at_once_with_back_pressure_lose_nothing(tmp_path: Path, busy) -> None:  # noqa: ANN001
    senders = [Sender(HttpSink(busy.url), f"load-{j}", spool_dir=tmp_path / "spool", max_batch=200,
                      flush_interval=0.005) for j in range(8)]

    def stream(s: Sender) -> None:
        for i in range(1500):
            s.put({"kind": "scalars", "step": i, "time": 1.0, "values": {"loss": float(i)}})

    threads = [threading.Thread(target=stream, args=(s,)) for s in senders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in senders:
        assert s.flush(120)
        s.close()
    for j in range(8):
        counts = _loss_counts(busy.data_dir, f"load-{j}")
        assert sorted(counts) == list(range(1500)) and set(counts.values()) == {1}


def test_a_damaged_store_is_reported_at_start(tmp_path: Path) -> None:
    srv = make_server(tmp_path)
    store = Store(srv.data_dir)
    store.write(lambda conn: conn.executemany(
        "INSERT INTO scalars(run, step, name, value, time) VALUES ('r', ?, 'loss', 1.0, 1.0)",
        [(i,) for i in range(20000)]))
    store.close()
    db = srv.data_dir / "traindx.sqlite"
    with sqlite3.connect(db) as conn:  # everything into the main file, so the damage is not masked by the WAL
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = db.stat().st_size
    with open(db, "r+b") as fh:  # scribble over the middle of the file, as a bad disk would
        fh.seek(size // 2)
        fh.write(os.urandom(8192))
    srv.start()
    try:
        health = httpx.get(f"{srv.url}/health").json()
        assert health["store"] != "ok"
        assert any("integrity" in w for w in health["warnings"])
    finally:
        srv.stop()


def test_writes_committed_together_stay_atomic_each(tmp_path: Path) -> None:
    """Group commit: writes that wait together share a transaction, but one that fails leaves nothing
    of itself behind and takes nothing of the others with it; each caller gets its own result."""
    store = Store(tmp_path)
    running, gate = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:  # occupies the writer while the twelve queue up behind it
        running.set()
        gate.wait(30)

    holder = threading.Thread(target=store.write, args=(hold,))
    holder.start()
    assert running.wait(30)

    def job(i: int):  # noqa: ANN202
        def fn(conn: sqlite3.Connection) -> int:
            conn.execute("INSERT INTO scalars(run, step, name, value, time) VALUES ('r', ?, 'loss', 1.0, 1.0)", (i,))
            if i % 3 == 0:
                raise ValueError(f"job {i} refuses")
            return i
        return fn

    results: dict[int, object] = {}

    def call(i: int) -> None:
        try:
            results[i] = store.write(job(i))
        except ValueError as e:
            results[i] = str(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while store._jobs.qsize() < 12 and time.monotonic() < deadline:  # all twelve queued: committed together
        time.sleep(0.01)
    gate.set()
    for t in [holder, *threads]:
        t.join(30)
    store.close()
    assert results == {i: (f"job {i} refuses" if i % 3 == 0 else i) for i in range(12)}
    with _db(tmp_path) as conn:
        steps = sorted(s for (s,) in conn.execute("SELECT step FROM scalars"))
    assert steps == [i for i in range(12) if i % 3]
