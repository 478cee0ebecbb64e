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
import orjson
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
    never raises, its queue and spool stay within their limits, and what it had is kept in the spool
    (or, from a server that is only slow, delivered)."""
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
        assert all(p.stat().st_size <= 20_000 for p in spools)
        if mode != "slow":  # answers 5 s late are waited on: what the probe had may all be delivered by now
            assert spools
            assert probe.sender.dropped > 0 or mode == "busy" and bad.requests <= 1
        if mode == "busy":
            # Retry-After: 3600 means one request, then silence: the probe honours the back-pressure.
            assert bad.requests == 1


def test_a_spool_near_its_limit_keeps_what_fits(tmp_path: Path) -> None:
    """A hanging server and a small spool: close() keeps the first events that fit, within the limit,
    and counts only the rest as dropped (a batch larger than the room left is not thrown away whole)."""
    with BadServer("hang", delay=5.0) as bad:
        sender = Sender(HttpSink(bad.url, timeout=0.5), "tight", spool_dir=tmp_path, max_spool_bytes=20_000,
                        flush_interval=3600)
        total = 1_500  # about 60 KB of events: three times the spool
        for i in range(total):
            sender.put({"kind": "scalar", "step": i, "name": "loss", "value": float(i)})
        sender.close(timeout=0.5)
    [spool] = list(tmp_path.glob("tight.*.spool"))
    assert spool.stat().st_size <= 20_000
    kept = [e["step"] for line in spool.read_bytes().splitlines() for e in orjson.loads(line)["events"]]
    assert kept == list(range(len(kept))) and kept, "the first events, in order"
    assert len(kept) + sender.dropped >= total  # (and the sender's own status events, also dropped)


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


# -- a slow server is waited on; close() gives up only on a job that never had one ----------------------
def _no_spool_left(spool: Path) -> bool:
    return not [p for p in spool.glob("*.spool") if p.stat().st_size]


def test_close_waits_for_a_slow_server_and_stores_each_step_once(tmp_path: Path, busy) -> None:  # noqa: ANN001
    """Answers slower than the sink's read timeout while the job closes: the batches are stored by the server,
    the probe takes the timeouts for a slow server (not an absent one), sends them again, and close() waits
    until all is delivered; the ids make the copies count once."""
    from tests.badserver import SlowProxy

    with SlowProxy(busy.port, 2.0) as proxy:
        proxy.slow.clear()
        model, opt = _model()
        probe = probes.attach(model, opt, run="slow-close", sink=HttpSink(proxy.url, read_timeout=0.5), interval=1,
                              spool_dir=tmp_path / "spool", flush_interval=0.02)
        _train(probe, model, opt, 150)
        proxy.limit = proxy.held + 3  # the next three answers come 2 s late: after the probe stopped waiting
        proxy.slow.set()
        probe.close(timeout=120)
        assert proxy.held == proxy.limit
    counts = _loss_counts(busy.data_dir, "slow-close")
    assert sorted(counts) == list(range(150)) and set(counts.values()) == {1}
    assert _no_spool_left(tmp_path / "spool"), "close() returned with batches still in the spool"


def test_a_long_wait_for_an_answer_keeps_the_queue_within_its_bound(tmp_path: Path, busy) -> None:  # noqa: ANN001
    """While one answer takes seconds, the job goes on putting events: they move to the spool behind the batch
    in flight instead of overflowing the queue, and reach the server in order, each once."""
    from tests.badserver import SlowProxy

    with SlowProxy(busy.port, 3.0, limit=1) as proxy:
        sender = Sender(HttpSink(proxy.url), "long-wait", spool_dir=tmp_path / "spool", max_queue=300, max_batch=100,
                        flush_interval=0.01)
        for i in range(1200):
            sender.put({"kind": "scalars", "step": i, "time": 1.0, "values": {"loss": float(i)}})
            time.sleep(0.002)  # ~2.5 s of puts, most of them while the first answer is held
        assert sender.flush(120)
        sender.close()
    assert proxy.held == 1 and sender.dropped == 0 and sender.spooled_batches > 0
    counts = _loss_counts(busy.data_dir, "long-wait")
    assert sorted(counts) == list(range(1200)) and set(counts.values()) == {1}


def test_close_waits_for_a_server_that_comes_back(tmp_path: Path) -> None:
    """A server the probe had reached goes away (a restart): close() keeps trying until its timeout, and
    delivers everything once the server is back."""
    srv = make_server(tmp_path)
    srv.start()
    model, opt = _model()
    probe = probes.attach(model, opt, run="restarted", server=srv.url, interval=5, spool_dir=tmp_path / "spool",
                          flush_interval=0.02)
    try:
        _train(probe, model, opt, 50)
        assert probe.flush(30)
        srv.stop("kill")
        _train(probe, model, opt, 50)
        closing = threading.Thread(target=probe.close, kwargs={"timeout": 120})
        closing.start()
        time.sleep(2)  # close() is waiting by now
        assert closing.is_alive(), "close() gave up on a server it had reached"
        srv.start()
        closing.join(150)
        assert not closing.is_alive()
        counts = _loss_counts(srv.data_dir, "restarted")
        assert sorted(counts) == list(range(100)) and set(counts.values()) == {1}
        assert _no_spool_left(tmp_path / "spool")
    finally:
        srv.stop()


def test_a_job_with_no_server_at_all_says_in_one_line_where_its_events_wait(tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _model()
    probe = probes.attach(model, opt, run="serverless", server=f"http://127.0.0.1:{closed_port()}", interval=5,
                          spool_dir=tmp_path / "spool", flush_interval=0.02)
    _train(probe, model, opt, 40)
    with caplog.at_level("WARNING", logger="traindx.probe"):
        probe.close(timeout=600)  # returns after a short grace: no server ever answered this job
    [spool] = list((tmp_path / "spool").glob("serverless.*.spool"))
    said = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(said) == 1, said
    assert str(spool.absolute()) in said[0] and f"traindx import {spool.absolute()}" in said[0]
    assert "unreachable" in said[0] or "away" in said[0]
    events = sum(len(orjson.loads(line)["events"]) for line in spool.read_bytes().splitlines())
    assert f"{events} events in " in said[0]


# -- a job started before its server ---------------------------------------------------------------------------
LATE_JOB = textwrap.dedent("""
    import os, sys, time, torch, probes
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = probes.attach(model, opt, run="late-job", server=sys.argv[1], interval=1, flush_interval=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    steps = 0
    while not os.path.exists("stop") and steps < 20000:
        opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()
        probe.step(loss=loss)
        steps += 1
        time.sleep(0.005)
    probe.close(timeout=120)
    print(steps)
""")


def _top_step(srv, run: str) -> int:  # noqa: ANN001
    try:
        with _db(srv.data_dir) as conn:
            top = conn.execute("SELECT max(step) FROM scalars WHERE run=? AND name='loss'", (run,)).fetchone()[0]
    except sqlite3.Error:
        return -1
    return -1 if top is None else top


def test_a_job_started_before_its_server_delivers_live_once_it_starts(tmp_path: Path) -> None:
    """The user's order of things: training first, `traindx serve` later in the same directory. The server
    writes its token at its first start; the probe, refused (401), finds it there and delivers, live."""
    from tests.conftest import ServerProcess, free_port

    port = free_port()
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=tmp_path / ".traindx",
                        env={"TRAINDX_TOKEN": None, "TRAINDX_DATA": None})
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINDX_TOKEN", "TRAINDX_DATA", "TRAINDX_SPOOL")}
    env["PYTHONPATH"] = str(ROOT)
    job = subprocess.Popen([sys.executable, "-c", LATE_JOB, srv.url], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / ".traindx" / "spool").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the job is training, spooling what it cannot send
        time.sleep(2)
        srv.start()
        assert (tmp_path / ".traindx" / "token").exists()
        # Live: the steps the job takes now reach the server while it runs, not only at its close.
        seen = []
        while len(set(seen)) < 3 and time.monotonic() < deadline and job.poll() is None:
            top = _top_step(srv, "late-job")
            if top >= 0:
                seen.append(top)
            time.sleep(0.5)
        assert len(set(seen)) >= 3 and job.poll() is None, "no live delivery after the server started"
        (tmp_path / "stop").touch()
        out, err = job.communicate(timeout=180)
        assert job.returncode == 0, err[-3000:]
        steps = int(out.split()[-1])
        counts = _loss_counts(srv.data_dir, "late-job")
        assert sorted(counts) == list(range(steps)) and set(counts.values()) == {1}
        assert "not delivered" not in err and "401" not in err, err[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
        srv.stop()


def test_the_token_is_read_again_when_the_server_refuses_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Refused for want of a token, the probe says once where it looks for one, keeps the batches, and
    delivers them all when the token appears there."""
    srv = make_server(tmp_path, env={"TRAINDX_TOKEN": None})
    srv.start()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.delenv("TRAINDX_TOKEN", raising=False)
    monkeypatch.setenv("TRAINDX_DATA", str(elsewhere))
    model, opt = _model()
    try:
        with caplog.at_level("WARNING", logger="traindx.probe"):
            probe = probes.attach(model, opt, run="token-late", server=srv.url, interval=5,
                                  spool_dir=tmp_path / "spool", flush_interval=0.02)
            for _ in range(6):  # refused batch after batch, for a few seconds
                _train(probe, model, opt, 10)
                time.sleep(0.5)
            assert probe.sender.pending_spool
            (elsewhere / "token").write_text((srv.data_dir / "token").read_text())
            _train(probe, model, opt, 10)
            probe.close(timeout=60)
        waiting = [r.getMessage() for r in caplog.records if "waiting for one" in r.getMessage()]
        assert len(waiting) == 1, waiting
        assert str((elsewhere / "token").absolute()) in waiting[0] and "TRAINDX_TOKEN" in waiting[0]
        counts = _loss_counts(srv.data_dir, "token-late")
        assert sorted(counts) == list(range(70)) and set(counts.values()) == {1}
    finally:
        srv.stop()
