"""What the MCP server offers beside tools: the run report and the contract as resources, the triage prompt."""

from __future__ import annotations

import json

from mcp.server.mcpserver import Context

from schemas.export import json_schema

from ...read import diagnosis
from .server import TraindxMCP, call, services


async def run_report(run: str, ctx: Context) -> str:
    return (await call(diagnosis.diagnose, services(ctx).store, run)).report


def contract_schema() -> str:
    return json.dumps(json_schema())


def triage_run(run: str) -> str:
    return (f"Training run {run!r} is being watched by traindx. 1) Call get_anomalies(run={run!r}, "
            "status='open') and read the most severe. 2) Call diagnose to find the root cause. 3) Call "
            "propose_fix for the root cause's anomaly and apply_fix with the first live proposal the job allows. "
            "4) Poll get_fix_status until it is effective or ineffective; if get_audit's verdict entry for the fix "
            "says revert_suggested, revert_fix; if ineffective, try the next proposal. Report what you found, what "
            "you changed (before -> after) and the verdict.")


def register(server: TraindxMCP) -> None:
    server.resource("traindx://runs/{run}/report", mime_type="text/plain",
                    description="The run's diagnosis as a report a person can read.")(run_report)
    server.resource("traindx://schema", mime_type="application/schema+json",
                    description="The JSON Schema of every event and record (schemas/traindx.schema.json).")(
        contract_schema)
    server.prompt(description="Find what is wrong with a training run and fix it, step by step.")(triage_run)
