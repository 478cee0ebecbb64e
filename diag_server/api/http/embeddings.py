"""GET /v1/runs/{run}/embeddings: the embedding tables as their latest report described them."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request
from fastapi.responses import Response

from schemas.events import MAX_EMBEDDING_ROWS
from schemas.records import EmbeddingTables

from ...read import queries
from ..deps import Svc, router as _router
from ..render import respond

router = _router()


@router.get("/v1/runs/{run}/embeddings", response_model=EmbeddingTables, tags=["embeddings"],
            summary="The run's embedding tables as last reported: counts, collapse statistics, worst rows")
def embeddings(request: Request, services: Svc, run: str,
               table: Annotated[str | None, Query(description="One table: 'item.weight' or 'item'.")] = None,
               rows: Annotated[int, Query(ge=0, le=MAX_EMBEDDING_ROWS, description="Most rows listed per list "
                                          "(zombies, rarest, conflicted, dead, non-finite).")] = 20,
               ) -> Response:
    return respond(request, queries.embeddings(services.store, run, table=table, rows=rows))
