"""The MCP tools: thin typed functions over the same query and fix functions the HTTP routes call.

One module per family; ``FAMILIES`` lists them in the order ``tools/list`` shows. Each tool takes and
returns pydantic models, so ``tools/list`` advertises input and output schemas and every result carries
structured content. Errors come back as tool errors with a message an agent can act on (an unknown run
lists the known runs; a stale fix says why).
"""

from __future__ import annotations

import inspect

from ...pipeline.services import Services
from . import anomalies, compression, context, distributed, fixes, runs, series
from .server import INSTRUCTIONS, TraindxMCP

FAMILIES = (runs, anomalies, fixes, compression, series, distributed)


def build_mcp(services: Services, version: str) -> TraindxMCP:
    server = TraindxMCP(services, version)
    for family in FAMILIES:
        for fn, hints in family.TOOLS:
            # A tool's description is its docstring without the source's indentation.
            server.add_tool(fn, description=inspect.cleandoc(fn.__doc__ or ""), annotations=hints)
    context.register(server)
    return server


__all__ = ["FAMILIES", "INSTRUCTIONS", "TraindxMCP", "build_mcp"]
