"""The HTTP API for people, against a real server holding a real (finished) training run that went wrong:
parity with the MCP tools, JSON and XML, content negotiation, the one error shape, the OpenAPI
description, paging and filters, downsampling that keeps spikes, and the change stream."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx
import orjson
import pytest
from lxml import etree

from tests.conftest import PEOPLE_RUN, PEOPLE_TOKEN, ServerProcess
from diag_server.read.downsample import min_max, min_max_query
from diag_server.api.xml import xsd_schema

RUN = PEOPLE_RUN
AUTH = {"authorization": f"Bearer {PEOPLE_TOKEN}"}
XML_PARSER = etree.XMLParser(resolve_entities=False, no_network=True)

# Each MCP tool and the HTTP route that answers the same question through the same function.
TOOL_ROUTES = {
    "list_runs": ("GET", "/v1/runs"),
    "get_run": ("GET", "/v1/runs/{run}"),
    "get_anomalies": ("GET", "/v1/runs/{run}/anomalies"),
    "diagnose": ("GET", "/v1/runs/{run}/diagnosis"),
    "propose_fix": ("POST", "/v1/runs/{run}/anomalies/{anomaly_id}/propose"),
    "apply_fix": ("POST", "/v1/runs/{run}/fixes/{fix_id}/apply"),
    "get_fix_status": ("GET", "/v1/runs/{run}/fixes/{fix_id}"),
    "revert_fix": ("POST", "/v1/runs/{run}/fixes/{fix_id}/revert"),
    "get_audit": ("GET", "/v1/runs/{run}/audit"),
    "compression_recipe": ("GET", "/v1/runs/{run}/compression"),
    "get_series": ("GET", "/v1/runs/{run}/series/{name}"),
    "get_embeddings": ("GET", "/v1/runs/{run}/embeddings"),
    "propose_prune": ("POST", "/v1/runs/{run}/compression/prune"),
    "measure_sensitivity": ("POST", "/v1/runs/{run}/compression/sensitivity"),
    "capture": ("POST", "/v1/runs/{run}/captures"),
    "get_capture": ("GET", "/v1/runs/{run}/captures/{capture_id}"),
    "get_timeline": ("GET", "/v1/runs/{run}/timeline"),
}


@pytest.fixture
def srv(people_server: ServerProcess) -> ServerProcess:
    return people_server


def get(srv: ServerProcess, path: str, **kw) -> httpx.Response:
    return httpx.get(f"{srv.url}{path}", timeout=10, **kw)


def test_every_mcp_tool_has_an_http_route_that_answers_the_same(srv: ServerProcess) -> None:
    from agent_examples.scripted_agent import connect

    async def tools() -> tuple[list[str], dict[str, dict]]:
        async with connect(f"{srv.url}/mcp", token=PEOPLE_TOKEN) as mcp:
            names = [t.name for t in (await mcp.list_tools()).tools]
            calls = {"list_runs": {}, "get_run": {"run": RUN}, "diagnose": {"run": RUN},
                     "get_anomalies": {"run": RUN, "limit": 50},
                     "get_series": {"run": RUN, "name": "loss", "max_points": 50},
                     "get_embeddings": {"run": RUN}}
            return names, {n: (await mcp.call_tool(n, args)).structured_content for n, args in calls.items()}

    names, answers = asyncio.run(tools())
    paths = get(srv, "/openapi.json").json()["paths"]
    assert sorted(names) == sorted(TOOL_ROUTES), "a new MCP tool needs an HTTP route (and a line in TOOL_ROUTES)"
    for method, path in TOOL_ROUTES.values():
        assert method.lower() in paths[path], f"{method} {path} is not in /openapi.json"
    http = {"list_runs": "/v1/runs", "get_run": f"/v1/runs/{RUN}", "diagnose": f"/v1/runs/{RUN}/diagnosis",
            "get_anomalies": f"/v1/runs/{RUN}/anomalies?limit=50", "get_series": f"/v1/runs/{RUN}/series/loss?max_points=50",
            "get_embeddings": f"/v1/runs/{RUN}/embeddings"}
    for name, path in http.items():
        body = get(srv, path).json()
        mine = answers[name]
        if name == "list_runs":  # other tests' runs may come and go: compare this run's entry
            body, mine = ([r for r in d["runs"] if r["run"] == RUN] for d in (body, mine))
        assert body == mine, name


GET_ROUTES = [
    ("/health", "Health"), ("/v1/runs", "RunPage"), (f"/v1/runs/{RUN}", "RunSummary"),
    (f"/v1/runs/{RUN}/anomalies", "AnomalyPage"), (f"/v1/runs/{RUN}/anomalies/a-1", "Anomaly"),
    (f"/v1/runs/{RUN}/diagnosis", "Diagnosis"), (f"/v1/runs/{RUN}/fixes", "FixPage"),
    (f"/v1/runs/{RUN}/fixes/f-1", "Fix"), (f"/v1/runs/{RUN}/audit", "AuditPage"),
    (f"/v1/runs/{RUN}/history", "RunHistory"), (f"/v1/runs/{RUN}/series/loss", "Series"),
    (f"/v1/runs/{RUN}/series/sys/step_time", "Series"),
    (f"/v1/runs/{RUN}/series/0.weight?collection=gradients&field=norm", "Series"),
    (f"/v1/runs/{RUN}/scalars", "SeriesSet"), (f"/v1/runs/{RUN}/stats?collection=updates&field=update_ratio", "SeriesSet"),
    (f"/v1/runs/{RUN}/embeddings", "EmbeddingTables"), (f"/v1/runs/{RUN}/embeddings?table=nope", "Error"),
    (f"/v1/runs/{RUN}/heatmap", "Heatmap"), (f"/v1/runs/{RUN}/compression?target_sparsity=0.5", "CompressionRecipe"),
    (f"/v1/runs/{RUN}/nope", "Error"), ("/v1/runs/missing/anomalies", "Error"),
]


@pytest.mark.parametrize("how", ["accept", "query"])
def test_every_get_route_answers_xml_valid_against_the_xsd(srv: ServerProcess, how: str) -> None:
    xsd = xsd_schema()
    for path, model in GET_ROUTES:
        if how == "accept":
            res = get(srv, path, headers={"accept": "application/xml"})
        else:
            res = get(srv, path + ("&" if "?" in path else "?") + "format=xml")
        assert res.headers["content-type"].startswith("application/xml"), path
        doc = etree.fromstring(res.content, XML_PARSER)
        assert doc.tag == (model if res.status_code < 400 else "Error"), (path, res.text[:300])
        assert xsd.validate(doc), f"{path}: {xsd.error_log.last_error}"
        json_res = get(srv, path)
        assert json_res.status_code == res.status_code and json_res.headers["content-type"] == "application/json"


def test_unsupported_accept_gets_406_listing_what_is_offered(srv: ServerProcess) -> None:
    res = get(srv, "/v1/runs", headers={"accept": "text/csv"})
    assert res.status_code == 406
    err = res.json()
    assert err["error"] == "not_acceptable" and "application/json" in err["message"] and "application/xml" in err["message"]
    assert get(srv, "/v1/runs?format=yaml").status_code == 406
    # q-values are honoured: XML preferred over JSON, and */* falls back to JSON.
    assert get(srv, "/v1/runs", headers={"accept": "application/json;q=0.5, application/xml"}).text.startswith("<?xml")
    assert get(srv, "/v1/runs", headers={"accept": "text/html, */*;q=0.1"}).headers["content-type"] == "application/json"


def test_every_error_has_one_shape_in_the_requested_format(srv: ServerProcess) -> None:
    cases = [
        ("/v1/runs/missing", {}, 404, "unknown_run"),
        (f"/v1/runs/{RUN}/anomalies?limit=0", {}, 422, "invalid_request"),
        (f"/v1/runs/{RUN}/anomalies?kind=bogus", {}, 422, "invalid_request"),
        (f"/v1/runs/{RUN}/fixes/f-999", {}, 404, "unknown_fix"),
        ("/v2/nothing", {}, 404, "not_found"),
        ("/v1/runs", {"host": "evil.example:80"}, 421, "invalid_host"),
        ("/v1/runs", {"origin": "http://evil.example"}, 403, "invalid_origin"),
    ]
    xsd = xsd_schema()
    for path, headers, status, code in cases:
        res = get(srv, path, headers=headers)
        assert res.status_code == status and res.json()["error"] == code, (path, res.text)
        assert set(res.json()) == {"error", "message", "detail"}
        xml = get(srv, path, headers={**headers, "accept": "application/xml"})
        doc = etree.fromstring(xml.content, XML_PARSER)
        assert xml.status_code == status and doc.tag == "Error" and xsd.validate(doc)
        assert doc.findtext("error") == code
    # A write the job cannot take says why, in the same shape.
    bad = httpx.post(f"{srv.url}/v1/runs/{RUN}/fixes/f-1/revert", headers=AUTH)
    assert bad.status_code == 409 and bad.json()["error"] == "not_applied"


def test_openapi_describes_every_route_format_error_and_the_ingest_body(srv: ServerProcess, tmp_path: Path) -> None:
    from diag_server.api import dashboard, metrics
    from diag_server.api.http import ROUTERS

    doc = get(srv, "/openapi.json").json()
    routes = [route for router in (*ROUTERS, dashboard.router, metrics.router) for route in router.routes]
    declared = {(m.lower(), r.path.replace(":path", "")) for r in routes if r.include_in_schema for m in r.methods}
    assert len(declared) >= 20
    described = {(m, p) for p, item in doc["paths"].items() for m in item}
    assert declared == described
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "Error" in schemas
    for path, item in doc["paths"].items():
        for op in item.values():
            responses = op["responses"]
            for status in ("404", "422", "403"):
                if path.startswith("/v1/") or (status == "403" and path != "/metrics"):
                    assert responses[status]["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/Error"}, (path, status)
            ok = (responses.get("200") or responses.get("201") or {}).get("content", {})
            if path.startswith("/v1/") and not path.endswith("/stream") and "204" not in responses:
                offered = next(p for p in op["parameters"] if p["name"] == "format")["schema"]["enum"]
                # every record answers in JSON and XML; a profiler trace is a JSON file and says so
                media = {"application/json", "application/xml"} if "xml" in offered else {"application/json"}
                assert set(ok) == media and "json" in offered, path
                assert "406" in responses
    ingest = doc["paths"]["/v1/ingest"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ingest == {"$ref": "#/components/schemas/IngestBatch"}
    assert "kind" in schemas["FixAck"]["required"]
    params = {p["name"] for p in doc["paths"]["/v1/runs/{run}/anomalies"]["get"]["parameters"]}
    assert {"kind", "severity", "status", "min_step", "max_step", "min_step_time", "offset", "limit"} <= params
    assert "text/event-stream" in doc["paths"]["/v1/runs/{run}/stream"]["get"]["responses"]["200"]["content"]
    # Every integer, in a parameter or a body, says its range (from the models: nothing adds it afterwards).
    def integers(node):  # noqa: ANN001, ANN202
        if isinstance(node, dict):
            if node.get("type") == "integer":
                yield node
            for v in node.values():
                yield from integers(v)
        elif isinstance(node, list):
            for v in node:
                yield from integers(v)

    bounded = list(integers(doc))
    assert len(bounded) > 100
    assert all("maximum" in n and ("minimum" in n or "exclusiveMinimum" in n) for n in bounded)


LISTS = [("/v1/runs", "runs"), (f"/v1/runs/{RUN}/anomalies", "anomalies"), (f"/v1/runs/{RUN}/fixes", "fixes"),
         (f"/v1/runs/{RUN}/audit", "entries"), (f"/v1/runs/{RUN}/history", "entries")]


@pytest.mark.parametrize("path,items", LISTS)
def test_paging_behaves_the_same_on_every_list(srv: ServerProcess, path: str, items: str) -> None:
    whole = get(srv, f"{path}?limit=500").json()
    assert whole["total"] == len(whole[items]) and whole["next_offset"] is None and whole[items]
    walked, offset = [], 0
    while offset is not None:
        page = get(srv, f"{path}?limit=1&offset={offset}").json()
        assert page["total"] == whole["total"] and page["offset"] == offset and len(page[items]) == 1
        walked += page[items]
        offset = page["next_offset"]
    assert walked == whole[items]
    beyond = get(srv, f"{path}?offset={whole['total'] + 5}").json()
    assert beyond[items] == [] and beyond["next_offset"] is None and beyond["total"] == whole["total"]
    for bad in ("limit=0", "limit=501", "offset=-1"):
        res = get(srv, f"{path}?{bad}")
        assert res.status_code == 422 and res.json()["error"] == "invalid_request", bad


def test_filters_mean_the_same_on_every_list(srv: ServerProcess) -> None:
    anomalies = get(srv, f"/v1/runs/{RUN}/anomalies?limit=500").json()["anomalies"]
    kinds = {a["kind"] for a in anomalies}
    assert {"exploding_gradient", "nonfinite"} <= kinds
    for kind in kinds:
        page = get(srv, f"/v1/runs/{RUN}/anomalies?kind={kind}").json()
        assert page["total"] == sum(a["kind"] == kind for a in anomalies)
        fixes = get(srv, f"/v1/runs/{RUN}/fixes?kind={kind}").json()
        mine = {a["id"] for a in anomalies if a["kind"] == kind}
        assert all(f["anomaly_id"] in mine for f in fixes["fixes"])
    for sev in ("info", "warning", "critical"):
        assert get(srv, f"/v1/runs/{RUN}/anomalies?severity={sev}").json()["total"] == sum(
            a["severity"] == sev for a in anomalies)
    # A step range keeps what overlaps it, on anomalies, fixes (by their anomaly) and the timeline.
    first = min(a["first_step"] for a in anomalies)
    assert get(srv, f"/v1/runs/{RUN}/anomalies?max_step={first - 1}").json()["total"] == 0
    assert get(srv, f"/v1/runs/{RUN}/fixes?max_step={first - 1}").json()["total"] == 0
    hist = get(srv, f"/v1/runs/{RUN}/history?max_step={first - 1}").json()
    assert all(e["step"] <= first - 1 for e in hist["entries"])
    assert get(srv, f"/v1/runs/{RUN}/anomalies?min_step={first}&max_step={first}").json()["total"] >= 1
    # The latency threshold: every anomaly ran through steps slower than 0 s, none through 1000 s steps.
    assert get(srv, f"/v1/runs/{RUN}/anomalies?min_step_time=0").json()["total"] == len(anomalies)
    assert get(srv, f"/v1/runs/{RUN}/anomalies?min_step_time=1000").json()["total"] == 0
    ended = get(srv, "/v1/runs?status=ended&limit=500").json()["runs"]
    assert RUN in {r["run"] for r in ended} and {r["status"] for r in ended} == {"ended"}
    active = get(srv, "/v1/runs?status=active&limit=500").json()["runs"]
    assert RUN not in {r["run"] for r in active} and {r["status"] for r in active} <= {"active"}


def test_charts_get_their_series_and_downsampling_keeps_the_spike(srv: ServerProcess) -> None:
    full = get(srv, f"/v1/runs/{RUN}/series/0.weight?collection=gradients&max_points=10000").json()["points"]
    small = get(srv, f"/v1/runs/{RUN}/series/0.weight?collection=gradients&max_points=6").json()
    assert small["downsampled"] and len(small["points"]) <= 6
    finite = [p["value"] for p in full if p["value"] is not None]
    assert max(finite) in [p["value"] for p in small["points"]]  # the explosion survives
    if any(p["value"] is None for p in full):
        assert any(p["value"] is None for p in small["points"])  # and so does the NaN
    heat = get(srv, f"/v1/runs/{RUN}/heatmap?max_steps=4").json()
    assert heat["tensors"][:2] == ["0.weight", "0.bias"] and len(heat["steps"]) == 4
    assert len(heat["values"]) == len(heat["tensors"]) and all(len(r) == 4 for r in heat["values"])
    assert max(v for row in heat["values"] for v in row if v is not None) == max(
        v for t in heat["tensors"] for p in get(srv, f"/v1/runs/{RUN}/series/{t}?collection=gradients&max_points=10000")
        .json()["points"] if (v := p["value"]) is not None)
    time_split = get(srv, f"/v1/runs/{RUN}/scalars?prefix=sys/").json()["series"]
    names = {s["name"] for s in time_split}
    assert {"sys/data_wait", "sys/forward", "sys/backward", "sys/optimizer", "sys/rss_mb"} <= names
    loss = get(srv, f"/v1/runs/{RUN}/scalars?name=loss&name=accuracy").json()["series"]
    assert [s["name"] for s in loss] == ["loss", "accuracy"] and all(s["points"] for s in loss)
    ratios = get(srv, f"/v1/runs/{RUN}/stats?collection=updates&field=update_ratio&max_points=20").json()["series"]
    assert [s["name"] for s in ratios][:2] == ["0.weight", "0.bias"] and all(len(s["points"]) <= 20 for s in ratios)
    step_range = get(srv, f"/v1/runs/{RUN}/series/loss?min_step=10&max_step=20").json()["points"]
    assert step_range and all(10 <= p["step"] <= 20 for p in step_range)


def test_min_max_downsampling_keeps_spikes_and_nans() -> None:
    points = [(i, 1.0 + (i % 7) * 0.01) for i in range(100_000)]
    points[31_337] = (31_337, 500.0)
    points[77_000] = (77_000, None)
    points[50_001] = (50_001, -3.0)
    kept = min_max(points, 200)
    assert len(kept) <= 200 and [s for s, _ in kept] == sorted(s for s, _ in kept)
    assert (31_337, 500.0) in kept and (77_000, None) in kept and (50_001, -3.0) in kept
    assert min_max(points[:50], 200) == points[:50]
    # The same, done by SQLite, as the routes do it.
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE scalars(run TEXT, step INTEGER, name TEXT, value REAL)")
    conn.executemany("INSERT INTO scalars VALUES ('r', ?, 'loss', ?)", points)
    kept, total = min_max_query(conn, "scalars", "value", "run=? AND name=?", ("r", "loss"), 200)
    assert total == 100_000 and len(kept) <= 200 and [s for s, _ in kept] == sorted(s for s, _ in kept)
    assert (31_337, 500.0) in kept and (77_000, None) in kept and (50_001, -3.0) in kept


def test_stream_sends_an_update_with_the_runs_state(srv: ServerProcess) -> None:
    with httpx.stream("GET", f"{srv.url}/v1/runs/{RUN}/stream", timeout=10) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        event, data = None, None
        for line in res.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                data = orjson.loads(line.split(":", 1)[1])
                break
    summary = get(srv, f"/v1/runs/{RUN}").json()
    assert event == "update" and data["last_step"] == summary["run"]["last_step"] and data["ended"] is True
    assert get(srv, "/v1/runs/missing/stream").status_code == 404


def test_a_person_is_audited_as_a_person(srv: ServerProcess) -> None:
    trail = get(srv, f"/v1/runs/{RUN}/audit").json()["entries"]
    proposed = [e for e in trail if e["action"] == "proposed"]
    assert "person:ana" in {e["actor"] for e in proposed}  # named in x-traindx-actor: a person
    # (the fuzz proposes too, without naming itself: it is 'http:<address>')


def test_the_stat_field_parameter_lists_exactly_the_stored_statistics() -> None:
    from typing import get_args

    from diag_server.api.deps import StatName
    from diag_server.store import STAT_COLUMNS

    assert get_args(StatName) == STAT_COLUMNS
