"""GET /v1/runs/{run}/distribution: a tensor's value distribution over steps (quantile bands, min and max)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.events import MAX_WORLD_SIZE
from schemas.records import Distribution

from ...read import distributions
from ..deps import Svc, router as _router
from ..render import respond

router = _router()


@router.get("/v1/runs/{run}/distribution", response_model=Distribution, tags=["series"],
            summary="A layer's weights, gradients or activations over steps: quantile bands within min and max")
def distribution(request: Request, services: Svc, run: str,
                 collection: Annotated[Literal["weights", "gradients", "activations"],
                                       Query(description="Whose values.")] = "weights",
                 tensor: Annotated[str | None, Query(max_length=256, description="The tensor (a parameter, or a "
                                                     "module for activations); the collection's first by default.")]
                 = None,
                 rank: Annotated[int, Query(ge=0, le=MAX_WORLD_SIZE - 1, description="The process that measured "
                                            "it (each rank of a multi-rank run sends its own).")] = 0,
                 max_points: Annotated[int, Query(ge=2, le=5000, description="Points at most; neighbouring steps "
                                                  "share one past that (the bucket's extremes, its last quantiles).")]
                 = 300) -> Response:
    return respond(request, distributions.distribution(services.store, run, collection=collection, tensor=tensor,
                                                       rank=rank, max_points=max_points))
