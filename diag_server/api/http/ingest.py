"""POST /v1/ingest: a probe's batch, stored whole or refused whole, answered with pending commands."""

from __future__ import annotations

import anyio
from fastapi import Request
from fastapi.responses import Response

from schemas.events import IngestReply

from ...errors import ApiError
from ...pipeline.ingest import MAX_BODY_BYTES, ingest, parse_batch
from ..deps import INGEST_ERRORS, WRITER, Svc, router as _router
from ..render import respond

router = _router()


@router.post("/v1/ingest", response_model=IngestReply, dependencies=WRITER, tags=["ingest"], responses=INGEST_ERRORS,
             summary="Store a probe's batch of events (idempotent by batch_id) and return pending fix commands")
async def ingest_batch(request: Request, services: Svc) -> Response:
    settings = services.settings
    # Back-pressure before reading the body: the probe keeps the batch in its spool and retries.
    if services.pending_ingest >= settings.max_pending_ingest:
        raise ApiError(503, "overloaded", f"{services.pending_ingest} batches are waiting to be stored; "
                       "retry after the Retry-After delay", headers={"Retry-After": "1"})
    services.size_guard.check_ingest()
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, "body_too_large", f"the body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
    services.pending_ingest += 1  # counted from here: awaiting the body lets other requests in
    try:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, "body_too_large", f"the body exceeds the limit of {MAX_BODY_BYTES} bytes")
        # Parsing and validating a large batch is CPU work: off the event loop, so queries stay quick. One
        # batch parsed at a time (request.app.state.parse_limiter): validation holds the GIL, and more of it
        # in parallel only starves the readers without storing any faster, since the writer is one thread.
        batch = await anyio.to_thread.run_sync(parse_batch, bytes(body), limiter=request.app.state.parse_limiter)
        reply = await anyio.to_thread.run_sync(ingest, services.store, services.engine, batch)
    finally:
        services.pending_ingest -= 1
    return respond(request, reply)
