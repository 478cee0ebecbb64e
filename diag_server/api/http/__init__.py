"""The HTTP API, one router per resource; ``ROUTERS`` lists them in the order the OpenAPI document shows.

Routes are thin: each parses its parameters, calls the shared query or fix function, and hands the
record to ``render.respond``, which renders it in the format the client asked for. That format is settled
before the route runs (``render.NegotiatedRoute``), so a request the server cannot answer changes nothing.
"""

from __future__ import annotations

from fastapi import APIRouter

from . import (anomalies, compare, compression, distributed, distributions, embeddings, fixes, health, ingest,
               runs, series)

ROUTERS: tuple[APIRouter, ...] = (
    health.router, ingest.router, runs.router, anomalies.router, fixes.router, series.router, embeddings.router,
    compression.router, distributed.router, compare.router, distributions.router,
)

__all__ = ["ROUTERS"]
