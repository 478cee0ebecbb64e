"""The live dashboard: a run list at ``/``, a run page at ``/runs/{run}``, several runs side by side at
``/compare?run=a&run=b``, and their static assets.

The page is plain HTML, CSS and JavaScript shipped in the package (``diag_server/api/static``), with uPlot
(vendored from the npm registry, MIT, its licence beside it) for every chart: lines, the heat map and the
distribution bands are uPlot charts (the last two draw their cells and shapes in uPlot's draw hook, on its
scales and cursor). It reads the same /v1 routes as everyone else and listens to /v1/runs/{run}/stream for
changes while a run is active. Nothing is built or fetched at run time.
"""

from __future__ import annotations

import mimetypes
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

from ..errors import ApiError

HTML = {200: {"content": {"text/html": {"schema": {"type": "string"}}}, "description": "The dashboard page."}}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".txt": "text/plain"}


@cache
def asset_names() -> frozenset[str]:
    return frozenset(p.name for p in resources.files(__package__).joinpath("static").iterdir() if p.is_file())


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


router = APIRouter(tags=["dashboard"])  # Host/Origin and the token: security.SecurityMiddleware, before any route


@router.get("/", response_class=HTMLResponse, responses=HTML, summary="The dashboard: the list of runs")
def index() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers={"cache-control": "no-cache"})


@router.get("/runs/{run}", response_class=HTMLResponse, responses=HTML,
            summary="The dashboard: one run's charts, anomalies, fixes and timeline")
def run_page(run: str) -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers={"cache-control": "no-cache"})


@router.get("/compare", response_class=HTMLResponse, responses=HTML,
            summary="The dashboard: runs side by side (repeat run=): a metric overlaid, config differences")
def compare_page() -> HTMLResponse:
    return HTMLResponse(_asset("index.html"), headers={"cache-control": "no-cache"})


@router.get("/static/{name}", include_in_schema=False)
def static(name: str) -> Response:
    if name not in asset_names():
        raise ApiError(404, "not_found", f"no asset {name!r}")
    suffix = name[name.rfind("."):]
    media = _TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"
    return Response(_asset(name), media_type=media, headers={"cache-control": "max-age=3600"})
