"""The server's faces: HTTP routes, MCP tools, the dashboard, security. The only package that imports
fastapi, starlette or mcp; everything here is thin and calls the layers below (pipeline, read, fixes)."""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
