"""Time from a faulty step to the anomaly being visible through MCP.

    python benchmarks/latency.py [--interval 50] [--repeats 3]

A real `traindx serve`, the seeded learning-rate-spike job (agent_examples.jobs), and an MCP client
(Streamable HTTP) polling get_anomalies every 20 ms. Reports, per repeat, the seconds and steps from
the end of the faulty step to the first get_anomalies answer that lists the anomaly, against the
baseline of one sampling interval (the earliest a sampled statistic can show the fault).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_examples.jobs import lr_spike_job  # noqa: E402
from agent_examples.scripted_agent import ToolFailed, call, connect  # noqa: E402
from diag_server.testing import serve  # noqa: E402

FAULT = 300


async def watch(url: str, run: str, stop: threading.Event) -> float | None:
    async with connect(f"{url}/mcp") as client:
        while not stop.is_set():
            try:
                page = await call(client, "get_anomalies", run=run, status="open")
                if any(a["severity"] != "info" for a in page["anomalies"]):
                    return time.time()
            except ToolFailed:
                pass
            await asyncio.sleep(0.02)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pace", type=float, default=0.002, help="seconds of simulated compute per step")
    args = ap.parse_args()
    data = tempfile.mkdtemp(prefix="traindx-latency-")
    os.environ["TRAINDX_SPOOL"] = os.path.join(data, "spool")
    server = serve(os.path.join(data, "data"))
    url = server.url
    rows = []
    try:
        for r in range(args.repeats):
            run = f"latency-{r}"
            stop = threading.Event()
            box: dict = {}
            job = threading.Thread(target=lambda box=box, run=run, stop=stop: box.update(res=lr_spike_job(
                run=run, steps=FAULT + 6 * args.interval + 100, fault_step=FAULT, pace=args.pace,
                interval=args.interval, probe_kwargs={"server": url}, stop=stop)))
            job.start()
            seen = asyncio.run(watch(url, run, stop))
            stop.set()
            job.join()
            res = box["res"]
            fault_t = res.times[FAULT]
            seen_step = next((i for i, t in enumerate(res.times) if t >= seen), len(res.times)) if seen else None
            rows.append((seen - fault_t, seen_step - FAULT))
            print(f"  repeat {r}: visible through MCP {seen - fault_t:.3f} s and {seen_step - FAULT} steps "
                  f"after the faulty step")
    finally:
        server.stop()
    secs = statistics.median(s for s, _ in rows)
    steps = statistics.median(n for _, n in rows)
    print(f"time from faulty step to anomaly via MCP, interval {args.interval}: median {secs:.3f} s, "
          f"{steps:.0f} steps; baseline one sampling interval = {args.interval} steps; "
          f"ratio {steps / args.interval:.2f} intervals")


if __name__ == "__main__":
    main()
