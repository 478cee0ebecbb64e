"""The example agent against a real server and a real job that has ended: a clean message and an exit status
that says so, never a traceback; a revert the job can no longer take ends the triage, changing nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from agent_examples.scripted_agent import (EXIT_JOB_ENDED, JobEnded, Outcome, ToolFailed, connect, revert,
                                           revert_suggested)
from tests.conftest import ROOT, ServerProcess


def _ended_run(server: ServerProcess, run: str, *, apply: bool) -> tuple[dict, dict | None]:
    """A real job whose loss goes NaN (and, with ``apply``, a live fix for it applied by the job); then it ends."""
    from scripts.live_run import ALLOW, LiveRun

    job = LiveRun(server.url, run, interval=2, step_sleep=0.002).start()
    try:
        job.wait_steps(60)
        job.inject("nan", steps=100_000)  # until the job ends: its anomaly stays open
        job.wait_steps(40)
        with server.client(timeout=30) as c:
            deadline = time.monotonic() + 60
            anomalies: list = []
            while not anomalies and time.monotonic() < deadline:
                anomalies = c.get(f"/v1/runs/{run}/anomalies", params={"kind": "nonfinite"}).json().get("anomalies", [])
                time.sleep(0.2)
            assert anomalies, "the NaN loss was not flagged"
            if not apply:
                return anomalies[0], None
            proposals = c.post(f"/v1/runs/{run}/anomalies/{anomalies[0]['id']}/propose").json()["fixes"]
            fix = next(f for f in proposals if f["live"] and f["action"] in ALLOW)
            c.post(f"/v1/runs/{run}/fixes/{fix['id']}/apply").raise_for_status()
            status = {}
            while status.get("status") not in ("applied", "effective", "ineffective") and time.monotonic() < deadline:
                status = c.get(f"/v1/runs/{run}/fixes/{fix['id']}").json()
                time.sleep(0.1)
            assert status["status"] in ("applied", "effective", "ineffective"), status
    finally:
        job.stop()
    return anomalies[0], status


def test_the_agent_exits_cleanly_when_the_job_has_ended(server: ServerProcess) -> None:
    """The agent finds the ended run's anomaly, proposes, and cannot apply: it says the job is gone and exits 3."""
    run = "agent-ended"
    _ended_run(server, run, apply=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "agent_examples.scripted_agent", "--server", f"{server.url}/mcp",
                           "--run", run, "--timeout", "30", "--poll", "0.1"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == EXIT_JOB_ENDED, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "the job is gone" in done.stderr and "job_unavailable" in done.stderr
    assert "stopping: what was applied stays as it is" in done.stdout


def test_a_revert_the_ended_job_cannot_take_ends_the_triage_and_changes_nothing(server: ServerProcess) -> None:
    run = "agent-revert-ended"
    _, applied = _ended_run(server, run, apply=True)
    assert applied is not None
    out, said = Outcome(run=run), []

    async def go() -> None:
        async with connect(f"{server.url}/mcp") as client:
            assert await revert_suggested(client, run, applied["id"]) is False  # no verdict says it did harm
            with pytest.raises(JobEnded) as err:
                await revert(client, run, applied["id"], out, said.append, timeout=10, poll=0.1)
            assert isinstance(err.value, ToolFailed) and err.value.code == "job_unavailable"

    asyncio.run(go())
    assert not out.reverted
    fix = httpx.get(f"{server.url}/v1/runs/{run}/fixes/{applied['id']}", headers=server.headers).json()
    assert fix["status"] == applied["status"]  # nothing was queued: the fix stands as the job left it
