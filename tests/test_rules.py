"""Rules one by one, the anomaly lifecycle, and the catalog's documentation, on small hand-made streams."""

from __future__ import annotations

import uuid
from pathlib import Path

import orjson
import pytest

from diag_server.pipeline.engine import Engine, EngineSettings
from diag_server.pipeline.ingest import ingest
from diag_server.rules import BUILTIN, Observations
from diag_server.rules.system import GpuMemoryFragmentation, StepTimeOutlier
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


def test_step_time_outliers_are_info_until_they_keep_happening():
    rule = StepTimeOutlier()
    state = rule.initial_state()
    calm = [(s, {"sys/step_time": 0.01, "sys/step_time_max": 0.012}) for s in range(0, 20, 5)]
    assert rule.observe(state, _sys_obs(calm)) == []
    one = rule.observe(state, _sys_obs([(20, {"sys/step_time": 0.02, "sys/step_time_max": 0.5})]))
    assert [f.severity.value for f in one] == ["info"]
    many = [(s, {"sys/step_time": 0.01, "sys/step_time_max": 0.5}) for s in range(25, 125, 5)]
    assert rule.observe(state, _sys_obs(many))[-1].severity.value == "warning"


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
