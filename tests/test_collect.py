"""probes.collect: activation and update statistics as torch computes them, and hooks that come off."""

from __future__ import annotations

import pytest
import torch

import probes
from probes.collect import _activation_rows, _activation_stats
from probes.sinks import MemorySink
from tests.test_probe import _train


def _act_row(y: torch.Tensor, module: torch.nn.Module | None) -> dict:
    raw = _activation_stats(y, module)
    raw = raw.tolist() if isinstance(raw, torch.Tensor) else raw
    return _activation_rows(["a"], [[v] for v in raw])[0]


def test_activation_stats_match_torch(path):
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    x[:, :5] = -1.0 - x[:, :5].abs()  # five units never fire
    y = torch.relu(x)
    row = _act_row(y, torch.nn.ReLU())
    assert row["numel"] == y.numel()
    assert row["mean"] == pytest.approx(y.mean().item(), abs=1e-6)
    assert row["std"] == pytest.approx(y.std(unbiased=False).item(), rel=1e-4)
    assert (row["min"], row["max"]) == pytest.approx((y.min().item(), y.max().item()))
    assert row["zero_frac"] == pytest.approx((y == 0).float().mean().item())
    assert row["dead_frac"] == pytest.approx(((y.amax(0) <= 0).float().mean()).item())
    assert row["dead_frac"] >= 5 / 32 and row["saturated_frac"] is None


def test_dead_units_of_sequences_and_images_are_their_feature_and_channel(path):
    torch.manual_seed(0)
    seq = torch.relu(torch.randn(4, 10, 16))
    seq[..., :4] = 0.0
    img = torch.relu(torch.randn(4, 8, 5, 5))
    img[:, :2] = 0.0
    assert _act_row(seq, torch.nn.ReLU())["dead_frac"] == pytest.approx(4 / 16)
    assert _act_row(img, torch.nn.ReLU())["dead_frac"] == pytest.approx(2 / 8)


def test_saturated_fraction_of_a_bounded_activation(path):
    y = torch.tensor([[-1.0, -0.995, 0.0, 0.5], [0.9, 0.985, 1.0, 0.2]])
    row = _act_row(y, torch.nn.Tanh())
    assert row["saturated_frac"] == pytest.approx(4 / 8) and row["dead_frac"] is None
    assert _act_row(y.double(), torch.nn.Tanh())["saturated_frac"] == pytest.approx(4 / 8)
    assert _act_row(y.t(), torch.nn.Tanh())["saturated_frac"] == pytest.approx(4 / 8)  # a non-contiguous view
    p = torch.tensor([0.0, 0.005, 0.5, float("nan"), 0.995, 1.0])  # NaN is neither bound
    assert _act_row(p, torch.nn.Sigmoid())["saturated_frac"] == pytest.approx(4 / 6)


def test_non_finite_activations_are_counted_and_the_moments_skip_them(path):
    y = torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]])
    row = _act_row(y, None)
    assert (row["nan_count"], row["inf_count"]) == (1, 1)
    assert row["mean"] == pytest.approx(2.0) and (row["min"], row["max"]) == (1.0, 3.0)
    y = torch.relu(torch.randn(64, 32))
    y[3, 7], y[9, 1] = float("nan"), float("-inf")  # a unit with a NaN is not thereby alive
    y[:, 7] = torch.where(torch.isnan(y[:, 7]), y[:, 7], torch.zeros(64))
    row = _act_row(y, torch.nn.ReLU())
    assert (row["nan_count"], row["inf_count"]) == (1, 1)
    want = (torch.nan_to_num(y, nan=0.0).amax(0) <= 0).float().mean().item()
    assert row["dead_frac"] == pytest.approx(want) and row["dead_frac"] >= 1 / 32


def test_update_ratio_matches_torch_every_step(path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sink = MemorySink()
    with probes.attach(model, opt, run="upd", sink=sink, interval=1) as probe:
        for _ in range(3):
            before = [p.detach().clone() for p in model.parameters()]
            _train(probe, model, opt, 1)
            want = {n: ((p.detach() - b).norm() / b.norm()).item()
                    for (n, p), b in zip(model.named_parameters(), before)}
            norms = {n: (p.detach() - b).norm().item() for (n, p), b in zip(model.named_parameters(), before)}
            probe.flush()
            last = [e for e in sink.events if e["kind"] == "tensor_stats" and e["collection"] == "updates"][-1]
            assert {r["name"]: r["update_ratio"] for r in last["rows"]} == pytest.approx(want, rel=1e-4)
            assert {r["name"]: r["norm"] for r in last["rows"]} == pytest.approx(norms, rel=1e-4)


def _hooked(model, opt) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()) or bool(
        opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks)


def test_every_step_sampling_keeps_hooks_between_steps_and_takes_them_off_after():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sink = MemorySink()
    probe = probes.attach(model, opt, run="keep", sink=sink, interval=1)
    _train(probe, model, opt, 4)
    assert _hooked(model, opt)  # armed for the next step
    with probe.mode("eval"), torch.no_grad():
        model(torch.randn(4, 8))
        assert not _hooked(model, opt)  # an eval block runs without them
        probe.step()
    _train(probe, model, opt, 2)
    probe.set_interval(10)
    _train(probe, model, opt, 1)  # step 6 was armed under interval 1; step 7 is not sampled
    assert not _hooked(model, opt)
    probe.close()
    assert not _hooked(model, opt)
    steps = sorted(e["step"] for e in sink.events if e["kind"] == "tensor_stats" and e["collection"] == "activations")
    assert steps == [0, 1, 2, 3, 4, 5, 6]
    one = [e for e in sink.events if e["kind"] == "tensor_stats" and e["collection"] == "activations"]
    assert all([r["name"] for r in e["rows"]] == ["<input>", "0", "1", "2", "<output>"] for e in one)


def test_the_output_has_its_last_layers_numbers_without_a_dead_fraction():
    torch.manual_seed(0)
    for last in (torch.nn.Linear(16, 4), torch.nn.ReLU()):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sink = MemorySink()
        with probes.attach(model, opt, run="out", sink=sink, interval=1) as probe:
            _train(probe, model, opt, 2)
        for e in (e for e in sink.events if e["kind"] == "tensor_stats" and e["collection"] == "activations"):
            rows = {r["name"]: r for r in e["rows"]}
            out, layer = rows["<output>"], rows["3"]
            assert {k: v for k, v in out.items() if k not in ("name", "dead_frac")} == \
                {k: v for k, v in layer.items() if k not in ("name", "dead_frac")}
            assert out["dead_frac"] is None
            assert (layer["dead_frac"] is None) == isinstance(last, torch.nn.Linear)
