"""The HTTP API: ingest for probes, and the same queries as the MCP tools for people, in JSON or XML.

Routes are thin: each parses its parameters, calls the shared query or fix function, and hands the
record to ``respond``, which renders it in the format the client asked for. That format is settled
before the route runs (``render.NegotiatedRoute``), so a request the server cannot answer changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from schemas.enums import SCHEMA_VERSION, AnomalyKind, AnomalyStatus, Collection, FixStatus, Severity
from schemas.events import INT64_MAX, MAX_EMBEDDING_ROWS, MAX_STEP, MAX_WORLD_SIZE, IngestReply
from schemas.records import (Anomaly, AnomalyPage, AuditPage, CompressionRecipe, Diagnosis, EmbeddingTables, Error, Fix,
                             FixList, FixPage, Health, Heatmap, RunHistory, RunPage, RunSummary, Series, SeriesSet)

from . import compression, diagnosis, fixes, queries, views
from .errors import ApiError
from .ingest import MAX_BODY_BYTES, ingest, parse_batch
from .render import NegotiatedRoute, error_response, offers, respond
from .retention import delete_run
from .security import authorized
from .services import Services
from .stream import run_updates

# The same paging and step-range parameters on every list, with the same bounds.
Offset = Annotated[int, Query(ge=0, le=2**31, description="Skip this many items (see next_offset).")]
Limit = Annotated[int, Query(ge=1, le=queries.MAX_PAGE, description="Page size.")]
MinStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Only items still holding at or after this step.")]
MaxStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Only items that began at or before this step.")]
MaxPoints = Annotated[int, Query(ge=2, le=10000, description="Downsample each series to at most this many points, "
                                                             "keeping each bucket's min and max (spikes survive).")]
StatName = Literal["numel", "norm", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_frac", "dead_frac",
                   "saturated_frac", "update_ratio"]  # the stored columns (store.STAT_COLUMNS); a test keeps them equal
StatField = Annotated[StatName, Query(description="Statistic of each tensor.")]


def actor(request: Request) -> str:
    """Who asked, for the audit trail: a person who named themselves (the dashboard and the CLI send
    'x-traindx-actor: <name>') is 'person:<name>'; anyone else is 'http:<address>'."""
    who = "".join(c for c in (request.headers.get("x-traindx-actor") or "") if c.isprintable()).strip()
    if who.startswith("person:"):
        who = who[len("person:"):]
    host = request.client.host if request.client else "unknown"
    return f"person:{who[:64]}" if who else f"http:{host}"


ERRORS = {s: {"model": Error} for s in (400, 401, 403, 404, 406, 409, 413, 421, 422, 500)}
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
    r = APIRouter(responses=ERRORS, route_class=NegotiatedRoute)

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
        return respond(request, reply)

    @r.get("/v1/runs", response_model=RunPage, tags=["runs"], summary="List runs, most recently active first")
    def runs(request: Request, status: Literal["active", "ended", "stale"] | None = None, offset: Offset = 0,
             limit: Limit = 50) -> Response:
        return respond(request, queries.run_page(store, status=status, offset=offset, limit=limit))

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
                  status: AnomalyStatus | None = None, min_step: MinStep = None, max_step: MaxStep = None,
                  offset: Offset = 0, limit: Limit = 50,
                  min_step_time: Annotated[float | None, Query(
                      ge=0, allow_inf_nan=False, description="Latency threshold in seconds: only anomalies during "
                      "which a step took at least this long (sys/step_time_max).")] = None) -> Response:
        return respond(request, queries.anomalies(store, run, kind=kind, severity=severity, status=status,
                                                  min_step=min_step, max_step=max_step, offset=offset, limit=limit,
                                                  min_step_time=min_step_time))

    @r.get("/v1/runs/{run}/anomalies/{anomaly_id}", response_model=Anomaly, tags=["anomalies"],
           summary="One anomaly with its evidence")
    def anomaly(request: Request, run: str, anomaly_id: str) -> Response:
        return respond(request, queries.get_anomaly(store.read(), run, anomaly_id))

    @r.get("/v1/runs/{run}/diagnosis", response_model=Diagnosis, tags=["anomalies"])
    def diagnose(request: Request, run: str) -> Response:
        return respond(request, diagnosis.diagnose(store, run))

    @r.post("/v1/runs/{run}/anomalies/{anomaly_id}/propose", response_model=FixList, dependencies=writer,
            tags=["fixes"])
    def propose(request: Request, run: str, anomaly_id: str) -> Response:
        return respond(request, fixes.propose(store, run, anomaly_id, actor(request)))

    @r.get("/v1/runs/{run}/fixes", response_model=FixPage, tags=["fixes"])
    def list_fixes(request: Request, run: str, status: FixStatus | None = None, anomaly_id: str | None = None,
                   kind: Annotated[AnomalyKind | None, Query(description="Kind of the fix's anomaly.")] = None,
                   severity: Annotated[Severity | None, Query(description="Severity of the fix's anomaly.")] = None,
                   min_step: MinStep = None, max_step: MaxStep = None, offset: Offset = 0,
                   limit: Limit = 50) -> Response:
        return respond(request, queries.fix_page(store, run, status=status, anomaly_id=anomaly_id, kind=kind,
                                              severity=severity, min_step=min_step, max_step=max_step,
                                              offset=offset, limit=limit))

    @r.get("/v1/runs/{run}/fixes/{fix_id}", response_model=Fix, tags=["fixes"])
    def get_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.status(store, run, fix_id))

    @r.post("/v1/runs/{run}/fixes/{fix_id}/apply", response_model=Fix, dependencies=writer, tags=["fixes"])
    def apply_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.apply(store, run, fix_id, actor(request)))

    @r.post("/v1/runs/{run}/fixes/{fix_id}/revert", response_model=Fix, dependencies=writer, tags=["fixes"])
    def revert_fix(request: Request, run: str, fix_id: str) -> Response:
        return respond(request, fixes.revert(store, run, fix_id, actor(request)))

    @r.get("/v1/runs/{run}/audit", response_model=AuditPage, tags=["fixes"],
           summary="Who asked for what, when, with the job's before/after values")
    def audit(request: Request, run: str, fix_id: str | None = None, offset: Offset = 0,
              limit: Limit = 50) -> Response:
        return respond(request, queries.audit_page(store, run, fix_id=fix_id, offset=offset, limit=limit))

    @r.get("/v1/runs/{run}/history", response_model=RunHistory, tags=["runs"],
           summary="The run's timeline: anomalies, fixes and verdicts on the step axis")
    def history(request: Request, run: str, type: views.HistoryType | None = None, min_step: MinStep = None,
                max_step: MaxStep = None, offset: Offset = 0, limit: Limit = 50) -> Response:
        return respond(request, views.history(store, run, type=type, min_step=min_step, max_step=max_step,
                                              offset=offset, limit=limit))

    @r.get("/v1/runs/{run}/series/{name:path}", response_model=Series, tags=["series"],
           summary="One metric over steps (a scalar, or a tensor's statistic with collection=)")
    def series(request: Request, run: str, name: str,
               collection: Annotated[Collection | None, Query(description="Read a tensor's statistic from this "
                                                                          "collection; omit for a scalar.")] = None,
               field: StatField = "norm",
               min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500,
               rank: Annotated[int | None, Query(ge=0, le=MAX_WORLD_SIZE - 1, description="One rank's points only.")] = None,
               ) -> Response:
        return respond(request, queries.series(store, run, name, collection=collection.value if collection else None,
                                               field=field, max_points=max_points, min_step=min_step,
                                               max_step=max_step, rank=rank))

    @r.get("/v1/runs/{run}/embeddings", response_model=EmbeddingTables, tags=["embeddings"],
           summary="The run's embedding tables as last reported: counts, collapse statistics, worst rows")
    def embeddings(request: Request, run: str,
                   table: Annotated[str | None, Query(description="One table: 'item.weight' or 'item'.")] = None,
                   rows: Annotated[int, Query(ge=0, le=MAX_EMBEDDING_ROWS, description="Most rows listed per list "
                                                                                     "(zombies, rarest, conflicted, dead, non-finite).")] = 20,
                   ) -> Response:
        return respond(request, queries.embeddings(store, run, table=table, rows=rows))

    @r.get("/v1/runs/{run}/scalars", response_model=SeriesSet, tags=["series"],
           summary="Several scalar series for one chart: loss and user scalars, sys/ step times, memory")
    def scalars(request: Request, run: str,
                name: Annotated[list[str] | None, Query(description="Scalar names; repeat for several.")] = None,
                prefix: Annotated[str | None, Query(description="Every scalar whose name starts with this, "
                                                            "e.g. 'sys/'.")] = None,
                min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500) -> Response:
        return respond(request, views.scalar_set(store, run, names=name, prefix=prefix, min_step=min_step,
                                                 max_step=max_step, max_points=max_points))

    @r.get("/v1/runs/{run}/stats", response_model=SeriesSet, tags=["series"],
           summary="One statistic of each tensor of a collection, e.g. update ratios per layer")
    def stats(request: Request, run: str, collection: Collection, field: StatField = "norm",
              tensor: Annotated[list[str] | None, Query(description="Tensor names; default all.")] = None,
              min_step: MinStep = None, max_step: MaxStep = None, max_points: MaxPoints = 500) -> Response:
        return respond(request, views.stat_set(store, run, collection=collection.value, field=field, tensors=tensor,
                                               min_step=min_step, max_step=max_step, max_points=max_points))

    @r.get("/v1/runs/{run}/heatmap", response_model=Heatmap, tags=["series"],
           summary="A tensors x steps matrix of one statistic (gradient norm per layer by default)")
    def heatmap(request: Request, run: str, collection: Collection = Collection.gradients, field: StatField = "norm",
                min_step: MinStep = None, max_step: MaxStep = None,
                max_steps: Annotated[int, Query(ge=1, le=5000, description="Columns at most; neighbouring steps "
                                                                           "share a column (its largest value).")] = 200,
                ) -> Response:
        return respond(request, views.heatmap(store, run, collection=collection.value, field=field,
                                              min_step=min_step, max_step=max_step, max_steps=max_steps))

    @r.get("/v1/runs/{run}/stream", tags=["runs"], response_class=Response,
           summary="Server-sent events: an 'update' event each time the run's data changes",
           responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                            "description": "A text/event-stream; each 'update' event's data is JSON with the "
                                           "run's last_step, status, open anomalies and a change counter."}})
    @offers("event-stream")
    async def stream(request: Request, run: str) -> Response:
        queries.require_run(store.read(), run)
        from sse_starlette.sse import EventSourceResponse

        return EventSourceResponse(run_updates(store.path, run), ping=15)

    @r.get("/v1/runs/{run}/compression", response_model=CompressionRecipe, tags=["compression"])
    def compression_recipe(request: Request, run: str,
                           target_sparsity: Annotated[float, Query(ge=0.0, lt=1.0)] = 0.8,
                           target_bytes: Annotated[int | None, Query(gt=0, le=INT64_MAX)] = None,
                           structure: Literal["unstructured", "channels"] = "unstructured") -> Response:
        return respond(request, compression.recipe(store, run, target_sparsity, target_bytes=target_bytes,
                                                   structure=structure))

    @r.post("/v1/runs/{run}/compression/prune", response_model=Fix, dependencies=writer, tags=["compression"])
    def compression_prune(request: Request, run: str, target_sparsity: Annotated[float, Query(ge=0.0, lt=1.0)] = 0.8,
                          target_bytes: Annotated[int | None, Query(gt=0, le=INT64_MAX)] = None,
                          structure: Literal["unstructured", "channels"] = "unstructured",
                          rounds: Annotated[int, Query(ge=1, le=1000)] = 1,
                          every: Annotated[int, Query(ge=0, le=MAX_STEP)] = 1) -> Response:
        return respond(request, compression.propose_prune(store, run, target_sparsity, target_bytes=target_bytes,
                                                          structure=structure, rounds=rounds, every=every,
                                                          actor=actor(request)))

    @r.post("/v1/runs/{run}/compression/sensitivity", response_model=Fix, dependencies=writer, tags=["compression"])
    def compression_sensitivity(request: Request, run: str) -> Response:
        return respond(request, compression.request_sensitivity(store, run, actor=actor(request)))

    from .distributed_api import build_router as distributed_routes
    r.routes.extend(distributed_routes(services, writer).routes)  # one flat router
    return r


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return error_response(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        detail = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors()[:20]]
        return error_response(request, ApiError(422, "invalid_request", "the request's parameters are invalid", detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> Response:
        import logging

        logging.getLogger("traindx.http").exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request, ApiError(500, "internal_error", f"the server failed on this request "
                                                f"({type(err).__name__}); it keeps serving, and the log has the trace"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return error_response(request, ApiError(err.status_code, code, message[:500], headers=dict(err.headers or {})))
