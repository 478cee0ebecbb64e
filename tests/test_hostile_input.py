"""Bad input gets a clear 4xx (or tool error), writes nothing, and the server keeps serving.

One server (the app in-process, a real SQLite file) holds a live run with an anomaly, proposed and
applied fixes and a capture, so that every write route and tool has something it *could* change. Then:

- every operation of ``/openapi.json`` gets hostile path ids (traversal, NUL, as long as a URL holds,
  ...), hostile values for each of its parameters by type (int64 bounds and beyond, NaN/Infinity, wrong
  types, long strings) and an Accept or ``?format=`` it cannot answer;
- the ingest route gets every integer, number and boolean of a batch holding every event kind replaced
  by an out-of-range or wrongly typed value, hypothesis' random and mutated bodies, and a hand-written
  corpus (NaN/Infinity literals, 10k-deep nesting, huge strings, unicode oddities, an XML entity bomb);
- every MCP tool, over the MCP SDK's client, gets hostile arguments of every kind;
- the same batch id is posted from several threads at once.

Each answer must be below 500 (a tool error must be one the server meant: a validation error or an
ApiError's code, never a crash). Each refusal must leave the store as it was: every table's rows are
compared before and after. At the end, valid data is still stored exactly as sent. The last test prints
how many cases ran (``hostile-input cases: N``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote

import anyio
import orjson
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client

from diag_server import __version__
from diag_server.api import create_app
from diag_server.cli import main
from diag_server.pipeline.services import Settings
from diag_server.api.mcp import build_mcp

TOKEN = "hostile-input-test-token-0123456789"
# Cases run, answers of 500 or more, and refusals that changed the store: the figures the last test prints.
CASES = {"n": 0, "5xx": 0, "written": 0}
_FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)
MB = 1 << 20

# What the setup creates, and the ids the hostile requests aim at (real ones, so a write could happen).
LIVE = "live"  # a job heard from recently: fixes can be applied and captures requested
VICTIM = "victim"  # the run the DELETE cases aim at
IDS: dict[str, str] = {}


@functools.cache
def _reader(data: Path) -> sqlite3.Connection:
    return sqlite3.connect(data / "traindx.sqlite", isolation_level=None, check_same_thread=False)


def _store(data: Path) -> dict[str, str]:
    """Every table's rows, as a digest per table: what 'nothing was written' is checked against."""
    conn = _reader(data)
    out = {}
    for (table,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name").fetchall():
        h = hashlib.blake2b(digest_size=16)
        for row in conn.execute(f'SELECT * FROM "{table}"'):
            h.update(repr(row).encode())
        out[table] = h.hexdigest()
    return out


def _batch_id(prefix: str) -> str:
    _batch_id.n += 1  # type: ignore[attr-defined]
    return f"{prefix}-{_batch_id.n:08d}"  # type: ignore[attr-defined]


_batch_id.n = 0  # type: ignore[attr-defined]


def full_batch(run: str, t: float, batch_id: str | None = None, seq: int = 0) -> dict[str, Any]:
    """A valid batch holding every event kind, with every kind of field set."""
    return {"batch_id": batch_id or _batch_id("full"), "run": run, "seq": seq, "rank": 0, "events": [
        {"kind": "run_start", "step": 0, "time": t, "modules": [{"name": "fc", "type": "Linear"}],
         "params": [{"name": "fc.weight", "shape": [2, 3], "numel": 6, "trainable": True, "local_numel": 6}],
         "total_params": 6, "optimizer": {"type": "SGD", "param_groups": [{"lr": 0.1, "momentum": 0, "nesterov": False}]},
         "world_size": 1, "rank": 0, "local_rank": 0, "host": "h", "allow": ["lr_scale"], "config": {"interval": 1}},
        {"kind": "scalars", "step": 1, "time": t, "values": {"loss": 0.5, "acc": None, "lr": 1.0}},
        {"kind": "tensor_stats", "step": 1, "time": t, "collection": "gradients",
         "rows": [{"name": "fc.weight", "numel": 6, "norm": 1.25, "mean": 0.0, "nan_count": 0, "inf_count": 0}]},
        {"kind": "tensor_stats", "step": 1, "time": t, "collection": "embeddings",
         "rows": [{"name": "emb.weight", "numel": 8, "embedding": {
             "rows": 4, "dim": 2, "sparse": False, "tracked_steps": 1, "median_touches": 2.0,
             "zombies": [{"row": 1, "touches": 2, "velocity": 0.1}],
             "conflicted": [{"row": 2, "touches": 3, "reports": 1, "run_score": 2.5}], "dead_ids": [3]}}]},
        {"kind": "spans", "step": 1, "time": t, "spans": [
            {"name": "forward", "category": "phase", "start": t, "duration": 0.01, "gpu_duration": 0.005}]},
        {"kind": "layer_profiles", "step": 1, "time": t, "source": "fisher", "samples": 4, "base_loss": 0.5,
         "layers": [{"name": "fc.weight", "numel": 6, "shape": [2, 3], "sparsities": [0.5], "unstructured": [0.1]}]},
        {"kind": "tensor_snapshot", "step": 1, "time": t, "request_id": "s-404", "tensors": [
            {"name": "fc.weight", "source": "parameter", "shape": [2, 3], "dtype": "float32", "numel": 6,
             "offset": 0, "values": [0.1, None], "nan_count": 1, "inf_count": 0}]},
        {"kind": "capture", "step": 1, "time": t, "capture_id": "c-404", "last_step": 2, "profiled": True,
         "ops": [{"name": "aten::mm", "calls": 3, "cpu_time_ms": 1.0, "self_cpu_time_ms": 0.5}],
         "shapes": [{"module": "fc", "type": "Linear", "inputs": [[4, 3]], "outputs": [[4, 2]]}]},
        {"kind": "fix_ack", "step": 1, "time": t, "fix_id": "f-404", "status": "rejected", "reason": "no",
         "before": {"lr": 0.1}, "after": {}},
        {"kind": "message", "step": 1, "time": t, "level": "info", "text": "hello"},
        {"kind": "run_end", "step": 2, "time": t}]}


def _valid() -> dict[str, Any]:
    return {"batch_id": "valid-batch-0001", "run": "fuzz", "seq": 0, "events": [
        {"kind": "run_start", "step": 0, "time": 1.0, "params": [{"name": "w", "shape": [2], "numel": 2}],
         "allow": ["lr_scale"], "config": {"interval": 5}},
        {"kind": "scalars", "step": 1, "time": 1.0, "values": {"loss": 0.5, "acc": None}},
        {"kind": "tensor_stats", "step": 1, "time": 1.0, "collection": "gradients",
         "rows": [{"name": "w", "numel": 2, "norm": 1.0, "nan_count": 0}]},
        {"kind": "message", "step": 1, "time": 1.0, "level": "info", "text": "hello"},
        {"kind": "fix_ack", "step": 1, "time": 1.0, "fix_id": "f-1", "status": "rejected", "reason": "no"},
        {"kind": "run_end", "step": 2, "time": 2.0}]}


VALID = _valid()


def _heartbeat(client: TestClient) -> None:
    """Keep LIVE live (a job unheard of for 30 s is stale, and writes to it are refused for that reason)."""
    r = client.post("/v1/ingest", content=orjson.dumps({"batch_id": _batch_id("beat"), "run": LIVE, "seq": 0,
                                                         "events": []}))
    assert r.status_code == 200, r.text


def _setup(client: TestClient) -> None:
    """LIVE: a run whose gradients went NaN (an anomaly), its fixes proposed, one applied and acknowledged,
    a capture requested; VICTIM: another run for the DELETE cases."""
    t = time.time()
    events: list[dict] = [{"kind": "run_start", "step": 0, "time": t, "params": [{"name": "w", "shape": [2], "numel": 2}],
                           "allow": ["lr_scale", "grad_clip", "skip_nonfinite", "set_lr", "sensitivity"],
                           "config": {"interval": 1}}]
    for step in range(1, 30):
        events += [{"kind": "scalars", "step": step, "time": t, "values": {"loss": 1.0 / step}},
                   {"kind": "tensor_stats", "step": step, "time": t, "collection": "gradients",
                    "rows": [{"name": "w", "numel": 2, "norm": 1.0, "nan_count": 0}]}]
    events += [{"kind": "scalars", "step": 30, "time": t, "values": {"loss": None}},
               {"kind": "tensor_stats", "step": 30, "time": t, "collection": "gradients",
                "rows": [{"name": "w", "numel": 2, "norm": None, "nan_count": 2}]}]
    for body in (VALID, {"batch_id": "setup-live-0", "run": LIVE, "seq": 0, "events": events},
                 full_batch(VICTIM, t, "setup-victim-0")):
        r = client.post("/v1/ingest", content=orjson.dumps(body))
        assert r.status_code == 200, r.text
    anomaly = client.get(f"/v1/runs/{LIVE}/anomalies?kind=nonfinite").json()["anomalies"][0]["id"]
    fixes = [f for f in client.post(f"/v1/runs/{LIVE}/anomalies/{anomaly}/propose").json()["fixes"] if f["live"]]
    applied, proposed = fixes[0]["id"], fixes[1]["id"]
    assert client.post(f"/v1/runs/{LIVE}/fixes/{applied}/apply").json()["status"] == "pending"
    ack = {"kind": "fix_ack", "step": 31, "time": t, "fix_id": applied, "status": "applied",
           "before": {"lr": 0.1}, "after": {"lr": 0.05}}
    r = client.post("/v1/ingest", content=orjson.dumps({"batch_id": "setup-live-1", "run": LIVE, "seq": 1,
                                                         "events": [ack]}))
    assert r.status_code == 200
    assert client.get(f"/v1/runs/{LIVE}/fixes/{applied}").json()["status"] == "applied"
    capture = client.post(f"/v1/runs/{LIVE}/captures?steps=2").json()["id"]
    IDS.update(run=LIVE, anomaly_id=anomaly, fix_id=proposed, applied_fix=applied, capture_id=capture, name="loss")


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Path]]:
    data = tmp_path_factory.mktemp("hostile")
    app = create_app(Settings(data_dir=data, token=TOKEN))
    with TestClient(app, base_url="http://127.0.0.1:8765", headers={"authorization": f"Bearer {TOKEN}"}) as c:
        _setup(c)
        yield c, data


def _check(client: TestClient, data: Path, method: str, url: str, *, what: str = "", **kw: Any):  # noqa: ANN202
    """Send one hostile request: below 500, and a refusal writes nothing. Returns the response."""
    before = _store(data)
    r = client.request(method, url, **kw)
    CASES["n"] += 1
    CASES["5xx"] += r.status_code >= 500
    assert r.status_code < 500, (what, method, url[:200], r.status_code, r.text[:300])
    if r.status_code >= 400:
        after = _store(data)
        changed = [t for t in after if after[t] != before.get(t)]
        CASES["written"] += bool(changed)
        assert not changed, f"{what} {method} {url[:200]} refused ({r.status_code}) yet wrote to {changed}"
        if r.content and r.headers.get("content-type", "").startswith("application/json"):
            body = r.json()
            assert body["error"] and body["message"], "every refusal says what is wrong"
    return r


def _post(client: TestClient, data: Path, body: bytes, **kw: Any) -> int:
    return _check(client, data, "POST", "/v1/ingest", what="ingest", content=body, **kw).status_code


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # the stdlib: integers beyond 64 bits are fair game too


# -- ingest: hypothesis -------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=25)


def _paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


FULL = full_batch("mutant", 1.0, "mutant-0000")
PATHS = [p for p in _paths(FULL) if p]


@st.composite
def mutated_batches(draw: st.DrawFn) -> dict:
    batch = copy.deepcopy(FULL)
    batch["batch_id"] = draw(st.from_regex(r"[A-Za-z0-9]{16}", fullmatch=True))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = batch
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue
    return batch


@given(body=json_values)
@_FUZZ
def test_fuzz_random_json_bodies(app_client, body: Any) -> None:  # noqa: ANN001
    client, data = app_client
    _post(client, data, _dumps(body))


@given(batch=mutated_batches())
@settings(_FUZZ, max_examples=400)
def test_fuzz_mutated_batches(app_client, batch: dict) -> None:  # noqa: ANN001
    client, data = app_client
    _post(client, data, _dumps(batch))


@given(body=st.binary(max_size=512))
@settings(_FUZZ, max_examples=100)
def test_fuzz_random_bytes(app_client, body: bytes) -> None:  # noqa: ANN001
    client, data = app_client
    assert _post(client, data, body) != 200


@given(run=st.text(max_size=300), name=st.text(max_size=100), limit=st.text(max_size=8),
       kind=st.text(max_size=20), accept=st.text(max_size=40))
@settings(_FUZZ, max_examples=100)
def test_fuzz_rest_parameters(app_client, run: str, name: str, limit: str, kind: str, accept: str) -> None:  # noqa: ANN001
    client, data = app_client
    run, name = quote(run, safe=""), quote(name, safe="")  # as a client sends them
    for method, path, params in (
            ("GET", f"/v1/runs/{run}", {}), ("GET", f"/v1/runs/{run}/anomalies", {"limit": limit, "kind": kind}),
            ("GET", f"/v1/runs/fuzz/series/{name}", {"max_points": limit}), ("GET", "/v1/runs/fuzz/fixes", {"status": kind}),
            ("POST", f"/v1/runs/{LIVE}/captures", {"steps": limit, "profile": kind}),
            ("POST", f"/v1/runs/{run}/fixes/{name}/apply", {})):
        try:
            client.build_request(method, path, params=params, headers={"accept": accept})
        except (UnicodeEncodeError, ValueError):
            continue  # the client itself cannot send it (a header outside latin-1, ...)
        _check(client, data, method, path, what="fuzzed parameters", params=params, headers={"accept": accept})


# -- ingest: every integer, number and boolean of every event kind -----------------------------------------
INT_BAD = [2**63, 2**64 - 1, 2**64, 10**30, -1, -(2**63) - 1, True, "1", 1.5]
NUMBER_BAD = ["1.0", True, False, [], {}]
BOOL_BAD = [1, 0, "true", None]
# Free-form values (a job's config, an optimizer's hyperparameters, a fix's before/after) take any scalar.
_FREE_FORM = {"config", "param_groups", "before", "after"}


def _leaves(value: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*prefix, i))
    else:
        yield prefix, value


def _set(doc: dict, path: tuple, value: Any) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


def test_ingest_refuses_every_out_of_range_or_mistyped_field(app_client) -> None:  # noqa: ANN001
    """An integer beyond int64 (or negative where a count is meant), a boolean or a string where a number
    is meant, a number where a boolean is: 422, nothing stored, on every field of every event kind."""
    client, data = app_client
    base = full_batch("typed", time.time())
    checked = 0
    for path, value in _leaves(base):
        if _FREE_FORM & set(map(str, path)) or path[-1] in ("batch_id",):
            continue
        bad = (INT_BAD if type(value) is int else NUMBER_BAD if type(value) is float else
               BOOL_BAD if type(value) is bool else [])
        for wrong in bad:
            body = _set(base, path, wrong)
            body["batch_id"] = _batch_id("typed")
            status = _post(client, data, _dumps(body))
            assert status == 422, (path, wrong, status)
            checked += 1
    assert checked > 250


@pytest.mark.parametrize("field,value", [
    (("seq",), 2**63), (("seq",), 2**64 - 1), (("rank",), 2**63), (("rank",), 2**64 - 1), (("rank",), -1),
    (("events", 2, "rows", 0, "numel"), 2**64 - 1), (("events", 2, "rows", 0, "inf_count"), 2**63),
    (("events", 0, "world_size"), 2**64 - 1), (("events", 0, "world_size"), 0),
    (("events", 0, "local_rank"), 2**63), (("events", 0, "local_rank"), -1),
    (("events", 1, "time"), True), (("events", 1, "values", "loss"), "1.0"), (("events", 1, "values", "loss"), True),
])
def test_the_fields_once_stored_or_crashing_are_refused(app_client, field: tuple, value: Any) -> None:  # noqa: ANN001
    client, data = app_client
    body = _set(full_batch("named", time.time()), field, value)
    r = _check(client, data, "POST", "/v1/ingest", what="named field", content=_dumps(body))
    assert r.status_code == 422 and r.json()["error"] == "invalid_batch"
    assert ".".join(map(str, field[-1:])) in " ".join(r.json()["detail"])


def _deep(depth: int) -> bytes:
    return (b'{"batch_id": "deep-%08d", "run": "r", "seq": 0, "events": [{"kind": "run_start", "step": 0, '
            b'"time": 1.0, "config": {"x": ' % depth + b"[" * depth + b"]" * depth + b"}}]}")


def _batch(**events: Any) -> bytes:
    return _dumps({"batch_id": "hostile-0001", "run": "hostile", "seq": 0, "events": [events]})


def _event(**fields: Any) -> dict:
    return {"kind": "scalars", "step": 1, "time": 1.0, "values": {"loss": 1.0}, **fields}


DEEP = b'{"batch_id": "deep-00001", "run": "r", "seq": 0, "events": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
CORPUS: dict[str, tuple[bytes, dict]] = {
    "nan literal": (b'{"batch_id": "nan-000001", "run": "r", "seq": 0, "events": [{"kind": "scalars", "step": 1, '
                    b'"time": 1.0, "values": {"loss": NaN}}]}', {}),
    "infinity literal": (b'{"batch_id": "inf-000001", "run": "r", "seq": 0, "events": [{"kind": "scalars", '
                         b'"step": 1, "time": 1.0, "values": {"loss": Infinity}}]}', {}),
    "number overflowing to inf": (b'{"batch_id": "big-000001", "run": "r", "seq": 0, "events": [{"kind": "scalars", '
                                  b'"step": 1, "time": 1.0, "values": {"loss": 1e400}}]}', {}),
    "huge integer step": (_batch(**_event(step=10**30)), {}),
    "negative step": (_batch(**_event(step=-1)), {}),
    "bool as step": (_batch(**_event(step=True)), {}),
    "huge string": (_batch(**{"kind": "message", "step": 1, "time": 1.0, "text": "x" * 5_000_000}), {}),
    "body over the limit": (b"[" + b"0," * (17 << 20) + b"0]", {}),
    "deep nesting": (DEEP, {}),
    "lone surrogate": (b'{"batch_id": "sur-000001", "run": "r\\ud800", "seq": 0, "events": []}', {}),
    "invalid utf-8": (b'{"batch_id": "utf-000001", "run": "r\xff\xfe", "seq": 0, "events": []}', {}),
    "overlong utf-8 slash": (b'{"batch_id": "ovl-000001", "run": "\xc0\xafetc", "seq": 0, "events": []}', {}),
    "nul in a tensor name": (_batch(**{"kind": "tensor_stats", "step": 1, "time": 1.0, "collection": "weights",
                                       "rows": [{"name": "w\u0000x"}]}), {}),
    "control chars in a scalar name": (_batch(**_event(values={"lo\nss": 1.0})), {}),
    "path traversal run id": (orjson.dumps({"batch_id": "trav-00001", "run": "../../etc/passwd", "seq": 0,
                                            "events": []}), {}),
    "rtl override run id": (orjson.dumps({"batch_id": "rtl-000001", "run": "run\u202egnp.exe", "seq": 0,
                                          "events": []}), {}),
    "zero-width run id": (orjson.dumps({"batch_id": "zw-0000001", "run": "r\u200bun", "seq": 0, "events": []}), {}),
    "unknown event kind": (_batch(kind="exec", step=1, time=1.0), {}),
    "extra field": (_batch(**_event(shell="rm -rf /")), {}),
    "too many events": (orjson.dumps({"batch_id": "many-00001", "run": "r", "seq": 0,
                                      "events": [_event()] * 5001}), {}),
    "nan time": (_batch(**_event(time=None)), {}),
    "sql in a run id": (orjson.dumps({"batch_id": "sql-000001", "run": "r'; DROP TABLE runs;--", "seq": 0,
                                      "events": []}), {}),
    "embedding summary with a negative row": (_batch(kind="tensor_stats", step=1, time=1.0, collection="embeddings",
                                                     rows=[{"name": "t.weight", "numel": 8, "embedding": {
                                                         "rows": 4, "dim": 2, "zombies": [{"row": -1, "touches": 3}]}}]), {}),
    "embedding summary listing too many rows": (_batch(kind="tensor_stats", step=1, time=1.0, collection="embeddings",
                                                       rows=[{"name": "t.weight", "numel": 8, "embedding": {
                                                           "rows": 4, "dim": 2, "dead_ids": list(range(513))}}]), {}),
    "bom prefix": (b"\xef\xbb\xbf" + _batch(**_event()), {}),
    "empty body": (b"", {}),
    "xml entity bomb": (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;'
                        b'&a;&a;&a;&a;"><!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">]><IngestBatch>&c;</IngestBatch>',
                        {"headers": {"content-type": "application/xml"}}),
    "external entity": (b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><x>&e;</x>',
                        {"headers": {"content-type": "text/xml"}}),
}

CORPUS.update({
    "10k-deep nesting in a value": (_deep(10_000), {}),
    "10k-deep objects": (b'{"batch_id": "deepobj-01", "run": "r", "seq": 0, "events": [], "x": '
                         + b'{"a": ' * 10_000 + b"1" + b"}" * 10_000 + b"}", {}),
    "-infinity literal": (b'{"batch_id": "ninf-00001", "run": "r", "seq": 0, "events": [{"kind": "scalars", '
                          b'"step": 1, "time": -Infinity, "values": {"loss": 1.0}}]}', {}),
    "1 MB run id": (orjson.dumps({"batch_id": "mbrun-0001", "run": "r" * MB, "seq": 0, "events": []}), {}),
    "1 MB scalar name": (_batch(**_event(values={"l" * MB: 1.0})), {}),
    "1 MB batch id": (orjson.dumps({"batch_id": "b" * MB, "run": "r", "seq": 0, "events": []}), {}),
    "seq beyond int64": (_dumps({"batch_id": "seq-000001", "run": "r", "seq": 2**64 - 1, "events": [_event()]}), {}),
    "time as a boolean": (_batch(**_event(time=True)), {}),
    "loss as a string": (_batch(**_event(values={"loss": "1.0"})), {}),
    "loss as a boolean": (_batch(**_event(values={"loss": True})), {}),
    "path traversal capture id": (_batch(kind="capture", step=1, time=1.0, capture_id="../../etc/passwd",
                                         last_step=1), {}),
    "wrong accept": (_batch(**_event()), {"headers": {"accept": "text/html"}}),
    "wrong format": (_batch(**_event()), {"params": {"format": "yaml"}}),
})


@pytest.mark.parametrize("case", list(CORPUS))
def test_hostile_corpus_is_refused_whole(app_client, case: str) -> None:  # noqa: ANN001
    client, data = app_client
    body, kw = CORPUS[case]
    assert _post(client, data, body, **kw) in (400, 406, 413, 422)
    assert client.get("/health").status_code == 200  # still serving


def test_a_run_start_with_a_bad_interval_is_refused_whole(app_client):  # noqa: ANN001
    """Found by the fuzz: the server paces its rules by config.interval, which once reached int() as a list."""
    client, data = app_client
    for bad in ([None], "10", 0, True):
        batch = {**VALID, "batch_id": f"bad-interval-{bad!r}",
                 "events": [{"kind": "run_start", "step": 0, "time": 1.0, "config": {"interval": bad}}]}
        r = _check(client, data, "POST", "/v1/ingest", what="interval", content=orjson.dumps(batch))
        assert r.status_code == 422 and "config.interval must be a positive integer" in r.text, (bad, r.text)


# -- every route of /openapi.json ------------------------------------------------------------------------
# A URL holds at most 64 KiB in the client (httpx; uvicorn refuses far less): the long ids and values are
# as long as a URL can carry. Bodies and MCP arguments get the full megabyte.
URL_MAX = 60_000
PATH_BAD = ["../../../etc/passwd", "..", ".", "..%2F..%2Fetc%2Fpasswd", "%2e%2e%2f", "x" * URL_MAX, "\x00", "live\x00",
            "' OR '1'='1' --", "\u202egnp.exe", "-1", str(2**64), "a-18446744073709551616", "f-" + "9" * 30, " ",
            "%", "live/../victim"]
QUERY_BAD = {
    "integer": [str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), "-1", str(-(2**63)), str(-(2**63) - 1),
                "1" + "0" * 30, "1e3", "1.5", "NaN", "Infinity", "-Infinity", "0x10", "abc", "", "1 1", "\uff11", "true",
                "[]", "9" * 5000],
    "number": ["NaN", "nan", "Infinity", "-Infinity", "inf", "1e309", "-1e309", "1e-400", "abc", "", "0x1p3", "true",
               "9" * 5000, "-0"],
    "boolean": ["maybe", "2", "-1", "NaN", "truee", "", "x" * 1000],
    "string": ["x" * URL_MAX, "../../../etc/passwd", "\x00", "' OR '1'='1' --", "\u202egnp.exe", "\U0001d518", "<x/>",
               ""],
}
ACCEPT_BAD = ["text/html", "application/yaml", "text/csv", "application/json;q=0", "image/*",
              "application/json;q=0, application/xml;q=0"]
FORMAT_BAD = ["yaml", "html", "JSON", "", "xml\x00", "chrome", "event-stream"]


def _type(schema: dict, comps: dict) -> str:
    if "$ref" in schema:
        return _type(comps[schema["$ref"].rsplit("/", 1)[-1]], comps)
    for option in schema.get("anyOf", []):
        if option.get("type") != "null":
            return _type(option, comps)
    return {"array": "string"}.get(schema.get("type", "string"), schema.get("type", "string"))


def _operations(client: TestClient) -> list[tuple[str, str, dict, set]]:
    """(method, path, {parameter: (where, type)}, the formats it offers) for every operation described."""
    doc = client.get("/openapi.json").json()
    comps = doc["components"]["schemas"]
    ops = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            params = {p["name"]: (p["in"], _type(p.get("schema", {}), comps)) for p in op.get("parameters", [])}
            offered = {f for p in op.get("parameters", []) if p["name"] == "format" for f in p["schema"]["enum"]}
            ops.append((method.upper(), path, params, offered))
    return ops


def _fill(method: str, path: str, values: dict[str, str]) -> str:
    ids = {**IDS, **values}
    if path.endswith("/revert") and "fix_id" not in values:
        ids["fix_id"] = IDS["applied_fix"]  # reverting has something to act on: an applied fix
    if method == "DELETE" and "run" not in values:
        ids["run"] = VICTIM
    for name, value in ids.items():
        path = path.replace("{" + name + "}", quote(value, safe=""))
    assert "{" not in path, path
    return path


def test_every_route_refuses_hostile_input_and_writes_nothing(app_client) -> None:  # noqa: ANN001
    client, data = app_client
    ops = _operations(client)
    assert len(ops) >= 30
    for method, path, params, offered in ops:
        _heartbeat(client)
        negotiated = path.startswith("/v1/") or path == "/health"
        assert not negotiated or offered, (method, path)
        url = _fill(method, path, {})
        for accept in ACCEPT_BAD:
            r = _check(client, data, method, url, what="accept", headers={"accept": accept})
            assert not negotiated or r.status_code == 406, (method, path, accept, r.status_code)
        for fmt in FORMAT_BAD:
            if fmt in offered:
                continue
            r = _check(client, data, method, url, what="format", params={"format": fmt})
            assert not negotiated or r.status_code == 406, (method, path, fmt, r.status_code)
        for name, (where, kind) in params.items():
            if where == "path":
                for bad in PATH_BAD:
                    _check(client, data, method, _fill(method, path, {name: bad}), what=f"path {name}")
            elif where == "query" and name != "format":
                for bad in QUERY_BAD[kind]:
                    _check(client, data, method, url, what=f"query {name}", params={name: bad})
    # What the refused requests aimed at is as it was.
    assert client.get(f"/v1/runs/{VICTIM}").status_code == 200
    assert client.get(f"/v1/runs/{LIVE}/fixes/{IDS['fix_id']}").json()["status"] == "proposed"
    assert client.get(f"/v1/runs/{LIVE}/fixes/{IDS['applied_fix']}").json()["status"] == "applied"
    assert len(client.get(f"/v1/runs/{LIVE}/captures").json()["captures"]) == 1


# -- every MCP tool, over the MCP client --------------------------------------------------------------------
ARG_BAD = {
    "integer": [2**63, 2**64 - 1, 2**64, 10**30, -1, -(2**63) - 1, "NaN", "Infinity", "1e309", 1.5, "abc", [], {}, "9" * 5000],
    "number": ["NaN", "Infinity", "-Infinity", "1e309", 1e308, -1e308, "abc", [], {}],
    "string": ["x" * MB, "../../../etc/passwd", "\x00", "' OR '1'='1' --", "\u202e", 123, [], {}, None],
    "boolean": ["maybe", 2, [], {}, None],
}
# A tool error the server meant: its argument validation, or an ApiError's code (api/mcp/server.py); anything else
# (an OverflowError's text, say) is a crash, the MCP form of a 500.
MEANT = re.compile(r"^(Error executing tool \w+: )?(\d+ validation errors? for |[a-z][a-z_]*: )")


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def _arg_type(schema: dict) -> str:
    for option in schema.get("anyOf", []):
        if option.get("type") != "null":
            return _arg_type(option)
    return schema.get("type", "string") if schema.get("type") in ARG_BAD else "string"


def test_every_mcp_tool_refuses_hostile_arguments_and_writes_nothing(app_client) -> None:  # noqa: ANN001
    client, data = app_client
    server = build_mcp(client.app.state.services, __version__)

    def base(tool: str) -> dict[str, Any]:
        return {"run": LIVE, "anomaly_id": IDS["anomaly_id"], "capture_id": IDS["capture_id"], "name": "loss",
                "fix_id": IDS["applied_fix"] if tool == "revert_fix" else IDS["fix_id"]}

    async def go() -> int:
        tried = 0
        async with Client(server) as mcp:
            tools = (await mcp.list_tools()).tools
            assert len(tools) >= 16
            for tool in tools:
                props = tool.input_schema.get("properties", {})
                required = tool.input_schema.get("required", [])
                good = {k: v for k, v in base(tool.name).items() if k in props}
                variants: list[dict] = [{}, {**good, "extra": _nested(200)}] if required else []
                for name, schema in props.items():
                    variants += [{**good, name: bad} for bad in ARG_BAD[_arg_type(schema)]]
                    variants.append({**good, name: _nested(200)})
                    variants.append({**good, name: "rm -rf /" if _arg_type(schema) == "string" else "1; DROP TABLE runs"})
                for args in variants:
                    if not tried % 25:
                        _heartbeat(client)
                    before = _store(data)
                    try:
                        result = await mcp.call_tool(tool.name, args)
                        refused, text = result.is_error, (result.content[0].text if result.is_error else "")
                    except Exception as e:  # noqa: BLE001 - a protocol-level refusal is a refusal too
                        refused, text = True, f"protocol_error: {e}"
                    tried += 1
                    CASES["n"] += 1
                    crashed = refused and not MEANT.match(text)
                    CASES["5xx"] += crashed
                    assert not crashed, (tool.name, str(args)[:200], text[:300])
                    if refused:
                        written = [t for t, d in _store(data).items() if d != before.get(t)]
                        CASES["written"] += bool(written)
                        assert not written, (tool.name, str(args)[:200], text[:200], written)
            assert not (await mcp.call_tool("list_runs", {})).is_error  # still serving
        return tried

    assert anyio.run(go) > 400
    assert client.get(f"/v1/runs/{LIVE}/fixes/{IDS['fix_id']}").json()["status"] == "proposed"


# -- the same batch from several threads at once ------------------------------------------------------------
def test_concurrent_duplicate_batches_are_stored_once(app_client) -> None:  # noqa: ANN001
    client, data = app_client
    rounds, senders = 12, 6
    for i in range(rounds):
        body = orjson.dumps({"batch_id": _batch_id("twin"), "run": "twins", "seq": i, "events": [
            {"kind": "scalars", "step": i, "time": time.time(), "values": {"loss": float(i)}}]})
        replies: list = []
        threads = [threading.Thread(target=lambda replies=replies, body=body: replies.append(client.post("/v1/ingest", content=body)))
                   for _ in range(senders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        CASES["n"] += senders
        CASES["5xx"] += sum(r.status_code >= 500 for r in replies)
        assert [r.status_code for r in replies] == [200] * senders
        assert sorted(r.json()["duplicate"] for r in replies) == [False] + [True] * (senders - 1)
    rows = _reader(data).execute("SELECT step, value FROM scalars WHERE run='twins' ORDER BY step").fetchall()
    assert rows == [(i, float(i)) for i in range(rounds)]  # each batch once


# -- and afterwards, valid data is stored exactly ---------------------------------------------------------
def test_valid_data_is_stored_exactly_afterwards(app_client) -> None:  # noqa: ANN001
    client, data = app_client
    t = time.time()
    body = full_batch("after", t)
    body["events"].insert(2, {"kind": "scalars", "step": 2, "time": t, "values": {"loss": 3}})  # an integer is a number
    r = client.post("/v1/ingest", content=orjson.dumps(body))
    assert r.status_code == 200 and r.json()["accepted"] == len(body["events"])
    db = _reader(data)
    assert db.execute("SELECT step, name, value, time, rank FROM scalars WHERE run='after' ORDER BY step, name"
                      ).fetchall() == [(1, "acc", None, t, 0), (1, "loss", 0.5, t, 0), (1, "lr", 1.0, t, 0),
                                       (2, "loss", 3.0, t, 0)]
    assert db.execute("SELECT step, collection, tensor, numel, norm, mean, nan_count, inf_count FROM stats "
                      "WHERE run='after' AND collection='gradients'").fetchall() == [
        (1, "gradients", "fc.weight", 6, 1.25, 0.0, 0, 0)]
    summary = orjson.loads(db.execute("SELECT summary FROM embedding_tables WHERE run='after'").fetchone()[0])
    assert (summary["rows"], summary["dead_ids"], summary["zombies"][0]["touches"]) == (4, [3], 2)
    assert db.execute("SELECT name, duration, gpu_duration FROM spans WHERE run='after'").fetchall() == [
        ("forward", 0.01, 0.005)]
    assert db.execute("SELECT text FROM messages WHERE run='after'").fetchall() == [("hello",)]
    start = orjson.loads(db.execute("SELECT start FROM runs WHERE run='after'").fetchone()[0])
    assert (start["total_params"], start["params"][0]["shape"], start["optimizer"]["param_groups"]) == (
        6, [2, 3], [{"lr": 0.1, "momentum": 0, "nesterov": False}])
    # The setup's run, under every hostile request above, holds what it was sent.
    loss = db.execute("SELECT step, value FROM scalars WHERE run=? AND name='loss' ORDER BY step", (LIVE,)).fetchall()
    assert loss == [(s, 1.0 / s) for s in range(1, 30)] + [(30, None)]
    assert client.get(f"/v1/runs/{VICTIM}").status_code == 200


# -- files and configuration ----------------------------------------------------------------------------
def test_imported_files_refuse_bad_lines_and_keep_the_good(tmp_path: Path) -> None:
    good = orjson.dumps({"batch_id": "import-good-1", "run": "imp", "seq": 0, "events": [_event()]})
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join([b"\x00\xff binary junk", CORPUS["nan literal"][0], good, b"{" * 5000,
                                 b"x" * (33 << 20), CORPUS["extra field"][0], b""]))
    data = tmp_path / "data"
    r = CliRunner().invoke(main, ["import", str(path), "--data", str(data)])
    assert r.exit_code == 0, r.output
    assert "1 batch(es) stored, 0 already present, 5 refused" in r.output
    with sqlite3.connect(data / "traindx.sqlite") as conn:
        assert conn.execute("SELECT count(*) FROM scalars").fetchone()[0] == 1


@pytest.mark.parametrize("env", [{"TRAINDX_PORT": "eighty"}, {"TRAINDX_PORT": "99999"},
                                 {"TRAINDX_MAX_DATA_MB": "-5"}, {"TRAINDX_MAX_PENDING_INGEST": "0"},
                                 {"TRAINDX_ALLOW_HOSTS": "evil.example:notaport"},
                                 {"TRAINDX_ALLOW_ORIGINS": "null"}, {"TRAINDX_ALLOW_ORIGINS": "http://x/path"}])
def test_bad_config_is_refused_with_a_clear_message(tmp_path: Path, env: dict) -> None:
    r = CliRunner().invoke(main, ["serve", "--data", str(tmp_path)], env=env)
    assert r.exit_code == 2 and "Invalid value" in r.output and "Traceback" not in r.output


# The tests that send cases; the figure is printed (and held to 3,000) when all of them ran.
SENDERS = {"test_fuzz_random_json_bodies", "test_fuzz_mutated_batches", "test_fuzz_random_bytes",
           "test_fuzz_rest_parameters", "test_ingest_refuses_every_out_of_range_or_mistyped_field",
           "test_the_fields_once_stored_or_crashing_are_refused", "test_hostile_corpus_is_refused_whole",
           "test_a_run_start_with_a_bad_interval_is_refused_whole",
           "test_every_route_refuses_hostile_input_and_writes_nothing",
           "test_every_mcp_tool_refuses_hostile_arguments_and_writes_nothing",
           "test_concurrent_duplicate_batches_are_stored_once"}
RAN: set[str] = set()


@pytest.fixture(autouse=True)
def _record(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    RAN.add(request.node.originalname)


def test_zz_hostile_input_figure(capsys: pytest.CaptureFixture) -> None:
    """Runs last in this module: the figure over every case above (also printed without -s)."""
    if not SENDERS <= RAN:
        pytest.skip(f"not every case-sending test of this module ran ({sorted(SENDERS - RAN)} did not)")
    with capsys.disabled():
        print(f"\nhostile-input cases: {CASES['n']}, answers >= 500: {CASES['5xx']}, "
              f"refusals that wrote: {CASES['written']}")
    assert CASES["5xx"] == 0 and CASES["written"] == 0
    assert CASES["n"] >= 3000
