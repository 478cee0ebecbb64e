"""MCP tools of the repair loop: propose, apply, watch, revert."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.records import AuditPage, Fix, FixList

from ... import fixes
from ...read import queries
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
    or reverted, with the reason and the job's before/after values. Once judged, get_audit(run, fix_id) has
    the verdict's detail: call revert_fix only when it says revert_suggested (the loss got worse); an
    ineffective fix that did no harm stays, since reverting restores the state the anomaly arose in."""
    return await call(fixes.status, services(ctx).store, run, fix_id)


async def get_audit(
    run: RunArg,
    ctx: Context,
    fix_id: Annotated[str | None, Field(description="Only this fix's entries, e.g. 'f-5'.")] = None,
    offset: Annotated[int, Field(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Field(ge=1, le=queries.MAX_PAGE, description="Page size.")] = 50,
) -> AuditPage:
    """The run's audit trail, oldest first: who asked for what (actor), what the job answered (before/after
    values), and each verdict with its detail: loss_before, loss_after and revert_suggested (true when the
    fix left the loss worse than before it: the one case where reverting it is known to help). Page with
    offset/next_offset."""
    return await call(queries.audit_page, services(ctx).store, run, fix_id=fix_id, offset=offset, limit=limit)


async def revert_fix(run: RunArg, fix_id: str, ctx: Context) -> Fix:
    """Undo an applied fix in the job (restore the learning rate, remove a clip, ...). The status becomes
    reverted once the job acknowledges."""
    return await call(fixes.revert, services(ctx).store, run, fix_id, actor(ctx))


TOOLS = ((propose_fix, PROPOSE), (apply_fix, CHANGE_JOB), (get_fix_status, READ), (get_audit, READ),
         (revert_fix, CHANGE_JOB))
