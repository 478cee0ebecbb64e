"""Where teams already watch: Prometheus scraping /metrics, and a run exported to TensorBoard."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

import probes
from tests.integration_helpers import Agent, one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _faulty_run(url: str, run: str, spool) -> None:
    """20 steps of a tiny regression; at step 12 a batch of NaN inputs poisons the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with probes.attach(model, opt, run=run, server=url, interval=2, flush_interval=0.05, spool_dir=spool) as probe:
        for step in range(20):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            if step == 12:
                x = x * float("nan")
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step(loss=loss, **({"val_loss": loss.detach() * 1.1} if step % 5 == 0 else {}))


@pytest.fixture(scope="module")
def faulty(session_server, tmp_path_factory):
    run = "export-nan"
    _faulty_run(session_server.url, run, tmp_path_factory.mktemp("spool"))
    assert "nonfinite" in [a["kind"] for a in Agent(session_server.url, run).anomalies()]
    return session_server, run


def _samples(families, name: str, run: str) -> list:
    return [s for f in families for s in f.samples if s.name == name and s.labels.get("run") == run]


def test_prometheus_metrics_parse_with_the_official_parser(faulty):
    from prometheus_client.parser import text_string_to_metric_families

    srv, run = faulty
    r = httpx.get(f"{srv.url}/metrics", headers=srv.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    [step] = _samples(families, "traindx_run_step", run)
    assert step.value == 20  # the run_end event is stamped with the step count: 20 steps done
    [loss] = _samples(families, "traindx_run_loss", run)
    assert math.isnan(loss.value)  # the run's loss went NaN at step 12 and stayed so: alertable as such
    [open_anomaly] = _samples(families, "traindx_run_open_anomalies", run)
    assert open_anomaly.labels == {"run": run, "kind": "nonfinite", "severity": "critical"}
    assert open_anomaly.value == 1
    [events] = _samples(families, "traindx_run_ingested_events_total", run)
    [rate] = _samples(families, "traindx_run_ingest_events_per_second", run)
    assert events.value > 20 and rate.value > 0
    [active] = _samples(families, "traindx_run_active", run)
    assert active.value == 0  # the job closed its probe

    # A scraper that asks for OpenMetrics gets it, and its parser reads it.
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    r = httpx.get(f"{srv.url}/metrics", headers={**srv.headers, "accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    om = list(om_parse(r.text))
    assert [s.value for s in _samples(om, "traindx_run_open_anomalies", run)] == [1]


def _export(*args: str):  # noqa: ANN202
    """`traindx export ...`, run by click's runner in this process (a new process would import torch again)."""
    from click.testing import CliRunner

    from diag_server.cli import main

    return CliRunner().invoke(main, ["export", *args])


def test_tensorboard_export_reads_back_with_tensorboards_event_reader(faulty, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    srv, run = faulty
    out = tmp_path / "tb"
    done = _export(run, "--tensorboard", str(out), "--data", str(srv.data_dir))
    assert done.exit_code == 0, done.output
    assert "histograms" in done.output

    ea = EventAccumulator(str(out / run), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    ea.Reload()
    tags = ea.Tags()
    loss = ea.Scalars("loss")
    assert [e.step for e in loss] == list(range(20))
    assert all(math.isfinite(e.value) for e in loss[:12]) and all(math.isnan(e.value) for e in loss[13:])
    assert [e.step for e in ea.Scalars("val_loss")] == [0, 5, 10, 15]
    grad = ea.Scalars("gradients/0.weight/norm")
    assert [e.step for e in grad] == list(range(0, 20, 2)) and grad[0].value > 0
    assert "updates/2.weight/update_ratio" in tags["scalars"] and "activations/1/dead_frac" in tags["scalars"]
    hist = ea.Histograms("gradients/norm")
    assert [h.step for h in hist] == list(range(0, 12, 2))  # from step 12 on every norm is NaN: nothing to bin
    assert hist[0].histogram_value.num == 4  # four gradient tensors: two weights, two biases
    assert "anomalies/text_summary" in tags["tensors"]

    # Exporting again replaces the earlier export instead of doubling every point.
    assert _export(run, "--tensorboard", str(out), "--data", str(srv.data_dir)).exit_code == 0
    ea = EventAccumulator(str(out / run), size_guidance={"scalars": 0})
    ea.Reload()
    assert len(ea.Scalars("loss")) == 20


def test_export_of_an_unknown_run_says_so(faulty, tmp_path):
    srv, _ = faulty
    done = _export("no-such-run", "--tensorboard", str(tmp_path / "tb"), "--data", str(srv.data_dir))
    assert done.exit_code == 1 and "no run named 'no-such-run'" in done.output
    assert not (tmp_path / "tb").exists()
    done = _export("x", "--tensorboard", str(tmp_path / "tb"), "--data", str(tmp_path / "nothing"))
    assert done.exit_code == 1 and "no traindx store" in done.output
