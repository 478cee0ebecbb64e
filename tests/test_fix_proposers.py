"""Fix proposals from an anomaly's evidence and the run's stored history, on a real SQLite store.

The anomalies are written the way the rules report them (evidence keys of diag_server/rules/), so these
tests check the proposers alone: which action comes first, with what parameters, and why.
"""

from __future__ import annotations

import time

import orjson
import pytest

from diag_server import fixes
from diag_server.errors import ApiError
from diag_server.pipeline.ingest import pending_commands
from diag_server.store import Store

RUN = "r1"
MODULES = [{"name": "0", "type": "Linear"}, {"name": "1", "type": "ReLU"}, {"name": "2", "type": "Linear"},
           {"name": "3", "type": "ReLU"}, {"name": "4", "type": "Linear"}]


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "data")
    yield s
    s.close()


def _run(store, *, allow=("lr_scale", "set_lr", "grad_clip", "rollback", "reinit_dead_units", "unfreeze"),
         optimizer="SGD", lr=0.01, trainable=None, last_step=300, interval=10, ended=False, last_seen=None):
    params = [{"name": f"{m}.{p}", "shape": [4, 4], "numel": 16, "trainable": (trainable or {}).get(f"{m}.{p}", True),
               "dtype": "float32"} for m in ("0", "2", "4") for p in ("weight", "bias")]
    start = {"kind": "run_start", "modules": MODULES, "params": params, "allow": list(allow),
             "optimizer": {"type": optimizer, "param_groups": [{"lr": lr}]}, "config": {"interval": interval}}
    now = time.time()

    def write(conn):
        conn.execute("INSERT OR REPLACE INTO runs(run, created_at, last_seen, last_step, ended, start) VALUES (?,?,?,?,?,?)",
                     (RUN, now, last_seen or now, last_step, int(ended), orjson.dumps(start).decode()))
    store.write(write)


def _anomaly(store, kind, evidence, *, first_step=100, last_step=120, tensors=()):
    def write(conn):
        cur = conn.execute(
            "INSERT INTO anomalies(run, kind, severity, status, first_step, last_step, tensors, message, evidence, rule,"
            " key, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (RUN, kind, "warning", "open", first_step, last_step, orjson.dumps(list(tensors)).decode(), "m",
             orjson.dumps(evidence).decode(), kind, kind, time.time(), time.time()))
        conn.execute("UPDATE anomalies SET id=? WHERE seq=?", (f"a-{cur.lastrowid}", cur.lastrowid))
        return f"a-{cur.lastrowid}"
    return store.write(write)


def _series(store, name, points):
    store.write(lambda conn: conn.executemany("INSERT INTO scalars(run, step, name, value, time) VALUES (?,?,?,?,0)",
                                              [(RUN, s, name, v) for s, v in points]))


def _updates(store, ratio, steps=(60, 70, 80, 90, 100)):
    rows = [(RUN, s, "updates", f"{m}.weight", ratio) for s in steps for m in ("0", "2", "4")]
    store.write(lambda conn: conn.executemany(
        "INSERT INTO stats(run, step, collection, tensor, update_ratio) VALUES (?,?,?,?,?)", rows))


def _propose(store, anomaly_id):
    return fixes.propose(store, RUN, anomaly_id, "mcp:test").fixes


def test_dead_relu_reinitialises_the_dead_layer_first_and_advises_leaky_relu(store):
    _run(store)
    a = _anomaly(store, "dead_relu", {"dead_frac": 1.0, "layers": ["1"], "threshold": 0.5}, tensors=["1"])
    top, *rest = _propose(store, a)
    assert (top.action.value, top.params, top.live) == ("reinit_dead_units", {"module": "1"}, True)
    assert "100%" in top.rationale and "'0'" in top.rationale  # names the layer whose weights are re-initialised
    advice = [f for f in rest if f.action.value == "advice"]
    assert advice and not advice[0].live and advice[0].status.value == "advice"
    assert "nn.LeakyReLU(0.01)" in advice[0].params["instructions"]
    assert "kaiming_normal_(model[0].weight, nonlinearity='relu')" in advice[0].params["instructions"]
    with pytest.raises(ApiError, match="not_live|advice"):
        fixes.apply(store, RUN, advice[0].id, "mcp:test")  # advice is never claimed as applied


def test_units_that_died_under_a_too_large_step_get_the_step_fixed_first(store):
    _run(store)
    osc = _anomaly(store, "oscillating_loss", {"median_jump": 0.8, "initial": 1.0}, first_step=10)
    dead = _anomaly(store, "dead_relu", {"dead_frac": 1.0, "layers": ["3"]}, first_step=20, tensors=["3"])
    first, second = _propose(store, dead)[:2]
    assert first.action.value == "lr_scale" and osc in first.rationale
    assert second.action.value == "reinit_dead_units"


def test_units_dying_under_large_updates_get_the_rate_cut_first(store):
    _run(store)
    _updates(store, 0.2)
    dead = _anomaly(store, "dead_relu", {"dead_frac": 1.0, "layers": ["3"]}, first_step=100, tensors=["3"])
    first = _propose(store, dead)[0]
    assert first.action.value == "lr_scale" and first.params == {"factor": 0.05}  # to 1e-2 from 0.2


def test_nonfinite_rolls_back_to_before_the_first_bad_step(store):
    _run(store)
    a = _anomaly(store, "nonfinite", {"first_step": 200, "first_in": "scalar:loss", "first_tensor": "loss",
                                      "latest_step": 230, "seen_in": ["scalar:loss"]}, first_step=200, last_step=230)
    proposals = _propose(store, a)
    assert proposals[0].action.value == "rollback" and proposals[0].params == {"before_step": 200}
    assert "skip_nonfinite" in [f.action.value for f in proposals]


def test_nonfinite_after_a_learning_rate_rise_rolls_back_to_before_the_rise_with_the_old_rate(store):
    """NaN weights cannot be repaired by a rate: the rollback comes first and carries the rate from before
    the rise (a rollback that kept the risen rate would blow up again: 0 of 2 such runs recovered)."""
    _run(store)
    _series(store, "lr/group0", [(s, 0.01) for s in range(0, 200, 10)] + [(s, 1.0) for s in range(200, 260, 10)])
    a = _anomaly(store, "nonfinite", {"first_step": 230}, first_step=230, last_step=250)
    first = _propose(store, a)[0]
    assert (first.action.value, first.params) == ("rollback", {"before_step": 191, "lr": 0.01})


def test_divergence_after_a_learning_rate_rise_rolls_back_with_the_old_settings(store):
    _run(store)
    _series(store, "lr/group0", [(s, 0.01) for s in range(0, 200, 10)] + [(s, 0.1) for s in range(200, 260, 10)])
    a = _anomaly(store, "loss_divergence", {"loss_median": 4.0, "best": 0.07, "ratio": 57.0}, first_step=220,
                 last_step=240)
    roll, set_lr = _propose(store, a)[:2]
    # To before the rise (the rate is sampled every 10 steps: step 191 is the first that may have had it).
    assert (roll.action.value, roll.params) == ("rollback", {"before_step": 191, "lr": 0.01})
    assert (set_lr.action.value, set_lr.params) == ("set_lr", {"lr": 0.01})  # what to do without a snapshot
    _run(store, allow=("set_lr",))  # a job that keeps no snapshots gets set_lr first
    assert _propose(store, a)[0].action.value == "set_lr"


def test_oscillating_loss_scales_the_rate_by_what_the_swings_support(store):
    _run(store)
    a = _anomaly(store, "oscillating_loss", {"median_jump": 0.8, "initial": 1.0, "turns": 0.6, "amplitude": 0.5})
    top = _propose(store, a)[0]
    assert top.action.value == "lr_scale" and top.params == {"factor": 0.0625}  # 0.05 * 1.0 / 0.8
    assert top.risk == "medium" and top.expected_effect


def test_oscillation_since_the_start_rolls_back_to_the_start_with_the_rate_cut(store):
    _run(store, lr=0.1)
    _series(store, "lr/group0", [(s, 0.1) for s in range(0, 130, 10)])
    _series(store, "loss", [(s, 5.0 + (s % 2)) for s in range(0, 130)])  # still ~80% of the initial 6.9
    dead = _anomaly(store, "dead_relu", {"dead_frac": 1.0, "layers": ["3"]}, first_step=20, last_step=120)
    osc = _anomaly(store, "oscillating_loss", {"median_jump": 3.5, "initial": 6.93}, first_step=37, last_step=90)
    roll, cut = _propose(store, osc)[:2]
    assert (roll.action.value, roll.params) == ("rollback", {"before_step": 1, "lr": 0.0099})  # 0.1 * 0.099
    assert (cut.action.value, cut.params) == ("lr_scale", {"factor": 0.099})  # without a snapshot from then
    # The dead units' own proposals put the same rollback first: it revives them along with the rate cut.
    assert _propose(store, dead)[0].params == roll.params
    # The step sizes at the start set the new rate, when the job measured them: 0.16 -> 1e-2 is a 16x cut.
    _updates(store, 0.16, steps=(0, 10))
    _updates(store, 0.04, steps=(20, 30, 40))
    assert _propose(store, osc)[0].params == {"before_step": 1, "lr": 0.00625}


def test_oscillation_after_real_progress_cuts_the_rate_in_place(store):
    _run(store, lr=0.1)
    _series(store, "lr/group0", [(s, 0.1) for s in range(0, 130, 10)])
    _series(store, "loss", [(s, 0.5 + 0.4 * (s % 2)) for s in range(0, 130)])  # far below the initial 6.9
    osc = _anomaly(store, "oscillating_loss", {"median_jump": 0.4, "initial": 6.93}, first_step=100, last_step=120)
    assert _propose(store, osc)[0].action.value == "lr_scale"  # a rollback would throw the progress away


def _grad_norms(store, norms):
    store.write(lambda conn: conn.executemany(
        "INSERT INTO stats(run, step, collection, tensor, norm) VALUES (?,?,?,?,?)",
        [(RUN, s, "gradients", "0.weight", n) for s, n in norms]))


def test_recurring_gradient_spikes_get_a_clip_that_follows_the_norm_then_a_rollback(store):
    _run(store)
    _series(store, "lr/group0", [(s, 0.01) for s in range(0, 300, 10)])  # no rate change: not the cause
    _grad_norms(store, [(s, 1.0) for s in range(0, 150, 10)])
    a = _anomaly(store, "exploding_gradient", {"global_norm": 20.0, "healthy_median": 1.0, "ratio": 20.0},
                 first_step=150, last_step=230)
    clip, roll, cut, advice = _propose(store, a)
    assert (clip.action.value, clip.params) == ("grad_clip", {"max_norm": 2.0, "relative": 1.0})
    assert (roll.action.value, roll.params) == ("rollback", {"before_step": 150, "min_step": 75})
    assert cut.action.value == "lr_scale"
    assert not advice.live and "HuberLoss" in advice.params["instructions"]


def test_loss_not_decreasing_raises_the_rate_to_a_healthy_update_ratio(store):
    _run(store, lr=1e-5)
    _updates(store, 2e-6)
    a = _anomaly(store, "loss_not_decreasing", {"loss_median": 5.0, "initial": 5.1, "steps": 100, "min_drop": 0.01})
    top = _propose(store, a)[0]
    assert top.action.value == "set_lr" and top.params == {"lr": pytest.approx(0.05)}  # 1e-5 * (1e-2 / 2e-6)
    assert "2e-06" in top.rationale


def test_abnormal_update_ratio_high_cuts_the_rate(store):
    _run(store)
    a = _anomaly(store, "abnormal_update_ratio", {"median_update_ratio": 0.5, "low": 1e-6, "high": 0.2,
                                                  "direction": "high"})
    top = _propose(store, a)[0]
    assert top.action.value == "lr_scale" and top.params == {"factor": 0.04}  # to 0.02, a decade under 0.2


def test_unchanged_tensor_unfreezes_and_says_whether_it_was_frozen(store):
    _run(store, trainable={"2.weight": False, "2.bias": False})
    a = _anomaly(store, "unchanged_tensor", {"tensors": ["2.weight", "2.bias"], "samples": 2},
                 tensors=["2.weight", "2.bias"])
    top, advice = _propose(store, a)
    assert top.action.value == "unfreeze" and top.params == {"pattern": ["2.weight", "2.bias"]}
    assert "requires_grad=False" in top.rationale
    assert "model.parameters()" in advice.params["instructions"] and "model[2]" in advice.params["instructions"]


def test_vanishing_gradient_is_advice_only_since_no_live_fix_helps(store):
    """Measured: scaling the starved layers' gradients (47-100x) or raising the rate left 6-12-layer sigmoid
    MLPs at chance, exactly where the run without a fix ended; so nothing is proposed live, and it says so."""
    for optimizer in ("Adam", "SGD"):
        _run(store, optimizer=optimizer, allow=("grad_scale", "set_lr", "lr_scale"))
        a = _anomaly(store, "vanishing_gradient", {"first_last_ratio": 1e-4, "ratio_threshold": 1e-3,
                                                   "first": "0.weight", "last": "4.weight"}, tensors=["0.weight"])
        (only,) = _propose(store, a)
        assert only.action.value == "advice" and "No live fix helps here" in only.rationale


@pytest.mark.parametrize("kind,needle", [("dataloader_bottleneck", "num_workers"),
                                         ("input_not_normalized", "(x - mean) / (std + 1e-8)"),
                                         ("poor_weight_init", "kaiming_normal_"),
                                         ("saturated_activation", "nn.LayerNorm")])
def test_advice_kinds_give_code_level_instructions(store, kind, needle):
    _run(store)
    a = _anomaly(store, kind, {"mean": 800.0, "std": 150.0, "tensors": ["0.weight"], "layers": ["1"]})
    (only,) = _propose(store, a)
    assert only.action.value == "advice" and not only.live and needle in only.params["instructions"]


def test_rollback_cannot_be_reverted_and_an_ended_job_gets_a_clear_answer(store):
    _run(store)
    a = _anomaly(store, "nonfinite", {"first_step": 200}, first_step=200)
    roll = _propose(store, a)[0]
    fixes.apply(store, RUN, roll.id, "mcp:test")
    store.write(lambda conn: conn.execute("UPDATE fixes SET status='applied', pending_op=NULL WHERE id=?", (roll.id,)))
    with pytest.raises(ApiError, match="cannot be undone"):
        fixes.revert(store, RUN, roll.id, "mcp:test")
    _run(store, ended=True)
    clip = next(f for f in _propose(store, a) if f.action.value == "skip_nonfinite")
    with pytest.raises(ApiError, match="the job has ended"):
        fixes.apply(store, RUN, clip.id, "mcp:test")


def test_a_fix_the_ranks_scheduled_is_waited_for_until_their_step(store):
    """A multi-rank job's ranks hold a fix for the step they all apply it after (probes/agreement.py) and say
    so: the server waits for their answer from that step on, not from when the command went out."""
    from schemas.events import FixAck

    _run(store, last_step=300)
    a = _anomaly(store, "oscillating_loss", {"median_jump": 0.8, "initial": 1.0})
    fix = _propose(store, a)[0]
    fixes.apply(store, RUN, fix.id, "mcp:agent")
    store.write(lambda conn: pending_commands(conn, RUN))  # handed out at step 300
    ack = FixAck(step=2000, time=time.time(), fix_id=fix.id, status="scheduled")
    store.write(lambda conn: fixes.schedule(conn, RUN, ack, time.time()))
    _run(store, last_step=1500)  # far past the usual 50 steps, before the ranks' step
    waiting = fixes.status(store, RUN, fix.id)
    assert (waiting.status.value, waiting.scheduled_step) == ("pending", 2000)
    _run(store, last_step=2000 + 51)  # and then no answer
    assert fixes.status(store, RUN, fix.id).status.value == "expired"
    trail = store.read().execute("SELECT action, detail FROM audit WHERE fix_id=?", (fix.id,)).fetchall()
    assert ("scheduled", {"op": "apply", "step": 2000}) in [(r[0], orjson.loads(r[1])) for r in trail]


def test_a_refused_fix_asked_for_again_goes_out_again_as_a_new_attempt(store):
    """Before, the job's answer to the first request stayed on record and the command was never sent again:
    asked for again after a refusal, a fix only expired."""
    from diag_server.pipeline import ranks
    from diag_server.pipeline.ingest import _apply_ack
    from schemas.events import FixAck

    def sent():
        return store.write(lambda conn: ranks.commands_for(conn, 0, pending_commands(conn, RUN)))

    _run(store, last_step=300)
    a = _anomaly(store, "oscillating_loss", {"median_jump": 0.8, "initial": 1.0})
    fix = _propose(store, a)[0]
    fixes.apply(store, RUN, fix.id, "mcp:agent")
    assert [(c.fix_id, c.attempt) for c in sent()] == [(fix.id, 1)]
    ack = FixAck(step=301, time=time.time(), fix_id=fix.id, status="rejected", reason="not applied: ask again")
    store.write(lambda conn: _apply_ack(conn, RUN, ranks.gather_ack(conn, RUN, 0, ack), time.time()))
    assert fixes.status(store, RUN, fix.id).status.value == "rejected" and sent() == []
    assert fixes.apply(store, RUN, fix.id, "mcp:agent").status.value == "pending"
    assert [(c.fix_id, c.attempt) for c in sent()] == [(fix.id, 2)]


def test_a_pending_fix_the_job_never_acknowledges_expires_with_the_reason(store):
    _run(store, last_step=300)
    a = _anomaly(store, "oscillating_loss", {"median_jump": 0.8, "initial": 1.0})
    fix = _propose(store, a)[0]
    assert fixes.apply(store, RUN, fix.id, "mcp:agent").status.value == "pending"
    assert fixes.status(store, RUN, fix.id).status.value == "pending"  # the job has not moved on yet
    _run(store, last_step=300 + 200)  # the job stepped on, but no reply has carried the command to it yet
    assert fixes.status(store, RUN, fix.id).status.value == "pending"
    store.write(lambda conn: pending_commands(conn, RUN))  # a batch's reply hands it to the job at step 500
    _run(store, last_step=500 + 51)  # 5 intervals of 10, at least 50 steps, without an ack
    expired = fixes.status(store, RUN, fix.id)
    assert expired.status.value == "expired" and "without acknowledging" in expired.reason
    # Asked again, then the job went silent: the fix expires when queried, not when the job comes back.
    assert fixes.apply(store, RUN, fix.id, "mcp:agent").status.value == "pending"
    _run(store, last_step=551, last_seen=time.time() - 120)
    stale = fixes.status(store, RUN, fix.id)
    assert stale.status.value == "expired" and "not been heard from" in stale.reason
    trail = [(r["actor"], r["action"], r["fix_id"]) for r in store.read().execute("SELECT * FROM audit WHERE run=?", (RUN,))]
    assert ("mcp:agent", "apply_requested", fix.id) in trail and ("server", "expired", fix.id) in trail
    assert ("mcp:test", "proposed", fix.id) in trail
