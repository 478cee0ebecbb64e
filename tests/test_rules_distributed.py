"""The cross-rank rules on their own (pure: observations in, findings out), and fixes across ranks in a real store."""

from __future__ import annotations

import json
from pathlib import Path

from diag_server.pipeline.engine import Engine
from diag_server.pipeline.ingest import ingest
from diag_server.rules import Observations
from diag_server.rules.distributed import CrossRankTiming, RankMemoryGrowth
from diag_server.store import Store
from schemas.events import IngestBatch


def _spans(step: int, *, data: float = 0.001, fwd: float = 0.002, bwd: float = 0.004, opt: float = 0.001,
           allreduce: float = 0.003, wait: float = 0.001) -> list[dict]:
    t = 1000.0 + step
    total = data + fwd + bwd + opt
    out = [("step", "step", t, total), ("data_wait", "phase", t, data), ("forward", "phase", t + data, fwd),
           ("backward", "phase", t + data + fwd, bwd), ("optimizer", "phase", t + data + fwd + bwd, opt),
           ("allreduce", "comm", t + data + fwd + bwd - allreduce, allreduce),
           ("comm_wait", "comm", t + data + fwd + bwd - wait, wait)]
    return [{"step": step, "mode": "train", "name": n, "category": c, "start": s, "duration": d} for n, c, s, d in out]


def _feed(rule, state: dict, world: int, per_rank) -> list:  # noqa: ANN001
    found = []
    for step in range(0, 20, 2):
        for rank in range(world):
            obs = Observations(run="r", rank=rank, world_size=world, spans=_spans(step, **per_rank(rank)))
            found += rule.observe(state, obs)
            state = json.loads(json.dumps(state))  # the engine persists state as JSON between batches
    return found


def test_every_rank_waiting_at_the_all_reduce_is_a_comm_bottleneck() -> None:
    rule = CrossRankTiming()
    found = _feed(rule, rule.initial_state(), 4, lambda r: {"bwd": 0.09, "allreduce": 0.08, "wait": 0.06})
    assert {(f.kind.value, f.key) for f in found} == {("comm_bottleneck", "allreduce")}
    assert found[-1].evidence["min_wait_share"] > 0.5


def test_equal_ranks_with_short_waits_raise_nothing() -> None:
    rule = CrossRankTiming()
    assert _feed(rule, rule.initial_state(), 4, lambda r: {}) == []


def test_a_straggler_is_told_apart_from_the_ranks_that_wait_for_it() -> None:
    rule = CrossRankTiming()
    # Rank 3's backward is slow; ranks 0-2 finish theirs and wait at the all-reduce (their backward spans
    # include the wait, which comm_wait tells apart).
    slow = lambda r: {"bwd": 0.1, "wait": 0.001} if r == 3 else {"bwd": 0.1, "wait": 0.096}  # noqa: E731
    found = _feed(rule, rule.initial_state(), 4, slow)
    assert {(f.kind.value, f.evidence["rank"], f.evidence["phase"]) for f in found} == {
        ("straggler_rank", 3, "backward")}
    assert found[0].evidence["others_wait_s"] > 0.09


def test_a_step_is_judged_only_once_every_rank_has_reported_it() -> None:
    rule = CrossRankTiming()
    state = rule.initial_state()
    for step in range(0, 20, 2):  # only ranks 0 and 1 of 3 report
        for rank in range(2):
            assert rule.observe(state, Observations(run="r", rank=rank, world_size=3, spans=_spans(
                step, fwd=0.2 if rank == 1 else 0.002))) == []
    assert len(state["pending"]) <= 16  # bounded while a rank is silent


def test_one_rank_leaking_memory_is_named() -> None:
    rule = RankMemoryGrowth()
    state = rule.initial_state()
    found = []
    for i in range(12):
        for rank in range(2):
            rss = 500.0 + (40.0 * i if rank == 1 else (i % 2))
            found += rule.observe(state, Observations(run="r", rank=rank, world_size=2,
                                                      scalars={"sys/rss_mb": [(i * 10, rss)]}))
    assert {(f.evidence["rank"], f.evidence["series"]) for f in found} == {(1, "sys/rss_mb")}


def _batch(rank: int, seq: int, events: list[dict]) -> IngestBatch:
    return IngestBatch.model_validate({"batch_id": f"b-{rank}-{seq:04d}-xxxx", "run": "ddp", "seq": seq,
                                       "rank": rank, "events": events})


def test_a_fix_counts_as_applied_only_when_every_rank_applied_it(tmp_path: Path) -> None:
    store, engine = Store(tmp_path), Engine()
    try:
        for rank in range(2):
            ingest(store, engine, _batch(rank, 0, [{"kind": "run_start", "time": 1.0, "rank": rank, "world_size": 2,
                                                    "allow": ["set_probe"]}]))
        store.write(lambda c: c.execute(
            "INSERT INTO fixes(id, run, action, params, rationale, live, rank, status, pending_op, created_at, "
            "updated_at) VALUES ('f-1', 'ddp', 'set_probe', '{\"interval\": 5}', 'look closer', 1, 1, 'pending', "
            "'apply', 1, 1)"))
        ack = {"kind": "fix_ack", "step": 3, "time": 2.0, "fix_id": "f-1", "status": "applied",
               "before": {"interval": 50}, "after": {"interval": 5}}
        reply = ingest(store, engine, _batch(0, 1, [ack]))
        assert reply.commands == []  # rank 0 has it; it is not sent to rank 0 again
        status = lambda: store.read().execute("SELECT status FROM fixes WHERE id='f-1'").fetchone()[0]  # noqa: E731
        assert status() == "pending"  # rank 1 has not applied it yet
        assert [c.fix_id for c in ingest(store, engine, _batch(1, 1, [])).commands] == ["f-1"]
        ingest(store, engine, _batch(1, 2, [{**ack, "status": "rejected", "reason": "not allowed"}]))
        row = store.read().execute("SELECT status, reason FROM fixes WHERE id='f-1'").fetchone()
        assert row[0] == "rejected" and "rank 1" in row[1] and "ranks 0 did apply it" in row[1]
    finally:
        store.close()


def test_steps_slowed_by_a_capture_are_not_compared() -> None:
    rule = CrossRankTiming()
    state = rule.initial_state()
    found = []
    for step in range(0, 20, 2):
        for rank in range(2):
            spans = _spans(step, fwd=0.2 if rank == 0 else 0.002)
            if rank == 0:  # rank 0 runs torch.profiler on these steps
                spans = [{**s, "capture": "c-1"} for s in spans]
            found += rule.observe(state, Observations(run="r", rank=rank, world_size=2, spans=spans))
    assert found == []
