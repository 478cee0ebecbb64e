"""The probe's side of compression: the fisher collection, the prune and sensitivity actions, offline files."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from lxml import etree

import probes
from diag_server.compression.offline import load_compressed, pack, serialized_size, unpack
from diag_server.compression.recipe import plan
from diag_server.api.xml import to_xml, xsd_schema
from probes.fisher import find
from schemas import export
from schemas.events import LayerProfiles

ROOT = Path(__file__).resolve().parent.parent


def tiny(d_in: int = 6) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d_in, 48), torch.nn.ReLU(), torch.nn.Linear(48, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 1))


def data(n: int = 256, d_in: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, d_in, generator=g)
    return x, (x[:, :1] * 2 - x[:, 1:2] + 0.5 * x[:, 2:3] * x[:, 3:4])


def train(model, opt, probe, steps: int, x, y, batch: int = 32) -> None:
    for i in range(steps):
        b = slice((i * batch) % len(x), (i * batch) % len(x) + batch)
        loss = ((model(x[b]) - y[b]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)


def attach(model, opt, tmp_path, **kw):
    sink = probes.MemorySink()
    kw.setdefault("collections", {"fisher": 1})
    return probes.attach(model, opt, run="t", sink=sink, spool_dir=tmp_path, **kw), sink


def command(probe, sink, cmd: dict) -> dict:
    """Hand the job one command as the server would (on a reply), and return its acknowledgement."""
    sink.commands.append(cmd)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe.flush()
        probe.step()
        acks = [e for e in sink.events if e["kind"] == "fix_ack" and e["fix_id"] == cmd["fix_id"]
                and e["op"] == cmd.get("op", "apply")]
        if acks:
            return acks[-1]
    raise AssertionError("the job never acknowledged the command")


def test_fisher_values_are_squared_gradients_and_kfac_factors(tmp_path) -> None:
    model, (x, y) = tiny(), data()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients we check against stay valid
    probe, sink = attach(model, opt, tmp_path)
    loss = ((model(x[:32]) - y[:32]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    grad = model[0].weight.grad.clone()
    h = x[:32]
    opt.step()
    probe.step(loss=loss)
    fisher = find(probe)
    # One sample: the bias-corrected EMA is the squared gradient itself; A is E[x x^T] of the layer's input.
    assert torch.allclose(fisher.diagonal("0.weight"), grad ** 2, rtol=1e-5)
    curv = fisher.curvature("0.weight")
    assert torch.allclose(curv.A, h.T @ h / 32, rtol=1e-4, atol=1e-6)
    assert curv.G.shape == (48,) and bool((curv.G >= 0).all())
    probe.close()
    stats = [e for e in sink.events if e["kind"] == "tensor_stats" and e["collection"] == "fisher"]
    assert stats and {r["name"] for r in stats[0]["rows"]} == {"0.weight", "0.bias", "2.weight", "2.bias",
                                                                 "4.weight", "4.bias"}
    profiles = [e for e in sink.events if e["kind"] == "layer_profiles"]
    assert profiles, "close() sends the final layer profiles"
    ev = LayerProfiles.model_validate(profiles[-1])
    assert [l.name for l in ev.layers] == ["0.weight", "2.weight", "4.weight"]
    curve = ev.layers[0].unstructured
    assert curve[0] == 0 and all(b >= a for a, b in zip(curve, curve[1:]))  # more pruning never costs less


def test_fisher_is_opt_in_per_module_bounded_and_skips_unsampled_steps(tmp_path) -> None:
    model, (x, y) = tiny(), data()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    probe, sink = attach(model, opt, tmp_path, collections={"fisher": 5}, fisher_modules=["0", "2"],
                         fisher_max_elements=(6 * 48 + 48 + 36 + 48) + (48 * 32 + 32))
    fisher = find(probe)
    # Layer 0 fits with its K-FAC factors; layer 2 only with its diagonal; layer 4 was not asked for.
    assert [(l.name, l.kfac) for l in fisher.layers] == [("0", True), ("2", False)]
    assert fisher.elements <= probe.fisher_max_elements
    train(model, opt, probe, 12, x, y)
    assert fisher.samples == 3  # steps 0, 5, 10
    assert fisher.diagonal("4.weight") is None
    assert all(s.device == p.device for l in fisher.layers for s, p in zip(l.diag.values(), l.params.values()))
    probe.close()

    probe, sink = attach(tiny(), None, tmp_path, fisher_max_elements=10)
    probe.step()
    probe.close()
    assert find(probe).layers == []
    assert any(e["kind"] == "message" and "left out 3 module(s)" in e["text"] for e in sink.events)


def profiled_run(tmp_path, steps: int = 100):
    model, (x, y) = tiny(), data()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    probe, sink = attach(model, opt, tmp_path, allow=["prune", "sensitivity"])
    train(model, opt, probe, steps, x, y)
    return model, opt, probe, sink, x, y


def test_recipe_meets_its_target_and_validates(tmp_path) -> None:
    model, opt, probe, sink, x, y = profiled_run(tmp_path)
    profiles = {p["name"]: p for p in find(probe).profiles()}
    total = sum(p.numel() for p in model.parameters())
    r = plan("t", profiles, {}, total, target_sparsity=0.7, loss=0.05)
    assert r.achieved_sparsity >= 0.7 - 1e-3
    assert all(l.reason and l.size_bytes is not None and l.loss_increase is not None for l in r.layers)
    assert r.predicted_size_bytes < r.dense_size_bytes
    budget = r.dense_size_bytes // 8
    by_size = plan("t", profiles, {}, total, target_bytes=budget, loss=0.05)
    assert by_size.predicted_size_bytes <= budget and by_size.target_size_bytes == budget
    for rec in (r, by_size):
        jsonschema.validate(rec.model_dump(mode="json"), export.schema_for("CompressionRecipe"))
        xsd_schema().assertValid(etree.fromstring(to_xml(rec)))
    probe.close()


def test_prune_keeps_masks_through_training_and_reverts(tmp_path) -> None:
    model, opt, probe, sink, x, y = profiled_run(tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ack = command(probe, sink, {"fix_id": "f-1", "action": "prune", "params": {
        "layers": ["0.weight", "2.weight"], "sparsity": [0.5, 0.8], "rounds": 2, "every": 5}})
    assert ack["status"] == "applied", ack
    assert ack["after"]["sparsity"][1] < 0.8  # gradual: the first of two rounds on the cubic ramp
    train(model, opt, probe, 30, x, y)  # fine-tune under the masks; the second round comes at step 5
    w0, w2 = model[0].weight, model[2].weight
    assert float((w0 == 0).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert float((w2 == 0).float().mean()) == pytest.approx(0.8, abs=0.01)
    mask = w2 != 0
    train(model, opt, probe, 10, x, y)
    assert torch.equal(model[2].weight != 0, mask), "pruned weights stay pruned through optimizer steps"
    ack = command(probe, sink, {"fix_id": "f-1", "op": "revert", "action": "prune"})
    assert ack["status"] == "reverted"
    assert torch.equal(model[2].weight, before["2.weight"])
    train(model, opt, probe, 3, x, y)
    assert float((model[2].weight == 0).float().mean()) < 0.05, "the mask is gone after revert"
    probe.close()


def test_sensitivity_measures_each_layer_on_the_held_batch(tmp_path) -> None:
    model, opt, probe, sink, x, y = profiled_run(tmp_path, steps=60)
    ack = command(probe, sink, {"fix_id": "f-2", "action": "sensitivity", "params": {}})
    assert ack["status"] == "rejected" and "set_held_batch" in ack["reason"]
    probe.set_held_batch(x[:128], y[:128], torch.nn.functional.mse_loss)
    weights = model[0].weight.detach().clone()
    ack = command(probe, sink, {"fix_id": "f-3", "action": "sensitivity", "params": {"sparsities": [0.5, 0.9]}})
    assert ack["status"] == "applied", ack
    assert torch.equal(model[0].weight, weights) and model.training
    probe.flush()
    ev = [e for e in sink.events if e["kind"] == "layer_profiles" and e["source"] == "held_batch"][-1]
    layer = ev["layers"][0]
    assert layer["sparsities"] == [0.5, 0.9] and layer["unstructured"][1] > layer["unstructured"][0]
    assert set(layer["precision"]) == {"fp16", "bf16", "int8"} and abs(layer["precision"]["fp16"]) < 1e-3
    probe.close()


def test_compress_writes_a_smaller_file_that_loads_and_predicts_the_same(tmp_path) -> None:
    model, opt, probe, sink, x, y = profiled_run(tmp_path)
    profiles = {p["name"]: p for p in find(probe).profiles()}
    r = plan("t", profiles, {}, sum(p.numel() for p in model.parameters()), target_sparsity=0.6, loss=1.0)
    command(probe, sink, {"fix_id": "f-4", "action": "prune", "params": {
        "layers": [l.name for l in r.layers], "sparsity": [l.sparsity for l in r.layers], "every": 0}})
    probe.close()
    with torch.no_grad():
        want = model(x)
    ckpt, recipe, out = tmp_path / "model.pt", tmp_path / "recipe.json", tmp_path / "small.pt"
    torch.save(model.state_dict(), ckpt)
    recipe.write_text(r.model_dump_json())
    proc = subprocess.run([sys.executable, "-m", "diag_server.cli", "compress", "--checkpoint", str(ckpt),
                           "--recipe", str(recipe), "--out", str(out)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"compressed_bytes"' in proc.stdout
    assert out.stat().st_size < 0.6 * ckpt.stat().st_size
    small = tiny()
    load_compressed(out, small)
    with torch.no_grad():
        got = small(x)
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())  # int8 where the recipe chose it
    assert torch.equal(small[0].weight == 0, model[0].weight == 0)
    # A tensor stored in fp32 comes back bit for bit.
    fp32 = r.model_copy(update={"layers": [l.model_copy(update={"precision": "fp32"}) for l in r.layers]})
    assert torch.equal(unpack(pack(model.state_dict(), fp32))["2.weight"], model[2].weight.detach())
    assert serialized_size(pack(model.state_dict(), fp32)) < serialized_size(model.state_dict())
