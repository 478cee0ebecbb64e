"""Runs: the list, one run's summary, its history on the step axis, its change stream, deleting it."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.records import RunHistory, RunPage, RunSummary

from ...read import queries, views
from ...pipeline.retention import delete_run
from ...read.stream import run_updates
from ..deps import WRITER, Limit, MaxStep, MinStep, Offset, Svc, router as _router
from ..render import offers, respond

router = _router()


@router.get("/v1/runs", response_model=RunPage, tags=["runs"], summary="List runs, most recently active first")
def runs(request: Request, services: Svc, status: Literal["active", "ended", "stale"] | None = None,
         offset: Offset = 0, limit: Limit = 50,
         search: Annotated[str | None, Query(max_length=128, description="Runs whose id contains this, in any "
                                                                         "case.")] = None,
         open_anomalies: Annotated[bool | None, Query(description="true: only runs with an open anomaly; false: "
                                                                  "only runs without one.")] = None) -> Response:
    return respond(request, queries.run_page(services.store, status=status, offset=offset, limit=limit,
                                             search=search, open_anomalies=open_anomalies))


@router.get("/v1/runs/{run}", response_model=RunSummary, tags=["runs"])
def run_summary(request: Request, services: Svc, run: str) -> Response:
    return respond(request, queries.run_summary(services.store, run))


@router.delete("/v1/runs/{run}", status_code=204, dependencies=WRITER, tags=["runs"],
               summary="Delete a run and everything stored about it (export it first: traindx export)")
def delete(request: Request, services: Svc, run: str, force: bool = False) -> Response:
    delete_run(services.store, run, force=force, engine=services.engine)
    return Response(status_code=204)


@router.get("/v1/runs/{run}/history", response_model=RunHistory, tags=["runs"],
            summary="The run's timeline: anomalies, fixes and verdicts on the step axis")
def history(request: Request, services: Svc, run: str, type: views.HistoryType | None = None,
            min_step: MinStep = None, max_step: MaxStep = None, offset: Offset = 0, limit: Limit = 50) -> Response:
    return respond(request, views.history(services.store, run, type=type, min_step=min_step, max_step=max_step,
                                          offset=offset, limit=limit))


@router.get("/v1/runs/{run}/stream", tags=["runs"], response_class=Response,
            summary="Server-sent events: an 'update' event each time the run's data changes",
            responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                             "description": "A text/event-stream; each 'update' event's data is JSON with the "
                                            "run's last_step, status, open anomalies, its last sampled step "
                                            "(stats_step) and a change counter."}})
@offers("event-stream")
async def stream(request: Request, services: Svc, run: str) -> Response:
    queries.require_run(services.store.read(), run)
    from sse_starlette.sse import EventSourceResponse

    return EventSourceResponse(run_updates(services.store.path, run), ping=15)
