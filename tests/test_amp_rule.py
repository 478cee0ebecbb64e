"""The nonfinite rule and AMP: gradients of a step the GradScaler skipped are not a fault; anything else is."""

from __future__ import annotations

import orjson

from diag_server.rules import Observations
from diag_server.rules.nonfinite import NonFinite


def _grads(step: int, nan: int) -> dict:
    return {step: [{"name": "fc.weight", "norm": None if nan else 1.0, "nan_count": nan, "inf_count": 0}]}


def test_skipped_step_gradients_are_ignored_even_when_they_arrive_in_a_later_batch():
    rule = NonFinite()
    state = rule.initial_state()
    first = Observations(run="r", interval=1, scalars={"loss": [(4, 0.5)], "amp/skipped": [(4, 1.0)]})
    assert rule.observe(state, first) == []
    state = orjson.loads(orjson.dumps(state))  # the engine persists rule state between batches
    second = Observations(run="r", interval=1, stats={"gradients": _grads(4, nan=12)})
    assert rule.observe(state, second) == []


def test_nan_gradients_on_a_step_the_scaler_did_not_skip_are_still_a_fault():
    rule = NonFinite()
    state = rule.initial_state()
    obs = Observations(run="r", interval=1, scalars={"amp/skipped": [(4, 1.0)]}, stats={"gradients": _grads(5, nan=3)})
    [finding] = rule.observe(state, obs)
    assert finding.evidence["first_step"] == 5 and finding.evidence["first_in"] == "gradients"


def test_a_nan_loss_on_a_skipped_step_is_still_a_fault():
    # The scaler only explains overflowing scaled gradients; a NaN forward is broken whatever the scaler does.
    rule = NonFinite()
    obs = Observations(run="r", interval=1, scalars={"amp/skipped": [(4, 1.0)], "loss": [(4, None)]})
    [finding] = rule.observe(rule.initial_state(), obs)
    assert finding.evidence["first_in"] == "scalar:loss"
