"""An LLM-driven agent: the prompt and tool loop a real assistant uses with traindx.

The scripted agent (scripted_agent.py) hard-codes the triage loop; this one lets a model decide. It
connects to traindx with the official MCP client, hands the model every traindx tool (name, description
and input schema, exactly as ``tools/list`` advertises them), starts the conversation with the server's own
``triage_run`` prompt, and runs the loop: the model asks for tools, each call goes to the server, each
result (its structured content, as compact JSON) goes back, until the model answers without a tool call
or the turn budget runs out. Tools annotated destructive (``apply_fix``, ``revert_fix``: they change
the job) run only with ``--allow-writes``; without it the model is told they were refused, so it can look,
diagnose and propose, and the person decides.

Needs the ``anthropic`` SDK (``pip install -e ".[llm]"``) and ``ANTHROPIC_API_KEY``; without the key it
says so and exits 1. No test needs it.

    traindx serve &                                   # and a training job with a probe attached
    python -m agent_examples.llm_agent --run my-run --allow-writes
    python -m agent_examples.llm_agent --run my-run --stdio --data .traindx   # no server needed
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from typing import Any

import orjson

from agent_examples.scripted_agent import connect

DEFAULT_MODEL = "claude-sonnet-5-5"
SYSTEM = """You are an ML engineer's assistant attached to a live PyTorch training job through traindx.
Find what is going wrong and fix it while the job runs. Work from evidence: read the anomalies and the
diagnosis before proposing anything, prefer the root cause over its consequences, apply one fix at a
time, and wait for its verdict (get_fix_status) before trying another; revert a fix that made things
worse. Fixes that need a restart are advice: give the user the exact code change. End with a short
report: what went wrong, at which step, what you did, and the verdict."""


def anthropic_tools(tools: list[Any]) -> list[dict]:
    """MCP tool definitions as the Messages API takes them."""
    return [{"name": t.name, "description": t.description or "", "input_schema": t.input_schema} for t in tools]


def tool_result_text(result: Any) -> str:
    """What the model reads of a tool result: the structured content as compact JSON, else the text."""
    if result.structured_content is not None:
        return orjson.dumps(result.structured_content).decode()
    return "\n".join(getattr(c, "text", "") for c in result.content)


async def triage_with_llm(client: Any, llm: Any, run: str, *, model: str, max_turns: int = 30,
                          allow_writes: bool = False, log: Any = print) -> str:
    listed = (await client.list_tools()).tools
    destructive = {t.name for t in listed if t.annotations and t.annotations.destructive_hint}
    prompt = await client.get_prompt("triage_run", {"run": run})
    messages: list[dict] = [{"role": "user", "content": prompt.messages[0].content.text}]
    tools = anthropic_tools(listed)
    for _ in range(max_turns):
        reply = await asyncio.to_thread(llm.messages.create, model=model, max_tokens=2048, system=SYSTEM,
                                        tools=tools, messages=messages)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        for b in reply.content:
            if b.type == "text" and b.text.strip():
                log(f"assistant: {b.text.strip()}")
        if not calls:
            return "\n".join(b.text for b in reply.content if b.type == "text")
        results = []
        for call in calls:
            log(f"-> {call.name}({orjson.dumps(call.input).decode()})")
            if call.name in destructive and not allow_writes:
                text, is_error = f"refused: {call.name} changes the job; run with --allow-writes to let it", True
            else:
                result = await client.call_tool(call.name, call.input)
                text, is_error = tool_result_text(result), result.is_error
            log(f"<- {'error: ' if is_error else ''}{text[:300]}")
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": text, "is_error": is_error})
        messages.append({"role": "user", "content": results})
    return f"stopped after {max_turns} turns without a final answer"


async def main_async(args: argparse.Namespace) -> int:
    import anthropic

    llm = anthropic.Anthropic()
    async with connect(args.server, stdio_data=args.data if args.stdio else None, name="traindx-llm-agent") as client:
        report = await triage_with_llm(client, llm, args.run, model=args.model, max_turns=args.max_turns,
                                       allow_writes=args.allow_writes)
    print("\n" + report)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default="http://127.0.0.1:8765/mcp", help="MCP endpoint (Streamable HTTP)")
    p.add_argument("--stdio", action="store_true", help="launch `traindx mcp` and talk to it over stdio")
    p.add_argument("--data", default=".traindx", help="data directory for --stdio")
    p.add_argument("--run", required=True)
    p.add_argument("--model", default=os.environ.get("TRAINDX_LLM_MODEL", DEFAULT_MODEL))
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--allow-writes", action="store_true", help="let the model apply and revert fixes")
    args = p.parse_args()
    if not os.environ.get("ANTHROPIC_API_KEY"):
        sys.exit("llm_agent: set ANTHROPIC_API_KEY to run the LLM-driven example (the scripted agent needs no key)")
    if importlib.util.find_spec("anthropic") is None:
        sys.exit('llm_agent: pip install -e ".[llm]" for the anthropic SDK')
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
