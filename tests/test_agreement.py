"""The ranks' agreement on the step a fix is applied after (probes/agreement.py), rank by rank through one
real torch.distributed store (a HashStore: the calls two ranks make, in the orders they can come in).
tests/test_distributed.py runs it in real 2-rank gloo jobs."""

from __future__ import annotations

import torch.distributed as dist

from probes.agreement import MIN_LEAD, Agreement


def _ranks() -> tuple[Agreement, Agreement]:
    store = dist.PrefixStore("traindx/run/", dist.HashStore())
    return Agreement(store, 2), Agreement(store, 2)


def test_the_first_proposal_stands_and_both_ranks_apply_after_it():
    r0, r1 = _ranks()
    at = r0.propose(("f-1", "apply", "1"), 100, step_time=0.01)  # 2 s of 10 ms steps ahead
    assert at == 300
    assert r1.propose(("f-1", "apply", "1"), 140, step_time=0.001) == at  # its own lead would have been 2000 steps
    assert r1.verdict(("f-1", "apply", "1"), at, at) is None and r0.verdict(("f-1", "apply", "1"), at, at) is None


def test_a_rank_that_picks_it_up_past_the_step_makes_every_rank_refuse():
    r0, r1 = _ranks()
    at = r0.propose(("f-2", "apply", "1"), 10, step_time=None)
    assert at == 10 + MIN_LEAD
    why = r0.verdict(("f-2", "apply", "1"), at, at)  # rank 1 has not counted itself in
    assert why == f"only 1 of 2 ranks had it by step {at}"
    assert r1.propose(("f-2", "apply", "1"), at + 1, step_time=None) == at  # late: not counted
    assert r1.verdict(("f-2", "apply", "1"), at + 1, at) == why


def test_a_late_rank_first_to_ask_writes_the_refusal_the_other_rank_reads():
    """Rank 1 is one step past the agreed step when it picks the command up (the ranks step in lockstep,
    within one step of each other) and asks first: rank 0, which counted itself in, refuses too."""
    r0, r1 = _ranks()
    at = r0.propose(("f-3", "apply", "1"), 50, step_time=None)
    assert r1.propose(("f-3", "apply", "1"), at + 1, step_time=None) == at
    assert r1.verdict(("f-3", "apply", "1"), at + 1, at) is not None
    assert r0.verdict(("f-3", "apply", "1"), at, at) == "only 1 of 2 ranks had it by step 55"


def test_another_attempt_is_agreed_on_anew():
    r0, r1 = _ranks()
    at = r0.propose(("f-4", "apply", "1"), 10, step_time=None)
    assert r0.verdict(("f-4", "apply", "1"), at, at) is not None  # rank 1 never had the first attempt
    at2 = r0.propose(("f-4", "apply", "2"), 30, step_time=None)
    assert r1.propose(("f-4", "apply", "2"), 31, step_time=None) == at2 == 30 + MIN_LEAD
    assert r0.verdict(("f-4", "apply", "2"), at2, at2) is None and r1.verdict(("f-4", "apply", "2"), at2, at2) is None


def test_a_single_process_job_has_no_agreement():
    assert Agreement.for_job("run", 1) is None
    assert Agreement.for_job("run", 2) is None  # torch.distributed not initialised here
