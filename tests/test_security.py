"""Nobody let in: the token on every route, Host/Origin checks, loopback by default, the job's own bounds."""

from __future__ import annotations

import stat
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
import torch
from click.testing import CliRunner
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import probes
from diag_server.cli import main
from probes.sinks import MemorySink

from tests.conftest import make_server


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    s = make_server(tmp_path_factory.mktemp("sec"), env={"TRAINDX_TOKEN": None})
    s.start()
    yield s
    s.stop()


def _routes(srv) -> list[tuple[str, str]]:  # noqa: ANN001
    spec = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers).json()
    out = [(m.upper(), p.replace("{run}", "r").replace("{anomaly_id}", "a-1").replace("{fix_id}", "f-1")
            .replace("{name}", "loss")) for p, ops in spec["paths"].items() for m in ops]
    return [*out, ("POST", "/mcp"), ("GET", "/mcp"), ("GET", "/openapi.json"), ("GET", "/docs")]


def test_token_is_generated_on_first_start_with_0600_and_kept(srv, tmp_path: Path) -> None:  # noqa: ANN001
    path = srv.data_dir / "token"
    mode = stat.S_IMODE(path.stat().st_mode)
    assert mode == 0o600
    first = path.read_text().strip()
    assert len(first) >= 32
    again = make_server(tmp_path, env={"TRAINDX_TOKEN": None})
    again.data_dir = srv.data_dir
    assert again.token == first


def test_every_route_but_health_needs_the_token(srv) -> None:  # noqa: ANN001
    routes = _routes(srv)
    assert len(routes) > 10
    for method, path in routes:
        if path == "/health":
            continue
        for headers in ({}, {"authorization": "Bearer wrong-token-wrong-token"}, {"authorization": srv.token}):
            r = httpx.request(method, srv.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.json()["error"] == "unauthorized"
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert httpx.get(f"{srv.url}/v1/runs", headers=srv.headers).status_code == 200


def test_the_dashboard_link_sets_a_cookie_that_authorizes(srv) -> None:  # noqa: ANN001
    with httpx.Client(base_url=srv.url) as c:
        assert c.get("/v1/runs", params={"token": "nope"}).status_code == 401
        assert c.get("/v1/runs", params={"token": srv.token}).status_code == 200
        cookie = c.cookies.get("traindx_token")
        assert cookie == srv.token
        assert c.get("/v1/runs").status_code == 200


@pytest.mark.parametrize("path", ["/v1/runs", "/mcp", "/health"])
def test_dns_rebinding_and_cross_site_requests_are_refused(srv, path: str) -> None:  # noqa: ANN001
    method = "POST" if path == "/mcp" else "GET"
    evil_host = httpx.request(method, srv.url + path, headers={**srv.headers, "host": f"evil.example:{srv.port}"})
    assert evil_host.status_code == 421 and evil_host.json()["error"] == "invalid_host"
    evil_origin = httpx.request(method, srv.url + path, headers={**srv.headers, "origin": "http://evil.example"})
    assert evil_origin.status_code == 403 and evil_origin.json()["error"] == "invalid_origin"
    same = httpx.get(f"{srv.url}/health", headers={"origin": f"http://localhost:{srv.port}",
                                                     "host": f"localhost:{srv.port}"})
    assert same.status_code == 200


def test_read_routes_open_only_when_asked_and_writes_never(tmp_path: Path) -> None:
    s = make_server(tmp_path, "--open-reads")
    s.start()
    try:
        assert httpx.get(f"{s.url}/v1/runs").status_code == 200
        assert httpx.post(f"{s.url}/v1/ingest", json={}).status_code == 401
        assert httpx.delete(f"{s.url}/v1/runs/r").status_code == 401
        assert httpx.post(f"{s.url}/mcp", json={}).status_code == 401
    finally:
        s.stop()


def test_mcp_clients_pass_the_token_from_the_environment(srv) -> None:  # noqa: ANN001
    async def call(headers: dict) -> bool:
        async with httpx2.AsyncClient(headers=headers) as http:
            async with Client(streamable_http_client(f"{srv.url}/mcp", http_client=http)) as client:
                return not (await client.call_tool("list_runs", {})).is_error

    assert anyio.run(call, srv.headers)
    with pytest.raises(Exception):  # noqa: B017 - the SDK surfaces the 401 as its own error type
        anyio.run(call, {})


def test_the_probe_finds_the_token_in_the_data_dir(srv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("TRAINDX_TOKEN")
    monkeypatch.setenv("TRAINDX_DATA", str(srv.data_dir))
    model = torch.nn.Linear(2, 1)
    with probes.attach(model, run="finds-token", server=srv.url, spool_dir=tmp_path / "spool") as p:
        p.step(loss=1.0)
        assert p.flush(30)
    assert httpx.get(f"{srv.url}/v1/runs/finds-token", headers=srv.headers).status_code == 200


def test_binding_beyond_loopback_needs_an_explicit_flag(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data", str(tmp_path)])
    assert r.exit_code == 2 and "--allow-remote" in r.output
    r = CliRunner().invoke(main, ["serve", "--token", "short", "--data", str(tmp_path)])
    assert r.exit_code == 2 and "16" in r.output


def test_the_job_decides_what_it_accepts_and_the_server_cannot_widen_it() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = MemorySink()
    probe = probes.attach(model, opt, run="bounds", sink=sink, allow={"lr_scale": {"max_factor": 2.0}})
    sink.commands = [
        {"fix_id": "f-1", "op": "apply", "action": "lr_scale", "params": {"factor": 10.0}},  # beyond the job's bound
        {"fix_id": "f-2", "op": "apply", "action": "lr_scale", "params": {"factor": 10.0, "max_factor": 100.0}},
        {"fix_id": "f-3", "op": "apply", "action": "grad_clip", "params": {"max_norm": 1.0}},  # not allowed
        {"fix_id": "f-4", "op": "apply", "action": "set_lr", "params": {"lr": 5.0}},  # not allowed
        {"fix_id": "f-5", "op": "revert", "action": "lr_scale"},  # nothing applied to revert
        {"fix_id": "f-6", "op": "apply", "action": "lr_scale", "params": {"factor": 1.5}},  # within bounds
    ]
    for _ in range(3):
        probe.step(loss=1.0)
        probe.flush(5)
    probe.close()
    acks = {e["fix_id"]: e for e in sink.events if e["kind"] == "fix_ack"}
    assert [acks[f]["status"] for f in ("f-1", "f-2", "f-3", "f-4", "f-5", "f-6")] == [
        "rejected", "rejected", "rejected", "rejected", "failed", "applied"]
    assert "bounds" in acks["f-1"]["reason"] and "does not allow" in acks["f-3"]["reason"]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.015)  # only f-6 changed the job
