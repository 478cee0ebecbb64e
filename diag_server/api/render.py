"""Answer formats: which one a request gets (decided before its route runs), the renderers, the one error shape.

Every API route is a ``NegotiatedRoute``: the format is chosen from ``?format=`` and ``Accept`` before
the parameters are read and before the route acts, so a request the server could not answer is refused
(406) with nothing done, on every route at once; a write route also refuses a parameter it does not
know (422) before FastAPI validates the ones it does. A route offers JSON and XML unless it says otherwise
with ``@offers(...)`` (the change stream, a profiler trace). The renderers are a registry of small
functions, as datasette's output formats are.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ApiError


def _json(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


def _xml(model: BaseModel) -> bytes:
    from .xml import to_xml

    return to_xml(model)


RENDERERS: dict[str, tuple[str, Callable[[BaseModel], bytes]]] = {
    "json": ("application/json", _json),
    "xml": ("application/xml", _xml),
}
# Every format a route may offer, by its ?format= name: the media types an Accept header names it by.
# 'chrome' (a Chrome trace file, the timeline's) is JSON too, so it is only ever chosen by name.
MEDIA: dict[str, tuple[str, ...]] = {
    "json": ("application/json",),
    "xml": ("application/xml", "text/xml"),
    "chrome": (),
    "event-stream": ("text/event-stream",),
}
DEFAULT_OFFER = ("json", "xml")


def offers(*formats: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Mark a route's endpoint with the formats it answers in, first preferred (default: JSON, then XML)."""
    unknown = [f for f in formats if f not in MEDIA]
    if unknown or not formats:
        raise ValueError(f"unknown formats {unknown}; known: {', '.join(MEDIA)}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.formats = tuple(formats)  # type: ignore[attr-defined]
        return fn

    return mark


def formats_of(endpoint: Callable[..., Any]) -> tuple[str, ...]:
    return getattr(endpoint, "formats", DEFAULT_OFFER)


def _describe(offer: Sequence[str]) -> str:
    media = [m for f in offer for m in MEDIA[f][:1]]
    return f"{', '.join(media)} (or ?format={'|'.join(offer)})"


def negotiate(request: Request, offer: Sequence[str] = DEFAULT_OFFER) -> str:
    """The format of ``offer`` the client asked for; ApiError 406 when it accepts none of them."""
    fmt = request.query_params.get("format")
    if fmt is not None:
        if fmt not in offer:
            raise ApiError(406, "not_acceptable", f"format={fmt[:64]!r} is not offered here; use one of: "
                           f"{', '.join(offer)}")
        return fmt
    accept = request.headers.get("accept") or "*/*"
    ranked = []
    for i, part in enumerate(accept.split(",")):
        media, _, params = part.strip().partition(";")
        media = media.strip().lower()
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if not q > 0:  # q=0 is "not this" (and a NaN is no preference at all)
            continue
        for rank, f in enumerate(offer):
            names = MEDIA[f]
            if media in names or (names and media == "*/*") or any(media == n.split("/")[0] + "/*" for n in names):
                ranked.append((-q, i, rank, f))
                break
    if not ranked:
        raise ApiError(406, "not_acceptable", f"cannot answer with {accept[:200]!r}; offered: {_describe(offer)}")
    return min(ranked)[3]


def respond(request: Request, model: BaseModel, status: int = 200) -> Response:
    fmt = getattr(request.state, "format", None)
    if fmt not in RENDERERS:  # a route built without NegotiatedRoute, or one answering its own format
        fmt = negotiate(request)
    media, render = RENDERERS[fmt]
    return Response(render(model), status_code=status, media_type=media)


def error_response(request: Request, err: ApiError) -> Response:
    try:
        fmt = negotiate(request)
    except ApiError:
        fmt = "json"  # the client accepts nothing we offer: the error itself still has to be readable
    media, render = RENDERERS[fmt]
    return Response(render(err.body()), status_code=err.status, media_type=media, headers=err.headers)


def _query_names(dependant: Any) -> set[str]:
    names = {f.alias for f in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


class NegotiatedRoute(APIRoute):
    """An API route that settles its answer's format before anything else of the request is read, and
    a write route that refuses a parameter it does not know (``?dry_run=1`` must not apply a fix)."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()
        offer = formats_of(self.endpoint)
        known = _query_names(self.dependant) | {"format"}
        writes = not (self.methods or set()) <= {"GET", "HEAD"}

        async def negotiated(request: Request) -> Response:
            request.state.format = negotiate(request, offer)
            unknown = sorted(set(request.query_params) - known) if writes else []
            if unknown:
                raise ApiError(422, "invalid_request", f"this route does not take {len(unknown)} of the parameters "
                               "sent; nothing was done", [f"query.{name[:64]}: not a parameter of this route (it "
                                                          f"takes: {', '.join(sorted(known))})" for name in unknown[:5]])
            return await handler(request)

        return negotiated


def install_error_handlers(app: FastAPI) -> None:
    """Every error, whatever raised it, answered in the one error shape and in the client's format."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return error_response(request, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> Response:
        detail = [f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors()[:20]]
        return error_response(request, ApiError(422, "invalid_request", "the request's parameters are invalid", detail))

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> Response:
        logging.getLogger("traindx.http").exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(request, ApiError(500, "internal_error", f"the server failed on this request "
                                                f"({type(err).__name__}); it keeps serving, and the log has the trace"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code, "http_error")
        message = f"no route {request.method} {request.url.path}" if err.status_code in (404, 405) else str(err.detail)
        return error_response(request, ApiError(err.status_code, code, message[:500], headers=dict(err.headers or {})))
