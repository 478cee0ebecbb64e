"""Distributed runs: the timeline across ranks (JSON, XML or a Chrome trace) and profiler captures."""

from __future__ import annotations

from typing import Annotated

import orjson
from fastapi import Query, Request
from fastapi.responses import Response

from schemas.events import MAX_WORLD_SIZE
from schemas.records import Capture, CaptureList, Timeline

from ...pipeline import captures
from ...read import timeline
from ..deps import WRITER, MaxStep, MinStep, Svc, actor, router as _router
from ..render import offers, respond

router = _router()


@router.get("/v1/runs/{run}/timeline", response_model=Timeline, tags=["distributed"],
            summary="The run's spans across ranks; ?format=chrome for a Chrome trace / Perfetto JSON file")
@offers("json", "xml", "chrome")
def get_timeline(request: Request, services: Svc, run: str, min_step: MinStep = None, max_step: MaxStep = None,
                 limit: Annotated[int, Query(ge=1, le=timeline.MAX_SPANS)] = 20_000) -> Response:
    tl = timeline.timeline(services.store, run, min_step=min_step, max_step=max_step, limit=limit)
    if request.state.format == "chrome":
        return Response(orjson.dumps(timeline.chrome_trace(tl)), media_type="application/json",
                        headers={"content-disposition": f'attachment; filename="{run}.trace.json"'})
    return respond(request, tl)


@router.post("/v1/runs/{run}/captures", response_model=Capture, status_code=201, dependencies=WRITER,
             tags=["distributed"], summary="Record everything for the next N steps on every rank, with torch.profiler")
def request_capture(request: Request, services: Svc, run: str,
                    steps: Annotated[int, Query(ge=1, le=captures.MAX_CAPTURE_STEPS)] = 5,
                    profile: bool = True) -> Response:
    return respond(request, captures.request(services.store, run, steps, profile, actor(request)), status=201)


@router.get("/v1/runs/{run}/captures", response_model=CaptureList, tags=["distributed"])
def list_captures(request: Request, services: Svc, run: str) -> Response:
    return respond(request, captures.list_captures(services.store, run))


@router.get("/v1/runs/{run}/captures/{capture_id}", response_model=Capture, tags=["distributed"])
def get_capture(request: Request, services: Svc, run: str, capture_id: str) -> Response:
    return respond(request, captures.get(services.store, run, capture_id))


@router.get("/v1/runs/{run}/captures/{capture_id}/trace", tags=["distributed"],
            summary="torch.profiler's Chrome trace from one rank of a capture",
            responses={200: {"content": {"application/json": {"schema": {"type": "object"}}},
                             "description": "The Chrome trace (JSON) torch.profiler wrote on that rank."}})
@offers("json")
def capture_trace(services: Svc, run: str, capture_id: str,
                  rank: Annotated[int, Query(ge=0, le=MAX_WORLD_SIZE - 1)] = 0) -> Response:
    return Response(captures.trace(services.store, run, capture_id, rank), media_type="application/json",
                    headers={"content-disposition": f'attachment; filename="{run}.{capture_id}.rank{rank}.json"'})
