"""Rules one by one, the anomaly lifecycle, and the catalog's documentation, on small hand-made streams."""

from __future__ import annotations

import uuid
from pathlib import Path

import orjson
import pytest

from diag_server.pipeline.engine import Engine, EngineSettings
from diag_server.pipeline.ingest import ingest
from diag_server.rules import BUILTIN, Observations
from diag_server.rules.system import GpuMemoryFragmentation, MemoryGrowth, StepTimeOutlier
from diag_server.rules.weights import PoorWeightInit
from diag_server.store import Store
from schemas.enums import AnomalyKind
from schemas.events import IngestBatch

ROOT = Path(__file__).resolve().parent.parent


def test_every_kind_has_a_rule_and_every_default_names_its_source():
    covered = {k.value for cls in BUILTIN for k in cls.kinds}
    assert covered == {k.value for k in AnomalyKind}  # the embedding and distributed rules are merged in too
    docs = (ROOT / "docs" / "rules.md").read_text()
    for cls in BUILTIN:
        assert cls.description and cls.name in docs
        for name, p in cls.params.items():
            assert p.source and p.help, f"{cls.name}.{name} needs a source and a help text"


def test_rule_state_is_json_and_round_trips():
    """Every rule's state after real observations survives orjson, as the engine stores it."""
    obs = _sys_obs([(s, {"sys/data_wait": 0.02, "sys/step_time": 0.025, "sys/step_time_max": 0.03,
                         "sys/rss_mb": 100.0 + s, "loss": 1.0 / (s + 1)}) for s in range(0, 50, 5)])
    for cls in BUILTIN:
        rule = cls()
        state = rule.initial_state()
        rule.observe(state, obs)
        assert orjson.loads(orjson.dumps(state)) == state, cls.name


def _sys_obs(points: list[tuple[int, dict]], run: str = "r", interval: int = 5) -> Observations:
    obs = Observations(run=run, interval=interval)
    for step, values in points:
        for k, v in values.items():
            obs.scalars.setdefault(k, []).append((step, v))
    return obs


def test_gpu_fragmentation_needs_a_sustained_large_gap():
    rule, state = GpuMemoryFragmentation(), {}
    frag = [(s, {"sys/cuda_reserved_mb": 8000.0, "sys/cuda_allocated_mb": 2000.0}) for s in range(0, 15, 5)]
    assert rule.observe(state, _sys_obs(frag[:2])) == []
    found = rule.observe(state, _sys_obs(frag[2:]))
    assert found and found[0].kind == AnomalyKind.gpu_memory_fragmentation and found[0].evidence["fraction"] == 0.75
    small = [(s, {"sys/cuda_reserved_mb": 800.0, "sys/cuda_allocated_mb": 100.0}) for s in range(0, 30, 5)]
    assert GpuMemoryFragmentation().observe({}, _sys_obs(small)) == []  # 700 MB unused is not worth a warning


def test_memory_that_settles_in_or_wanders_is_not_a_leak_and_a_leak_is():
    """A GPT-2 of the healthy corpus at interval 100: its RSS rose 12 then 7 MB over its first two intervals (the
    first evaluation, caches built on first use), then wandered within 10 MB. A leak keeps its pace."""
    rss = [476, 488, 495, 490, 486, 492, 486, 495]  # the run's samples, steps 0-700
    healthy = [(i * 100, {"sys/rss_mb": float(v)}) for i, v in enumerate(rss)]
    rule = MemoryGrowth()
    assert rule.observe(rule.initial_state(), _sys_obs(healthy, interval=100)) == []
    state = rule.initial_state()  # the same, a sample per batch
    assert [f for p in healthy for f in rule.observe(state, _sys_obs([p], interval=100))] == []
    leak = [(s, {"sys/rss_mb": 400.0 + 4 * s}) for s in range(0, 30, 5)]  # 4 MiB kept every step
    [found] = MemoryGrowth().observe(MemoryGrowth().initial_state(), _sys_obs(leak))
    assert found.kind == AnomalyKind.memory_growth and found.first_step == 15  # samples 5, 10, 15


def test_a_stall_of_the_job_is_info_and_a_busy_machine_is_nothing():
    rule = StepTimeOutlier()
    state = rule.initial_state()
    calm = [(s, {"sys/step_time": 0.01, "sys/step_time_max": 0.012}) for s in range(0, 20, 5)]
    assert rule.observe(state, _sys_obs(calm)) == []
    one = rule.observe(state, _sys_obs([(20, {"sys/step_time": 0.02, "sys/step_time_max": 0.5})]))
    assert [f.severity.value for f in one] == ["info"] and "stall" in one[0].message
    # Stalls every few samples are one anomaly that holds, not one each (10-13 per run crowded the list).
    later = [(s, {"sys/step_time": 0.01, "sys/step_time_max": 0.5 if s % 50 == 0 else 0.012})
             for s in range(25, 200, 5)]
    [held] = rule.observe(state, _sys_obs(later))
    assert held.first_step == 20 and held.step == 195 and held.evidence["steps"] == [100, 150]  # the last 20 samples
    # A busy machine: every interval has steps 20-40x the median, none stands out of the others.
    busy = StepTimeOutlier()
    state = busy.initial_state()
    noisy = [(s, {"sys/step_time": 0.01 * (1 + s % 3), "sys/step_time_max": 0.2 + 0.2 * (s % 2)})
             for s in range(0, 500, 5)]
    assert busy.observe(state, _sys_obs(noisy)) == []


def test_poor_weight_init_judges_the_first_weights_against_fan_in():
    start = {"modules": [{"name": "fc", "type": "Linear"}], "params": [{"name": "fc.weight", "shape": [64, 100]}]}
    obs = Observations(run="r", start=start, stats={"weights": {0: [{"name": "fc.weight", "std": 5.0}]}})
    found = PoorWeightInit().observe({}, obs)
    assert found and found[0].tensors == ["fc.weight"] and found[0].evidence["scaled_std"] == pytest.approx(50.0)
    fine = Observations(run="r", start=start, stats={"weights": {0: [{"name": "fc.weight", "std": 0.057}]}})
    assert PoorWeightInit().observe({}, fine) == []


def _feed(store: Store, engine: Engine, run: str, events: list[dict], seq: int) -> None:
    ingest(store, engine, IngestBatch.model_validate({"batch_id": uuid.uuid4().hex, "run": run, "seq": seq,
                                                      "events": events}))


def test_anomaly_lifecycle_open_advance_resolve_reopen(tmp_path):
    store, engine = Store(tmp_path), Engine()
    start = {"kind": "run_start", "step": 0, "time": 1.0, "config": {"interval": 5}}
    _feed(store, engine, "life", [start], 0)

    def at(step: int, slow: bool) -> dict:
        values = {"sys/data_wait": 0.02, "sys/step_time": 0.025} if slow else \
            {"sys/data_wait": 0.0001, "sys/step_time": 0.01}
        return {"kind": "scalars", "step": step, "time": 1.0 + step, "values": values}

    def rows():
        return store.read().execute("SELECT id, status, first_step, last_step, resolved_step FROM anomalies "
                                    "WHERE run='life' ORDER BY seq").fetchall()

    for i, step in enumerate(range(0, 35, 5)):
        _feed(store, engine, "life", [at(step, True)], i + 1)
        if step == 15:
            assert [(r["status"], r["first_step"], r["last_step"]) for r in rows()] == [("open", 10, 15)]
    assert [(r["status"], r["last_step"]) for r in rows()] == [("open", 30)]  # advanced, never duplicated
    for i, step in enumerate(range(35, 80, 5)):
        _feed(store, engine, "life", [at(step, False)], 20 + i)
    (r,) = rows()
    assert r["status"] == "resolved" and r["last_step"] == 30 and r["resolved_step"] <= 30 + 4 * 5
    for i, step in enumerate(range(80, 100, 5)):
        _feed(store, engine, "life", [at(step, True)], 40 + i)
    assert [x["status"] for x in rows()] == ["resolved", "open"]  # a new episode is a new anomaly
    store.close()


def test_server_wide_settings_tune_and_disable(tmp_path):
    engine = Engine(EngineSettings(rule_params={"dataloader_bottleneck": {"fraction": 0.99}},
                                   disabled={"step_time_outlier"}))
    assert "step_time_outlier" not in [r.name for r in engine.rules]
    d = {r["name"]: r for r in engine.describe()}["dataloader_bottleneck"]["params"]["fraction"]
    assert d["value"] == 0.99 and d["default"] == 0.5
    with pytest.raises(ValueError, match="no rule named"):
        Engine(EngineSettings(disabled={"no_such_rule"}))


def test_rule_settings_from_flags_and_environment():
    from diag_server.rule_config import engine_settings

    s = engine_settings(["diag_server.rules.loss:Overfitting"], ["overfitting.margin=0.2"], [],
                        env={"TRAINDX_DISABLE_RULES": "step_time_outlier,memory_growth"})
    assert s.disabled == {"step_time_outlier", "memory_growth"} and s.rule_params == {"overfitting": {"margin": 0.2}}
    with pytest.raises(ValueError, match="rule.param=value"):
        engine_settings([], ["overfitting=0.2"], [], env={})
    with pytest.raises(ValueError, match="not a Rule subclass"):
        engine_settings(["diag_server.rules.base:median"], [], [], env={})


def test_overfitting_holds_between_rare_validations():
    """Validation every 100 steps, sampling every 10: one anomaly that holds, not one per evaluation."""
    from diag_server.rules.loss import Overfitting

    rule = Overfitting()
    state = rule.initial_state()
    findings = []
    for lo in range(0, 600, 50):  # batches of 50 steps
        obs = Observations(run="r", interval=10)
        obs.scalars["loss"] = [(s, 2.0 / (1 + s / 50)) for s in range(lo, lo + 50)]
        obs.scalars["val_loss"] = [(s, 2.0 if s == 0 else 2.0 + s / 100) for s in range(lo, lo + 50) if s % 100 == 0]
        findings += [(lo, f.step) for f in rule.observe(state, obs)]
    batches = sorted({lo for lo, _ in findings})
    assert batches == list(range(batches[0], 600, 50))  # reported in every batch once it began
    assert batches[0] <= 200


# -- the same events, however they are cut into batches, give the same anomalies --------------------------
def _first_steps(events: list[dict], cuts: list[int], tmp_path: Path, run: str) -> dict[str, tuple[int, str]]:
    """Feed ``events`` (a recorded run, in order) to a real store and engine in batches that end before each
    index of ``cuts``; the first step and the severity of each kind's first anomaly."""
    store, engine = Store(tmp_path / run), Engine()
    bounds = [0, *cuts, len(events)]
    for seq, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi > lo:
            _feed(store, engine, run, events[lo:hi], seq)
    rows = store.read().execute("SELECT kind, first_step, severity FROM anomalies WHERE run=? ORDER BY seq",
                                (run,)).fetchall()
    store.close()
    first: dict[str, tuple[int, str]] = {}
    for kind, step, severity in rows:
        first.setdefault(kind, (step, severity))
    return first


@pytest.mark.parametrize("case", ["dead_relu_bias", "tiny_lr", "too_high_lr", "memorise_tiny_train_set"])
def test_one_batch_or_many_give_the_same_first_step(tmp_path, case):
    """A job's events imported whole, posted as one batch, or streamed in batches of one step or of random
    sizes: each anomaly begins at the step where its condition first held (the fault suite's dead ReLU at
    step 0; before, the one batch said step 55, the last sample of the batch that held it)."""
    import random

    from benchmarks.faults import by_step, recorded

    events = recorded(case)
    per_step = [ev for group in by_step(events) for ev in group]  # run_start first
    steps = [i for i in range(1, len(per_step)) if per_step[i]["step"] != per_step[i - 1]["step"]]
    rng = random.Random(0)
    expected = _first_steps(per_step, steps, tmp_path, "steps")
    assert expected, f"{case} raised nothing"
    assert _first_steps(per_step, [], tmp_path, "one") == expected
    for trial in range(2):
        cuts = sorted(rng.sample(range(1, len(per_step)), k=len(per_step) // 7))
        assert _first_steps(per_step, cuts, tmp_path, f"random{trial}") == expected
    if case == "dead_relu_bias":
        assert expected["dead_relu"][0] == 0


# -- what a healthy run of each kind looks like ----------------------------------------------------------------
def _grads(step: int, norms: dict[str, float], numel: int = 4096) -> dict:
    return {"kind": "tensor_stats", "step": step, "time": 1.0, "collection": "gradients",
            "rows": [{"name": n, "numel": numel, "norm": v} for n, v in norms.items()]}


def _obs(start: dict | None, events: list[dict], interval: int = 10) -> Observations:
    obs = Observations(run="r", start=start, interval=interval)
    for ev in events:
        if ev["kind"] == "scalars":
            for k, v in ev["values"].items():
                obs.scalars.setdefault(k, []).append((ev["step"], v))
        else:
            obs.stats.setdefault(ev["collection"], {})[ev["step"]] = ev["rows"]
    return obs


def _losses(values: dict[int, float]) -> list[dict]:
    return [{"kind": "scalars", "step": s, "time": 1.0, "values": {"loss": v}} for s, v in values.items()]


MLP = {"modules": [{"name": f"l{i}", "type": "Linear"} for i in range(8)],
       "params": [{"name": f"l{i}.weight", "shape": [64, 64]} for i in range(8)]}


def test_gradients_that_grow_as_the_run_starts_learning_are_not_exploding():
    """A late learner: flat at ln 2 with small gradients, then the loss drops as they grow 20x. An lr spike: the
    same growth while the loss rises. Only the second explodes."""
    from diag_server.rules.gradients import ExplodingGradient

    def run(after: float) -> list:
        rule = ExplodingGradient()
        state = rule.initial_state()
        flat = _losses({s: 0.693 for s in range(0, 200)})
        grads = [_grads(s, {"l0.weight": 0.05, "l7.weight": 0.05}) for s in range(0, 200, 10)]
        rule.observe(state, _obs(MLP, flat + grads))
        moving = _losses({s: 0.693 + (after - 0.693) * (s - 199) / 10 for s in range(200, 211)})
        return rule.observe(state, _obs(MLP, moving + [_grads(210, {"l0.weight": 1.0, "l7.weight": 1.0})]))

    assert run(after=0.2) == []  # learning: the loss reaches new lows as the gradients grow
    [f] = run(after=3.0)
    assert f.kind == AnomalyKind.exploding_gradient and f.step == 210


def test_a_hard_batch_of_a_converged_run_is_not_an_exploding_gradient():
    """Its recent median has shrunk 100x since the run began; a batch 18x that median is still far below the
    norms the run had while learning."""
    from diag_server.rules.gradients import ExplodingGradient

    rule = ExplodingGradient()
    state = rule.initial_state()
    early = [_grads(s, {"l0.weight": 5.0 / (1 + s), "l7.weight": 5.0 / (1 + s)}) for s in range(0, 100, 10)]
    late = [_grads(s, {"l0.weight": 0.05, "l7.weight": 0.05}) for s in range(100, 400, 10)]
    losses = _losses({s: 2.3 / (1 + s) for s in range(400)})
    assert rule.observe(state, _obs(MLP, losses + early + late)) == []
    spike = _losses({s: 0.3 for s in range(400, 411)}) + [_grads(410, {"l0.weight": 0.9, "l7.weight": 0.9})]
    assert rule.observe(state, _obs(MLP, spike)) == []


def test_a_converged_model_has_no_vanishing_gradient_and_a_deep_sigmoid_net_has():
    from diag_server.rules.gradients import VanishingGradient

    tiny = {f"l{i}.weight": 1e-6 * (i + 1) for i in range(8)}  # RMS ~1e-8: the absolute test's range
    converged = _losses({s: 6.0 * 0.95 ** s + 1e-3 for s in range(300)})
    rule = VanishingGradient()
    assert rule.observe(rule.initial_state(), _obs(MLP, converged + [_grads(290, tiny)])) == []
    stuck = _losses({s: 1.386 for s in range(300)})
    [f] = rule.observe(rule.initial_state(), _obs(MLP, stuck + [_grads(290, tiny)]))
    assert "still near where it began" in f.message
    # A transformer block's query and key projections learn slowly at first: the first half's largest
    # gradient, not its first tensor's, stands for it.
    block = {"l0.weight": 1e-6, "l1.weight": 1e-6, "l2.weight": 0.01, "l3.weight": 0.01,
             "l4.weight": 0.01, "l5.weight": 0.01, "l6.weight": 0.01, "l7.weight": 0.01}
    assert rule.observe(rule.initial_state(), _obs(MLP, _losses({0: 6.0}) + [_grads(0, block)])) == []
    embedded = {"modules": [{"name": "emb", "type": "Embedding"}, *MLP["modules"]],
                "params": [{"name": "emb.weight", "shape": [50000, 64]}, *MLP["params"]]}
    sparse = {"emb.weight": 1e-9, **{f"l{i}.weight": 0.01 for i in range(8)}}  # a batch touches a few rows
    assert rule.observe(rule.initial_state(), _obs(embedded, _losses({0: 6.0}) + [_grads(0, sparse)])) == []


def test_a_converged_loss_wandering_above_its_best_is_not_diverging():
    from diag_server.rules.loss import LossDivergence

    rule = LossDivergence()
    state = rule.initial_state()
    down = {s: 2.3 * 0.9 ** s + 6e-7 for s in range(300)}
    up = {s: 2e-6 for s in range(300, 400)}  # 3.4x its best, a millionth of where it began
    assert rule.observe(state, _obs(None, _losses({**down, **up}))) == []
    [f] = rule.observe(state, _obs(None, _losses({s: 1.0 for s in range(400, 440)})))
    assert f.kind == AnomalyKind.loss_divergence


def test_a_regression_output_averaging_one_over_c_is_not_a_softmax():
    """After an lr fault a regression MLP's single output column (its ReLUs dead) sat at a constant 1/13."""
    from diag_server.rules.activations import OutputRangeMismatch

    regression = {"modules": [{"name": "0", "type": "Linear"}, {"name": "1", "type": "ReLU"},
                              {"name": "2", "type": "Linear"}],
                  "params": [{"name": "0.weight", "shape": [64, 16]}, {"name": "2.weight", "shape": [1, 64]}]}
    out = {"numel": 64, "min": 1 / 13, "max": 1 / 13, "mean": 1 / 13, "std": 0.0}
    rows = [{"name": "2", **out}, {"name": "<output>", **out}]
    assert OutputRangeMismatch().observe({}, _obs(regression, [{"kind": "tensor_stats", "step": 0, "time": 1.0,
                                                               "collection": "activations", "rows": rows}])) == []
    softmax = {"modules": [{"name": "0", "type": "Linear"}, {"name": "1", "type": "Softmax"}],
               "params": [{"name": "0.weight", "shape": [6, 20]}]}
    probs = {"numel": 384, "min": 0.01, "max": 0.9, "mean": 1 / 6, "std": 0.2}
    rows = [{"name": "0", "numel": 384, "min": -3.0, "max": 3.0, "mean": 0.1}, {"name": "1", **probs},
            {"name": "<output>", **probs}]
    [f] = OutputRangeMismatch().observe({}, _obs(softmax, [{"kind": "tensor_stats", "step": 0, "time": 1.0,
                                                           "collection": "activations", "rows": rows}]))
    assert f.evidence["classes"] == 6


def _updates(step: int, ratio: float) -> dict:
    return {"kind": "tensor_stats", "step": step, "time": 1.0, "collection": "updates",
            "rows": [{"name": f"l{i}.weight", "update_ratio": ratio} for i in range(8)]}


def _lr(step: int, lr: float) -> dict:
    return {"kind": "scalars", "step": step, "time": 1.0, "values": {"lr/group0": lr}}


def test_small_updates_under_a_warmup_or_a_decayed_rate_are_by_design():
    from diag_server.rules.weights import AbnormalUpdateRatio

    flat = _losses({s: 2.0 for s in range(200)})
    # A warmup: the rate climbs from 1e-6 to 1e-3; updates at the first steps are 1000x smaller than later.
    warm = [e for s in range(0, 200, 10) for e in (_lr(s, min(1e-3, 1e-6 * 2 ** (s / 10))),
                                                   _updates(s, min(1e-3, 1e-6 * 2 ** (s / 10))))]
    rule = AbnormalUpdateRatio()
    assert rule.observe(rule.initial_state(), _obs(MLP, flat + warm)) == []
    # A step decay after the peak: 1e-4 of the peak rate gives 1e-7 updates, 1e-3 at the peak rate.
    decayed = [e for s in range(0, 200, 10) for e in (_lr(s, 1e-3 if s < 100 else 1e-7),
                                                      _updates(s, 1e-3 if s < 100 else 1e-7))]
    assert rule.observe(rule.initial_state(), _obs(MLP, flat + decayed)) == []
    # A rate too small from the start (the suite's tiny_lr) stays flagged.
    tiny = [e for s in range(0, 200, 10) for e in (_lr(s, 1e-7), _updates(s, 1e-8))]
    [f] = rule.observe(rule.initial_state(), _obs(MLP, flat + tiny))
    assert f.evidence["direction"] == "low" and f.first_step == 0


def test_a_plateau_with_moving_weights_is_info_and_a_warmup_is_waited_out():
    from diag_server.rules.loss import LossNotDecreasing

    start = {**MLP, "config": {"interval": 10, "collections": ["updates"]}}
    flat = _losses({s: 0.693 for s in range(300)})
    moving = [_updates(s, 3e-3) for s in range(0, 300, 10)]
    rule = LossNotDecreasing()
    [f] = rule.observe(rule.initial_state(), _obs(start, flat + moving))
    assert f.severity.value == "info" and "plateau" in f.message
    still = [_updates(s, 1e-8) for s in range(0, 300, 10)]
    [f] = rule.observe(rule.initial_state(), _obs(start, flat + still))
    assert f.severity.value == "warning" and f.first_step == 59
    # A warmup to step 200: nothing is judged before the rate stops rising, and then min_steps after it.
    warm = [_lr(s, 1e-3 * min(1.0, (s + 10) / 200)) for s in range(0, 300, 10)]
    [f] = rule.observe(rule.initial_state(), _obs(start, flat + still + warm))
    assert f.first_step >= 190 + 60


def test_a_small_init_in_a_model_that_normalises_is_a_transformer_recipe():
    start = {"modules": [{"name": "patch", "type": "Conv2d"}, {"name": "norm", "type": "LayerNorm"}],
             "params": [{"name": "patch.weight", "shape": [64, 1, 2, 2]}]}
    obs = Observations(run="r", start=start, stats={"weights": {0: [{"name": "patch.weight", "std": 0.02}]}})
    assert PoorWeightInit().observe({}, obs) == []  # std 0.02 over 4 inputs: 0.04, rescaled by the norm
    plain = {"modules": start["modules"][:1], "params": start["params"]}
    obs = Observations(run="r", start=plain, stats={"weights": {0: [{"name": "patch.weight", "std": 0.02}]}})
    assert PoorWeightInit().observe({}, obs)
