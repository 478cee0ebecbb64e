"""Nothing lost or doubled when the server is slow, close() waiting for it; and a job started before its server.

Slow server: --jobs (8) jobs, each its own process training a small MLP for --steps (2000) steps with the
probe at interval 1, stream to a real `traindx serve` through a proxy (tests.badserver.SlowProxy) that holds
every answer to ingest 6-10 s (the request reaches the server at once: the batch is stored, its answer is
late), from --slow-after seconds after the jobs start until they have all closed, while 4 readers poll
get_anomalies (2 over HTTP, 2 over MCP) straight at the server. Each job ends with
``probe.close(timeout=180)``. Per run: the loss steps missing from the store (lost) and stored twice
(doubled), against the goal of 0 and 0, and how long close() took; over --runs runs (5). The baseline is
one run of the same jobs with the server not slowed (its close() times).

Late server: one job starts --late (30) seconds before its server, in a directory where `traindx serve`
then starts with its data in ./.traindx and no TRAINDX_TOKEN anywhere (the server writes its token at its
first start; the probe finds it on its first 401). Prints whether every step was stored once, and how long
after the server's start the job's steps arrived live (the store holding the step the job was at when the
server started: goal 10 s).

    python benchmarks/slow_server.py                   # 5 slow runs + baseline + late server
    python benchmarks/slow_server.py --quick           # 1 slow run of 4 jobs x 600 steps, late 10 s
    python benchmarks/slow_server.py --only late
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLOSE_TIMEOUT = 180.0
GOAL_LIVE_S = 10.0


def job(url: str, run: str, steps: int, pace: float) -> None:
    """One training job: a small MLP, the probe at interval 1, then close(timeout=180); prints a JSON line."""
    import logging

    import torch

    import probes

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(1)  # one core per job: more threads only fight over a shared machine
    torch.manual_seed(hash(run) % 1000)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = probes.attach(model, opt, run=run, server=url, interval=1)
    x, y = torch.randn(32, 32), torch.randn(32, 1)
    times = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        times.append(time.time())
        if pace:
            time.sleep(pace)
    t0 = time.monotonic()
    probe.close(timeout=CLOSE_TIMEOUT)
    close_s = time.monotonic() - t0
    s = probe.sender
    print(json.dumps({"run": run, "steps": steps, "close_s": close_s, "left_events": s._pending_events,
                      "left_batches": s._pending_batches, "dropped": s.dropped, "spooled": s.spooled_batches,
                      "step_times": times if pace else []}), flush=True)


def _drain(srv) -> None:  # noqa: ANN001
    """Read the server's stderr as it comes: the harness pipes it, and a full pipe would stop the server (the
    MCP readers' tool errors, for runs that have not sent their first batch, are logged there)."""
    threading.Thread(target=lambda: [None for _ in srv.proc.stderr], daemon=True).start()


def _losses(db: Path, run: str) -> dict[int, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return dict(conn.execute("SELECT step, count(*) FROM scalars WHERE run=? AND name='loss' GROUP BY step",
                                 (run,)).fetchall())


def _readers(srv, runs: list[str], stop: threading.Event) -> list[threading.Thread]:  # noqa: ANN001
    """2 HTTP and 2 MCP readers polling get_anomalies of the jobs' runs (an unknown run yet is fine)."""
    import httpx

    from agent_examples.scripted_agent import ToolFailed, call, connect

    def http_reader() -> None:
        with httpx.Client(base_url=srv.url, headers=srv.headers, timeout=120) as c:
            i = 0
            while not stop.is_set():
                c.get(f"/v1/runs/{runs[i % len(runs)]}/anomalies", params={"limit": 20})
                i += 1
                time.sleep(0.05)

    def mcp_reader() -> None:
        async def go() -> None:
            async with connect(f"{srv.url}/mcp", token=srv.token, name="slow-server-reader") as client:
                i = 0
                while not stop.is_set():
                    try:
                        await call(client, "get_anomalies", run=runs[i % len(runs)], limit=20)
                    except ToolFailed:
                        pass  # the run has not sent its first batch yet
                    i += 1
                    await asyncio.sleep(0.05)
        try:
            asyncio.run(go())
        except Exception as e:  # noqa: BLE001 - a reader's failure is reported, the measurement goes on
            print(f"  (an MCP reader stopped: {type(e).__name__}: {e})", file=sys.stderr)

    threads = [threading.Thread(target=f, daemon=True) for f in (http_reader, http_reader, mcp_reader, mcp_reader)]
    for t in threads:
        t.start()
    return threads


def slow_run(tag: str, jobs: int, steps: int, slow: bool, slow_after: float, tmp: Path) -> dict:
    from tests.badserver import SlowProxy
    from diag_server.testing import make_server

    srv = make_server(tmp / tag)
    srv.start()
    _drain(srv)
    runs = [f"{tag}-job{j}" for j in range(jobs)]
    stop = threading.Event()
    try:
        with SlowProxy(srv.port, (6.0, 10.0), seed=len(tag)) as proxy:
            proxy.slow.clear()
            readers = _readers(srv, runs, stop)
            env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINDX_SPOOL": str(tmp / tag / "spool")}
            procs = [subprocess.Popen([sys.executable, __file__, "--job", proxy.url, run, str(steps), "0"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for run in runs]
            if slow:
                threading.Timer(slow_after, proxy.slow.set).start()
            outs = [p.communicate(timeout=3600) for p in procs]
            held = proxy.held
            stop.set()
            for t in readers:
                t.join(30)
        results = []
        for run, (out, err) in zip(runs, outs):
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if not lines:
                raise RuntimeError(f"job {run} failed: {err[-2000:]}")
            r = json.loads(lines[-1])
            counts = _losses(srv.data_dir / "traindx.sqlite", run)
            r["lost"] = sum(1 for s in range(r["steps"]) if s not in counts)
            r["doubled"] = sum(1 for c in counts.values() if c > 1)
            r["said"] = [ln for ln in err.splitlines() if "not delivered" in ln]
            results.append(r)
    finally:
        stop.set()
        srv.stop()
    return {"jobs": results, "held": held}


def late_server(late: float, after: float, tmp: Path) -> dict:
    """A job started ``late`` s before its server, training on for ``after`` s once the server is up."""
    from diag_server.testing import ServerProcess, free_port

    home = tmp / "late"
    home.mkdir()
    port = free_port()
    srv = ServerProcess(url=f"http://127.0.0.1:{port}", port=port, data_dir=home / ".traindx",
                        env={"TRAINDX_TOKEN": None, "TRAINDX_DATA": None})
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINDX_TOKEN", "TRAINDX_DATA", "TRAINDX_SPOOL")}
    env["PYTHONPATH"] = str(ROOT)
    pace = 0.01
    # Enough steps to run ``late + after`` seconds at the pace (the job's own step time comes on top).
    steps = int((late + after) / pace)
    started = time.time()
    # Into files, not pipes: the job's last line (its step times) is larger than a pipe holds.
    out_file, err_file = open(tmp / "late.out", "w+"), open(tmp / "late.err", "w+")
    proc = subprocess.Popen([sys.executable, __file__, "--job", srv.url, "late-job", str(steps), str(pace)],
                            cwd=home, stdout=out_file, stderr=err_file, text=True, env=env)
    time.sleep(late)
    srv.start()
    up = time.time()
    _drain(srv)
    db = srv.data_dir / "traindx.sqlite"
    polls: list[tuple[float, int]] = []  # (when, highest loss step stored)
    while proc.poll() is None:
        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
                top = conn.execute("SELECT max(step) FROM scalars WHERE run='late-job' AND name='loss'").fetchone()[0]
        except sqlite3.Error:
            top = None
        polls.append((time.time(), -1 if top is None else top))
        time.sleep(0.1)
    proc.wait()
    out, err = (tmp / "late.out").read_text(), (tmp / "late.err").read_text()
    out_file.close(), err_file.close()
    try:
        r = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    except IndexError:
        raise RuntimeError(f"the late job failed: {err[-2000:]}") from None
    counts = _losses(db, "late-job")
    srv.stop()
    times = r["step_times"]
    at_start = sum(1 for t in times if t <= up) - 1  # the step the job was at when the server was up
    live = next((t - up for t, top in polls if top >= at_start), None)
    lags = []  # once live: how far behind the job the store was, in seconds
    for t, top in polls:
        if live is not None and t - up >= live and 0 <= top < len(times):
            lags.append(max(t - times[top], 0.0))
    return {"steps": r["steps"], "stored": len(counts), "doubled": sum(1 for c in counts.values() if c > 1),
            "lost": sum(1 for s in range(r["steps"]) if s not in counts), "started_before": up - started,
            "live_s": live, "lag_s": statistics.median(lags) if lags else None,
            "said": [ln for ln in err.splitlines() if "traindx" in ln][:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--slow-after", type=float, default=10.0, help="Seconds after the jobs start that the server slows.")
    ap.add_argument("--late", type=float, default=30.0, help="Seconds the late job trains before its server starts.")
    ap.add_argument("--only", choices=["slow", "late"])
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--quick", action="store_true", help="1 slow run of 4 jobs x 600 steps; the late job 10 s early.")
    ap.add_argument("--job", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        url, run, steps, pace = args.job
        job(url, run, int(steps), float(pace))
        return 0
    if args.quick:
        args.jobs, args.steps, args.runs, args.late, args.slow_after = 4, 600, 1, 10.0, 5.0
    ok = True
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.only in (None, "slow"):
            print(f"slow server: ingest answers held 6-10 s from {args.slow_after:g} s in until every job has closed; "
                  f"{args.jobs} jobs x {args.steps} steps at interval 1, 4 readers polling get_anomalies; "
                  f"close(timeout={CLOSE_TIMEOUT:g}); CPUs: {os.cpu_count()} (shared)", flush=True)
            closes: list[float] = []
            for i in range(args.runs):
                res = slow_run(f"slow{i}", args.jobs, args.steps, True, args.slow_after, tmp)
                jobs = res["jobs"]
                lost, doubled = sum(j["lost"] for j in jobs), sum(j["doubled"] for j in jobs)
                c = [j["close_s"] for j in jobs]
                closes += c
                left = sum(j["left_events"] for j in jobs)
                ok &= lost == 0 and doubled == 0
                print(f"  run {i + 1}: steps lost {lost}, doubled {doubled}   (goal 0, 0)   close() median "
                      f"{statistics.median(c):.1f} s, max {max(c):.1f} s (timeout {CLOSE_TIMEOUT:g} s); answers held "
                      f"{res['held']}; events left undelivered at close {left}; dropped "
                      f"{sum(j['dropped'] for j in jobs)}", flush=True)
                for j in jobs:
                    for line in j["said"]:
                        print(f"    {j['run']}: {line}")
            base = None
            if not args.no_baseline:
                res = slow_run("base", args.jobs, args.steps, False, 0.0, tmp)
                b = [j["close_s"] for j in res["jobs"]]
                base = statistics.median(b)
                lost = sum(j["lost"] for j in res["jobs"]) + sum(j["doubled"] for j in res["jobs"])
                print(f"  baseline, server not slowed: close() median {base:.2f} s, max {max(b):.2f} s; "
                      f"lost + doubled {lost}", flush=True)
            med = statistics.median(closes)
            print(f"  => lost/doubled in every run: {'0 / 0' if ok else 'NOT 0'}   (goal 0 / 0 in {args.runs} runs of "
                  f"{args.runs}); close() median {med:.1f} s, max {max(closes):.1f} s"
                  + (f", x{med / base:.0f} the unslowed baseline ({base:.2f} s)" if base else ""), flush=True)
        if args.only in (None, "late"):
            r = late_server(args.late, 20.0, tmp)
            met = r["lost"] == 0 and r["doubled"] == 0 and r["live_s"] is not None and r["live_s"] <= GOAL_LIVE_S
            ok &= met
            live = "never" if r["live_s"] is None else f"{r['live_s']:.1f} s"
            lag = "-" if r["lag_s"] is None else f"{r['lag_s']:.2f} s"
            print(f"late server: a job started {r['started_before']:.0f} s before its server (token written by the "
                  f"server at its start, found by the probe): steps stored {r['stored']} of {r['steps']}, lost "
                  f"{r['lost']}, doubled {r['doubled']} (goal all, 0, 0); live {live} after the server's start "
                  f"(goal <= {GOAL_LIVE_S:g} s), then {lag} behind the job (median)")
            for line in r["said"]:
                print(f"    the job said: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
