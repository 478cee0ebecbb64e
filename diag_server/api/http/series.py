"""Series for charts: one metric, several scalars, one statistic of every tensor, the heat map."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.enums import Collection
from schemas.events import MAX_WORLD_SIZE
from schemas.records import Heatmap, Series, SeriesSet

from ...read import queries, views
from ..deps import MaxPoints, MaxStep, MinStep, StatField, Svc, router as _router
from ..render import respond

router = _router()


@router.get("/v1/runs/{run}/series/{name:path}", response_model=Series, tags=["series"],
            summary="One metric over steps (a scalar, or a tensor's statistic with collection=)")
def series(request: Request, services: Svc, run: str, name: str,
           collection: Annotated[Collection | None, Query(description="Read a tensor's statistic from this "
                                                                      "collection; omit for a scalar.")] = None,
           field: StatField = "norm", min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500,
           rank: Annotated[int | None, Query(ge=0, le=MAX_WORLD_SIZE - 1, description="One rank's points only.")] = None,
           ) -> Response:
    return respond(request, queries.series(services.store, run, name,
                                           collection=collection.value if collection else None, field=field,
                                           max_points=max_points, min_step=min_step, max_step=max_step, rank=rank))


@router.get("/v1/runs/{run}/scalars", response_model=SeriesSet, tags=["series"],
            summary="Several scalar series for one chart: loss and user scalars, sys/ step times, memory")
def scalars(request: Request, services: Svc, run: str,
            name: Annotated[list[str] | None, Query(description="Scalar names; repeat for several.")] = None,
            prefix: Annotated[str | None, Query(description="Every scalar whose name starts with this, "
                                                        "e.g. 'sys/'.")] = None,
            min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500) -> Response:
    return respond(request, views.scalar_set(services.store, run, names=name, prefix=prefix, min_step=min_step,
                                             max_step=max_step, max_points=max_points))


@router.get("/v1/runs/{run}/stats", response_model=SeriesSet, tags=["series"],
            summary="One statistic of each tensor of a collection, e.g. update ratios per layer")
def stats(request: Request, services: Svc, run: str, collection: Collection, field: StatField = "norm",
          tensor: Annotated[list[str] | None, Query(description="Tensor names; default all.")] = None,
          min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500) -> Response:
    return respond(request, views.stat_set(services.store, run, collection=collection.value, field=field,
                                           tensors=tensor, min_step=min_step, max_step=max_step,
                                           max_points=max_points))


@router.get("/v1/runs/{run}/heatmap", response_model=Heatmap, tags=["series"],
            summary="A tensors x steps matrix of one statistic (gradient norm per layer by default)")
def heatmap(request: Request, services: Svc, run: str, collection: Collection = Collection.gradients,
            field: StatField = "norm", min_step: MinStep = None, max_step: MaxStep = None,
            max_steps: Annotated[int, Query(ge=1, le=5000, description="Columns at most; neighbouring steps "
                                                                       "share a column (its largest value).")] = 200,
            ) -> Response:
    return respond(request, views.heatmap(services.store, run, collection=collection.value, field=field,
                                          min_step=min_step, max_step=max_step, max_steps=max_steps))
