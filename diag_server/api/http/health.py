"""GET /health: the server's version, its store's state and the data directory's size."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from schemas.enums import SCHEMA_VERSION
from schemas.records import Health

from ... import __version__
from ..deps import Svc, router as _router
from ..render import respond

router = _router()


@router.get("/health", response_model=Health, tags=["server"])
def health(request: Request, services: Svc) -> Response:
    guard = services.size_guard
    warnings = [w for w in (guard.warning(fresh=True),) if w]
    if services.store_status != "ok":
        warnings.insert(0, f"the store failed its integrity check at start: {services.store_status}")
    return respond(request, Health(version=__version__, schema_version=SCHEMA_VERSION,
                                   data_dir=str(services.settings.data_dir), store=services.store_status,
                                   data_bytes=guard.used(), max_data_bytes=guard.max_bytes, warnings=warnings))
