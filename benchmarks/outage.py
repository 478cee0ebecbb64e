"""The probe's cost to the training job while its server is away.

Trains a small MLP on CPU and times its steps in four settings, alternating them for --repeats rounds:
no probe (the baseline), probe with the server up, probe with the server down (a closed port: the
probe spools), and probe with a server that hangs (accepts, never answers). Prints the median step
time of each and the ratios against the baseline and against the server being up, plus what the probe
kept in its spool and dropped. The probe runs with its defaults (interval 50, all collections).

    python benchmarks/outage.py            # 5 rounds of 600 steps
    python benchmarks/outage.py --quick    # 2 rounds of 300 steps

With --outage SECONDS it instead trains through a real outage of that length: the server is SIGKILLed
mid-run, the job trains on for SECONDS, the server starts again on the same port and data, and the
script counts every step's loss in the store (goal: each exactly once).

    python benchmarks/outage.py --outage 180
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import probes  # noqa: E402
from probes.sinks import HttpSink  # noqa: E402


def _steps(probe: probes.Probe | None, steps: int) -> float:
    """Median seconds per step of a small MLP (about a millisecond a step on one CPU core)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if probe is not None:
        probe = probes.attach(model, opt, **probe)  # type: ignore[arg-type]
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if probe is not None:
                probe.step(loss=loss)
            times.append(time.perf_counter() - t0)
    finally:
        if probe is not None:
            probe.close(timeout=1)
    return statistics.median(times)


def exactly_once(outage_s: float) -> int:
    import sqlite3

    from diag_server.testing import make_server

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def train_for(probe: probes.Probe, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            probe.step(loss=loss)

    with tempfile.TemporaryDirectory() as d:
        srv = make_server(Path(d))
        srv.start()
        probe = probes.attach(model, opt, run="outage", server=srv.url, spool_dir=Path(d) / "spool")
        try:
            train_for(probe, 5)
            srv.stop("kill")
            t0 = time.monotonic()
            train_for(probe, outage_s)
            spooled = sum(p.stat().st_size for p in (Path(d) / "spool").glob("*.spool"))
            srv.start()
            down = time.monotonic() - t0
            train_for(probe, 5)
            steps = probe.step_count
            probe.close(timeout=300)
            with sqlite3.connect(srv.data_dir / "traindx.sqlite") as conn:
                counts = dict(conn.execute("SELECT step, count(*) FROM scalars WHERE run='outage' AND name='loss' "
                                           "GROUP BY step").fetchall())
        finally:
            srv.stop()
    missing = sum(1 for s in range(steps) if s not in counts)
    twice = sum(1 for c in counts.values() if c > 1)
    print(f"outage of {down:.0f} s (SIGKILL, restart on the same port): {steps} steps, spool peaked near "
          f"{spooled / 1e6:.1f} MB; losses missing: {missing}, stored twice: {twice}")
    return 0 if missing == twice == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 300 steps.")
    ap.add_argument("--outage", type=float, default=None, metavar="SECONDS",
                    help="Train through a real outage of this length and count every step's loss instead.")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one core per job: more threads only fight over a shared machine
    if args.outage is not None:
        return exactly_once(args.outage)
    if args.quick:
        args.steps, args.repeats = 300, 2
    torch.set_num_threads(1)

    from tests.badserver import BadServer, closed_port
    from diag_server.testing import make_server

    with tempfile.TemporaryDirectory() as d, BadServer("hang") as hang:
        tmp = Path(d)
        srv = make_server(tmp)
        srv.start()
        down_url = f"http://127.0.0.1:{closed_port()}"
        spool = tmp / "spool"
        settings = {
            "no probe": None,
            "server up": {"sink_url": srv.url},
            "server down": {"sink_url": down_url},
            "server hangs": {"sink_url": hang.url},
        }
        results: dict[str, list[float]] = {k: [] for k in settings}
        try:
            _steps(None, 50)  # warm-up
            for r in range(args.repeats):
                for name, cfg in settings.items():
                    probe = None
                    if cfg is not None:
                        tag = name.replace(" ", "-")
                        probe = {"run": f"outage-{r}-{tag}", "spool_dir": spool / tag,
                                 "sink": HttpSink(cfg["sink_url"], timeout=2)}
                    results[name].append(_steps(probe, args.steps))
        finally:
            srv.stop()
        spooled = sum(p.stat().st_size for p in spool.glob("*/*.spool"))

    med = {k: statistics.median(v) for k, v in results.items()}
    base, up = med["no probe"], med["server up"]
    print(f"probe step time while the server is away: small MLP on CPU, {args.repeats} rounds of {args.steps} steps, "
          f"medians; CPUs: {os.cpu_count()} (shared, under load)")
    for name, t in med.items():
        print(f"  {name:<13} {1e3 * t:7.3f} ms/step   x{t / base:.3f} vs no probe   x{t / up:.3f} vs server up")
    print(f"  step-time ratio, server down / no probe: {med['server down'] / base:.3f} "
          f"(server up / no probe: {up / base:.3f})")
    print(f"  left in spool files at the end: {spooled / 1e3:.0f} kB (replayed by the next probe or traindx import)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
