"""Plain training loops: gradient accumulation, AMP with a GradScaler, torch.compile'd models."""

from __future__ import annotations

import math

import pytest
import torch

import probes
from tests.integration_helpers import Agent, one_thread  # noqa: F401
from probes.sinks import MemorySink

pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _global_norm(rows: list[dict]) -> float:
    return math.sqrt(sum(r["norm"] ** 2 for r in rows))


def test_accumulation_reports_the_accumulated_gradient_once_per_optimizer_step():
    model, sink = _mlp(), MemorySink()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe = probes.attach(model, opt, run="loop-accum", sink=sink, interval=1, collections=["gradients"])
    accumulate, reference = 4, _mlp()
    expected, last_micro = [], []
    batches = _batches(12)
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            expected.append(math.sqrt(sum(p.grad.norm() ** 2 for p in model.parameters())))
            reference.load_state_dict(model.state_dict())
            reference.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).div(accumulate).backward()
            last_micro.append(math.sqrt(sum(p.grad.norm() ** 2 for p in reference.parameters())))
            opt.step()
            probe.step(loss=loss)  # once per optimizer step: the gradients are the accumulated ones
            opt.zero_grad()
    probe.close()
    reported = [_global_norm(e["rows"]) for e in sink.events if e.get("collection") == "gradients"]
    assert len(reported) == 3
    assert reported == pytest.approx(expected, rel=1e-5)
    assert all(abs(r - m) > 1e-3 * r for r, m in zip(reported, last_micro))


def _amp_run(run: str, url: str, spool, *, tell_probe: bool) -> tuple[list[float], float]:
    """bf16 autocast on CPU with a GradScaler; step 4's loss is multiplied so its scaled gradients overflow."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    probe = probes.attach(model, opt, run=run, server=url, interval=1, flush_interval=0.05, spool_dir=spool,
                          scaler=scaler if tell_probe else None)
    for i, (x, y) in enumerate(_batches(12)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss * (1e38 if i == 4 else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        probe.step(loss=loss)
    probe.close()
    return [p.float().abs().max().item() for p in model.parameters()], scaler.get_scale()


def test_amp_steps_the_scaler_skips_are_reported_as_skipped_not_as_faults(session_server, tmp_path):
    weights, scale = _amp_run("loop-amp", session_server.url, tmp_path / "spool", tell_probe=True)
    assert all(math.isfinite(w) for w in weights) and scale == 32768.0  # the scaler skipped one step
    agent = Agent(session_server.url, "loop-amp")
    assert [(s, v) for s, v in agent.scalar("amp/skipped")] == [(4, 1.0)]
    # No fault from the skipped step (a 12-step run on random targets may still look oscillating).
    assert not {"nonfinite", "exploding_gradient"} & {a["kind"] for a in agent.anomalies()}
    # The probe reads the gradients after scaler.step() has unscaled them: their norms are O(1), not O(65536).
    grads = agent.client.get("/v1/runs/loop-amp/series/0.weight", params={"collection": "gradients"}).json()
    norms = [p["value"] for p in grads["points"]]
    assert len(norms) == 12 and norms[4] is None and all(0 < n < 100 for n in norms[:4] + norms[5:])

    # The same run without telling the probe about the scaler: the skipped step looks like a NaN fault.
    _amp_run("loop-amp-untold", session_server.url, tmp_path / "spool2", tell_probe=False)
    kinds = [a["kind"] for a in Agent(session_server.url, "loop-amp-untold").anomalies()]
    assert "nonfinite" in kinds


def test_compiled_model_what_the_probe_sees():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    model, sink = _mlp(), MemorySink()
    # aot_eager runs Dynamo and AOTAutograd as inductor does, without generating C++: the hooks behave the same.
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.01)
    probe = probes.attach(compiled, opt, run="loop-compiled", sink=sink, interval=2)
    graphs = []
    for x, y in _batches(10):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        graphs.append(counters["stats"]["unique_graphs"])
    probe.close()
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], "the probe's hooks made torch.compile recompile"
    by = {}
    for e in sink.events:
        if e["kind"] == "tensor_stats":
            by.setdefault(e["collection"], []).append(e)
    for collection in ("weights", "gradients", "updates"):
        assert [e["step"] for e in by[collection]] == [0, 2, 4, 6, 8]
        assert {r["name"] for r in by[collection][-1]["rows"]} >= {"_orig_mod.0.weight", "_orig_mod.2.bias"}
    assert all([r["name"] for r in e["rows"]] == ["<input>", "<output>"] for e in by["activations"])
    notes = [e["text"] for e in sink.events if e["kind"] == "message"]
    assert any("torch.compile'd" in t and "per-layer activations are not collected" in t for t in notes)
