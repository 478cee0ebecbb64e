"""Nobody let in: the token on every route, Host/Origin checks (scheme, host and port) on every route and
/mcp, the dashboard's cookie, loopback by default, the job's own bounds."""

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


def _lookalikes(port: int) -> tuple[list[str], list[str]]:
    """Hosts and Origins that are not this server: its names at other ports, look-alike names, other
    schemes, ``null``. (Each would pass a check that compares host names only, or prefixes.)"""
    other = 1 if port != 1 else 2
    hosts = [f"localhost:{other}", "127.0.0.1:1", f"[::1]:{other}", f"127.0.0.1.evil.com:{port}",
             f"localhost.attacker:{port}", f"evil.example:{port}", "localhost", "127.0.0.1", f"127.0.0.1:{port}0",
             f"127.0.0.1:{port}.evil.com", f"localhost:{port}@evil.example", ""]
    origins = [f"http://localhost:{other}", "http://127.0.0.1:1", f"http://[::1]:{other}",
               f"http://127.0.0.1.evil.com:{port}", f"http://localhost.attacker:{port}", "null",
               f"https://127.0.0.1:{port}", "http://127.0.0.1", f"http://127.0.0.1:{port}.evil.com",
               f"http://127.0.0.1:{port}0", "http://evil.example", f"file://127.0.0.1:{port}", ""]
    return hosts, origins


def test_only_this_servers_host_and_origin_get_in_on_every_route(srv) -> None:  # noqa: ANN001
    """Every route and /mcp, with the bearer token, with the dashboard's cookie and with neither: a Host or
    an Origin naming anything but this server (scheme, host and port) is refused before the route runs;
    this server's own names and origins get through to it."""
    routes = _routes(srv)
    hosts, origins = _lookalikes(srv.port)
    good_hosts = [f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", f"LOCALHOST:{srv.port}"]
    good_origins = [f"http://127.0.0.1:{srv.port}", f"http://localhost:{srv.port}"]
    auths = {"bearer": {"authorization": f"Bearer {srv.token}"}, "cookie": {"cookie": f"traindx_token={srv.token}"},
             "none": {}}
    cases = 0
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for method, path in routes:
            body = {"json": {}} if method in ("POST", "PUT") else {}
            for auth, creds in auths.items():
                for host in hosts:
                    r = c.request(method, path, headers={**creds, "host": host}, **body)
                    cases += 1
                    assert r.status_code == 421 and r.json()["error"] == "invalid_host", (method, path, auth, host)
                for origin in origins:
                    r = c.request(method, path, headers={**creds, "origin": origin}, **body)
                    cases += 1
                    assert r.status_code == 403 and r.json()["error"] == "invalid_origin", (method, path, auth, origin)
            for host in good_hosts:
                for origin in (None, *good_origins):
                    headers = {**auths["bearer"], "host": host, **({"origin": origin} if origin else {})}
                    r = c.request(method, path, headers=headers, **body)
                    cases += 1
                    assert r.status_code not in (401, 403, 421), (method, path, host, origin, r.status_code, r.text[:200])
            # The dashboard's cookie: enough to read; a write needs the Origin a browser always sends with one.
            r = c.request(method, path, headers={**auths["cookie"], "origin": good_origins[0]}, **body)
            assert r.status_code not in (401, 403, 421), (method, path, r.status_code)
            if method not in ("GET", "HEAD") and path != "/health":
                r = c.request(method, path, headers=auths["cookie"], **body)
                assert r.status_code == 403 and r.json()["error"] == "invalid_origin", (method, path)
            cases += 2
    assert cases > 3000
    # The SDK's own check on /mcp holds the same list (a second line, behind the middleware).
    from diag_server.api.security import Authorities, mcp_transport_security

    sdk = mcp_transport_security(Authorities("127.0.0.1", srv.port))
    assert f"127.0.0.1:{srv.port}" in sdk.allowed_hosts and not any(h.endswith(":*") for h in sdk.allowed_hosts)
    assert "http://127.0.0.1:1" not in sdk.allowed_origins and "null" not in sdk.allowed_origins


def test_a_cross_port_page_cannot_apply_a_fix_with_the_dashboards_cookie(srv) -> None:  # noqa: ANN001
    """What the issue saw: a page on another local port posting to .../apply with the browser's cookie."""
    cookie = {"cookie": f"traindx_token={srv.token}"}
    for origin in (f"http://localhost:{srv.port + 1}", "http://127.0.0.1:1", "null"):
        r = httpx.post(f"{srv.url}/v1/runs/r/fixes/f-1/apply", headers={**cookie, "origin": origin})
        assert r.status_code == 403 and r.json()["error"] == "invalid_origin", origin
        r = httpx.post(f"{srv.url}/mcp", headers={**cookie, "origin": origin, "content-type": "application/json"},
                       json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 403, origin


def test_configured_hosts_and_origins_are_let_in_exactly(tmp_path: Path) -> None:
    s = make_server(tmp_path, "--allow-host", "proxy.example", "--allow-host", "tunnel.example:9000",
                    "--allow-origin", "https://proxy.example")
    s.start()
    try:
        def status(host: str, origin: str | None = None) -> int:
            headers = {**s.headers, "host": host, **({"origin": origin} if origin else {})}
            return httpx.get(f"{s.url}/v1/runs", headers=headers).status_code

        assert status("proxy.example") == 200  # a proxy in front forwards its own name, without a port
        assert status(f"proxy.example:{s.port}") == 200
        assert status("tunnel.example:9000") == 200
        assert status("proxy.example", "https://proxy.example") == 200
        assert status("tunnel.example:9000", "http://tunnel.example:9000") == 200
        assert status("tunnel.example:9001") == 421 and status("tunnel.example") == 421
        assert status("proxy.example:9000") == 421
        assert status("proxy.example", "https://proxy.example:8443") == 403
        assert status("proxy.example", "http://proxy.example.evil.com") == 403
    finally:
        s.stop()


def test_a_person_without_the_token_is_told_how_to_open_the_dashboard(srv) -> None:  # noqa: ANN001
    browser = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
    for path in ("/", "/runs/r", "/v1/runs"):
        page = httpx.get(f"{srv.url}{path}", headers=browser)
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html"), path
        assert "traindx open" in page.text and "?token=" in page.text and srv.token not in page.text
    script = httpx.get(f"{srv.url}/v1/runs")  # a script still gets the one error shape
    assert script.status_code == 401 and script.json()["error"] == "unauthorized"
    r = CliRunner().invoke(main, ["open", "--print-only", "--data", str(srv.data_dir), "--server", srv.url],
                           env={"TRAINDX_TOKEN": None})
    assert r.exit_code == 0, r.output
    link = r.output.strip().splitlines()[-1]
    assert link == f"{srv.url}/?token={srv.token}"
    with httpx.Client() as c:
        assert c.get(link, headers=browser).status_code == 200 and c.cookies.get("traindx_token") == srv.token
    r = CliRunner().invoke(main, ["open", "--print-only", "--data", str(srv.data_dir / "nowhere")],
                           env={"TRAINDX_TOKEN": None})
    assert r.exit_code == 1 and "traindx serve" in r.output


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
