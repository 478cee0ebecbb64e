"""Bad input gets a clear 4xx, stores nothing, and the server keeps serving."""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest

from tests.conftest import make_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module: every test uses its own run names."""
    srv = make_server(tmp_path_factory.mktemp("ingest"))
    srv.start()
    yield srv
    srv.stop()


def _batch(run: str = "refused", **over) -> dict:
    b = {"batch_id": uuid.uuid4().hex, "run": run, "seq": 0,
         "events": [{"kind": "scalars", "step": 1, "time": 1.0, "values": {"loss": 0.5}}]}
    b.update(over)
    return b


BAD = [
    (b"{not json", 400, "invalid_json"),
    (orjson.dumps({"batch_id": "abcdefgh", "run": "r", "seq": "x", "events": []}), 422, "invalid_batch"),
    (orjson.dumps(_batch(events=[{"kind": "telepathy", "step": 1, "time": 1.0}])), 422, "invalid_batch"),
    (orjson.dumps(_batch(events=[{"kind": "scalars", "step": -1, "time": 1.0, "values": {}}])), 422, "invalid_batch"),
    (orjson.dumps(_batch(run="../../etc/passwd")), 422, "invalid_batch"),
    (orjson.dumps(_batch(extra_field=1)), 422, "invalid_batch"),
    # A valid event followed by a broken one: refused whole, the valid one is not stored either.
    (orjson.dumps(_batch(events=[{"kind": "scalars", "step": 1, "time": 1.0, "values": {"loss": 1.0}},
                                 {"kind": "scalars", "step": 2, "time": 1.0, "values": {"loss": "high"}}])),
     422, "invalid_batch"),
]


@pytest.mark.parametrize("body,status,code", BAD)
def test_malformed_ingest_is_refused_whole(server, body, status, code):
    r = httpx.post(f"{server.url}/v1/ingest", content=body,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == status
    err = r.json()
    assert err["error"] == code and err["message"]
    if status == 422:
        assert err["detail"], "a schema error says where the problem is"
    runs = [r["run"] for r in httpx.get(f"{server.url}/v1/runs", headers=server.headers).json()["runs"]]
    assert "refused" not in runs and "r" not in runs  # nothing stored
    assert httpx.get(f"{server.url}/health", headers=server.headers).status_code == 200  # still serving


def test_oversized_body_is_refused(server):
    big = b'{"batch_id":"abcdefgh","run":"r","seq":0,"events":[],"pad":"' + b"x" * (33 << 20) + b'"}'
    r = httpx.post(f"{server.url}/v1/ingest", content=big, timeout=60, headers=server.headers)
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    assert httpx.get(f"{server.url}/health", headers=server.headers).status_code == 200


def test_a_batch_sent_twice_is_stored_once(server):
    b = _batch(run="dup")
    first = httpx.post(f"{server.url}/v1/ingest", json=b, headers=server.headers).json()
    second = httpx.post(f"{server.url}/v1/ingest", json=b, headers=server.headers).json()
    assert first["accepted"] == 1 and not first["duplicate"]
    assert second["accepted"] == 0 and second["duplicate"]
    points = httpx.get(f"{server.url}/v1/runs/dup/series/loss", headers=server.headers).json()["points"]
    assert points == [{"step": 1, "value": 0.5}]


def test_non_finite_values_travel_as_null(server):
    b = _batch(run="nan", events=[{"kind": "scalars", "step": 3, "time": 1.0, "values": {"loss": None}}])
    assert httpx.post(f"{server.url}/v1/ingest", json=b, headers=server.headers).status_code == 200
    page = httpx.get(f"{server.url}/v1/runs/nan/anomalies", headers=server.headers).json()
    assert [a["kind"] for a in page["anomalies"]] == ["nonfinite"]
    assert page["anomalies"][0]["first_step"] == 3
