"""Record the agent sessions that tests replay: `python -m agent_examples.record [NAME ...]`.

Each scenario starts a fresh `traindx serve`, runs a seeded fault job against it, and lets the
scripted agent work over Streamable HTTP through a Recorder. Files land in agent_examples/sessions/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable

from agent_examples.scripted_agent import call, connect, triage
from agent_examples.sessions import Recorder, start_job

HERE = Path(__file__).resolve().parent / "sessions"


async def _healthy(client: Any, run: str, job: Any) -> None:
    await asyncio.to_thread(job.join)  # a healthy run: look once it is over, so the recording is not a race
    await triage(client, run, timeout=2, say=print)
    await call(client, "list_runs")
    await call(client, "get_run", run=run)
    await call(client, "diagnose", run=run)


async def _triage(client: Any, run: str, job: Any) -> None:
    await triage(client, run, timeout=60, verdict_timeout=90, say=print)
    # Once the run is over, the anomaly the agent fixed has its final status (while the run goes on, when
    # it clears depends on timing); which other kinds show up around it depends on timing too.
    await asyncio.to_thread(job.join)
    await call(client, "get_anomalies", run=run, kind="loss_divergence")
    await call(client, "compression_recipe", run=run, target_sparsity=0.5)


async def _triage_nan(client: Any, run: str, job: Any) -> None:
    await triage(client, run, timeout=60, verdict_timeout=90, say=print)
    await asyncio.to_thread(job.join)  # the final status, as above
    await call(client, "get_anomalies", run=run, kind="nonfinite")


async def _triage_embeddings(client: Any, run: str, job: Any) -> None:
    """A recommender with zombie item rows: the agent damps them; the verdict is on the loss (the data that
    makes them zombies is unchanged, so their anomaly holds). Then it reads the table the anomaly names."""
    outcome = await triage(client, run, timeout=60, verdict_timeout=90, say=print)
    await asyncio.to_thread(job.join)
    table = next(iter((outcome.anomaly or {}).get("tensors") or []), "item.weight")
    await call(client, "get_embeddings", run=run, table=table, rows=5)


async def _errors(client: Any, run: str, job: Any) -> None:
    """What an agent sees when it gets things wrong: an unknown run, an unknown fix, a bad argument."""
    await asyncio.to_thread(job.join)
    for tool, args in (("get_anomalies", {"run": "no-such-run"}), ("get_fix_status", {"run": run, "fix_id": "f-999"}),
                       ("get_anomalies", {"run": run, "limit": 0})):
        await client.call_tool(tool, args)


SCENARIOS: dict[str, tuple[dict, Callable[[Any, str, Any], Awaitable[None]]]] = {
    "healthy": ({"name": "lr_spike_job", "run": "session-healthy",
                 "kwargs": {"steps": 600, "fault_step": None, "pace": 0.004}}, _healthy),
    "exploding_fixed": ({"name": "lr_spike_job", "run": "session-lr-spike",
                         "kwargs": {"steps": 1600, "fault_step": 300, "pace": 0.004}}, _triage),
    "nan_rolled_back": ({"name": "fault_job", "run": "session-nan-batch",
                         "kwargs": {"fault": "nan_batch", "steps": 600, "pace": 0.004}}, _triage_nan),
    # A job that keeps no snapshots cannot roll back: the NaN batch has already poisoned the weights, so
    # skipping non-finite steps and cutting the rate both leave the anomaly in place (ineffective), and
    # the agent reverts each before trying the next; what is left (a clip, a rollback) the job refuses.
    "ineffective_reverted": ({"name": "fault_job", "run": "session-ineffective",
                              "kwargs": {"fault": "nan_batch", "steps": 1600, "pace": 0.004,
                                         "allow": ["skip_nonfinite", "lr_scale"]}}, _triage_nan),
    # Zombie item rows in a recommender (a broken join alternates the labels of 8 popular items): the agent
    # applies the proposed embedding_grad_scale, which the server judges on the loss, and looks at the table.
    "zombie_embeddings_damped": ({"name": "recommender_job", "run": "session-zombie-rows",
                                  "kwargs": {"steps": 900, "toggling": 8, "pace": 0.004}}, _triage_embeddings),
    "agent_errors": ({"name": "lr_spike_job", "run": "session-errors",
                      "kwargs": {"steps": 300, "fault_step": None, "pace": 0.004}}, _errors),
}


def record(name: str, out_dir: Path = HERE) -> Path:
    from diag_server.testing import serve

    spec, scenario = SCENARIOS[name]
    data = tempfile.mkdtemp(prefix=f"traindx-record-{name}-")
    os.environ["TRAINDX_SPOOL"] = os.path.join(data, "spool")
    server = serve(data)
    url = server.url
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.jsonl"
    try:
        job = start_job(spec, url)

        async def go() -> None:
            async with connect(f"{url}/mcp", name="traindx-recorder") as client:
                async with Recorder(client, path, job=spec) as rec:
                    await scenario(rec, spec["run"], job)

        asyncio.run(go())
        job.join()
    finally:
        server.stop()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", default=list(SCENARIOS), help=f"scenarios: {', '.join(SCENARIOS)}")
    for name in ap.parse_args().names:
        print(f"recorded {record(name)}")


if __name__ == "__main__":
    main()
