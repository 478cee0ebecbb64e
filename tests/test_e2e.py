"""End to end: a real server process, a real training loop with a fault, the mcp SDK's client.

The job's learning rate is raised 10x at step 300; the agent must see the anomaly through MCP, get a
fix proposed, apply it, and the job must apply it and acknowledge with before/after values.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from agent_examples.jobs import lr_spike_job
from agent_examples.scripted_agent import call, connect, triage


def _start_job(server, run: str, **kw) -> tuple[threading.Thread, dict]:
    box: dict = {}
    kw.setdefault("steps", 1000)
    kw.setdefault("fault_step", 300)
    kw.setdefault("pace", 0.003)
    job = threading.Thread(target=lambda: box.update(result=lr_spike_job(
        run=run, probe_kwargs={"server": server.url, "spool_dir": server.data_dir / "spool"}, **kw)))
    job.start()
    return job, box


async def _four_tools(client, run: str) -> dict:
    out = await triage(client, run, timeout=60, verdict_timeout=60, say=lambda m: None)
    page = await call(client, "get_anomalies", run=run, kind="loss_divergence")
    recipe = await call(client, "compression_recipe", run=run, target_sparsity=0.5)
    return {"outcome": out, "page": page, "recipe": recipe}


def test_mcp_over_streamable_http_finds_and_fixes_the_fault(server):
    job, box = _start_job(server, "e2e-http")
    async def go():
        async with connect(f"{server.url}/mcp", name="e2e-test-agent") as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert {"get_anomalies", "propose_fix", "apply_fix", "compression_recipe"} <= set(tools)
            assert tools["get_anomalies"].output_schema and tools["apply_fix"].input_schema
            return await _four_tools(client, "e2e-http")
    res = asyncio.run(go())
    job.join(120)
    out = res["outcome"]
    assert out.fix is not None, out.log
    # The top proposal undoes the damage and the cause: back to a snapshot from before the rise, at the rate
    # the run was healthy at.
    assert out.fix["action"] == "rollback" and out.fix["params"] == {"before_step": 291, "lr": 0.01}
    assert out.fix["before"]["lr"] == [0.1] and out.fix["after"]["lr"] == [0.01]
    assert out.fix["after"]["restored_step"] < 300 <= out.fix["applied_step"]
    assert out.verdict == "effective" and "back near its level before the fault" in out.fix["reason"]
    assert res["page"]["total"] >= 1 and all(a["kind"] == "loss_divergence" for a in res["page"]["anomalies"])
    assert 0.45 < res["recipe"]["achieved_sparsity"] < 0.55
    # The job recovered: its final loss is back near where it was before the fault.
    result = box["result"]
    assert result.error is None
    assert result.median(950, 1000) < 2 * result.median(250, 300)
    # The audit trail names who asked and what the job did.
    trail = httpx.get(f"{server.url}/v1/runs/e2e-http/audit", headers=server.headers).json()["entries"]
    actions = [(e["actor"], e["action"]) for e in trail]
    assert ("mcp:e2e-test-agent", "apply_requested") in actions and ("job", "applied") in actions


def test_mcp_over_stdio_reads_the_same_store(server):
    job, box = _start_job(server, "e2e-stdio")
    async def go():
        async with connect(stdio_data=str(server.data_dir), name="stdio-agent") as client:
            return await _four_tools(client, "e2e-stdio")
    res = asyncio.run(go())
    job.join(120)
    out = res["outcome"]
    assert out.fix is not None and out.fix["status"] in ("applied", "effective"), out.log
    assert out.fix["after"]["lr"] == [0.01]


def test_a_read_only_job_rejects_fixes(server):
    job, box = _start_job(server, "e2e-readonly", allow=(), steps=700)
    async def go():
        async with connect(f"{server.url}/mcp") as client:
            return await triage(client, "e2e-readonly", timeout=60, verdict_timeout=30, say=lambda m: None)
    out = asyncio.run(go())
    job.join(120)
    fixes = httpx.get(f"{server.url}/v1/runs/e2e-readonly/fixes", headers=server.headers).json()["fixes"]
    tried = [f for f in fixes if f["status"] == "rejected"]
    assert tried and "does not allow" in tried[0]["reason"]
    assert out.fix is None
    # Nothing changed in the job: the learning rate stayed where the fault put it.
    assert box["result"].lrs[-1] == pytest.approx(0.1)


def test_an_agent_that_finds_no_anomaly_still_reports_what_the_run_said(session_server):
    """No anomaly is not yet a healthy run: a probe that degraded, or a job that was killed, says so in the
    run's messages, and the scripted agent reports them instead of calling the run healthy."""
    import uuid

    run = "e2e-quiet-but-degraded"
    events = [{"kind": "run_start", "step": 0, "time": 1.0},
              {"kind": "scalars", "step": 1, "time": 1.0, "values": {"loss": 0.5}},
              {"kind": "message", "step": 7, "time": 2.0, "level": "error",
               "text": "probe error in activations hook: RuntimeError: boom"},
              {"kind": "message", "step": 8, "time": 2.0, "level": "info", "text": "an ordinary note"}]
    with session_server.client() as c:
        c.post("/v1/ingest", json={"batch_id": uuid.uuid4().hex, "run": run, "seq": 0, "events": events}
               ).raise_for_status()

    async def go():
        async with connect(f"{session_server.url}/mcp") as client:
            return await triage(client, run, timeout=1, say=lambda m: None)

    out = asyncio.run(go())
    assert out.anomaly is None
    assert out.log == ["no anomaly of warning or critical severity in 1s, but the run's messages say: "
                       "step 7: probe error in activations hook: RuntimeError: boom"]
