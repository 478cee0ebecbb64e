"""A scripted agent: watch a run, find what went wrong, fix it, check the fix worked, undo it if it did harm.

It uses nothing but the official MCP client and the server's tools, exactly as an AI assistant would:

    python -m agent_examples.scripted_agent --server http://127.0.0.1:8765/mcp --run exp-1
    python -m agent_examples.scripted_agent --stdio --data .traindx --run exp-1

Over stdio it launches `traindx mcp` itself (reading the same data directory as the running server,
which is where the job's probe sends its events and picks up fixes).

When to revert. A fix is applied to a job in which its anomaly holds, so the values it replaced (its
``before``) are the state the fault arose in: an lr fix after an lr spike replaced the spiked rate. Reverting
goes back there, which is known to be bad; so the agent reverts only when the server's verdict says the fix
made things worse (the verdict's ``revert_suggested`` in the audit trail: the loss at the end of the verdict's
window is worse than before the fix), never merely because the verdict is ``ineffective``. An ineffective fix
that did no harm stays, and the next proposal is tried on top of it. A rollback is never reverted.

Exit status: 0 a fix was judged effective (or no anomaly needed one), 1 the anomaly was not fixed (nothing
live to apply, refused, ineffective, no verdict in time), 3 the job ended (or stopped answering) before the
agent was done (what was applied stays applied; the message says where it stopped), 4 a tool failed
otherwise (the message says which and why).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp_types import Implementation

from schemas.auth import find_token

FINAL = {"effective", "ineffective", "rejected", "failed", "expired", "reverted"}
EXIT_FIXED, EXIT_NOT_FIXED, EXIT_JOB_ENDED, EXIT_TOOL_FAILED = 0, 1, 3, 4


class ToolFailed(Exception):
    """A tool answered with an error; ``code`` is the server's error code (``unknown_run``, ...)."""

    def __init__(self, tool: str, text: str) -> None:
        super().__init__(f"{tool}: {text}")
        self.tool = tool
        prefix = f"Error executing tool {tool}: "  # how the MCP SDK words a tool's error
        head = text.removeprefix(prefix).split(":", 1)[0].strip()  # traindx's errors: "code: message"
        self.code = head if head.isidentifier() else ""


class JobEnded(ToolFailed):
    """The job has ended or stopped answering (``job_unavailable``): nothing more can be done to it live."""


@dataclass
class Outcome:
    run: str
    anomaly: dict | None = None
    diagnosis: dict | None = None
    fix: dict | None = None
    verdict: str | None = None
    reverted: bool = False
    ended: str | None = None  # why the agent stopped early: the job ended or stopped answering
    detected_at: float | None = None
    applied_at: float | None = None
    log: list[str] = field(default_factory=list)


async def call(client: Client, tool: str, **args: Any) -> dict:
    result = await client.call_tool(tool, {k: v for k, v in args.items() if v is not None})
    if result.is_error:
        text = " ".join(getattr(c, "text", "") for c in result.content)
        failed = ToolFailed(tool, text)
        raise JobEnded(tool, text) if failed.code == "job_unavailable" else failed
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
            if e.code != "unknown_run":
                raise
            page = {"anomalies": []}  # the job has not sent its first batch yet
        urgent = [a for a in page["anomalies"] if a["severity"] in ("warning", "critical") and a["id"] not in skip]
        if urgent:
            return urgent[0]
        await asyncio.sleep(poll)
    return None


async def triage(client: Client, run: str, *, timeout: float = 60.0, poll: float = 0.25,
                 verdict_timeout: float = 60.0, say: Callable[[str], None] = print) -> Outcome:
    """Find the most urgent anomaly, fix its root cause, wait for the verdict, revert only a fix that did harm.
    A job that ends on the way stops the triage, with ``Outcome.ended`` saying where; other tool errors raise."""
    out = Outcome(run=run)

    def note(msg: str) -> None:
        out.log.append(msg)
        say(msg)

    try:
        await _triage(client, run, out, note, timeout, poll, verdict_timeout)
    except JobEnded as e:
        out.ended = str(e)
        note(f"the job has ended or stopped answering ({e}); stopping: what was applied stays as it is")
    return out


async def _triage(client: Client, run: str, out: Outcome, note: Callable[[str], None], timeout: float, poll: float,
                  verdict_timeout: float) -> None:
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
            return
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
            return
        handled.add(anomaly["id"])


async def _apply_first(client: Client, run: str, live: list[dict], out: Outcome, note: Callable[[str], None],
                       verdict_timeout: float, poll: float) -> None:
    """Apply the first proposal the job accepts; wait for the verdict; revert only a fix that did harm."""
    done: set[str] = set()  # a rollback applied after a guard is not applied again as the next proposal
    for fix in live:
        if fix["id"] in done:
            continue
        try:
            applied = await call(client, "apply_fix", run=run, fix_id=fix["id"])
        except JobEnded:
            raise
        except ToolFailed as e:  # this fix cannot be applied (its state, say): the next one may
            note(f"apply_fix {fix['id']} refused: {e}; trying the next proposal")
            continue
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
        if status["status"] == "pending":
            await _unless_ended(client, run, f"{fix['id']} was never applied")
            note(f"  {fix['id']} still pending after {verdict_timeout:.0f}s; stopping")
            return
        out.applied_at = time.monotonic()
        note(f"  {fix['id']} applied at step {status['applied_step']}: {status['before']} -> {status['after']}")
        status = await wait_for_status(client, run, fix["id"], FINAL, verdict_timeout, poll)
        out.fix, out.verdict = status, status["status"]
        if status["status"] not in FINAL:
            await _unless_ended(client, run, f"{fix['id']} was applied but not judged yet")
            note(f"  no verdict on {fix['id']} within {verdict_timeout:.0f}s (still {status['status']}); stopping")
            return
        note(f"  verdict: {status['status']} ({status['reason']})")
        if fix["action"] != "rollback" and await revert_suggested(client, run, fix["id"]):
            await revert(client, run, fix["id"], out, note, verdict_timeout, poll)
        elif status["status"] == "ineffective":
            note(f"  keeping {fix['id']}: it did not make things worse, and reverting it would restore "
                 f"{status['before']}, the state the anomaly arose in")
        if status["status"] != "ineffective":
            return
        note("  trying the next proposal")


async def revert_suggested(client: Client, run: str, fix_id: str) -> bool:
    """Whether the server's verdict on the fix says it made things worse (the audit's verdict detail)."""
    entries = (await call(client, "get_audit", run=run, fix_id=fix_id, limit=500))["entries"]
    verdicts = [e for e in entries if e["action"] == "verdict"]
    return bool(verdicts and verdicts[-1]["detail"].get("revert_suggested"))


async def revert(client: Client, run: str, fix_id: str, out: Outcome, note: Callable[[str], None], timeout: float,
                 poll: float) -> None:
    """Revert a fix and wait for the job's answer; ``JobEnded`` when the job is gone (nothing was changed)."""
    note(f"  {fix_id} made things worse: reverting it")
    await call(client, "revert_fix", run=run, fix_id=fix_id)
    status = await wait_for_status(client, run, fix_id, {"reverted", "expired", "failed"}, timeout, poll)
    if status["status"] == "reverted":
        out.reverted = True
        note(f"  reverted {fix_id}: {status['before']} -> {status['after']}")
        return
    if status["status"] in ("expired", "failed"):
        note(f"  the revert of {fix_id} did not happen: {status['reason']}")
    await _unless_ended(client, run, f"the revert of {fix_id} was not acknowledged")
    note(f"  the revert of {fix_id} is not acknowledged yet ({status['status']})")


async def _unless_ended(client: Client, run: str, what: str) -> None:
    """Raise ``JobEnded`` when the run has ended or gone stale: ``what`` is then why the agent stops."""
    state = (await call(client, "get_run", run=run))["run"]["status"]
    if state in ("ended", "stale"):
        raise JobEnded("get_run", f"job_unavailable: {what}: the run is {state}")


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
    token = token or find_token()  # as the probe and the CLI find it: $TRAINDX_TOKEN, else DATA/token
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


def exit_status(out: Outcome) -> int:
    """What the process says with its exit status (see the module docstring)."""
    if out.ended is not None:
        return EXIT_JOB_ENDED
    if out.anomaly is None or (out.verdict == "effective" and not out.reverted):
        return EXIT_FIXED
    return EXIT_NOT_FIXED


async def main_async(args: argparse.Namespace) -> int:
    try:
        async with connect(args.server, stdio_data=args.data if args.stdio else None, mode=args.mode) as client:
            print(f"watching run {args.run}", flush=True)  # connected: a caller may start the job now
            out = await triage(client, args.run, timeout=args.timeout, poll=args.poll)
    except ToolFailed as e:
        print(f"scripted agent: a tool failed: {e}", file=sys.stderr, flush=True)
        return EXIT_TOOL_FAILED
    code = exit_status(out)
    if code == EXIT_JOB_ENDED:
        print(f"scripted agent: stopped, the job is gone: {out.ended}", file=sys.stderr, flush=True)
    return code


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
