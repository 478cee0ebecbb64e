"""A scripted agent: watch a run, find what went wrong, fix it, check the fix worked, revert if it did not.

It uses nothing but the official MCP client and the server's tools, exactly as an AI assistant would:

    python -m agent_examples.scripted_agent --server http://127.0.0.1:8765/mcp --run exp-1
    python -m agent_examples.scripted_agent --stdio --data .traindx --run exp-1

Over stdio it launches `traindx mcp` itself (reading the same data directory as the running server,
which is where the job's probe sends its events and picks up fixes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import Implementation

FINAL = {"effective", "ineffective", "rejected", "failed", "expired", "reverted"}


class ToolFailed(Exception):
    pass


@dataclass
class Outcome:
    run: str
    anomaly: dict | None = None
    diagnosis: dict | None = None
    fix: dict | None = None
    verdict: str | None = None
    reverted: bool = False
    detected_at: float | None = None
    applied_at: float | None = None
    log: list[str] = field(default_factory=list)


async def call(client: Client, tool: str, **args: Any) -> dict:
    result = await client.call_tool(tool, {k: v for k, v in args.items() if v is not None})
    if result.is_error:
        text = " ".join(getattr(c, "text", "") for c in result.content)
        raise ToolFailed(f"{tool}: {text}")
    return result.structured_content


async def wait_for_anomaly(client: Client, run: str, *, timeout: float, poll: float,
                           skip: set[str] = frozenset(), kind: str | None = None) -> dict | None:  # type: ignore[assignment]
    """The most urgent open anomaly of warning or critical severity (not in ``skip``; of ``kind`` when given),
    once one appears."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            page = await call(client, "get_anomalies", run=run, status="open", kind=kind, limit=20)
        except ToolFailed as e:
            if "unknown_run" not in str(e):
                raise
            page = {"anomalies": []}  # the job has not sent its first batch yet
        urgent = [a for a in page["anomalies"] if a["severity"] in ("warning", "critical") and a["id"] not in skip]
        if urgent:
            return urgent[0]
        await asyncio.sleep(poll)
    return None


async def triage(client: Client, run: str, *, timeout: float = 60.0, poll: float = 0.25,
                 verdict_timeout: float = 60.0, say: Callable[[str], None] = print) -> Outcome:
    out = Outcome(run=run)

    def note(msg: str) -> None:
        out.log.append(msg)
        say(msg)

    deadline = time.monotonic() + timeout
    handled: set[str] = set()  # anomalies with nothing to apply live (advice only): watch for the next one
    while True:
        anomaly = await wait_for_anomaly(client, run, timeout=max(deadline - time.monotonic(), 0), poll=poll,
                                         skip=handled)
        if anomaly is None:
            if not handled:
                # No anomaly is not yet a healthy run: the probe may have degraded (a hook that raised,
                # dropped events) or the job may have died; the run's messages say so.
                messages = (await call(client, "get_run", run=run)).get("messages", [])
                worrying = [m for m in messages if m["level"] in ("warning", "error")]
                if worrying:
                    note(f"no anomaly of warning or critical severity in {timeout:.0f}s, but the run's messages say: "
                         + "; ".join(f"step {m['step']}: {m['text']}" for m in worrying[-3:]))
                else:
                    note(f"no anomaly of warning or critical severity in {timeout:.0f}s: the run looks healthy")
            return out
        if out.anomaly is None:
            out.anomaly = anomaly
            out.detected_at = time.monotonic()
        note(f"anomaly {anomaly['id']} ({anomaly['kind']}, {anomaly['severity']}) at step {anomaly['first_step']}: "
             f"{anomaly['message']}")
        diagnosis = await call(client, "diagnose", run=run)
        out.diagnosis = diagnosis
        note(f"diagnosis: {diagnosis['summary']}")
        # Fix the root cause the diagnosis ranks first; its consequences usually clear with it. A cause with
        # only advice (a restart) is reported and the next one is tried.
        targets = [c["anomaly_id"] for c in diagnosis["causes"] if c["anomaly_id"] not in handled] or [anomaly["id"]]
        for target_id in targets:
            proposals = (await call(client, "propose_fix", run=run, anomaly_id=target_id))["fixes"]
            for f in proposals:
                note(f"  proposal {f['id']} rank {f['rank']}: {f['action']} {f['params']} - {f['rationale']}")
            live = [f for f in proposals if f["live"] and f["status"] in ("proposed", "rejected", "expired", "reverted")]
            if not live:
                handled.add(target_id)
                note(f"  {target_id}: nothing to apply live (advice for a restart); looking further")
                continue
            out.anomaly = next((a for a in [anomaly] if a["id"] == target_id), out.anomaly)
            await _apply_first(client, run, live, out, note, verdict_timeout, poll)
            return out
        handled.add(anomaly["id"])


async def _apply_first(client: Client, run: str, live: list[dict], out: Outcome, note: Callable[[str], None],
                       verdict_timeout: float, poll: float) -> None:
    """Apply the first proposal the job accepts; wait for the verdict; revert if the server says so."""
    done: set[str] = set()  # a rollback applied after a guard is not applied again as the next proposal
    for fix in live:
        if fix["id"] in done:
            continue
        try:
            applied = await call(client, "apply_fix", run=run, fix_id=fix["id"])
        except ToolFailed as e:  # the job has ended or stopped answering: nothing more can be applied live
            note(f"apply_fix {fix['id']} refused: {e}; stopping")
            return
        note(f"apply_fix {fix['id']} ({fix['action']} {fix['params']}): {applied['status']}")
        if fix["action"] in GUARDS:
            # Sent right behind the guard, both ride on the same reply to the job, which applies them in order
            # at one step boundary: the restored state never meets an unguarded step.
            done |= await _undo_damage(client, run, fix, [f for f in live if f["id"] not in done], note,
                                       verdict_timeout, poll)
        status = await wait_for_status(client, run, fix["id"], {"applied", *FINAL}, verdict_timeout, poll)
        if status["status"] in ("rejected", "failed", "expired"):
            note(f"  {fix['id']} {status['status']}: {status['reason']}; trying the next proposal")
            continue
        out.applied_at = time.monotonic()
        note(f"  {fix['id']} applied at step {status['applied_step']}: {status['before']} -> {status['after']}")
        status = await wait_for_status(client, run, fix["id"], FINAL, verdict_timeout, poll)
        out.fix, out.verdict = status, status["status"]
        note(f"  verdict: {status['status']} ({status['reason']})")
        # Undo a fix that did not help, or that the server flags for making the loss worse; a rollback
        # cannot be undone (it already replaced the state), so it stays.
        worse = "revert it" in (status["reason"] or "")
        if (status["status"] == "ineffective" or worse) and fix["action"] != "rollback":
            await call(client, "revert_fix", run=run, fix_id=fix["id"])
            reverted = await wait_for_status(client, run, fix["id"], {"reverted"}, verdict_timeout, poll)
            out.reverted = True
            note(f"  reverted {fix['id']}: {reverted['status']} ({reverted['before']} -> {reverted['after']})")
        if status["status"] != "ineffective":
            return
        note("  trying the next proposal")


# Actions that stop further damage from now on but leave what was done: a rollback proposed with them
# undoes that, and they stay in force through it (a rollback restores weights and optimizer state, not
# the job's hooks).
GUARDS = {"grad_clip", "skip_nonfinite"}


async def _undo_damage(client: Client, run: str, guard: dict, live: list[dict], note: Callable[[str], None],
                       timeout: float, poll: float) -> set[str]:
    """With a guard, apply the rollback proposed for the same anomaly, if any; a rejected one (no snapshot
    from before the damage) leaves the guard alone."""
    roll = next((f for f in live if f["action"] == "rollback" and f["rank"] > guard["rank"]), None)
    if roll is None:
        return set()
    await call(client, "apply_fix", run=run, fix_id=roll["id"])
    note(f"  undoing the damage done before the guard: apply_fix {roll['id']} (rollback {roll['params']})")
    status = await wait_for_status(client, run, roll["id"], {"applied", *FINAL}, timeout, poll)
    note(f"  {roll['id']} {status['status']}: " + (f"{status['before']} -> {status['after']}"
                                                    if status["status"] not in ("rejected", "failed", "expired")
                                                    else str(status["reason"])))
    return {roll["id"]}


async def wait_for_status(client: Client, run: str, fix_id: str, until: set[str], timeout: float, poll: float) -> dict:
    """The fix's status once it is one of ``until`` (or when ``timeout`` seconds have passed)."""
    deadline = time.monotonic() + timeout
    status = await call(client, "get_fix_status", run=run, fix_id=fix_id)
    while status["status"] not in until and time.monotonic() < deadline:
        await asyncio.sleep(poll)
        status = await call(client, "get_fix_status", run=run, fix_id=fix_id)
    return status


def connect(server: str | None = None, *, stdio_data: str | None = None, name: str = "traindx-scripted-agent",
            token: str | None = None, mode: str = "auto") -> Client:
    """An MCP client over Streamable HTTP (a URL ending in /mcp; the token defaults to $TRAINDX_TOKEN) or
    over stdio (`traindx mcp`, which reads the data directory and needs no token).

    ``mode`` is the SDK's: "auto" speaks the current stateless revision (2026-07-28) and falls back to the
    handshake; "legacy" forces the 2025-11-25 initialize handshake, as older clients do.
    """
    info = Implementation(name=name, version="1")
    if stdio_data is not None:
        params = StdioServerParameters(command=sys.executable, args=["-m", "diag_server.cli", "mcp", "--data", stdio_data])
        return Client(params, client_info=info, mode=mode)
    token = token or os.environ.get("TRAINDX_TOKEN")
    if token:  # the server needs its token on /mcp (docs/security.md); the client passes it as a header
        return Client(_with_token(server, token), client_info=info, mode=mode)
    return Client(server, client_info=info, mode=mode)


@contextlib.asynccontextmanager
async def _with_token(url: str, token: str):  # noqa: ANN202 - a Transport: yields the client's streams
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers={"authorization": f"Bearer {token}"}) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams


async def main_async(args: argparse.Namespace) -> int:
    async with connect(args.server, stdio_data=args.data if args.stdio else None, mode=args.mode) as client:
        print(f"watching run {args.run}", flush=True)  # connected: a caller may start the job now
        out = await triage(client, args.run, timeout=args.timeout, poll=args.poll)
    return 0 if out.verdict in (None, "effective") else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="http://127.0.0.1:8765/mcp", help="MCP endpoint (Streamable HTTP)")
    p.add_argument("--stdio", action="store_true", help="launch `traindx mcp` and talk to it over stdio")
    p.add_argument("--data", default=".traindx", help="data directory for --stdio")
    p.add_argument("--mode", default="auto", choices=["auto", "legacy"],
                   help="protocol era: auto (the stateless 2026-07-28 revision) or legacy (the 2025-11-25 handshake)")
    p.add_argument("--run", required=True)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for an anomaly")
    p.add_argument("--poll", type=float, default=0.25, help="seconds between two looks at the run")
    sys.exit(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
