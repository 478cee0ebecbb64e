"""End to end: a NaN from one bad batch, repaired live by rollback, through a real server and MCP client.

The job (agent_examples.jobs.fault_job "nan_batch") keeps a snapshot every 25 steps; at step 200 one input
value is NaN and the weights go NaN. The scripted agent sees the anomaly, the top proposal is a rollback to
before step 200, the job restores its snapshot, and the run ends as good as the healthy run with the same seed.
"""

from __future__ import annotations

import asyncio
import math
import threading

import httpx

from agent_examples.jobs import fault_job
from agent_examples.scripted_agent import connect, triage


def test_a_nan_batch_is_rolled_back_live_and_the_run_recovers(server):
    run = "repair-nan"
    box: dict = {}
    job = threading.Thread(target=lambda: box.update(result=fault_job(
        "nan_batch", run=run, steps=500, pace=0.003,
        probe_kwargs={"server": server.url, "spool_dir": server.data_dir / "spool"})))
    job.start()

    async def go():
        async with connect(f"{server.url}/mcp", name="repair-agent") as client:
            return await triage(client, run, timeout=120, verdict_timeout=120, say=lambda m: None)

    out = asyncio.run(go())
    job.join(300)
    result = box["result"]
    assert result.error is None
    assert out.anomaly["kind"] == "nonfinite"
    fix = out.fix
    assert fix is not None, out.log
    assert fix["action"] == "rollback" and fix["params"] == {"before_step": 200}
    assert fix["after"]["restored_step"] == 175  # the newest snapshot from before the bad batch
    assert fix["status"] == "effective"
    # NaN until the rollback, finite after it, and as good as the healthy run at the end.
    assert math.isnan(result.losses[201])
    assert all(math.isfinite(x) for x in result.losses[fix["applied_step"] + 1:])
    healthy = fault_job("nan_batch", run="healthy", steps=500, pace=0, healthy=True, attach=False)
    assert result.final_loss <= 1.1 * healthy.final_loss
    # Who asked, what the job did, what the server judged: all in the audit trail.
    trail = [(e["actor"], e["action"], e["fix_id"]) for e in httpx.get(f"{server.url}/v1/runs/{run}/audit", headers=server.headers).json()["entries"]]
    assert ("mcp:repair-agent", "proposed", fix["id"]) in trail
    assert ("mcp:repair-agent", "apply_requested", fix["id"]) in trail
    assert ("job", "applied", fix["id"]) in trail and ("server", "verdict", fix["id"]) in trail
    # A rollback cannot be undone: the server says so instead of sending a command that would fail.
    r = httpx.post(f"{server.url}/v1/runs/{run}/fixes/{fix['id']}/revert", headers=server.headers)
    assert r.status_code == 409 and r.json()["error"] == "irreversible"
