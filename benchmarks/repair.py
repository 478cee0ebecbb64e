"""Live repair through the MCP loop: does the first proposal fix the run, and is every verdict true?

For every live-fixable fault (``agent_examples.jobs.REPAIR_FAULTS``: exploding gradients from corrupt
labels, NaN from a bad batch, a learning rate raised 10x, one too low, dead ReLU units, an oscillating loss,
a frozen layer; and issue 37's transformer whose Adam rate is raised 100x), over several seeds:

- the same job without the fault (the reference), and the faulty job without a fix, neither watched;
- the faulty job watched by an agent in its own process, over the official MCP client against a real
  ``traindx serve``. The agent takes the diagnosis's first cause, asks for proposals, applies proposal 1,
  waits for the server's verdict, and moves to the next proposal only when the verdict is ineffective
  (reverting first only when the server says the fix made things worse), at most ``--tries`` times.

A run is recovered when its final loss (evaluation loss on a fixed clean set, median over its last 100
steps) is within 1.25x of the same job's without the fault. The benchmark prints every verdict beside
whether the run recovered: an "effective" verdict on a run that did not recover is a false claim.

    PYTHONPATH=. python benchmarks/repair.py                          # 8 faults x 3 seeds
    PYTHONPATH=. python benchmarks/repair.py --faults nan_batch,transformer_lr_spike --seeds 1

Targets (issue 37): >= 95% of the faults recovered within 3 tries, and no "effective" verdict on a run that
did not recover.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECOVERED_WITHIN = 1.25  # the figure: final loss within 1.25x of the same job without the fault
TRANSFORMER = "transformer_lr_spike"
FINAL = {"effective", "ineffective", "rejected", "failed", "expired", "reverted"}


def faults() -> list[str]:
    from agent_examples.jobs import REPAIR_FAULTS

    return [*REPAIR_FAULTS, TRANSFORMER]


def run_job(fault: str, *, run: str, seed: int, steps: int | None, healthy: bool = False, attach: bool = True,
            pace: float = 0.0, probe_kwargs: dict | None = None) -> Any:
    """One of the suite's jobs: the MLP of fault_job with a fault of REPAIR_FAULTS, or issue 37's transformer."""
    from agent_examples.jobs import fault_job, transformer_job

    if fault == TRANSFORMER:
        return transformer_job(run=run, seed=seed, steps=steps or 1500, healthy=healthy, attach=attach, pace=pace,
                               probe_kwargs=probe_kwargs)
    return fault_job(fault, run=run, seed=seed, steps=steps or 1200, healthy=healthy, attach=attach, pace=pace,
                     probe_kwargs=probe_kwargs)


# -- the agent: its own process, the official MCP client -------------------------------------------------------
async def agent(server: str, run: str, tries: int, timeout: float, poll: float) -> dict:
    from agent_examples.scripted_agent import ToolFailed, call, connect

    out: dict[str, Any] = {"anomaly": None, "tries": [], "log": []}

    async def run_over() -> bool:
        # Ended, or silent for 30 s (its last batch may have gone to the spool when the server was busy).
        return (await call(client, "get_run", run=run))["run"]["status"] in ("ended", "stale")

    async with connect(server, name="repair-benchmark") as client:
        print("watching", flush=True)
        deadline = time.monotonic() + timeout
        target = None
        while target is None and time.monotonic() < deadline:
            try:
                page = await call(client, "get_anomalies", run=run, status="open", limit=50)
            except ToolFailed:
                page = {"anomalies": []}  # the job has not sent its first batch yet
            if any(a["severity"] in ("warning", "critical") for a in page["anomalies"]):
                causes = (await call(client, "diagnose", run=run))["causes"]
                target = next((c["anomaly_id"] for c in causes), None) or page["anomalies"][0]["id"]
            elif await run_over_safe(run_over):
                break
            else:
                await asyncio.sleep(poll)
        if target is None:
            out["log"].append("no anomaly")
            return out
        anomalies = {a["id"]: a for a in (await call(client, "get_anomalies", run=run, limit=200))["anomalies"]}
        out["anomaly"] = {k: anomalies.get(target, {}).get(k) for k in ("id", "kind", "first_step")}
        proposals = (await call(client, "propose_fix", run=run, anomaly_id=target))["fixes"]
        out["proposals"] = [f"{f['action']} {f['params']}" + ("" if f["live"] else " (advice)") for f in proposals]
        for fix in [f for f in proposals if f["live"]]:
            if len([t for t in out["tries"] if t["applied_step"] is not None]) >= tries:
                break
            try:
                await call(client, "apply_fix", run=run, fix_id=fix["id"])
            except ToolFailed as e:  # the job has ended: nothing more can be applied
                out["log"].append(f"apply {fix['id']} refused: {e}")
                break
            status = await wait(client, run, fix["id"], {"applied", *FINAL}, run_over, poll)
            record = {"id": fix["id"], "action": fix["action"], "params": fix["params"], "status": status["status"],
                      "applied_step": status.get("applied_step"), "reason": status.get("reason")}
            out["tries"].append(record)
            if status["status"] in ("rejected", "failed", "expired", "pending"):
                continue  # not applied: the next proposal, and no try spent
            status = await wait(client, run, fix["id"], FINAL, run_over, poll)
            record.update(status=status["status"], reason=status.get("reason"))
            if status["status"] != "ineffective":
                break  # effective, or no verdict before the job ended
            if "revert it" in (status.get("reason") or "") and fix["action"] != "rollback":
                await call(client, "revert_fix", run=run, fix_id=fix["id"])
                record["reverted"] = True
    return out


async def run_over_safe(check: Any) -> bool:
    try:
        return await check()
    except Exception:  # noqa: BLE001 - the run may not exist yet
        return False


async def wait(client: Any, run: str, fix_id: str, until: set[str], run_over: Any, poll: float) -> dict:
    """The fix's status once it is one of ``until``, or as it stands once the job has ended."""
    from agent_examples.scripted_agent import call

    while True:
        status = await call(client, "get_fix_status", run=run, fix_id=fix_id)
        if status["status"] in until:
            return status
        if await run_over():
            await asyncio.sleep(1.0)  # the job's last batch may still be on its way
            return await call(client, "get_fix_status", run=run, fix_id=fix_id)
        await asyncio.sleep(poll)


# -- the benchmark ------------------------------------------------------------------------------------------------
@dataclass
class Result:
    fault: str
    seed: int
    healthy: float
    unfixed: float
    fixed: float
    anomaly: dict | None
    tries: list[dict] = field(default_factory=list)
    proposals: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    @property
    def recovered(self) -> bool:
        return self.fixed == self.fixed and self.fixed <= RECOVERED_WITHIN * self.healthy

    @property
    def applied(self) -> list[dict]:
        return [t for t in self.tries if t["applied_step"] is not None]


def _auth() -> dict[str, str]:
    return {"authorization": f"Bearer {os.environ['TRAINDX_TOKEN']}"}


def fixed_run(url: str, spool: str, fault: str, run: str, seed: int, steps: int | None, pace: float, tries: int,
              poll: float) -> tuple[Any, dict]:
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--agent", "--server", f"{url}/mcp",
                             "--run", run, "--tries", str(tries), "--poll", str(poll)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            cwd=ROOT)
    ready = proc.stdout.readline().decode()
    if "watching" not in ready:
        raise RuntimeError(f"the agent did not start: {ready}{proc.communicate()[1].decode()[-2000:]}")
    result = run_job(fault, run=run, seed=seed, steps=steps, pace=pace,
                     probe_kwargs={"server": url, "spool_dir": spool})
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = stdout.decode().strip().splitlines()
    if proc.returncode != 0 or not lines:
        # Counted as a run the agent did not fix, with what it said: one stuck agent does not end the benchmark.
        return result, {"anomaly": None, "tries": [], "log": [f"the agent failed ({proc.returncode}): "
                                                             f"{stderr.decode()[-500:]}"]}
    return result, json.loads(lines[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="", help="comma-separated names (default: all)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="steps per job (default: 1200, the transformer 1500)")
    p.add_argument("--pace", type=float, default=0.004, help="seconds of sleep per MLP step (stands in for compute)")
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--poll", type=float, default=0.3, help="seconds between two looks of the agent")
    p.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.agent:
        print(json.dumps(asyncio.run(agent(args.server, args.run, args.tries, 300, args.poll))), flush=True)
        return 0

    import torch

    from diag_server.testing import serve

    names = [f for f in args.faults.split(",") if f] or faults()
    unknown = set(names) - set(faults())
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}; known: {faults()}")
    torch.set_num_threads(1)  # the jobs share the CPU with the server and the agent
    data = tempfile.mkdtemp(prefix="traindx-repair-")
    server = serve(data)
    url = server.url
    spool = os.path.join(data, "spool")
    results: list[Result] = []
    t0 = time.time()
    try:
        for seed in range(args.seeds):
            for fault in names:
                tag = f"{fault}-s{seed}"
                pace = 0.0 if fault == TRANSFORMER else args.pace  # the transformer's own step takes ~8 ms
                healthy = run_job(fault, run=f"{tag}-healthy", seed=seed, steps=args.steps, healthy=True, attach=False)
                unfixed = run_job(fault, run=f"{tag}-unfixed", seed=seed, steps=args.steps, attach=False)
                fixed, seen = fixed_run(url, spool, fault, f"{tag}-fixed", seed, args.steps, pace, args.tries,
                                        args.poll)
                for r in (healthy, unfixed, fixed):
                    if r.error is not None:
                        raise r.error
                res = Result(fault, seed, healthy.final_loss, unfixed.final_loss, fixed.final_loss, seen["anomaly"],
                             seen["tries"], seen.get("proposals", []), seen.get("log", []))
                results.append(res)
                _print_run(res)
    finally:
        server.stop()
    _summary(results, args, time.time() - t0)
    return 0


def _print_run(r: Result) -> None:
    a = r.anomaly or {}
    print(f"\n[{r.fault} seed {r.seed}] {a.get('kind', 'no anomaly')} at step {a.get('first_step', '-')}: "
          f"healthy {r.healthy:.4g}, no fix {r.unfixed:.4g}, fixed {r.fixed:.4g} -> "
          f"{'recovered' if r.recovered else 'NOT recovered'} ({r.fixed / r.healthy:.2f}x)", flush=True)
    for line in r.log:
        print(f"   agent: {line}", flush=True)
    for i, t in enumerate(r.tries, 1):
        where = f"at step {t['applied_step']}" if t["applied_step"] is not None else "not applied"
        print(f"   try {i}: {t['action']} {t['params']} {where}: {t['status']}"
              + (" (reverted)" if t.get("reverted") else "") + f" - {(t.get('reason') or '')[:300]}", flush=True)


def _summary(results: list[Result], args: argparse.Namespace, seconds: float) -> None:
    n = len(results)
    recovered = [r for r in results if r.recovered]
    within = [r for r in recovered if len(r.applied) <= args.tries]
    verdicts = [(t, r) for r in results for t in r.applied]
    false_effective = [(t, r) for t, r in verdicts if t["status"] == "effective" and not r.recovered]
    cautious = [(t, r) for t, r in verdicts if t["status"] == "ineffective" and r.recovered and t is r.applied[-1]]
    print(f"\nlive repair over MCP: {len(set(r.fault for r in results))} faults x {args.seeds} seed(s), "
          f"proposal 1 first, the next only after an ineffective verdict, at most {args.tries} tries "
          f"({seconds:.0f} s on a shared CPU)\n")
    print(f"{'fault':22s} {'seed':>4s} {'anomaly':22s} {'healthy':>8s} {'no fix':>8s} {'fixed':>8s} {'ratio':>6s} "
          f"{'recovered':>9s} {'tries':>5s}  verdicts")
    for r in results:
        kinds = ", ".join(f"{t['action']}:{t['status']}" for t in r.applied) or "-"
        print(f"{r.fault:22s} {r.seed:>4d} {(r.anomaly or {}).get('kind') or '-':22s} {r.healthy:8.4f} "
              f"{r.unfixed:8.4g} {r.fixed:8.4f} {r.fixed / r.healthy:5.2f}x {'yes' if r.recovered else 'no':>9s} "
              f"{len(r.applied):>5d}  {kinds}")
    tries = [len(r.applied) for r in within]
    unfixed = sum(r.unfixed == r.unfixed and r.unfixed <= RECOVERED_WITHIN * r.healthy for r in results)
    print(f"\nrecovered within {args.tries} tries   {len(within)}/{n} ({len(within) / n:.0%})   target >= 95%   "
          f"baseline, the same jobs without a fix: {unfixed}/{n} ({unfixed / n:.0%})")
    print(f"'effective' on a run that did not recover   {len(false_effective)}/{len(verdicts)} verdicts   target 0")
    print(f"tries per recovered run   median {statistics.median(tries) if tries else float('nan'):g}, "
          f"max {max(tries, default=0)}; first proposal enough: {sum(t == 1 for t in tries)}/{n}")
    print(f"verdicts: {sum(t['status'] == 'effective' for t, _ in verdicts)} effective, "
          f"{sum(t['status'] == 'ineffective' for t, _ in verdicts)} ineffective, "
          f"{sum(t['status'] not in ('effective', 'ineffective') for t, _ in verdicts)} without a verdict "
          f"(the job ended first); last verdict ineffective on a run that recovered after all: {len(cautious)}")
    for t, r in false_effective:
        print(f"  FALSE: {r.fault} seed {r.seed}: {t['action']} judged effective, final {r.fixed:.4g} against "
              f"healthy {r.healthy:.4g}")


if __name__ == "__main__":
    sys.exit(main())
