"""Ingest under load: N jobs streaming at their maximum rate into one `traindx serve`.

Prints the stat rows per second the server stores with N jobs (default 8) against one job alone
(the baseline), the p50/p99 latency of `get_anomalies` (GET /v1/runs/RUN/anomalies) under that load
against an idle server, and how many events were
lost (stored rows against rows the jobs produced; the goal is 0). Phases alternate (idle, 1 job,
N jobs) for --repeats rounds; figures are medians over the rounds.

Each job is its own process with the real Sender and HttpSink, putting tensor_stats events of
--rows rows as fast as its sender takes them (it never lets its queue grow past two batches, so
nothing is dropped at the source): its maximum sustainable rate.

    python benchmarks/ingest.py            # 8 jobs, 3 rounds of 8 s
    python benchmarks/ingest.py --quick    # 1 round of 4 s
"""

from __future__ import annotations

import argparse
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


def job(url: str, run: str, seconds: float, rows: int, spool: str) -> None:
    """One job: stream as fast as the sender delivers; print how many stat rows it produced."""
    from probes.sender import Sender
    from probes.sinks import HttpSink

    sender = Sender(HttpSink(url, timeout=30), run, spool_dir=spool, max_batch=100, flush_interval=0.005)
    names = [f"layer{i}.weight" for i in range(rows)]
    step = produced = 0
    started = time.time()  # after the imports: a job's start-up is not the server's time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if sender.queued > 2 * sender.max_batch:
            time.sleep(0.001)
            continue
        sender.put({"kind": "tensor_stats", "step": step, "time": time.time(), "collection": "gradients",
                    "rows": [{"name": n, "numel": 1024, "norm": 1.0 + step * 1e-6, "mean": 0.0, "std": 0.1,
                              "min": -1.0, "max": 1.0, "nan_count": 0, "inf_count": 0, "zero_frac": 0.0}
                             for n in names]})
        sender.put({"kind": "scalars", "step": step, "time": time.time(), "values": {"loss": 1.0 / (step + 1)}})
        produced += rows
        step += 1
    ok = sender.flush(300)
    print(produced, int(ok), started, time.time(), flush=True)
    sender.close()


def _stat_rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM stats").fetchone()[0]


def _query_latencies(url: str, headers: dict, run: str, stop: threading.Event) -> list[tuple[float, float]]:
    import httpx

    out: list[tuple[float, float]] = []  # (wall time sent, latency)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        while not stop.is_set():
            sent, t0 = time.time(), time.perf_counter()
            r = c.get(f"/v1/runs/{run}/anomalies", params={"limit": 20})
            out.append((sent, time.perf_counter() - t0))
            assert r.status_code == 200, r.text
            time.sleep(0.02)
    return out


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def phase(srv, n_jobs: int, seconds: float, rows: int, tag: str, tmp: Path) -> dict:  # noqa: ANN001
    db = srv.data_dir / "traindx.sqlite"
    stop = threading.Event()
    lat: list[tuple[float, float]] = []
    t = threading.Thread(target=lambda: lat.extend(_query_latencies(srv.url, srv.headers, "warm", stop)))
    before = _stat_rows(db)
    t.start()
    if n_jobs == 0:
        start = time.time()
        time.sleep(seconds)
        produced, complete, end = 0, True, time.time()
    else:
        procs = [subprocess.Popen([sys.executable, __file__, "--job", srv.url, f"{tag}-{j}", str(seconds), str(rows),
                                   str(tmp / "spool")], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)}) for j in range(n_jobs)]
        outs = [p.communicate(timeout=seconds + 600)[0].split() for p in procs]
        produced = sum(int(o[0]) for o in outs)
        complete = all(o[1] == "1" for o in outs)
        # From the first job's first event to the last job's last delivery: the server's own time.
        start, end = min(float(o[2]) for o in outs), max(float(o[3]) for o in outs)
    stop.set()
    t.join()
    stored = _stat_rows(db) - before
    window = [latency for sent, latency in lat if start <= sent <= end]
    return {"rows_per_s": stored / (end - start), "p50": _p(window, 0.5), "p99": _p(window, 0.99),
            "lost": produced - stored, "complete": complete, "queries": len(window)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0, help="How long each job streams per round.")
    ap.add_argument("--rows", type=int, default=64, help="Stat rows per tensor_stats event (tensors per model).")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round of 4 s.")
    ap.add_argument("--job", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job:
        url, run, seconds, rows, spool = args.job
        job(url, run, float(seconds), int(rows), spool)
        return 0
    if args.quick:
        args.repeats, args.seconds = 1, 4.0

    from diag_server.testing import make_server

    import httpx

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        srv = make_server(tmp)
        srv.start()
        try:
            # A run with anomalies to query: a loss that blows up.
            batch = {"batch_id": "warm-000001", "run": "warm", "seq": 0, "events": [
                {"kind": "scalars", "step": s, "time": 1.0, "values": {"loss": 1.0 if s < 300 else 1e3 * s}}
                for s in range(400)]}
            httpx.post(f"{srv.url}/v1/ingest", json=batch, headers=srv.headers).raise_for_status()
            results: dict[str, list[dict]] = {"idle": [], "one": [], "many": []}
            for r in range(args.repeats):
                results["idle"].append(phase(srv, 0, args.seconds / 2, args.rows, f"idle{r}", tmp))
                results["one"].append(phase(srv, 1, args.seconds, args.rows, f"one{r}", tmp))
                results["many"].append(phase(srv, args.jobs, args.seconds, args.rows, f"many{r}", tmp))
        finally:
            srv.stop()

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in results[key])

    lost = sum(x["lost"] for k in ("one", "many") for x in results[k])
    print(f"ingest, {args.jobs} jobs at their maximum rate ({args.rows} stat rows per event), "
          f"{args.repeats} round(s) of {args.seconds:g} s, medians; CPUs: {os.cpu_count()} (shared, under load):")
    print(f"  stat rows/s stored, {args.jobs} jobs : {med('many', 'rows_per_s'):,.0f}")
    print(f"  stat rows/s stored, 1 job   : {med('one', 'rows_per_s'):,.0f}   (baseline)")
    print(f"  ratio {args.jobs} jobs / 1 job   : {med('many', 'rows_per_s') / med('one', 'rows_per_s'):.2f}x")
    print(f"  get_anomalies p50 / p99, {args.jobs} jobs: {1e3 * med('many', 'p50'):.1f} / {1e3 * med('many', 'p99'):.1f} ms")
    print(f"  get_anomalies p50 / p99, idle  : {1e3 * med('idle', 'p50'):.1f} / {1e3 * med('idle', 'p99'):.1f} ms"
          "   (baseline)")
    print(f"  p99 ratio load / idle        : {med('many', 'p99') / med('idle', 'p99'):.1f}x")
    print(f"  events lost (produced - stored): {lost}; every job delivered everything: "
          f"{all(x['complete'] for k in ('one', 'many') for x in results[k])}")
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
