"""The HTTP API: ingest for probes, and the same queries as the MCP tools for people, in JSON or XML.

Routes are thin: each parses its parameters, calls the shared query or fix function, and hands the
record to ``respond``, which renders it in the format the client asked for (the renderers are a
registry of small functions, as datasette's output formats are).
"""

from __future__ import annotations

from typing import Annotated, Callable, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.enums import SCHEMA_VERSION, AnomalyKind, AnomalyStatus, FixStatus, Severity
from schemas.events import IngestReply
from schemas.records import (AnomalyPage, AuditTrail, CompressionRecipe, Diagnosis, Error, Fix, FixList, Health,
                             RunList, RunSummary, Series)

from . import compression, diagnosis, fixes, queries
from .errors import ApiError
from .ingest import MAX_BODY_BYTES, ingest, parse_batch
from .retention import delete_run
from .security import authorized
from .services import Services


def _json(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _xml(model: BaseModel) -> bytes:
    from .xml import to_xml

    return to_xml(model)


RENDERERS: dict[str, tuple[str, Callable[[BaseModel], bytes]]] = {
    "json": ("application/json", _json),
    "xml": ("application/xml", _xml),
}
_MEDIA = {"application/json": "json", "application/xml": "xml", "text/xml": "xml", "application/*": "json",
          "*/*": "json"}


def negotiate(request: Request) -> str:
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in RENDERERS:
            raise ApiError(406, "not_acceptable", f"format={fmt!r} is not offered; use one of: {', '.join(RENDERERS)}")
        return fmt
    accept = request.headers.get("accept") or "*/*"
    ranked = []
    for i, part in enumerate(accept.split(",")):
        media, _, params = part.strip().partition(";")
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if media.strip().lower() in _MEDIA and q > 0:
            ranked.append((-q, i, _MEDIA[media.strip().lower()]))
    if not ranked:
        raise ApiError(406, "not_acceptable", f"cannot answer with {accept!r}; offered: application/json, "
                       "application/xml (or ?format=json|xml)")
    return min(ranked)[2]


def respond(request: Request, model: BaseModel, status: int = 200) -> Response:
    media, render = RENDERERS[negotiate(request)]
    return Response(render(model), status_code=status, media_type=media)


def error_response(request: Request, err: ApiError) -> Response:
    try:
        fmt = negotiate(request)
    except ApiError:
        fmt = "json"  # the client accepts nothing we offer: the error itself still has to be readable
    media, render = RENDERERS[fmt]
    return Response(render(err.body()), status_code=err.status, media_type=media, headers=err.headers)


def actor(request: Request) -> str:
    who = request.headers.get("x-traindx-actor")
    host = request.client.host if request.client else "unknown"
    return f"http:{who[:64]}" if who else f"http:{host}"


ERRORS = {s: {"model": Error} for s in (400, 401, 404, 406, 409, 413, 422)}
# Ingest also answers 503 (overloaded: back off for Retry-After seconds) and 507 (data directory full).
INGEST_ERRORS = {s: {"model": Error} for s in (503, 507)}


def build_router(services: Services) -> APIRouter:
    store = services.store
    settings = services.settings
    token = settings.token
    # One batch parsed at a time: validation holds the GIL, and more of it in parallel only starves the
    # readers (get_anomalies under load) without storing any faster, since the writer is one thread.
    parse_limiter = anyio.CapacityLimiter(1)

    def require_token(request: Request) -> None:
        # The SecurityMiddleware checks first; this stays on every write route in case a route is ever
        # served without it (an app built by hand, a test). Reads opened by open_reads never reach here.
        if token is None:
            return
        if not authorized(request.headers, token.encode()):
            raise ApiError(401, "unauthorized", "this route needs 'Authorization: Bearer <token>' (see TRAINDX_TOKEN)")

    writer = [Depends(require_token)]
    r = APIRouter(responses=ERRORS)

    @r.get("/health", response_model=Health, tags=["server"])
    def health(request: Request) -> Response:
        from . import __version__
        guard = services.size_guard
        warnings = [w for w in (guard.warning(fresh=True),) if w]
        if services.store_status != "ok":
            warnings.insert(0, f"the store failed its integrity check at start: {services.store_status}")
        return respond(request, Health(version=__version__, schema_version=SCHEMA_VERSION,
                                       data_dir=str(settings.data_dir), store=services.store_status,
                                       data_bytes=guard.used(), max_data_bytes=guard.max_bytes, warnings=warnings))

    @r.post("/v1/ingest", response_model=IngestReply, dependencies=writer, tags=["ingest"], responses=INGEST_ERRORS,
            summary="Store a probe's batch of events (idempotent by batch_id) and return pending fix commands")
    async def ingest_batch(request: Request) -> Response:
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
            # Parsing and validating a large batch is CPU work: off the event loop, so queries stay quick.
            batch = await anyio.to_thread.run_sync(parse_batch, bytes(body), limiter=parse_limiter)
            reply = await anyio.to_thread.run_sync(ingest, store, services.engine, batch)
        finally:
            services.pending_ingest -= 1
        return Response(_json(reply), media_type="application/json")

    @r.get("/v1/runs", response_model=RunList, tags=["runs"])
    def runs(request: Request) -> Response:
        return respond(request, queries.list_runs(store))

    @r.get("/v1/runs/{run}", response_model=RunSummary, tags=["runs"])
    def run_summary(request: Request, run: str) -> Response:
        return respond(request, queries.run_summary(store, run))

    @r.delete("/v1/runs/{run}", status_code=204, dependencies=writer, tags=["runs"],
              summary="Delete a run and everything stored about it (export it first: traindx export)")
    def delete(request: Request, run: str, force: bool = False) -> Response:
        delete_run(store, run, force=force, engine=services.engine)
        return Response(status_code=204)

    @r.get("/v1/runs/{run}/anomalies", response_model=AnomalyPage, tags=["anomalies"])
    def anomalies(request: Request, run: str, kind: AnomalyKind | None = None, severity: Severity | None = None,
                  status: AnomalyStatus | None = None, min_step: Annotated[int | None, Query(ge=0)] = None,
                  max_step: Annotated[int | None, Query(ge=0)] = None, offset: Annotated[int, Query(ge=0)] = 0,
                  limit: Annotated[int, Query(ge=1, le=queries.MAX_PAGE)] = 50) -> Response:
        return respond(request, queries.anomalies(store, run, kind=kind, severity=severity, status=status,
                                                  min_step=min_step, max_step=max_step, offset=offset, limit=limit))

    @r.get("/v1/runs/{run}/diagnosis", response_model=Diagnosis, tags=["anomalies"])
    def diagnose(request: Request, run: str) -> Response:
        return respond(request, diagnosis.diagnose(store, run))

    @r.post("/v1/runs/{run}/anomalies/{anomaly_id}/propose", response_model=FixList, dependencies=writer,
            tags=["fixes"])
    def propose(request: Request, run: str, anomaly_id: str) -> Response:
        return respond(request, fixes.propose(store, run, anomaly_id, actor(request)))

    @r.get("/v1/runs/{run}/fixes", response_model=FixList, tags=["fixes"])
    def list_fixes(request: Request, run: str, status: FixStatus | None = None,
                   anomaly_id: str | None = None) -> Response:
        return respond(request, queries.fixes(store, run, status=status, anomaly_id=anomaly_id))

    @r.get("/v1/runs/{run}/fixes/{fix_id}", response_model=Fix, tags=["fixes"])
    def get_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.status(store, run, fix_id))

    @r.post("/v1/runs/{run}/fixes/{fix_id}/apply", response_model=Fix, dependencies=writer, tags=["fixes"])
    def apply_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.apply(store, run, fix_id, actor(request)))

    @r.post("/v1/runs/{run}/fixes/{fix_id}/revert", response_model=Fix, dependencies=writer, tags=["fixes"])
    def revert_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.revert(store, run, fix_id, actor(request)))

    @r.get("/v1/runs/{run}/audit", response_model=AuditTrail, tags=["fixes"])
    def audit(request: Request, run: str) -> Response:
        return respond(request, queries.audit(store, run))

    @r.get("/v1/runs/{run}/series/{name:path}", response_model=Series, tags=["series"])
    def series(request: Request, run: str, name: str, collection: str | None = None, field: str = "norm",
               max_points: Annotated[int, Query(ge=2, le=10000)] = 500) -> Response:
        return respond(request, queries.series(store, run, name, collection=collection, field=field,
                                               max_points=max_points))

    @r.get("/v1/runs/{run}/compression", response_model=CompressionRecipe, tags=["compression"])
    def compression_recipe(request: Request, run: str,
                           target_sparsity: Annotated[float, Query(ge=0.0, lt=1.0)] = 0.8,
                           target_bytes: Annotated[int | None, Query(gt=0)] = None,
                           structure: Literal["unstructured", "channels"] = "unstructured") -> Response:
        return respond(request, compression.recipe(store, run, target_sparsity, target_bytes=target_bytes,
                                                   structure=structure))

    @r.post("/v1/runs/{run}/compression/prune", response_model=Fix, dependencies=writer, tags=["compression"])
    def compression_prune(request: Request, run: str, target_sparsity: Annotated[float, Query(ge=0.0, lt=1.0)] = 0.8,
                          target_bytes: Annotated[int | None, Query(gt=0)] = None,
                          structure: Literal["unstructured", "channels"] = "unstructured",
                          rounds: Annotated[int, Query(ge=1, le=1000)] = 1,
                          every: Annotated[int, Query(ge=0)] = 1) -> Response:
        return respond(request, compression.propose_prune(store, run, target_sparsity, target_bytes=target_bytes,
                                                          structure=structure, rounds=rounds, every=every,
                                                          actor=actor(request)))

    @r.post("/v1/runs/{run}/compression/sensitivity", response_model=Fix, dependencies=writer, tags=["compression"])
    def compression_sensitivity(request: Request, run: str) -> Response:
        return respond(request, compression.request_sensitivity(store, run, actor=actor(request)))

    return r


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return error_response(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        detail = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors()[:20]]
        return error_response(request, ApiError(422, "invalid_request", "the request's parameters are invalid", detail))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return error_response(request, ApiError(err.status_code, code, message))
