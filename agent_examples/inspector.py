"""MCP conformance, checked by a client this project did not write: the MCP Inspector's CLI.

Starts a real ``traindx serve`` with a live seeded job whose learning rate spikes (so every tool has
something to answer about), then drives the server with ``@modelcontextprotocol/inspector --cli``
(pinned below, installed from the npm registry into ``.cache/inspector`` on first use) over both
transports: Streamable HTTP (``/mcp``, with the bearer token) and stdio (``traindx mcp``). It checks:

- ``tools/list`` (with ``--strict``: no error-severity schema portability problem): every tool, each
  with an input and an output schema, and the annotations an agent relies on (read-only tools say so;
  ``apply_fix`` and ``revert_fix`` are destructive and idempotent; ``propose_fix`` is idempotent);
- ``tools/call`` of every tool with valid arguments: no error, structured content that validates
  against the tool's own output schema, and a text block beside it for clients that read only text;
- a bad call (an unknown run) is a tool error whose text names the known runs;
- ``resources/list``, ``resources/templates/list``, ``resources/read``, ``prompts/list`` and
  ``prompts/get`` answer.

    python -m agent_examples.inspector            # prints one line per check, exits 1 on any failure

It needs Node.js and npm (the tests skip it cleanly when they are absent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parent.parent
INSPECTOR = "@modelcontextprotocol/inspector@2.12.0"
CACHE = ROOT / ".cache" / "inspector"
RUN = "conformance"

READ_ONLY = {"list_runs", "get_run", "get_anomalies", "diagnose", "get_fix_status", "get_audit",
             "compression_recipe", "get_series", "get_timeline", "get_capture", "get_embeddings"}
DESTRUCTIVE = {"apply_fix", "revert_fix"}
IDEMPOTENT = {"propose_fix", "apply_fix", "revert_fix"}


class InspectorError(Exception):
    pass


def install(cache: Path = CACHE) -> Path:
    """The Inspector's launcher, installed with npm into ``cache`` unless it is there already."""
    launcher = cache / "node_modules" / ".bin" / "mcp-inspector"
    if launcher.exists():
        return launcher
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise InspectorError("Node.js and npm are needed to run the MCP Inspector")
    cache.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(cache), INSPECTOR],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or not launcher.exists():
        raise InspectorError(f"npm install {INSPECTOR} failed: {out.stderr[-2000:]}")
    return launcher


@dataclass
class Result:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail and not ok else ''}", flush=True)
        return ok

    @property
    def failed(self) -> list[str]:
        return [f"{n}: {d}" for n, ok, d in self.checks if not ok]


class Inspector:
    """One transport's way of calling ``mcp-inspector --cli``."""

    def __init__(self, launcher: Path, target: list[str], extra: list[str]) -> None:
        self.launcher, self.target, self.extra = launcher, target, extra

    def __call__(self, method: str, *args: str, ok_codes: tuple[int, ...] = (0,)) -> tuple[Any, str]:
        cmd = [str(self.launcher), "--cli", *self.extra, "--method", method, *args, "--", *self.target]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        if out.returncode not in ok_codes:
            raise InspectorError(f"{method} exited {out.returncode}: {(out.stderr or out.stdout)[-1500:]}")
        try:
            return json.loads(out.stdout), out.stderr
        except json.JSONDecodeError:
            raise InspectorError(f"{method} printed no JSON: {out.stdout[-500:]} {out.stderr[-500:]}") from None


def _tool_args(args: dict[str, Any]) -> list[str]:
    if not args:
        return []
    return ["--tool-arg", *(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in args.items())]


def check_transport(name: str, inspector: Inspector, result: Result) -> None:
    listed, stderr = inspector("tools/list", "--strict")
    tools = {t["name"]: t for t in listed.get("tools", [])}
    result.check(f"{name} tools/list --strict", bool(tools), stderr.strip()[-300:])
    for tool, spec in sorted(tools.items()):
        ann = spec.get("annotations") or {}
        problems = []
        if not spec.get("description") or not spec.get("inputSchema", {}).get("type") == "object":
            problems.append("no description or input schema")
        if not spec.get("outputSchema"):
            problems.append("no output schema")
        if ann.get("readOnlyHint", False) != (tool in READ_ONLY):
            problems.append(f"readOnlyHint={ann.get('readOnlyHint')}")
        if tool not in READ_ONLY:
            if ann.get("destructiveHint", True) != (tool in DESTRUCTIVE):
                problems.append(f"destructiveHint={ann.get('destructiveHint')}")
            if ann.get("idempotentHint", False) != (tool in IDEMPOTENT):
                problems.append(f"idempotentHint={ann.get('idempotentHint')}")
        result.check(f"{name} tools/list {tool}: schemas and annotations", not problems, "; ".join(problems))

    def call(tool: str, **args: Any) -> dict:
        out, _ = inspector("tools/call", "--tool-name", tool, *_tool_args(args))
        structured = out.get("structuredContent")
        problems = []
        if out.get("isError"):
            problems.append("is an error: " + " ".join(c.get("text", "") for c in out.get("content", []))[:300])
        elif not isinstance(structured, dict):
            problems.append("no structured content")
        else:
            try:
                jsonschema.validate(structured, tools[tool]["outputSchema"])
            except jsonschema.ValidationError as e:
                problems.append(f"structured content does not match the output schema: {e.message[:200]}")
            if not any(c.get("type") == "text" and c.get("text") for c in out.get("content", [])):
                problems.append("no text content")
        result.check(f"{name} tools/call {tool}", not problems, "; ".join(problems))
        return structured or {}

    call("list_runs")
    call("get_run", run=RUN)
    anomalies = call("get_anomalies", run=RUN, status="open").get("anomalies") or [{}]
    call("diagnose", run=RUN)
    fixes = call("propose_fix", run=RUN, anomaly_id=anomalies[0].get("id", "a-1")).get("fixes") or [{}]
    fix = fixes[0].get("id", "f-1")
    call("apply_fix", run=RUN, fix_id=fix)
    call("get_fix_status", run=RUN, fix_id=fix)
    call("revert_fix", run=RUN, fix_id=fix)
    call("get_audit", run=RUN, fix_id=fix)
    call("compression_recipe", run=RUN, target_sparsity=0.5)
    call("propose_prune", run=RUN, target_sparsity=0.5)
    call("measure_sensitivity", run=RUN)
    call("get_series", run=RUN, name="loss", max_points=50)
    call("get_embeddings", run=RUN)
    call("get_timeline", run=RUN, limit=50)
    capture = call("capture", run=RUN, steps=1, profile=False)
    call("get_capture", run=RUN, capture_id=capture.get("id", "c-1"))
    untested = set(tools) - {"list_runs", "get_run", "get_anomalies", "diagnose", "propose_fix", "apply_fix",
                             "get_fix_status", "revert_fix", "get_audit", "compression_recipe", "propose_prune",
                             "measure_sensitivity", "get_series", "get_timeline", "capture", "get_capture",
                             "get_embeddings"}
    result.check(f"{name} every listed tool was called", not untested, f"not called: {sorted(untested)}")

    # The CLI exits 5 for a tool error and still prints the result.
    bad, _ = inspector("tools/call", "--tool-name", "get_anomalies", "--tool-arg", "run=no-such-run", ok_codes=(5,))
    text = " ".join(c.get("text", "") for c in bad.get("content", []))
    result.check(f"{name} an unknown run is a tool error naming the known runs",
                 bool(bad.get("isError")) and "unknown_run" in text and RUN in text, text[:200])

    resources, _ = inspector("resources/list")
    result.check(f"{name} resources/list", any(r.get("uri") == "traindx://schema" for r in resources.get("resources", [])))
    templates, _ = inspector("resources/templates/list")
    result.check(f"{name} resources/templates/list",
                 any(t.get("uriTemplate") == "traindx://runs/{run}/report" for t in templates.get("resourceTemplates", [])))
    report, _ = inspector("resources/read", "--uri", f"traindx://runs/{RUN}/report")
    result.check(f"{name} resources/read report", RUN in json.dumps(report))
    prompts, _ = inspector("prompts/list")
    result.check(f"{name} prompts/list", any(p.get("name") == "triage_run" for p in prompts.get("prompts", [])))
    prompt, _ = inspector("prompts/get", "--prompt-name", "triage_run", "--prompt-args", f"run={RUN}")
    result.check(f"{name} prompts/get triage_run", f"run='{RUN}'" in json.dumps(prompt))


def _wait_for_anomaly(url: str, token: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/runs/{RUN}/anomalies", params={"status": "open"},
                      headers={"authorization": f"Bearer {token}"}, timeout=5)
        if r.status_code == 200 and r.json().get("anomalies"):
            return
        time.sleep(0.3)
    raise InspectorError(f"the seeded job raised no anomaly within {timeout:.0f} s")


def run(transports: tuple[str, ...] = ("http", "stdio")) -> Result:
    """Each transport gets its own server, data directory and live job: a fix applied and reverted over
    one must not be what the other finds."""
    launcher = install()
    result = Result()
    for transport in transports:
        check_transport_on_a_fresh_server(launcher, transport, result)
    return result


def check_transport_on_a_fresh_server(launcher: Path, transport: str, result: Result) -> None:
    from agent_examples.jobs import lr_spike_job
    from diag_server.testing import serve

    data = tempfile.mkdtemp(prefix="traindx-inspector-")
    server = serve(data)
    url = server.url
    token = os.environ["TRAINDX_TOKEN"]
    stop = threading.Event()
    job = threading.Thread(target=lr_spike_job, daemon=True, kwargs=dict(
        run=RUN, steps=100_000, fault_step=150, stop=stop, probe_kwargs={"server": url, "spool_dir": f"{data}/spool"}))
    try:
        job.start()
        _wait_for_anomaly(url, token)
        if transport == "http":
            inspector = Inspector(launcher, [f"{url}/mcp"],
                                  ["--transport", "http", "--header", f"Authorization: Bearer {token}"])
        else:
            inspector = Inspector(launcher, [sys.executable, "-m", "diag_server.cli", "mcp", "--data", data],
                                  ["--transport", "stdio"])
        check_transport(transport, inspector, result)
    finally:
        stop.set()
        job.join(30)
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["http", "stdio", "both"], default="both")
    args = p.parse_args()
    try:
        result = run(("http", "stdio") if args.transport == "both" else (args.transport,))
    except InspectorError as e:
        sys.exit(f"inspector: {e}")
    passed = sum(ok for _, ok, _ in result.checks)
    print(f"{passed}/{len(result.checks)} checks passed ({INSPECTOR})")
    sys.exit(1 if result.failed else 0)


if __name__ == "__main__":
    main()
