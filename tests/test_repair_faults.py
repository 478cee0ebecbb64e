"""The repair suite's two hardest faults, fixed by the proposals the server makes for them: real torch runs.

A corrupt label every 10th batch (exploding gradients) and a learning rate 10x too high from the start
(oscillating loss) both do damage that a fix of the cause alone leaves in place. Each test runs the job of
agent_examples.jobs with its probe sending to the server's own ingest, rules and fix loop in-process (no
HTTP, no agent process); the first time the fault's anomaly is open, the test does what the scripted agent
does: apply the top live proposal, and the rollback proposed behind a guard. It asserts what a user would
see: the run ends within 10% of the healthy run's evaluation loss, where the unfixed run ends far above it.
"""

from __future__ import annotations

import orjson
import pytest

from agent_examples.jobs import fault_job
from agent_examples.scripted_agent import GUARDS
from diag_server import fixes
from diag_server.pipeline.engine import Engine
from diag_server.pipeline.ingest import ingest
from probes.sinks import dumps
from schemas.events import IngestBatch

STEPS = 600


class InProcessServer:
    """A probe sink that is the server: each batch is ingested and the rules run on it; the fixes applied
    ride back on the reply, as they do over HTTP."""

    def __init__(self, store, kind: str, action: str | None = None) -> None:
        self.store, self.engine, self.kind, self.action = store, Engine(), kind, action
        self.applied: list[dict] = []

    def send(self, batch: dict) -> dict:
        for e in batch["events"]:
            if e.get("kind") == "fix_ack":
                self.applied.append({"ack": e.get("status"), "step": e.get("step")})  # for the failure message
        reply = ingest(self.store, self.engine, IngestBatch.model_validate(orjson.loads(dumps(batch))))
        run = batch["run"]
        if not self.applied:  # act once, as the agent does on the first anomaly
            row = self.store.read().execute("SELECT id FROM anomalies WHERE run=? AND kind=? AND status='open'",
                                            (run, self.kind)).fetchone()
            if row is not None:
                self._act(run, row[0])
        return reply.model_dump(mode="json")

    def _act(self, run: str, anomaly_id: str) -> None:
        live = [f for f in fixes.propose(self.store, run, anomaly_id, "test").fixes if f.live]
        if self.action is not None:  # a given action, as a person who picked it would apply it
            live = [f for f in live if f.action.value == self.action]
        chosen = [live[0]]
        if live[0].action.value in GUARDS:
            chosen += [f for f in live[1:] if f.action.value == "rollback"][:1]
        for f in chosen:
            fixes.apply(self.store, run, f.id, "test")
            self.applied.append({"action": f.action.value, "params": f.params})

    def close(self) -> None:
        pass


def _fixed(store, fault: str, kind: str) -> tuple[float, list[dict], list[dict]]:
    sink = InProcessServer(store, kind)
    result = fault_job(fault, run=f"{fault}-fixed", steps=STEPS, pace=0.002,
                       probe_kwargs={"sink": sink, "flush_interval": 0.02})
    assert result.error is None
    return result.final_loss, [a for a in sink.applied if "action" in a], sink.applied


def _baseline(fault: str, **kw) -> float:
    return fault_job(fault, run=fault, steps=STEPS, pace=0, attach=False, **kw).final_loss


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def store(tmp_path):
    from diag_server.store import Store

    s = Store(tmp_path / "data")
    yield s
    s.close()


def test_spikes_from_corrupt_labels_are_clipped_as_they_come_and_their_damage_rolled_back(store):
    fixed, applied, log = _fixed(store, "exploding_gradients", "exploding_gradient")
    healthy, unfixed = _baseline("exploding_gradients", healthy=True), _baseline("exploding_gradients")
    assert [a["action"] for a in applied] == ["grad_clip", "rollback"]
    assert applied[0]["params"]["relative"] == 1.0  # follows the gradient norm down, where a fixed clip lags
    assert unfixed > 5 * healthy
    assert fixed <= 1.1 * healthy, (fixed, healthy, log)


def test_a_rate_too_high_from_the_start_is_rolled_back_to_the_start_with_the_rate_cut(store):
    fixed, applied, log = _fixed(store, "oscillating_loss", "oscillating_loss")
    healthy, unfixed = _baseline("oscillating_loss", healthy=True), _baseline("oscillating_loss")
    assert [a["action"] for a in applied] == ["rollback"]
    assert applied[0]["params"]["lr"] < 0.02  # cut from 0.1, to about the rate the healthy run uses
    assert unfixed > 5 * healthy
    assert fixed <= 1.1 * healthy, (fixed, healthy, log)
