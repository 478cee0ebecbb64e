"""The LLM-driven example's tool loop, against a real server, with a scripted stand-in for the model.

The model's side is a fixed script of tool requests (no provider, no key): what is tested is the MCP
side of the loop, which a real model relies on: tools advertised in the Messages API's shape, each
request sent to the server, its structured result handed back, destructive tools refused unless allowed.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass, field

from agent_examples.llm_agent import triage_with_llm
from agent_examples.scripted_agent import connect
from tests.conftest import ROOT


@dataclass
class Block:
    type: str
    text: str = ""
    id: str = ""
    name: str = ""
    input: dict = field(default_factory=dict)

    def model_dump(self, exclude_none: bool = True) -> dict:
        return {k: v for k, v in self.__dict__.items() if v}


@dataclass
class Reply:
    content: list[Block]


class ScriptedModel:
    """Answers each turn from a script; records what it was sent."""

    def __init__(self, turns: list[list[Block]]) -> None:
        self.turns, self.seen = turns, []
        self.messages = self

    def create(self, **kwargs):
        self.seen.append({**kwargs, "messages": list(kwargs["messages"])})  # the loop appends to its list
        return Reply(self.turns[len(self.seen) - 1])


def test_the_loop_calls_tools_returns_structured_results_and_refuses_writes(session_server):
    model = ScriptedModel([
        [Block("text", text="Looking."), Block("tool_use", id="t1", name="list_runs")],
        [Block("tool_use", id="t2", name="get_anomalies", input={"run": "nope"}),
         Block("tool_use", id="t3", name="apply_fix", input={"run": "nope", "fix_id": "f-1"})],
        [Block("text", text="No such run; nothing to fix.")],
    ])

    async def go():
        async with connect(f"{session_server.url}/mcp", name="llm-test") as client:
            return await triage_with_llm(client, model, "nope", model="scripted", log=lambda _: None)

    report = asyncio.run(go())
    assert report == "No such run; nothing to fix."
    first = model.seen[0]
    assert "get_anomalies(run='nope'" in first["messages"][0]["content"]
    tools = {t["name"]: t for t in first["tools"]}
    assert tools["get_anomalies"]["input_schema"]["required"] == ["run"] and tools["apply_fix"]["description"]
    runs = model.seen[1]["messages"][-1]["content"][0]
    assert runs["tool_use_id"] == "t1" and runs["content"].startswith('{"runs":') and not runs["is_error"]
    unknown, refused = model.seen[2]["messages"][-1]["content"]
    assert unknown["is_error"] and "unknown_run" in unknown["content"]
    assert refused["is_error"] and refused["content"].startswith("refused: apply_fix")


def test_without_a_key_it_says_so():
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "agent_examples.llm_agent", "--run", "x"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "ANTHROPIC_API_KEY" in out.stderr
