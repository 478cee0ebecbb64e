"""Recorded agent sessions replay against a fresh server driven by the same seeded training run."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import pytest

from agent_examples.scripted_agent import connect
from agent_examples.sessions import SessionError, _learn_ids, diff, load, mask, replay, start_job
from tests.conftest import ROOT

SESSIONS = sorted((ROOT / "agent_examples" / "sessions").glob("*.jsonl"))


@pytest.mark.parametrize("path", SESSIONS, ids=lambda p: p.stem)
def test_recorded_session_replays(server, path):
    header, calls = load(path)
    assert header["protocol_version"] and header["server_version"]
    # The same seeded job, stepping slower: its steps and anomalies are the same, and a client on a loaded
    # machine still sees each state the recording saw (an anomaly still open, a fix not yet verified).
    spec = {**header["job"], "kwargs": {**header["job"]["kwargs"], "pace": max(header["job"]["kwargs"].get("pace", 0), 0.012)}}
    job = start_job(spec, server.url, spool_dir=str(server.data_dir / "spool"))

    async def go():
        async with connect(f"{server.url}/mcp", name="replay-test") as client:
            return await replay(client, calls, timeout=45)

    report = asyncio.run(go())
    job.join(120)
    assert report.ok, [(m.seq, m.tool, m.differences[:5]) for m in report.mismatches]


def test_replay_over_stdio_with_the_cli(server):
    path = ROOT / "agent_examples" / "sessions" / "healthy.jsonl"
    header, _ = load(path)
    job = start_job(header["job"], server.url, spool_dir=str(server.data_dir / "spool"))
    job.join(120)
    out = subprocess.run([sys.executable, "-m", "diag_server.cli", "replay", str(path), "--against", "stdio",
                          "--data", str(server.data_dir)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 differ" in out.stdout


def test_a_changed_meaning_is_reported():
    recorded = {"anomalies": [{"id": "a-1", "kind": "loss_divergence", "first_step": 310, "message": "x"}]}
    same = {"anomalies": [{"id": "a-7", "kind": "loss_divergence", "first_step": 344, "message": "y"}]}
    other = {"anomalies": [{"id": "a-1", "kind": "exploding_gradient", "first_step": 310, "message": "x"}]}
    assert diff(mask(recorded), mask(same)) == []
    assert diff(mask(recorded), mask(other)) == [
        "$.anomalies[0] kind='loss_divergence': no replayed item matches; the closest replayed item differs: "
        "[\"$.anomalies[0].kind: 'loss_divergence' != 'exploding_gradient'\"]"]
    assert diff(mask(recorded), mask({"anomalies": []})) == [
        "$.anomalies[0] kind='loss_divergence': no replayed item matches"]


def test_records_match_in_any_order_and_a_live_fault_may_raise_more():
    recorded = {"anomalies": [{"id": "a-1", "kind": "exploding_gradient", "severity": "warning"},
                              {"id": "a-2", "kind": "loss_divergence", "severity": "warning"}]}
    replayed = {"anomalies": [{"id": "a-4", "kind": "loss_divergence", "severity": "critical"},
                              {"id": "a-5", "kind": "dead_relu", "severity": "warning"},
                              {"id": "a-6", "kind": "exploding_gradient", "severity": "warning"}]}
    assert diff(recorded, replayed) == []
    assert _learn_ids(recorded, replayed) == {"a-1": "a-6", "a-2": "a-4"}
    missing = diff(recorded, {"anomalies": replayed["anomalies"][:2]})
    assert missing == ["$.anomalies[0] kind='exploding_gradient': no replayed item matches; the closest replayed "
                       "item differs: [\"$.anomalies[0].kind: 'exploding_gradient' != 'loss_divergence'\"]"]


def test_a_healthy_recording_stays_healthy():
    """A recorded empty list is not a list of records: a false alarm in the replay is a difference."""
    assert diff({"anomalies": []}, {"anomalies": [{"id": "a-1", "kind": "dead_relu"}]}) == [
        "$.anomalies: 0 items recorded, 1 replayed: kind='dead_relu'"]


def test_a_stall_of_the_machine_is_not_a_difference_and_a_problem_of_the_job_still_is():
    """A loaded machine can stall a healthy job long enough to flag a step_time_outlier: that measures the
    machine, so the replay drops it on both sides, and the ids around it still line up."""
    stall = {"id": "a-2", "kind": "step_time_outlier", "severity": "info"}
    recorded = {"anomalies": [{"id": "a-1", "kind": "exploding_gradient"}],
                "anomalies_by_kind": {"exploding_gradient": 1}}
    replayed = {"anomalies": [stall, {"id": "a-5", "kind": "exploding_gradient"}],
                "anomalies_by_kind": {"step_time_outlier": 1, "exploding_gradient": 1}}
    assert diff(recorded, replayed) == []
    assert _learn_ids(recorded, replayed) == {"a-1": "a-5"}
    assert diff({"causes": []}, {"causes": [{"anomaly_id": "a-2", "kind": "step_time_outlier"}]}) == []
    assert diff({"anomalies_by_kind": {}}, {"anomalies_by_kind": {"memory_growth": 1}}) == [
        "$.anomalies_by_kind.memory_growth: not in the recording"]


def test_a_diverged_replay_waits_for_its_first_difference_only():
    """A poll is sent again until its recorded answer comes back; once one call has differed the session has
    diverged, and later calls are sent once, not each waited for (a drifted recording fails in one timeout
    with its first difference, not in the test's timeout with none)."""
    calls = [{"seq": i, "tool": tool, "arguments": {}, "is_error": False, "structured": {"kind": "zombie_embedding"}}
             for i, tool in enumerate(["get_anomalies", "get_run", "get_fix", "get_embeddings"])]
    sent: list[str] = []

    class Client:
        async def call_tool(self, tool: str, arguments: dict):
            sent.append(tool)
            kind = "loss_divergence" if tool in ("get_run", "get_fix") else "zombie_embedding"
            return SimpleNamespace(is_error=False, structured_content={"kind": kind})

    report = asyncio.run(replay(Client(), calls, timeout=0.5, poll=0.01))
    assert [m.seq for m in report.mismatches] == [1, 2] and "loss_divergence" in report.mismatches[0].differences[0]
    assert sent.count("get_anomalies") == 1 and sent.count("get_run") > 1  # matched at once; polled to its deadline
    assert sent.count("get_fix") == 1 and sent.count("get_embeddings") == 1  # after the divergence: once each


def test_a_malformed_session_is_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type": "call", "tool": "x", "arguments": {}}\n')
    with pytest.raises(SessionError, match="no header"):
        load(bad)
    bad.write_text("not json\n")
    with pytest.raises(SessionError, match="bad.jsonl:1: not JSON"):
        load(bad)
