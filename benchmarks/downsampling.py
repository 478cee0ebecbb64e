"""What a chart costs on a long run: server-side min/max downsampling against sending every point.

    python benchmarks/downsampling.py [--points 200000] [--max-points 500] [--repeats 5]

One run in a real store (SQLite, the same queries the HTTP routes call) with a long `loss` series holding
one spike and one NaN. Side by side, alternating repeats, medians: the answer the dashboard asks for
(`queries.series(max_points=...)`, min/max per bucket) against the baseline of the whole series; and
whether plain striding (what the server did before) would have kept the spike and the NaN.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diag_server.read import queries  # noqa: E402
from diag_server.store import Store  # noqa: E402


def fill(store: Store, n: int) -> tuple[int, int]:
    spike, nan = int(n * 0.313) + 1, int(n * 0.77) + 1  # off any striding grid

    def write(conn) -> None:  # noqa: ANN001
        conn.execute("INSERT INTO runs(run, created_at, last_seen, last_step, ended) VALUES ('bench', 0, 0, ?, 1)",
                     (n - 1,))
        rows = [("bench", s, "loss", 2.0 * math.exp(-s / n) + 0.01 * math.sin(s), 0.0) for s in range(n)]
        rows[spike] = ("bench", spike, "loss", 500.0, 0.0)
        rows[nan] = ("bench", nan, "loss", None, 0.0)
        conn.executemany("INSERT INTO scalars(run, step, name, value, time) VALUES (?,?,?,?,?)", rows)

    store.write(write)
    return spike, nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=200_000)
    ap.add_argument("--max-points", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        spike, nan = fill(store, args.points)
        small_t, full_t, small_b, full_b = [], [], 0, 0
        for _ in range(args.repeats):  # alternate, so load on a shared machine hits both alike
            t = time.perf_counter()
            small = queries.series(store, "bench", "loss", max_points=args.max_points).model_dump_json()
            small_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            full = queries.series(store, "bench", "loss", max_points=args.points).model_dump_json()
            full_t.append(time.perf_counter() - t)
            small_b, full_b = len(small), len(full)
        kept = queries.series(store, "bench", "loss", max_points=args.max_points).points
        store.close()
    stride = -(-args.points // args.max_points)
    by_stride = set(range(0, args.points, stride))
    ms, mf = statistics.median(small_t), statistics.median(full_t)
    print(f"loss series of {args.points} points, answered with at most {args.max_points} (min/max per bucket)")
    print(f"  time  : {ms * 1e3:8.1f} ms   vs whole series {mf * 1e3:8.1f} ms   ratio {ms / mf:.2f}")
    print(f"  bytes : {small_b:8d}      vs whole series {full_b:8d}      ratio {small_b / full_b:.4f}")
    print(f"  spike at step {spike}: kept={any(p.step == spike for p in kept)} (striding: {spike in by_stride}); "
          f"NaN at step {nan}: kept={any(p.step == nan and p.value is None for p in kept)} "
          f"(striding: {nan in by_stride})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
