"""What an agent sees of the MCP server: tool schemas and annotations, resources, the triage prompt, errors."""

from __future__ import annotations

import asyncio

import pytest
from mcp import Client

from diag_server.pipeline.services import Services, Settings
from diag_server.api.mcp import build_mcp


@pytest.fixture
def mcp_server(tmp_path):
    services = Services(Settings(data_dir=tmp_path / "data"))
    yield build_mcp(services, "test")
    services.close()


def run(coro):
    return asyncio.run(coro)


def test_tools_advertise_schemas_and_honest_annotations(mcp_server):
    async def go():
        async with Client(mcp_server) as c:
            return {t.name: t for t in (await c.list_tools()).tools}
    tools = run(go())
    for name in ("get_anomalies", "propose_fix", "apply_fix", "compression_recipe", "diagnose", "revert_fix"):
        assert tools[name].input_schema["type"] == "object" and tools[name].output_schema, name
        assert tools[name].description and len(tools[name].description) > 80, name
    for name in ("list_runs", "get_anomalies", "diagnose", "get_fix_status", "compression_recipe"):
        assert tools[name].annotations.read_only_hint is True, name
    assert tools["apply_fix"].annotations.read_only_hint is False
    assert tools["apply_fix"].annotations.destructive_hint is True
    assert tools["apply_fix"].annotations.idempotent_hint is True
    assert tools["propose_fix"].annotations.destructive_hint is False


def test_resources_and_the_triage_prompt(mcp_server):
    async def go():
        async with Client(mcp_server) as c:
            statics = [str(r.uri) for r in (await c.list_resources()).resources]
            templates = [t.uri_template for t in (await c.list_resource_templates()).resource_templates]
            prompt = await c.get_prompt("triage_run", {"run": "exp-1"})
            schema = await c.read_resource("traindx://schema")
            return statics, templates, prompt, schema
    statics, templates, prompt, schema = run(go())
    assert "traindx://schema" in statics and "traindx://runs/{run}/report" in templates
    assert "get_anomalies(run='exp-1'" in prompt.messages[0].content.text
    assert '"$defs"' in schema.contents[0].text


def test_errors_an_agent_can_act_on(mcp_server):
    async def go():
        async with Client(mcp_server) as c:
            unknown = await c.call_tool("get_anomalies", {"run": "nope"})
            bad = await c.call_tool("get_anomalies", {"run": "nope", "limit": 0})
            return unknown, bad
    unknown, bad = run(go())
    assert unknown.is_error and "unknown_run" in unknown.content[0].text and "known runs" in unknown.content[0].text
    assert bad.is_error and "limit" in bad.content[0].text


def test_descriptions_read_cleanly(mcp_server):
    async def go():
        async with Client(mcp_server) as c:
            return (await c.list_tools()).tools
    for t in run(go()):
        assert "\n " not in t.description and t.description == t.description.strip(), t.name


def test_a_tool_refuses_an_argument_it_does_not_take(mcp_server):
    """The SDK drops unknown arguments; a write must not run on a call that meant something else."""
    async def go():
        async with Client(mcp_server) as c:
            return await c.call_tool("apply_fix", {"run": "r", "fix_id": "f-1", "dry_run": True})
    res = run(go())
    assert res.is_error and res.content[0].text.startswith("invalid_arguments: apply_fix does not take 'dry_run'")


def test_every_integer_argument_has_a_range(mcp_server):
    async def go():
        async with Client(mcp_server) as c:
            return (await c.list_tools()).tools

    def integers(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                yield node
            for v in node.values():
                yield from integers(v)
        elif isinstance(node, list):
            for v in node:
                yield from integers(v)

    found = [(t.name, n) for t in run(go()) for n in integers(t.input_schema)]
    assert len(found) >= 10
    for name, node in found:
        assert "maximum" in node and ("minimum" in node or "exclusiveMinimum" in node), (name, node)
