"""Compression: a recipe for a target sparsity or size, a prune fix from it, a sensitivity measurement."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.events import INT64_MAX, MAX_STEP
from schemas.records import CompressionRecipe, Fix

from ...compression import recipe as compression
from ..deps import WRITER, Svc, actor, router as _router
from ..render import respond

router = _router()

Sparsity = Annotated[float, Query(ge=0.0, lt=1.0)]
Bytes = Annotated[int | None, Query(gt=0, le=INT64_MAX)]
Structure = Literal["unstructured", "channels"]


@router.get("/v1/runs/{run}/compression", response_model=CompressionRecipe, tags=["compression"])
def compression_recipe(request: Request, services: Svc, run: str, target_sparsity: Sparsity = 0.8,
                       target_bytes: Bytes = None, structure: Structure = "unstructured") -> Response:
    return respond(request, compression.recipe(services.store, run, target_sparsity, target_bytes=target_bytes,
                                               structure=structure))


@router.post("/v1/runs/{run}/compression/prune", response_model=Fix, dependencies=WRITER, tags=["compression"])
def compression_prune(request: Request, services: Svc, run: str, target_sparsity: Sparsity = 0.8,
                      target_bytes: Bytes = None, structure: Structure = "unstructured",
                      rounds: Annotated[int, Query(ge=1, le=1000)] = 1,
                      every: Annotated[int, Query(ge=0, le=MAX_STEP)] = 1) -> Response:
    return respond(request, compression.propose_prune(services.store, run, target_sparsity, target_bytes=target_bytes,
                                                      structure=structure, rounds=rounds, every=every,
                                                      actor=actor(request)))


@router.post("/v1/runs/{run}/compression/sensitivity", response_model=Fix, dependencies=WRITER,
             tags=["compression"])
def compression_sensitivity(request: Request, services: Svc, run: str) -> Response:
    return respond(request, compression.request_sensitivity(services.store, run, actor=actor(request)))
