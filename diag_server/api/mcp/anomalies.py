"""MCP tools over anomalies: a run's list, and the diagnosis that relates them."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.enums import AnomalyKind, AnomalyStatus, Severity
from schemas.events import MAX_STEP
from schemas.records import AnomalyPage, Diagnosis

from ...read import diagnosis as diagnosis_
from ...read import queries
from .server import READ, RunArg, call, services


async def get_anomalies(
    run: RunArg,
    ctx: Context,
    kind: Annotated[AnomalyKind | None, Field(description="Only this anomaly kind.")] = None,
    severity: Annotated[Severity | None, Field(description="Only this severity.")] = None,
    status: Annotated[AnomalyStatus | None, Field(description="open or resolved; default both.")] = None,
    min_step: Annotated[int | None, Field(ge=0, le=MAX_STEP, description="Only anomalies still holding at or "
                                                                         "after this step.")] = None,
    max_step: Annotated[int | None, Field(ge=0, le=MAX_STEP, description="Only anomalies that began at or "
                                                                         "before this step.")] = None,
    offset: Annotated[int, Field(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Field(ge=1, le=200, description="Page size.")] = 20,
) -> AnomalyPage:
    """The run's anomalies, open and critical first: kind, severity, first and last step, tensors
    involved, a one-sentence message and the evidence numbers. Next: call diagnose(run) for how they
    relate, or propose_fix(run, anomaly_id) for the one to fix. Page with offset/next_offset."""
    return await call(queries.anomalies, services(ctx).store, run, kind=kind, severity=severity, status=status,
                      min_step=min_step, max_step=max_step, offset=offset, limit=limit)


async def diagnose(run: RunArg, ctx: Context) -> Diagnosis:
    """Rank the probable root causes of what went wrong in the run, each with the anomalies it explains,
    and a readable report. Fix the first cause first: its consequences often clear with it."""
    return await call(diagnosis_.diagnose, services(ctx).store, run)


TOOLS = ((get_anomalies, READ), (diagnose, READ))
