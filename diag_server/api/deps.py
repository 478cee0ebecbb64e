"""What every HTTP route shares: the app's services, who is asking, the write guard, common parameters."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from schemas.events import MAX_STEP
from schemas.records import Error

from ..errors import ApiError
from ..read.queries import MAX_PAGE
from ..pipeline.services import Services
from .render import NegotiatedRoute
from .security import authorized


def services(request: Request) -> Services:
    return request.app.state.services


Svc = Annotated[Services, Depends(services)]


def actor(request: Request) -> str:
    """Who asked, for the audit trail: a person who named themselves (the dashboard and the CLI send
    'x-traindx-actor: <name>') is 'person:<name>'; anyone else is 'http:<address>'."""
    who = "".join(c for c in (request.headers.get("x-traindx-actor") or "") if c.isprintable()).strip()
    if who.startswith("person:"):
        who = who[len("person:"):]
    host = request.client.host if request.client else "unknown"
    return f"person:{who[:64]}" if who else f"http:{host}"


def require_token(request: Request) -> None:
    # The SecurityMiddleware checks first; this stays on every write route in case a route is ever
    # served without it (an app built by hand, a test). Reads opened by open_reads never reach here.
    token = services(request).settings.token
    if token is not None and not authorized(request.headers, token.encode()):
        raise ApiError(401, "unauthorized", "this route needs 'Authorization: Bearer <token>' (see TRAINDX_TOKEN)")


WRITER = [Depends(require_token)]

ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": Error} for s in (400, 401, 403, 404, 406, 409, 413, 421, 422,
                                                                          500)}
# Ingest also answers 503 (overloaded: back off for Retry-After seconds) and 507 (data directory full).
INGEST_ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": Error} for s in (503, 507)}


def router() -> APIRouter:
    """A router of API routes: each settles its answer's format before it acts (render.NegotiatedRoute)."""
    return APIRouter(responses=ERRORS, route_class=NegotiatedRoute)


# The same paging and step-range parameters on every list, with the same bounds.
Offset = Annotated[int, Query(ge=0, le=2**31, description="Skip this many items (see next_offset).")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="Page size.")]
MinStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Only items still holding at or after this step.")]
MaxStep = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="Only items that began at or before this step.")]
MaxPoints = Annotated[int, Query(ge=2, le=10000, description="Downsample each series to at most this many points, "
                                                             "keeping each bucket's min and max (spikes survive).")]
StatName = Literal["numel", "norm", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_frac", "dead_frac",
                   "saturated_frac", "update_ratio"]  # the stored columns (store.STAT_COLUMNS); a test keeps them equal
StatField = Annotated[StatName, Query(description="Statistic of each tensor.")]
