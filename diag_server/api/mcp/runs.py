"""MCP tools over runs: the list, and one run's summary."""

from __future__ import annotations

from mcp.server.mcpserver import Context

from schemas.records import RunList, RunSummary

from ...read import queries
from .server import READ, RunArg, call, services


async def list_runs(ctx: Context) -> RunList:
    """List every run the server knows, most recently active first, with its status (active, ended,
    stale), last step and count of open anomalies. Call this first to find the run id to pass to the
    other tools."""
    return await call(queries.list_runs, services(ctx).store)


async def get_run(run: RunArg, ctx: Context) -> RunSummary:
    """Summary of one run: status, last step, latest value of every scalar (loss, val_loss, sys/...),
    open anomalies by kind, fixes by status, and the run's latest messages (the probe degraded or
    skipped a hook; the job ended on an uncaught exception or was killed by a signal, named there). Use
    it to check progress after a fix, and to learn why a run ended."""
    return await call(queries.run_summary, services(ctx).store, run)


TOOLS = ((list_runs, READ), (get_run, READ))
