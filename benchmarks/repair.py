"""Live repair: for each live-fixable fault, the run without intervention vs the run an agent fixes.

For every fault of ``agent_examples.jobs.REPAIR_FAULTS`` (exploding gradients, NaN from a bad batch,
learning rate too high, too low, dead ReLU units, oscillating loss, a frozen layer), with one seed:

- the healthy run (the same job without the fault), probe attached, no agent;
- the faulty run without intervention, probe attached, no agent;
- the faulty run where the scripted agent (agent_examples.scripted_agent, in its own process, over the
  official MCP client against a real ``traindx serve``) applies the top proposed fix as soon as the
  anomaly appears.

Prints per fault the final loss (MSE on a fixed clean evaluation set) of each run, whether the fixed run
recovered (final loss within 10% of the healthy run's), the steps from the anomaly's first step to the
step the job applied the fix, and the fixed run's wall time over the healthy run's. The three runs of a
fault are measured side by side, alternating with the other faults' runs; ``--repeats`` takes medians.

    PYTHONPATH=. python benchmarks/repair.py            # all faults, 800 steps each
    PYTHONPATH=. python benchmarks/repair.py --quick    # 400 steps
    PYTHONPATH=. python benchmarks/repair.py --faults nan_batch,dead_relu

Targets (issue 5): >= 90% of the faults recovered, with total time <= 1.2x the healthy run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from agent_examples.jobs import REPAIR_FAULTS, JobResult, fault_job  # noqa: E402
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


def _fixed_run(url: str, spool: str, fault: str, run: str, poll: float, **kw) -> tuple[JobResult, dict, dict | None, str]:
    """The faulty job with the scripted agent in its own process, as an AI assistant would be: it shares
    the CPU with the job, not the job's interpreter."""
    agent = subprocess.Popen([sys.executable, "-m", "agent_examples.scripted_agent", "--server", f"{url}/mcp",
                              "--run", run, "--timeout", "120", "--poll", str(poll)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    # An agent already watching, as in use: the job starts once the agent's MCP session is up.
    ready = agent.stdout.readline().decode()
    if "watching" not in ready:
        raise RuntimeError(f"the agent did not start: {ready}{agent.communicate()[0].decode()[-2000:]}")
    result = _job(url, spool, fault, run, **kw)
    try:
        log = agent.communicate(timeout=5)[0].decode()
    except subprocess.TimeoutExpired:  # still waiting for a verdict: the job has ended, so there is none
        agent.terminate()
        log = agent.communicate()[0].decode()
    fixes = httpx.get(f"{url}/v1/runs/{run}/fixes", headers=_auth()).json()["fixes"]
    applied = sorted((f for f in fixes if f["applied_step"] is not None), key=lambda f: f["applied_step"])
    fix = dict(applied[0]) if applied else {}
    if len(applied) > 1:  # a guard and the rollback after it, or the next proposal after an ineffective one
        fix["also"] = [f"{f['action']} {f['params']} ({f['status']})" for f in applied[1:]]
    anomaly = _anomaly(url, run, fix["anomaly_id"]) if fix.get("anomaly_id") else None
    return result, fix, anomaly, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(REPAIR_FAULTS), help="comma-separated names")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--pace", type=float, default=0.004, help="seconds of sleep per step (stands in for compute)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="400 steps")
    p.add_argument("--verbose", action="store_true", help="print the agent's log")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between two looks of the agent at the run")
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
                fixed, fix, anomaly, log = _fixed_run(url, spool, fault, f"{tag}-fixed", args.poll, **kw)
                for r in (healthy, unfixed, fixed):
                    if r.error is not None:
                        raise r.error
                row.healthy.append(healthy.final_loss)
                row.unfixed.append(unfixed.final_loss)
                row.fixed.append(fixed.final_loss)
                row.time_ratio.append(fixed.wall / healthy.wall)
                row.actions.append(f"{fix.get('action', '-')} {fix.get('params', '')}".strip()
                                   + "".join(f" + {a}" for a in fix.get("also", [])))
                row.verdicts.append(fix.get("status", "-"))
                if anomaly is not None:
                    row.anomalies.append(anomaly["kind"])
                    row.steps_to_fix.append(fix["applied_step"] - anomaly["first_step"])
                if args.verbose:
                    print(f"--- {tag}\n{log}")
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


def _auth() -> dict[str, str]:
    """The server needs its token on every route (docs/security.md); start_server put it in TRAINDX_TOKEN."""
    return {"authorization": f"Bearer {os.environ['TRAINDX_TOKEN']}"}


def _anomaly(url: str, run: str, anomaly_id: str) -> dict | None:
    page = httpx.get(f"{url}/v1/runs/{run}/anomalies", params={"limit": 200}, headers=_auth()).json()
    return next((a for a in page.get("anomalies", []) if a["id"] == anomaly_id), None)


if __name__ == "__main__":
    main()
