"""Verdicts on the run's outcome, the stall that a fix of the cause can leave, and fixes ranked by what they
repair: on synthetic series (a verdict, a rule, a proposal on a real SQLite store), and once with real training.
"""

from __future__ import annotations

import math
import random
import time
import uuid

import orjson
import pytest

from diag_server import fixes
from diag_server.pipeline.engine import Engine
from diag_server.pipeline.ingest import ingest
from diag_server.rules.base import Observations
from diag_server.rules.stall import TrainingStalled
from diag_server.store import Store
from diag_server.fixes.verdict import judge
from schemas.events import IngestBatch

RUN = "r1"


def _noisy(fn, steps, sigma, seed=0):
    rng = random.Random(seed)
    return [(s, fn(s) + rng.gauss(0, sigma)) for s in range(steps)]


def _judge(points, **kw):
    args = dict(fault_step=300, applied_step=320, window=200, max_windows=3, cleared_step=None, still_open=False,
                kind="abnormal_update_ratio")
    args.update(kw)
    series = points if isinstance(points, dict) else {"loss": points}
    return judge(series, **args)


# -- verdicts on synthetic series ------------------------------------------------------------------------------
def _transformer(after):
    """Cross-entropy over 16 tokens: 2.77 at chance, down to 2.04 at step 300, where the fault strikes."""
    return lambda s: 2.77 - 0.73 * s / 300 if s < 300 else (3.2 if s < 320 else after(s))


def test_a_run_stuck_at_chance_after_the_fix_is_ineffective_and_says_what_was_compared():
    points = _noisy(_transformer(lambda s: 2.773), 700, 0.03)
    v = _judge(points, now_step=520, cleared_step=340)
    assert v.status == "ineffective"
    assert "loss 2.7" in v.reason and "against 2.1 before the fault (steps 250-299)" in v.reason
    assert "no longer falling" in v.reason and "cleared at step 340" in v.reason
    # The fault was still unfolding when the fix came 20 steps after it: the fix is not blamed for its rise.
    assert not v.revert_suggested and "revert" not in v.reason
    assert "effective" not in v.reason.replace("ineffective", "")


def test_a_run_back_at_its_healthy_level_is_effective_as_soon_as_its_anomaly_clears():
    points = _noisy(_transformer(lambda s: 2.04 - 1e-4 * (s - 320)), 700, 0.03)
    assert _judge(points, now_step=360, cleared_step=340).status is None  # too soon: 40 steps after the fix
    v = _judge(points, now_step=380, cleared_step=340)
    assert v.status == "effective" and v.reason.startswith("effective: the run is back near its level before the fault")
    assert not _judge(points, now_step=380).status  # its anomaly still holds: the whole window is waited for
    assert _judge(points, now_step=520).status == "effective"


def test_a_noisy_loss_is_judged_on_medians_with_its_noise_allowed_for():
    # Minibatch noise of 0.3 around a healthy 1.0: back at 1.05 is back; at 1.6 it is not.
    back = _noisy(lambda s: 3.0 - 2.0 * min(s, 200) / 200 if s < 300 else (6.0 if s < 320 else 1.05), 700, 0.3)
    stuck = _noisy(lambda s: 3.0 - 2.0 * min(s, 200) / 200 if s < 300 else (6.0 if s < 320 else 1.6), 700, 0.3)
    assert _judge(back, now_step=520).status == "effective"
    assert _judge(stuck, now_step=520).status == "ineffective"


def test_without_a_healthy_stretch_the_fix_must_bring_the_loss_down():
    """A fault present from the start (or a fix before the run learned anything): nothing to come back to,
    so the loss must fall clearly below where it was before the fix and where the run started."""
    flat = [(s, 6.0) for s in range(600)]
    falling = [(s, 6.0 if s < 120 else max(6.0 * 0.98 ** (s - 120), 0.1)) for s in range(600)]
    kw = dict(fault_step=0, applied_step=120, now_step=320)
    v = _judge(falling, **kw)
    assert v.status == "effective" and "against 6 before the fix" in v.reason
    v = _judge(flat, **kw)
    assert v.status == "ineffective" and "before the fix" in v.reason
    # A fault that swung the loss wildly before the fix: its swings are not the noise the fix is held to.
    swinging = [(s, (40.0 if s % 2 else 0.5) if s < 120 else 0.07) for s in range(600)]
    assert _judge(swinging, **kw).status == "effective"


def test_the_validation_loss_counts_too():
    loss = _noisy(_transformer(lambda s: 2.0), 700, 0.01)
    # The training loss came back; the model did not.
    val = [(s, 2.8 - 0.7 * s / 300 if s < 300 else 2.6) for s in range(0, 700, 20)]
    v = _judge({"loss": loss, "val_loss": val}, now_step=520)
    assert v.status == "ineffective" and "val_loss 2.6 (steps 480-520) against 2.193 before the fault" in v.reason


def test_a_fix_that_makes_a_settled_run_worse_is_flagged_for_revert():
    points = [(s, 1.0 if s < 200 else (0.5 if s < 400 else 0.8)) for s in range(700)]
    v = _judge(points, fault_step=200, applied_step=400, now_step=600, cleared_step=250)
    assert v.status == "ineffective" and v.revert_suggested and "revert it" in v.reason


def test_a_mitigation_is_judged_on_not_costing_the_run():
    """Damping zombie rows leaves their anomaly in place: effective when no objective got worse, with the
    validation loss's gain named; flagged for revert when the loss got worse."""
    loss = [(s, 1.0 - 0.5 * s / 300 if s < 300 else 0.5) for s in range(600)]
    val = [(s, 0.9 if s <= 300 else 0.8) for s in range(0, 600, 25)]
    kw = dict(fault_step=280, applied_step=300, now_step=520, still_open=True, kind="zombie_embedding",
              mitigation=True)
    v = _judge({"loss": loss, "val_loss": val}, **kw)
    assert v.status == "effective" and "val_loss 0.8" in v.reason and "against 0.9 before the fix" in v.reason
    assert "The zombie_embedding anomaly still holds, as expected" in v.reason
    worse = [(s, 0.5 if s < 300 else 0.7) for s in range(600)]
    v = _judge({"loss": worse}, **kw)
    assert v.status == "ineffective" and v.revert_suggested


def test_a_loss_still_coming_down_gets_more_time_and_then_a_verdict():
    def descent(s):
        return 3.0 - 2.0 * s / 300
    slow = [(s, descent(s) if s < 300 else (5.0 if s < 320 else 1.0 + 4.0 * 0.995 ** (s - 320))) for s in range(1200)]
    assert _judge(slow, now_step=520).status is None  # still falling at the end of the window
    assert _judge(slow, now_step=900).status == "effective"
    stuck = [(s, descent(s) if s < 300 else (5.0 if s < 320 else 2.0 + 3.0 * 0.995 ** (s - 320))) for s in range(1400)]
    v = _judge(stuck, now_step=920)
    assert v.status == "ineffective" and "600 steps after the fix" in v.reason


def test_nan_after_the_fix_is_not_a_recovery():
    points = [(s, 1.0 if s < 300 else None) for s in range(600)]
    v = _judge(points, now_step=520)
    assert v.status == "ineffective" and "not finite" in v.reason


# -- the stall rule -------------------------------------------------------------------------------------------
def _obs(losses, ratios, interval=10, lrs=None):
    scalars = {"loss": losses}
    if lrs is not None:
        scalars["lr/group0"] = lrs
    return Observations(run="r", interval=interval, scalars=scalars,
                        stats={"updates": {s: [{"name": f"l{i}.weight", "update_ratio": r} for i in range(3)]
                                           for s, r in ratios}})


def _stall_series(after_loss, after_ratio, steps=800, fault=300):
    losses = [(s, 2.77 - 0.73 * s / fault if s < fault else after_loss(s)) for s in range(steps)]
    ratios = [(s, 2.5e-3 if s < fault else after_ratio(s)) for s in range(0, steps, 10)]
    return losses, ratios


def test_a_run_stuck_with_collapsed_updates_after_a_fault_stalls_until_it_recovers():
    rule = TrainingStalled()
    state = rule.initial_state()
    losses, ratios = _stall_series(lambda s: 2.77, lambda s: 5e-6)
    found = []
    for lo in range(0, 800, 10):  # batches of 10 steps, as a probe sends them
        obs = _obs([p for p in losses if lo <= p[0] < lo + 10], [p for p in ratios if lo <= p[0] < lo + 10])
        found += [(lo, f) for f in rule.observe(state, obs)]
    assert found, "no stall found"
    first_batch, f = found[0]
    assert 300 < first_batch <= 400 and f.severity.value == "warning"
    assert f.evidence["fault_step"] == 300 and f.since is None
    assert f.evidence["lost_fraction"] > 0.9 and f.evidence["update_ratio"] == 5e-6
    assert "roll back to before the fault" in f.message
    assert found[-1][0] == 790  # still held at the end: it stays open while the run is stuck
    # A rollback brings the loss back: the rule stops reporting, so the engine resolves it.
    back = _obs([(s, 2.0) for s in range(800, 830)], [(s, 2.5e-3) for s in range(800, 830, 10)])
    assert rule.observe(state, back) == []
    assert state["open"] is None


@pytest.mark.parametrize("case", ["step_decay", "gradual_decline", "loud_but_moving"])
def test_no_stall_on_healthy_shapes(case):
    """A step decay of the rate collapses the updates, but it changes the rate; updates that shrink sample by
    sample as a run converges are not a collapse; a loss that rises while updates stay healthy is another
    rule's business (divergence, oscillation)."""
    lrs = [(s, 1e-3) for s in range(0, 800, 10)]
    if case == "step_decay":
        losses, ratios = _stall_series(lambda s: 2.04 - 1e-4 * (s - 300), lambda s: 2.5e-5)
        lrs = [(s, 1e-3 if s < 300 else 1e-5) for s in range(0, 800, 10)]
    elif case == "gradual_decline":
        losses, ratios = _stall_series(lambda s: 2.04 - 1e-4 * (s - 300), lambda s: 2.5e-3 * 0.93 ** ((s - 300) / 10))
    else:
        losses, ratios = _stall_series(lambda s: 2.7, lambda s: 2e-3)
    rule = TrainingStalled()
    state = rule.initial_state()
    assert rule.observe(state, _obs(losses, ratios, lrs=lrs)) == []


def test_updates_that_collapse_with_the_rate_unchanged_are_a_stall_whatever_the_loss():
    """Adam's second moments filled by one huge batch: the loss barely moves, but every step is ~100x
    smaller than before with the same rate. A rollback brings the updates back and resolves it."""
    losses, ratios = _stall_series(lambda s: 2.1, lambda s: 2.5e-5)
    lrs = [(s, 1e-3) for s in range(0, 800, 10)]
    rule = TrainingStalled()
    state = rule.initial_state()
    (f,) = rule.observe(state, _obs(losses, ratios, lrs=lrs))
    assert f.evidence["mode"] == "updates" and f.evidence["fault_step"] == 291
    assert "100x less, from one sample to the next, and not because the learning rate fell" in f.message
    back = _obs([(s, 2.0) for s in range(800, 830)], [(s, 2.5e-3) for s in range(800, 830, 10)],
                lrs=[(s, 1e-3) for s in range(800, 830, 10)])
    assert rule.observe(state, back) == [] and state["open"] is None


def test_stall_state_round_trips_through_json():
    rule = TrainingStalled()
    state = rule.initial_state()
    losses, ratios = _stall_series(lambda s: 2.77, lambda s: 5e-6)
    rule.observe(state, _obs(losses[:400], ratios[:40]))
    state = orjson.loads(orjson.dumps(state))
    assert rule.observe(state, _obs(losses[400:], ratios[40:]))


# -- proposals ranked by what can repair the run -----------------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def _run(store, *, allow, optimizer="Adam", last_step=400, interval=10):
    start = {"kind": "run_start", "allow": list(allow), "config": {"interval": interval},
             "optimizer": {"type": optimizer, "param_groups": [{"lr": 1e-3}]},
             "modules": [{"name": "0", "type": "Linear"}, {"name": "1", "type": "ReLU"},
                         {"name": "2", "type": "Linear"}],
             "params": [{"name": f"{m}.{p}", "shape": [4, 4]} for m in ("0", "2") for p in ("weight", "bias")]}
    store.write(lambda conn: conn.execute(
        "INSERT OR REPLACE INTO runs(run, created_at, last_seen, last_step, ended, start) VALUES (?,?,?,?,0,?)",
        (RUN, time.time(), time.time(), last_step, orjson.dumps(start).decode())))


def _anomaly(store, kind, evidence, first_step, last_step):
    def write(conn):
        cur = conn.execute(
            "INSERT INTO anomalies(run, kind, severity, status, first_step, last_step, tensors, message, evidence, "
            "rule, key, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (RUN, kind, "warning", "open", first_step, last_step, "[]", "m", orjson.dumps(evidence).decode(), kind,
             kind, time.time(), time.time()))
        conn.execute("UPDATE anomalies SET id=? WHERE seq=?", (f"a-{cur.lastrowid}", cur.lastrowid))
        return f"a-{cur.lastrowid}"
    return store.write(write)


def _history(store, *, fault=300, lr_after=0.1, nan_weights_from=None, ratio_after=0.25, grad_after=1.0):
    """Samples every 10 steps: the rate, each weight's NaN count, update ratios and gradient norms."""
    scalars, stats = [], []
    for s in range(0, 400, 10):
        scalars.append((RUN, s, "lr/group0", 1e-3 if s < fault else lr_after, 0.0))
        bad = nan_weights_from is not None and s >= nan_weights_from
        for t in ("0.weight", "2.weight"):
            stats.append((RUN, s, "weights", t, 1 if bad else 0, None, None))
            stats.append((RUN, s, "updates", t, 0, 2e-3 if s < fault else ratio_after, None))
            stats.append((RUN, s, "gradients", t, 0, None, 1.0 if s < fault else grad_after))

    def write(conn):
        conn.executemany("INSERT INTO scalars(run, step, name, value, time) VALUES (?,?,?,?,?)", scalars)
        conn.executemany("INSERT INTO stats(run, step, collection, tensor, nan_count, update_ratio, norm) "
                         "VALUES (?,?,?,?,?,?,?)", stats)
    store.write(write)


LIGHTNING_ALLOW = ("set_lr", "lr_scale", "grad_clip")  # docs/integrations.md's allow-list


def test_nan_weights_under_lightnings_allow_list_get_a_restart_from_a_checkpoint_and_nothing_that_cannot_work(store):
    _run(store, allow=LIGHTNING_ALLOW)
    _history(store, lr_after=0.1, nan_weights_from=330)
    a = _anomaly(store, "nonfinite", {"first_step": 330, "first_in": "activations", "first_tensor": "1",
                                      "seen_in": ["activations", "gradients", "weights"]}, 330, 390)
    proposals = fixes.propose(store, RUN, a, "t").fixes
    assert [f.action.value for f in proposals] == ["advice"] and not proposals[0].live
    text = proposals[0].params["instructions"]
    assert "Restart from the last checkpoint saved before step 291" in text and "(0.001)" in text
    assert "NaN/Inf since step 330 (first in '0.weight')" in text and "allow={'rollback'" in text


def test_nan_weights_with_snapshots_roll_back_first_with_the_rate_from_before_the_rise(store):
    _run(store, allow=("set_lr", "skip_nonfinite", "grad_clip", "rollback"), optimizer="SGD")
    _history(store, lr_after=2.0, nan_weights_from=330)
    a = _anomaly(store, "nonfinite", {"first_step": 330}, 330, 390)
    proposals = fixes.propose(store, RUN, a, "t").fixes
    assert (proposals[0].action.value, proposals[0].params) == ("rollback", {"before_step": 291, "lr": 0.001})
    assert all(not f.live for f in proposals[1:])  # no set_lr, clip or guard: they cannot bring NaN weights back


def test_after_a_spike_in_adams_state_the_rollback_comes_first_and_a_rate_change_never_does(store):
    _run(store, allow=("set_lr", "lr_scale", "grad_clip", "rollback"))
    _history(store, lr_after=0.1)
    a = _anomaly(store, "abnormal_update_ratio", {"median_update_ratio": 0.25, "direction": "high", "high": 0.2},
                 300, 300)
    proposals = fixes.propose(store, RUN, a, "t").fixes
    assert (proposals[0].action.value, proposals[0].params) == ("rollback", {"before_step": 291, "lr": 0.001})
    actions = [f.action.value for f in proposals]
    set_lr = proposals[actions.index("set_lr")]
    assert actions.index("set_lr") > actions.index("advice") and "It cannot repair the run" in set_lr.rationale
    # A job that keeps no snapshots: the restart comes before the rate change, which still only limits damage.
    _run(store, allow=("set_lr", "lr_scale", "grad_clip"))
    b = _anomaly(store, "abnormal_update_ratio", {"median_update_ratio": 0.25, "direction": "high", "high": 0.2},
                 300, 310)
    actions = [f.action.value for f in fixes.propose(store, RUN, b, "t").fixes]
    assert actions[0] == "advice" and actions.index("set_lr") > 1 and actions.index("grad_clip") > 1


def test_adams_updates_collapsing_with_the_rate_unchanged_is_a_spike_it_took(store):
    _run(store, allow=("set_lr", "rollback"))
    _history(store, lr_after=1e-3, ratio_after=1e-7)
    a = _anomaly(store, "abnormal_update_ratio", {"median_update_ratio": 1e-7, "direction": "low"}, 310, 390)
    proposals = fixes.propose(store, RUN, a, "t").fixes
    assert proposals[0].action.value == "rollback" and "collapsed" in proposals[0].rationale
    assert not next(f for f in proposals if f.action.value == "set_lr").params["lr"] < 1e-3  # the raise is last


def test_a_stalled_run_is_rolled_back_to_before_the_fault(store):
    _run(store, allow=("set_lr", "rollback"))
    _history(store, lr_after=0.1)
    a = _anomaly(store, "training_stalled", {"fault_step": 291, "loss_median": 2.77, "best": 2.04,
                                             "update_ratio": 5e-6, "healthy_update_ratio": 2.5e-3}, 291, 600)
    roll, restart = fixes.propose(store, RUN, a, "t").fixes
    assert (roll.action.value, roll.params) == ("rollback", {"before_step": 291, "lr": 0.001})
    assert "2.77 against 2.04" in roll.rationale and restart.action.value == "advice"


# -- the order of a batch ----------------------------------------------------------------------------------------
def _batch(run, seq, events):
    return IngestBatch.model_validate({"batch_id": uuid.uuid4().hex, "run": run, "seq": seq, "events": events})


def test_a_fix_acknowledged_in_the_batch_that_holds_the_losses_before_it_has_its_loss_before(store):
    engine = Engine()
    start = {"kind": "run_start", "step": 0, "time": 1.0, "config": {"interval": 10}, "allow": ["lr_scale"]}
    ingest(store, engine, _batch("b", 0, [start]))
    a = store.write(lambda conn: conn.execute(
        "INSERT INTO anomalies(id, run, kind, severity, status, first_step, last_step, rule, key, created_at, "
        "updated_at) VALUES ('a-1','b','oscillating_loss','warning','open',0,0,'x','x',0,0)"))
    store.write(lambda conn: conn.execute(
        "INSERT INTO fixes(id, run, anomaly_id, action, params, live, rank, status, pending_op, created_at, updated_at)"
        " VALUES ('f-1','b','a-1','lr_scale','{}',1,1,'pending','apply',0,0)"))
    assert a is not None
    # ~1 ms steps: the losses of the 50 steps before the fix ride in the same batch as its acknowledgement.
    events = [{"kind": "scalars", "step": s, "time": 1.0, "values": {"loss": 2.0}} for s in range(60)]
    events.append({"kind": "fix_ack", "step": 59, "time": 1.0, "fix_id": "f-1", "op": "apply", "status": "applied",
                   "before": {"lr": [0.1]}, "after": {"lr": [0.05]}})
    ingest(store, engine, _batch("b", 1, events))
    verify = orjson.loads(store.read().execute("SELECT verify FROM fixes WHERE id='f-1'").fetchone()[0])
    assert verify["loss_before"] == 2.0


# -- with real training -------------------------------------------------------------------------------------------
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_transformer_after_an_lr_spike_set_lr_alone_stalls_and_the_top_proposal_recovers(tmp_path):
    """Issue 37's run: a 2-layer nn.TransformerEncoder under Adam 1e-3 whose rate is raised 100x at step 300.
    Setting the rate back leaves Adam's moments filled by the spike: the verdict says ineffective and the run
    is flagged as stalled. The top proposal, a rollback with the old rate, brings it back."""
    from tests.test_repair_faults import InProcessServer
    from agent_examples.jobs import transformer_job

    def fixed(action: str | None):
        store = Store(tmp_path / f"data-{action}")
        sink = InProcessServer(store, "abnormal_update_ratio", action=action)
        result = transformer_job(run="t", steps=800, probe_kwargs={"sink": sink, "flush_interval": 0.02,
                                                                   "spool_dir": tmp_path / f"spool-{action}"})
        assert result.error is None
        conn = store.read()
        verdicts = [(r["action"], r["status"], r["reason"]) for r in conn.execute(
            "SELECT action, status, reason FROM fixes WHERE run='t' AND applied_step IS NOT NULL")]
        stalls = [dict(r) for r in conn.execute("SELECT status, evidence FROM anomalies WHERE run='t' AND "
                                                "kind='training_stalled'")]
        store.close()
        return result, verdicts, stalls

    healthy = transformer_job(run="h", steps=800, healthy=True, attach=False).final_loss
    result, verdicts, stalls = fixed("set_lr")
    assert [(a, s) for a, s, _ in verdicts] == [("set_lr", "ineffective")], verdicts
    assert "before the fault" in verdicts[0][2]
    assert stalls and stalls[-1]["status"] == "open"
    assert result.final_loss > 1.25 * healthy  # it did not recover: the verdict was true
    result, verdicts, _ = fixed(None)
    assert [(a, s) for a, s, _ in verdicts] == [("rollback", "effective")], verdicts
    assert result.final_loss <= 1.25 * healthy and not math.isnan(result.final_loss)
