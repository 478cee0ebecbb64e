"""HTTP routes and MCP tools for distributed runs: the timeline (JSON, XML or Chrome trace) and captures.

Thin, as the other routes and tools are: they call ``timeline`` and ``captures`` and render the record.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from mcp.server.mcpserver import Context
from mcp_types import ToolAnnotations
from pydantic import Field

from schemas.events import MAX_STEP, MAX_WORLD_SIZE
from schemas.records import Capture, CaptureList, Timeline

from . import captures, timeline
from .http import ERRORS, MaxStep, MinStep, actor, respond
from .render import NegotiatedRoute, offers
from .services import Services
from .tools import _READ, RunArg, _actor, _call

MAX_CAPTURE_STEPS = captures.MAX_CAPTURE_STEPS


def build_router(services: Services, writer: list[Any]) -> APIRouter:
    """The distributed routes, with the main router's error responses and write guard (``writer``)."""

    store = services.store
    r = APIRouter(responses=ERRORS, route_class=NegotiatedRoute)

    @r.get("/v1/runs/{run}/timeline", response_model=Timeline, tags=["distributed"],
           summary="The run's spans across ranks; ?format=chrome for a Chrome trace / Perfetto JSON file")
    @offers("json", "xml", "chrome")
    def get_timeline(request: Request, run: str, min_step: MinStep = None, max_step: MaxStep = None,
                     limit: Annotated[int, Query(ge=1, le=timeline.MAX_SPANS)] = 20_000) -> Response:
        tl = timeline.timeline(store, run, min_step=min_step, max_step=max_step, limit=limit)
        if request.state.format == "chrome":
            return Response(orjson.dumps(timeline.chrome_trace(tl)), media_type="application/json",
                            headers={"content-disposition": f'attachment; filename="{run}.trace.json"'})
        return respond(request, tl)

    @r.post("/v1/runs/{run}/captures", response_model=Capture, status_code=201, dependencies=writer,
            tags=["distributed"], summary="Record everything for the next N steps on every rank, with torch.profiler")
    def request_capture(request: Request, run: str,
                        steps: Annotated[int, Query(ge=1, le=MAX_CAPTURE_STEPS)] = 5,
                        profile: bool = True) -> Response:
        return respond(request, captures.request(store, run, steps, profile, actor(request)), status=201)

    @r.get("/v1/runs/{run}/captures", response_model=CaptureList, tags=["distributed"])
    def list_captures(request: Request, run: str) -> Response:
        return respond(request, captures.list_captures(store, run))

    @r.get("/v1/runs/{run}/captures/{capture_id}", response_model=Capture, tags=["distributed"])
    def get_capture(request: Request, run: str, capture_id: str) -> Response:
        return respond(request, captures.get(store, run, capture_id))

    @r.get("/v1/runs/{run}/captures/{capture_id}/trace", tags=["distributed"],
           summary="torch.profiler's Chrome trace from one rank of a capture",
           responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                            "description": "The Chrome trace (JSON) torch.profiler wrote on that rank."}})
    @offers("json")
    def capture_trace(run: str, capture_id: str,
                      rank: Annotated[int, Query(ge=0, le=MAX_WORLD_SIZE - 1)] = 0) -> Response:
        return Response(captures.trace(store, run, capture_id, rank), media_type="application/json",
                        headers={"content-disposition": f'attachment; filename="{run}.{capture_id}.rank{rank}.json"'})

    return r


def register_tools(tool: Callable[[ToolAnnotations], Callable[..., Any]], services: Services) -> None:
    """Add the distributed tools with ``tool``, the MCP server's registering decorator (see tools.py)."""
    store = services.store

    @tool(_READ)
    async def get_timeline(
        run: RunArg,
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
        return await _call(timeline.timeline, store, run, min_step=min_step, max_step=max_step, limit=limit)

    @tool(ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False,
          open_world_hint=False))
    async def capture(
        run: RunArg,
        ctx: Context,
        steps: Annotated[int, Field(ge=1, le=MAX_CAPTURE_STEPS, description="Steps to record in full.")] = 5,
        profile: Annotated[bool, Field(description="Also run torch.profiler (operators, kernels, memory).")] = True,
    ) -> Capture:
        """Ask every rank of the live job to record everything for its next `steps` steps (all statistics
        every step, tensor shapes per module, and torch.profiler's operator/kernel time and memory), then
        return to normal sampling. Poll get_capture(run, id) until status is done; it lists the top operators
        per rank. Costs the job time while it runs: use a few steps."""
        return await _call(captures.request, store, run, steps, profile, _actor(ctx))

    @tool(_READ)
    async def get_capture(run: RunArg, capture_id: Annotated[str, Field(description="e.g. 'c-1', from capture")]) -> Capture:
        """A capture's status and, per rank that has finished, its operator breakdown (CPU and device time,
        memory), module input/output shapes, and whether the profiler trace can be downloaded
        (GET /v1/runs/{run}/captures/{id}/trace?rank=N)."""
        return await _call(captures.get, store, run, capture_id)
