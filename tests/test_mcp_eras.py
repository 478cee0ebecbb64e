"""Both protocol eras the SDK speaks, over both transports, against a real server process.

"auto" is the current stateless revision (2026-07-28: `server/discover`, no session); "legacy" is the
2025-11-25 initialize handshake that older clients (and the MCP Inspector) still use. An agent gets the
same tools, the same structured answers and the same errors whichever it speaks.
"""

from __future__ import annotations

import asyncio

import pytest
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS

from agent_examples.scripted_agent import connect


def _client(server, transport: str, mode: str):
    if transport == "stdio":
        return connect(stdio_data=str(server.data_dir), mode=mode)
    return connect(f"{server.url}/mcp", mode=mode)


@pytest.mark.parametrize("transport", ["http", "stdio"])
@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_each_era_gets_the_same_tools_and_answers(session_server, transport, mode):
    async def go():
        async with _client(session_server, transport, mode) as c:
            tools = {t.name: t for t in (await c.list_tools()).tools}
            runs = await c.call_tool("list_runs", {})
            unknown = await c.call_tool("get_anomalies", {"run": "no-such-run"})
            schema = await c.read_resource("traindx://schema")
            prompts = [p.name for p in (await c.list_prompts()).prompts]
            return c.protocol_version, tools, runs, unknown, schema, prompts

    version, tools, runs, unknown, schema, prompts = asyncio.run(go())
    if mode == "legacy":
        assert version in HANDSHAKE_PROTOCOL_VERSIONS and version >= "2025-11-25"
    else:
        assert version in MODERN_PROTOCOL_VERSIONS
    assert {"list_runs", "get_anomalies", "diagnose", "propose_fix", "apply_fix", "get_fix_status",
            "revert_fix", "compression_recipe"} <= set(tools)
    assert all(t.output_schema for t in tools.values())
    assert not runs.is_error and isinstance(runs.structured_content["runs"], list)
    assert unknown.is_error and "unknown_run" in unknown.content[0].text
    assert '"$defs"' in schema.contents[0].text
    assert "triage_run" in prompts
