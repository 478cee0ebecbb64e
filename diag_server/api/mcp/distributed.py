"""MCP tools for distributed runs: where each rank's step time goes, and profiler captures."""

from __future__ import annotations

from typing import Annotated

from mcp.server.mcpserver import Context
from pydantic import Field

from schemas.events import MAX_STEP
from schemas.records import Capture, Timeline

from ...pipeline import captures
from ...read import timeline
from .server import READ, REQUEST, RunArg, actor, call, services


async def get_timeline(
    run: RunArg,
    ctx: Context,
    min_step: Annotated[int | None, Field(ge=0, le=MAX_STEP, description="Only spans of steps at or after this "
                                                                         "one.")] = None,
    max_step: Annotated[int | None, Field(ge=0, le=MAX_STEP, description="Only spans of steps at or before this "
                                                                         "one.")] = None,
    limit: Annotated[int, Field(ge=1, le=20000, description="Most spans returned (the latest steps).")] = 500,
) -> Timeline:
    """Where each rank's step time goes. `ranks` gives every rank (host, local rank, last step) with its
    median time per phase over recent samples (data_wait, forward, backward, optimizer, allreduce,
    comm_wait = time waiting at the gradient all-reduce); `spans` are the raw sampled spans with wall-clock
    starts aligned across ranks. Compare ranks' phases to find a straggler; for a file to open in
    ui.perfetto.dev use GET /v1/runs/{run}/timeline?format=chrome or `traindx timeline RUN -o trace.json`."""
    return await call(timeline.timeline, services(ctx).store, run, min_step=min_step, max_step=max_step, limit=limit)


async def capture(
    run: RunArg,
    ctx: Context,
    steps: Annotated[int, Field(ge=1, le=captures.MAX_CAPTURE_STEPS, description="Steps to record in full.")] = 5,
    profile: Annotated[bool, Field(description="Also run torch.profiler (operators, kernels, memory).")] = True,
) -> Capture:
    """Ask every rank of the live job to record everything for its next `steps` steps (all statistics
    every step, tensor shapes per module, and torch.profiler's operator/kernel time and memory), then
    return to normal sampling. Poll get_capture(run, id) until status is done; it lists the top operators
    per rank. Costs the job time while it runs: use a few steps."""
    return await call(captures.request, services(ctx).store, run, steps, profile, actor(ctx))


async def get_capture(run: RunArg, capture_id: Annotated[str, Field(description="e.g. 'c-1', from capture")],
                      ctx: Context) -> Capture:
    """A capture's status and, per rank that has finished, its operator breakdown (CPU and device time,
    memory), module input/output shapes, and whether the profiler trace can be downloaded
    (GET /v1/runs/{run}/captures/{id}/trace?rank=N)."""
    return await call(captures.get, services(ctx).store, run, capture_id)


TOOLS = ((get_timeline, READ), (capture, REQUEST), (get_capture, READ))
