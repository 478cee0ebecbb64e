"""Live repair: for each live-fixable fault, the run without intervention vs the run an agent fixes.

For every fault of ``agent_examples.jobs.REPAIR_FAULTS`` (exploding gradients, NaN from a bad batch,
learning rate too high, too low, dead ReLU units, oscillating loss, a frozen layer), with one seed:

- the healthy run (the same job without the fault), probe attached, no agent;
- the faulty run without intervention, probe attached, no agent;
- the faulty run where the scripted agent (agent_examples.scripted_agent.triage, over the official MCP
  client against a real ``traindx serve``) applies the top proposed fix as soon as the anomaly appears.

Prints per fault the final loss (MSE on a fixed clean evaluation set) of each run, whether the fixed run
recovered (final loss within 10% of the healthy run's), the steps from the anomaly's first step to the
step the job applied the fix, and the fixed run's wall time over the healthy run's. The three runs of a
fault are measured side by side, alternating with the other faults' runs; ``--repeats`` takes medians.

    PYTHONPATH=. python benchmarks/repair.py            # all faults, 600 steps each
    PYTHONPATH=. python benchmarks/repair.py --quick    # 400 steps
    PYTHONPATH=. python benchmarks/repair.py --faults nan_batch,dead_relu

Targets (issue 5): >= 90% of the faults recovered, with total time <= 1.2x the healthy run.
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
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import torch  # noqa: E402

from agent_examples.jobs import REPAIR_FAULTS, JobResult, fault_job  # noqa: E402
from agent_examples.scripted_agent import Outcome, connect, triage  # noqa: E402
from diag_server.demo import _free_port, start_server  # noqa: E402

RECOVERED_WITHIN = 0.10  # the figure: final loss within 10% of the healthy run


@dataclass
class Row:
    fault: str
    healthy: list[float] = field(default_factory=list)
    unfixed: list[float] = field(default_factory=list)
    fixed: list[float] = field(default_factory=list)
    time_ratio: list[float] = field(default_factory=list)
    steps_to_fix: list[int] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)

    def recovered(self) -> bool:
        return bool(self.fixed) and _med(self.fixed) <= (1 + RECOVERED_WITHIN) * _med(self.healthy)


def _med(xs: list[float]) -> float:
    xs = [x if x == x else float("inf") for x in xs]
    return statistics.median(xs) if xs else float("nan")


def _job(url: str, spool: str, fault: str, run: str, *, healthy: bool = False, **kw) -> JobResult:
    return fault_job(fault, run=run, healthy=healthy, probe_kwargs={"server": url, "spool_dir": spool}, **kw)


def _fixed_run(url: str, spool: str, fault: str, run: str, **kw) -> tuple[JobResult, Outcome]:
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=_job(url, spool, fault, run, **kw)))
    job.start()

    async def agent() -> Outcome:
        async with connect(f"{url}/mcp", name="repair-benchmark-agent") as client:
            task = asyncio.create_task(triage(client, run, timeout=120, poll=0.1, verdict_timeout=120,
                                              say=lambda m: None))
            # Stop waiting once the job has ended: a verdict can only come while it runs.
            while not task.done() and job.is_alive():
                await asyncio.sleep(0.1)
            try:
                return await asyncio.wait_for(task, 3.0)
            except asyncio.TimeoutError:
                return Outcome(run=run, log=["the job ended first"])

    outcome = asyncio.run(agent())
    job.join()
    return box["result"], outcome


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(REPAIR_FAULTS), help="comma-separated names")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--pace", type=float, default=0.004, help="seconds of sleep per step (stands in for compute)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="400 steps")
    p.add_argument("--verbose", action="store_true", help="print the agent's log")
    args = p.parse_args()
    steps = 400 if args.quick else args.steps
    faults = [f for f in args.faults.split(",") if f]
    unknown = set(faults) - set(REPAIR_FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {sorted(REPAIR_FAULTS)}")
    torch.set_num_threads(1)  # the jobs share the CPU with the server and the agent

    data = tempfile.mkdtemp(prefix="traindx-repair-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(data, port)
    spool = os.path.join(data, "spool")
    rows = {f: Row(f) for f in faults}
    kw = {"steps": steps, "pace": args.pace, "seed": args.seed}
    try:
        for rep in range(args.repeats):
            for fault in faults:
                row = rows[fault]
                tag = f"{fault}-s{args.seed}-r{rep}"
                healthy = _job(url, spool, fault, f"{tag}-healthy", healthy=True, **kw)
                unfixed = _job(url, spool, fault, f"{tag}-unfixed", allow=(), **kw)
                fixed, outcome = _fixed_run(url, spool, fault, f"{tag}-fixed", **kw)
                for r in (healthy, unfixed, fixed):
                    if r.error is not None:
                        raise r.error
                row.healthy.append(healthy.final_loss)
                row.unfixed.append(unfixed.final_loss)
                row.fixed.append(fixed.final_loss)
                row.time_ratio.append(fixed.wall / healthy.wall)
                fix = outcome.fix or {}
                row.actions.append(f"{fix.get('action', '-')} {fix.get('params', '')}".strip())
                row.verdicts.append(outcome.verdict or "-")
                if outcome.anomaly:
                    row.anomalies.append(outcome.anomaly["kind"])
                if fix.get("applied_step") is not None and fix.get("anomaly_id"):
                    a = _anomaly(url, f"{tag}-fixed", fix["anomaly_id"])
                    if a is not None:
                        row.steps_to_fix.append(fix["applied_step"] - a["first_step"])
                if args.verbose:
                    print(f"--- {tag}", *outcome.log, sep="\n  ")
                print(f"[{tag}] healthy {healthy.final_loss:.4g}  unfixed {unfixed.final_loss:.4g}  "
                      f"fixed {fixed.final_loss:.4g}  ({row.actions[-1]}; {row.verdicts[-1]})", flush=True)
    finally:
        server.terminate()
        server.wait(10)

    print(f"\nrepair benchmark: {len(faults)} faults, {steps} steps, pace {args.pace}s, seed {args.seed}, "
          f"{args.repeats} repeat(s), medians")
    head = (f"{'fault':22s} {'anomaly':22s} {'healthy':>8s} {'no fix':>9s} {'fixed':>8s} {'recovered':>9s} "
            f"{'steps->fix':>10s} {'time/healthy':>12s}  fix (verdict)")
    print(head)
    print("-" * len(head))
    for row in rows.values():
        steps_to_fix = f"{statistics.median(row.steps_to_fix):.0f}" if row.steps_to_fix else "-"
        print(f"{row.fault:22s} {(row.anomalies or ['-'])[0]:22s} {_med(row.healthy):8.4f} {_med(row.unfixed):9.4g} "
              f"{_med(row.fixed):8.4f} {'yes' if row.recovered() else 'no':>9s} {steps_to_fix:>10s} "
              f"{_med(row.time_ratio):11.2f}x  {row.actions[0]} ({row.verdicts[0]})")
    recovered = [r for r in rows.values() if r.recovered()]
    fast = [r for r in recovered if _med(r.time_ratio) <= 1.2]
    print(f"\nrecovered: {len(recovered)}/{len(rows)} ({len(recovered) / len(rows):.0%}); recovered within 1.2x the "
          f"healthy run's time: {len(fast)}/{len(rows)} ({len(fast) / len(rows):.0%}); median time ratio "
          f"{statistics.median(_med(r.time_ratio) for r in rows.values()):.2f}x (target: >= 90% within 1.2x)")


def _anomaly(url: str, run: str, anomaly_id: str) -> dict | None:
    page = httpx.get(f"{url}/v1/runs/{run}/anomalies", params={"limit": 200}).json()
    return next((a for a in page.get("anomalies", []) if a["id"] == anomaly_id), None)


if __name__ == "__main__":
    main()
