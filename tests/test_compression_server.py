"""Compression end to end: a real server, a real job streaming Fisher profiles, recipe, sensitivity, prune."""

from __future__ import annotations

import time

import anyio
import httpx
import jsonschema
import torch
from lxml import etree
from agent_examples.scripted_agent import connect

import probes
from diag_server.api.xml import xsd_schema
from probes.fisher import find
from schemas import export

from tests.test_compression_probe import data, tiny  # noqa: E402


async def _mcp_recipe(url: str):
    async with connect(url) as client:  # with the server's token (TRAINDX_TOKEN), as agents send it
        return await client.call_tool("compression_recipe", {"run": "cx-1", "target_sparsity": 0.6})


def _until(probe, model, opt, x, y, check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loss = ((model(x[:32]) - y[:32]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        probe.flush()
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_recipe_sensitivity_and_live_prune_through_the_http_api(server, tmp_path) -> None:
    model, (x, y) = tiny(), data()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    probe = probes.attach(model, opt, run="cx-1", server=server.url, collections={"fisher": 1},
                          allow=["prune", "sensitivity"], spool_dir=tmp_path, flush_interval=0.05)
    for i in range(80):
        loss = ((model(x[i % 8 * 32:][:32]) - y[i % 8 * 32:][:32]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    find(probe).send_profiles(probe.step_count)
    assert probe.flush()
    api = httpx.Client(base_url=server.url, timeout=30, headers=server.headers)

    r = api.get("/v1/runs/cx-1/compression", params={"target_sparsity": 0.6})
    assert r.status_code == 200, r.text
    recipe = r.json()
    jsonschema.validate(recipe, export.schema_for("CompressionRecipe"))
    assert recipe["method"] == "fisher-obs-allocation" and recipe["achieved_sparsity"] >= 0.599
    assert [l["name"] for l in recipe["layers"]] == ["0.weight", "2.weight", "4.weight"]
    xml = api.get("/v1/runs/cx-1/compression", params={"target_sparsity": 0.6, "format": "xml"})
    xsd_schema().assertValid(etree.fromstring(xml.content))
    sized = api.get("/v1/runs/cx-1/compression", params={"target_bytes": recipe["dense_size_bytes"] // 6}).json()
    assert sized["predicted_size_bytes"] <= recipe["dense_size_bytes"] // 6
    bad = api.get("/v1/runs/cx-1/compression", params={"target_sparsity": 1.5})
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_request"
    # The same recipe over MCP, as an agent asks for it.
    tool = anyio.run(_mcp_recipe, f"{server.url}/mcp")
    assert not tool.is_error and tool.structured_content["layers"] == recipe["layers"]

    # Sensitivity on request: the job measures on its held batch; the next recipe is calibrated by it.
    probe.set_held_batch(x[:128], y[:128], torch.nn.functional.mse_loss)
    fix = api.post("/v1/runs/cx-1/compression/sensitivity").json()
    assert fix["action"] == "sensitivity" and fix["status"] == "pending"
    _until(probe, model, opt, x, y, lambda: api.get(f"/v1/runs/cx-1/fixes/{fix['id']}").json()["status"] == "applied")
    calibrated = api.get("/v1/runs/cx-1/compression", params={"target_sparsity": 0.6}).json()
    assert all("measured on the held batch" in l["reason"] for l in calibrated["layers"])

    # The recipe as a live fix: masks applied by the job and kept while it trains on.
    fix = api.post("/v1/runs/cx-1/compression/prune", params={"target_sparsity": 0.6}).json()
    assert fix["action"] == "prune" and fix["status"] == "proposed"
    assert api.post(f"/v1/runs/cx-1/fixes/{fix['id']}/apply").json()["status"] == "pending"
    done = _until(probe, model, opt, x, y,
                  lambda: (f := api.get(f"/v1/runs/cx-1/fixes/{fix['id']}").json())["status"] == "applied" and f)
    assert done["after"]["sparsity"] == fix["params"]["sparsity"] or all(
        abs(a - b) < 0.02 for a, b in zip(done["after"]["sparsity"], fix["params"]["sparsity"]))
    for _ in range(5):
        _until(probe, model, opt, x, y, lambda: True)
    zeros = sum(int((p == 0).sum()) for p in model.parameters())
    assert zeros / sum(p.numel() for p in model.parameters()) >= 0.59
    probe.close()
