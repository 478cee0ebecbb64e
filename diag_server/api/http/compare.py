"""GET /v1/compare: several runs side by side, for the dashboard's compare view and anyone else."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.records import RunComparison

from ...read import compare as comparing
from ..deps import MaxPoints, Svc, router as _router
from ..render import respond

router = _router()


@router.get("/v1/compare", response_model=RunComparison, tags=["runs"],
            summary="Runs side by side: one metric overlaid, their config differences, anomalies and fixes")
def compare(request: Request, services: Svc,
            run: Annotated[list[str], Query(min_length=1, max_length=comparing.MAX_COMPARED,
                                            description=f"Run ids, 1 to {comparing.MAX_COMPARED}: repeat run=.")],
            metric: Annotated[str, Query(min_length=1, max_length=256,
                                         description="The scalar to overlay: 'loss', 'val_loss', 'sys/step_time', "
                                                     "...")] = "loss",
            max_points: MaxPoints = 500,
            max_marks: Annotated[int, Query(ge=0, le=500, description="Most anomaly and fix marks per run, oldest "
                                                                      "first (marks_total says how many there are).")]
            = 200) -> Response:
    return respond(request, comparing.compare(services.store, run, metric=metric, max_points=max_points,
                                              max_marks=max_marks))
