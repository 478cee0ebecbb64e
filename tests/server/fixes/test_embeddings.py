"""The verdict on an embedding fix: taken on the loss, since damping cannot clear what makes rows zombies."""

from __future__ import annotations

import uuid

import pytest

from diag_server import fixes as server_fixes
from diag_server.pipeline.engine import Engine
from diag_server.pipeline.ingest import ingest
from diag_server.store import Store
from schemas import IngestBatch


@pytest.mark.parametrize("loss_after", [0.9, 1.5], ids=["not_worse", "worse"])
def test_a_damping_fix_is_judged_on_the_loss_while_its_zombies_hold(tmp_path, loss_after: float) -> None:
    """Damping zombie rows cannot clear what makes them zombies (their data): their anomaly holding after
    the fix is the expected state. The verdict is taken on the loss once the window has passed: effective
    when it is not worse, ineffective (revert suggested) when it is."""
    store, engine, run = Store(tmp_path), Engine(), "damped"
    seq = iter(range(10**6))

    def feed(*events: dict) -> None:
        ingest(store, engine, IngestBatch.model_validate({"batch_id": uuid.uuid4().hex, "run": run, "seq": next(seq),
                                                          "events": list(events)}))

    def step(at: int, loss: float) -> None:
        zombies = [{"row": r, "touches": 200, "velocity": 0.1, "consistency": -0.3, "snr": 0.05, "noise": 4.0}
                   for r in (3, 17, 29)]
        summary = {"rows": 1000, "dim": 8, "median_touches": 100.0, "zombies": zombies}
        feed({"kind": "scalars", "step": at, "time": 1.0 + at, "values": {"loss": loss}},
             {"kind": "tensor_stats", "step": at, "time": 1.0 + at, "collection": "embeddings",
              "rows": [{"name": "item.weight", "numel": 8000, "embedding": summary}]})

    feed({"kind": "run_start", "step": 0, "time": 1.0, "config": {"interval": 20}, "allow": ["embedding_grad_scale"]})
    for at in range(0, 101, 20):
        step(at, 1.0)
    (a,) = [x for x in store.read().execute("SELECT id, kind, status FROM anomalies WHERE run=?", (run,))]
    assert (a["kind"], a["status"]) == ("zombie_embedding", "open")
    fix = server_fixes.propose(store, run, a["id"], "test").fixes[0]
    assert fix.action.value == "embedding_grad_scale"
    server_fixes.apply(store, run, fix.id, "test")
    feed({"kind": "fix_ack", "step": 101, "time": 102.0, "fix_id": fix.id, "status": "applied",
          "before": {"embedding_grad_scale": 1.0}, "after": {"embedding_grad_scale": 0.4}})
    for at in range(120, 421, 20):
        step(at, loss_after)
    row = store.read().execute("SELECT status, reason FROM fixes WHERE id=? AND run=?", (fix.id, run)).fetchone()
    assert store.read().execute("SELECT status FROM anomalies WHERE id=? AND run=?", (a["id"], run)).fetchone()[0] == "open"
    if loss_after < 1.0:
        assert row["status"] == "effective" and "still holds, as expected" in row["reason"], row["reason"]
    else:
        assert row["status"] == "ineffective" and "revert it" in row["reason"], row["reason"]
    store.close()
