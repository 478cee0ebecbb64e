"""No false alarms on realistic healthy training: a slice of benchmarks/healthy_corpus.py through a real server.

The slice holds the runs whose healthy behaviour looked like a fault to the rules before: a tiny BERT and a ViT
(transformers' standard init: query and key projections get ~1e-4 of the other layers' gradients at first, and a
patch projection of std 0.02 over 4 inputs looks too small for its fan-in), a CNN with batch norm that converges
(its loss wanders 3x above its best near 0; a hard batch's gradient is 18x its recent median), and a run that
learns late (flat for 500 steps, then a sharp drop). Each is shortened where it still shows that; the probe
samples every 10 steps, the short interval of the benchmark. benchmarks/healthy.py runs the whole corpus.
"""

from __future__ import annotations

import sys

import httpx
import pytest

import probes
from tests.conftest import AUTH, ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.healthy_corpus import BY_NAME

SLICE = {"late_learner": 2000, "cnn_bn": 400, "bert": 150, "vit": 150}  # model -> steps


@pytest.mark.parametrize("name", list(SLICE))
def test_a_healthy_run_raises_no_alarm(session_server, one_torch_thread, tmp_path, name):
    run = f"healthy-{name}"
    result = BY_NAME[name].train(lambda m, o: probes.attach(m, o, run=run, server=session_server.url, interval=10,
                                                           spool_dir=tmp_path / "spool"), 0, steps=SLICE[name])
    found = httpx.get(f"{session_server.url}/v1/runs/{run}/anomalies", params={"limit": 500}, headers=AUTH).json()
    alarms = [(a["kind"], a["first_step"], a["message"]) for a in found["anomalies"] if a["severity"] != "info"]
    assert alarms == []
    assert result.median(len(result.losses) - 50, len(result.losses)) < 0.95 * result.median(0, 20)  # it learns
    if name == "late_learner":  # its plateau, read as such: an info while the weights move
        [plateau] = [a for a in found["anomalies"] if a["kind"] == "loss_not_decreasing"]
        assert plateau["severity"] == "info" and "plateau" in plateau["message"]
        assert result.median(0, 400) > 0.6 and result.losses[-1] < 0.01
