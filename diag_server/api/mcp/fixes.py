"""MCP tools of the repair loop: propose, apply, watch, revert."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.records import Fix, FixList

from ... import fixes
from .server import CHANGE_JOB, PROPOSE, READ, RunArg, actor, call, services


async def propose_fix(run: RunArg, anomaly_id: Annotated[str, Field(description="e.g. 'a-3'")],
                      ctx: Context) -> FixList:
    """Candidate fixes for one anomaly, best first, computed from its evidence and the run's history
    (a clip norm from the healthy gradient norms, the learning rate the run was healthy at). Each has
    an id, action, params, rationale, expected effect, risk and whether it can be applied live. Next:
    apply_fix(run, fix_id) with the first live one. Proposing again returns the same ids."""
    return await call(fixes.propose, services(ctx).store, run, anomaly_id, actor(ctx))


async def apply_fix(run: RunArg, fix_id: Annotated[str, Field(description="e.g. 'f-5', from propose_fix")],
                    ctx: Context) -> Fix:
    """Queue a proposed fix for the live job. The job applies it at its next step boundary (only if it
    allowed that action) and acknowledges with before/after values: status goes pending -> applied
    (or rejected/failed with the reason), then effective or ineffective once the server has watched
    the anomaly. Poll get_fix_status. Applying twice applies once."""
    return await call(fixes.apply, services(ctx).store, run, fix_id, actor(ctx))


async def get_fix_status(run: RunArg, fix_id: str, ctx: Context) -> Fix:
    """Where a fix stands: proposed, pending, applied, rejected, failed, expired, effective, ineffective
    or reverted, with the reason and the job's before/after values. If ineffective and the reason says
    the loss got worse, call revert_fix."""
    return await call(fixes.status, services(ctx).store, run, fix_id)


async def revert_fix(run: RunArg, fix_id: str, ctx: Context) -> Fix:
    """Undo an applied fix in the job (restore the learning rate, remove a clip, ...). The status becomes
    reverted once the job acknowledges."""
    return await call(fixes.revert, services(ctx).store, run, fix_id, actor(ctx))


TOOLS = ((propose_fix, PROPOSE), (apply_fix, CHANGE_JOB), (get_fix_status, READ), (revert_fix, CHANGE_JOB))
