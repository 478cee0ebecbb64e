"""The ASGI app, declared in one place: REST routes, MCP over Streamable HTTP at /mcp, lifespan.

It wires parts together and does nothing else.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import anyio
from fastapi import FastAPI

from .. import __version__
from ..pipeline.services import Services, Settings
from . import dashboard, metrics, openapi
from .http import ROUTERS
from .mcp import build_mcp
from .render import install_error_handlers
from .security import Authorities, SecurityMiddleware, load_or_create_token, mcp_transport_security


def create_app(settings: Settings | None = None, services: Services | None = None) -> FastAPI:
    services = services or Services(settings or Settings())
    settings = services.settings
    if settings.token is None:
        settings.token = load_or_create_token(settings.data_dir)
    authorities = Authorities(settings.host, settings.port, settings.allowed_hosts, settings.allowed_origins)
    mcp = build_mcp(services, __version__)
    mcp_app = mcp.streamable_http_app(streamable_http_path="/mcp", host=settings.host,
                                      transport_security=mcp_transport_security(authorities))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with mcp.session_manager.run():
            yield
        services.close()

    app = FastAPI(title="traindx", version=__version__, lifespan=lifespan,
                  description="Live diagnostics for PyTorch training runs: anomalies, root causes, fixes.")
    app.state.services = services
    app.state.parse_limiter = anyio.CapacityLimiter(1)  # ingest parses one batch at a time (http/ingest.py)
    app.state.metrics = metrics.build_registry(services.store)
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(metrics.router)  # GET /metrics for Prometheus
    app.include_router(dashboard.router)
    openapi.install(app)
    app.router.routes.extend(mcp_app.routes)  # the /mcp route, beside the REST routes
    # Outermost: Host/Origin and the token are checked before any route, /mcp included.
    app.add_middleware(SecurityMiddleware, token=settings.token, authorities=authorities,
                       open_reads=settings.open_reads)
    return app
