"""``traindx timeline`` and ``traindx capture``: the distributed-run commands, over a server's HTTP API."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click


def _server_option(f):  # noqa: ANN001
    return click.option("--server", default=lambda: os.environ.get("TRAINDX_SERVER", "http://127.0.0.1:8765"),
                        show_default="http://127.0.0.1:8765", help="The traindx server. Env: TRAINDX_SERVER.")(f)


def _client(server: str):  # noqa: ANN202
    import httpx

    headers = {"x-traindx-actor": "cli"}
    token = os.environ.get("TRAINDX_TOKEN")
    if token:
        headers["authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=60)


def _fail(r) -> None:  # noqa: ANN001
    try:
        body = r.json()
        msg = f"{body.get('error')}: {body.get('message')}"
    except ValueError:
        msg = r.text[:500]
    click.echo(f"traindx: {r.status_code} {msg}", err=True)
    sys.exit(1)


@click.command("timeline")
@click.argument("run")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the Chrome trace / Perfetto JSON here (default: RUN.trace.json).")
@click.option("--min-step", type=int, default=None, help="Only steps at or after this one.")
@click.option("--max-step", type=int, default=None, help="Only steps at or before this one.")
@_server_option
def timeline_command(run: str, output: Path | None, min_step: int | None, max_step: int | None, server: str) -> None:
    """Export RUN's timeline across ranks as a Chrome trace (open it in ui.perfetto.dev or chrome://tracing)."""
    params: dict = {"format": "chrome"}
    if min_step is not None:
        params["min_step"] = min_step
    if max_step is not None:
        params["max_step"] = max_step
    with _client(server) as c:
        r = c.get(f"/v1/runs/{run}/timeline", params=params)
    if r.status_code != 200:
        _fail(r)
    out = output or Path(f"{run}.trace.json")
    out.write_bytes(r.content)
    trace = r.json()
    spans = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X")
    ranks = len({e["pid"] for e in trace["traceEvents"]})
    click.echo(f"{out}: {spans} spans from {ranks} rank(s); open it in https://ui.perfetto.dev")


@click.command("capture")
@click.argument("run")
@click.option("--steps", type=int, default=5, show_default=True, help="Steps to record in full.")
@click.option("--no-profile", is_flag=True, help="Record statistics and shapes only, without torch.profiler.")
@_server_option
def capture_command(run: str, steps: int, no_profile: bool, server: str) -> None:
    """Ask every rank of RUN to record everything for its next STEPS steps, with torch.profiler."""
    with _client(server) as c:
        r = c.post(f"/v1/runs/{run}/captures", params={"steps": steps, "profile": str(not no_profile).lower()})
    if r.status_code != 201:
        _fail(r)
    cap = r.json()
    click.echo(f"{cap['id']}: {cap['status']}; see GET /v1/runs/{run}/captures/{cap['id']}")
