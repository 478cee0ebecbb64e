"""The MCP server object and what every tool shares: its services, the caller's name, errors as tool errors."""

from __future__ import annotations

from typing import Annotated, Any, Callable, TypeVar

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from ...errors import ApiError
from ...pipeline.services import Services

T = TypeVar("T")

INSTRUCTIONS = """traindx watches live PyTorch training runs. Typical loop: list_runs -> get_anomalies(run)
(open, critical first) -> diagnose(run) for the root cause -> propose_fix(run, anomaly_id) -> apply_fix(run,
fix_id) -> get_fix_status(run, fix_id) until it is effective or ineffective -> revert_fix if it made things
worse. Fixes are applied by the job itself between two steps, only if the job allowed that action."""

RunArg = Annotated[str, Field(description="Run id, as listed by list_runs.")]
READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
# Writes that change nothing already there (a proposal, a capture request): proposing twice gives the same ids.
PROPOSE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
REQUEST = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=False, open_world_hint=False)
# Writes that change the live job (apply, revert): applying twice applies once.
CHANGE_JOB = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


class TraindxMCP(MCPServer):
    """The MCP server: it carries the services its tools read (``ctx.mcp_server.services``), and its tools
    refuse an argument they do not take, before they run. The SDK drops unknown arguments silently, so
    ``apply_fix(run, fix_id, dry_run=true)`` would apply the fix."""

    _params: dict[str, frozenset[str]] | None = None

    def __init__(self, services: Services, version: str) -> None:
        super().__init__("traindx", instructions=INSTRUCTIONS, version=version)
        self.services = services

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        if self._params is None:
            self._params = {t.name: frozenset(t.input_schema.get("properties", {})) for t in await self.list_tools()}
        known = self._params.get(name)
        unknown = sorted(set(arguments) - known) if known is not None else []
        if unknown:
            shown = ", ".join(repr(u[:64]) for u in unknown[:5])
            raise ToolError(f"invalid_arguments: {name} does not take {shown}; it takes: {', '.join(sorted(known))}. "
                            "Nothing was done.")
        return await super().call_tool(name, arguments, context)


def services(ctx: Context) -> Services:
    return ctx.mcp_server.services  # type: ignore[attr-defined]


def actor(ctx: Context | None) -> str:
    """Who asked, for the audit trail: the MCP client's name."""
    try:
        info = ctx.session.client_params.client_info  # type: ignore[union-attr]
        return f"mcp:{info.name}" if info and info.name else "mcp"
    except Exception:  # noqa: BLE001 - stateless requests may carry no client info
        return "mcp"


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a store function off the event loop; its ApiError becomes a tool error an agent can act on."""
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    except ApiError as e:
        raise ToolError(f"{e.code}: {e}") from None
