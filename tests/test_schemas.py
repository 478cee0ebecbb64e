"""The contract's generated files: no drift, and every exported model's JSON / XML form validates."""

from __future__ import annotations

import enum
import inspect
import json
import math
from datetime import datetime

import jsonschema
import pytest
from lxml import etree
from pydantic import BaseModel

import schemas
from diag_server.api.xml import to_xml, xsd_schema
from schemas import events, export, records
from schemas import (
    Anomaly, AnomalyKind, AnomalyPage, AnomalyStatus, AuditEntry, AuditTrail, Cause, Collection, Command,
    CompressionRecipe, ConflictedRow, Diagnosis, EmbeddingRow, EmbeddingSummary, Error, Fix, FixAck, FixAction, FixList,
    FixStatus, Health, IngestBatch, IngestReply, LayerProfile, LayerProfiles, LayerRecipe, ModuleInfo, OptimizerInfo,
    ParamInfo, ProbeMessage, Run, RunEnd, RunList, RunMessage, RunStart, RunSummary, Scalars, Series, SeriesPoint,
    Severity, StatRow, TensorSlice, TensorSnapshot, TensorStats,
)
from schemas import (
    Capture, CaptureCommand, CaptureList, CaptureRank, CaptureResult, ModuleShape, OpStat, OpSummary, RankInfo,
    ShapeInfo, Span, Spans, Timeline, TimelineSpan,
)

NAN = float("nan")
PARAMS = {"lr": 0.001, "betas": [0.9, 0.999], "amsgrad": False, "foreach": None, "name": "adamw", "groups": ["a", "b"], "step": 3}
MODULE = ModuleInfo(name="encoder.layers.0.fc1", type="Linear")
PARAM = ParamInfo(name="encoder.layers.0.fc1.weight", shape=[512, 128], numel=65536)
OPTIMIZER = OptimizerInfo(type="AdamW", param_groups=[PARAMS, {"lr": 0.01, "weight_decay": 0.0}])
ROW = StatRow(name="encoder.layers.0.fc1.weight", numel=65536, norm=12.5, mean=NAN, std=None, min=-0.3, max=float("inf"),
              nan_count=3, inf_count=1, zero_frac=0.0, dead_frac=None, update_ratio=1e-3,
              quantiles=[-0.2, -0.1, -0.05, 0.0, 0.05, None, 0.2])
RUN_START = RunStart(time=1700000000.25, modules=[MODULE], params=[PARAM], total_params=65536, optimizer=OPTIMIZER,
                     torch_version="2.3.0", device="cuda:0", host="gpu-7", allow=[FixAction.lr_scale, FixAction.grad_clip],
                     config={"sample_every": 10, "collections": ["weights", "gradients"]},
                     run_config={"optim.lr": 3e-4, "model.layers": 12, "data.name": "wikitext-103", "amp": True,
                                 "betas": [0.9, 0.95], "tags": ["baseline", "lr-sweep"], "seed": None})
SCALARS = Scalars(step=10, time=1700000001.0, values={"loss": 2.31, "val_loss": None, "grad_norm": NAN})
TENSOR_STATS = TensorStats(step=10, time=1700000001.5, collection=Collection.gradients, rows=[ROW, StatRow(name="head.bias")])
FIX_ACK = FixAck(step=11, time=1700000002.0, fix_id="f-3", status="applied", before={"lr": 0.01}, after={"lr": 0.001})
MESSAGE = ProbeMessage(step=12, time=1700000003.0, text="server unreachable; spooling to disk")
RUN_END = RunEnd(step=100, time=1700000100.0)
LAYER_PROFILE = LayerProfile(name="fc1.weight", numel=65536, shape=[512, 128], method="obs-kfac", fisher_mean=1e-4,
                             saliency_mean=NAN, sparsities=[0.0, 0.5], unstructured=[0.0, None], channels=[0.0, 0.3],
                             precision={"fp16": 1e-9, "int8": None})
LAYER_PROFILES = LayerProfiles(step=90, time=1700000090.0, source="held_batch", base_loss=0.25,
                               layers=[LAYER_PROFILE, LayerProfile(name="fc2.weight", numel=10, sparsities=[0.5],
                                                                   unstructured=[0.1])])
COMMAND = Command(fix_id="f-3", action=FixAction.grad_clip, params={"max_norm": 1.0, "params": ["fc1.weight"]})
SLICE = TensorSlice(name="encoder.layers.0", source="activation", shape=[32, 128], dtype="float32", numel=4096,
                    offset=64, values=[0.5, NAN, None, -1.25], nan_count=2)
SNAPSHOT = TensorSnapshot(step=13, time=1700000004.0, request_id="s-1", tensors=[SLICE], missing=["gone.weight"])
ANOMALY = Anomaly(id="a-12", run="mnist-1", kind=AnomalyKind.exploding_gradient, severity=Severity.critical,
                  status=AnomalyStatus.open, first_step=40, last_step=52, tensors=["fc1.weight", "fc2.weight"],
                  message="Gradient norm of fc1.weight grew 40x in 10 steps.",
                  evidence={"grad_norm": 812.0, "baseline": 19.7, "ratio": None, "steps": [40.0, 52.0]},
                  rule="exploding_gradient", created_at=1700000040.0, updated_at=1700000052.0)
FIX = Fix(id="f-3", run="mnist-1", anomaly_id="a-12", action=FixAction.grad_clip, params={"max_norm": 1.0},
          rationale="Clip to the median pre-spike norm.", status=FixStatus.effective, requested_by="claude",
          created_at=1700000053.0, updated_at=1700000070.0, applied_step=54, before={"max_norm": None}, after={"max_norm": 1.0})
ADVICE = Fix(id="f-4", run="mnist-1", anomaly_id=None, action=FixAction.advice, rationale="Normalize inputs.",
             live=False, rank=2, status=FixStatus.advice, created_at=1.0, updated_at=1.0)
AUDIT = AuditEntry(run="mnist-1", time=1700000053.0, actor="mcp:claude", action="apply_requested", fix_id="f-3",
                   detail={"params": ["max_norm"], "max_norm": 1.0})
RUN = Run(run="mnist-1", status="active", created_at=1.0, last_seen=2.0, last_step=52, device="cuda:0",
          total_params=65536, allow=[FixAction.lr_scale], open_anomalies=1)
LAYER = LayerRecipe(name="fc1.weight", numel=65536, sparsity=0.5, precision="int8", saliency=None, reason="low Fisher saliency")
CAUSE = Cause(anomaly_id="a-12", kind=AnomalyKind.exploding_gradient, step=40, tensor="fc1.weight",
              explanation="Learning rate too high for this depth.", consequences=["a-13", "a-14"])

EMB_ROW = EmbeddingRow(row=17, touches=40, velocity=0.01, consistency=-0.8, snr=NAN)
CONFLICTED_ROW = ConflictedRow(row=40, touches=210, noise=1.1, run_noise=3.4, run_score=2.7, reports=12)
EMB_SUMMARY = EmbeddingSummary(rows=1682, dim=32, tracked_steps=300, touched_rows=1600, never_updated=50,
                               median_touches=12.0, effective_rank=None, mean_cosine=0.1, zombies=[EMB_ROW],
                               rarest=[EMB_ROW], conflicted=[CONFLICTED_ROW], dead_ids=[3, 9], nonfinite_ids=[])
SPAN = Span(name="allreduce", category="comm", start=1700000001.25, duration=0.012, gpu_duration=0.011)
SPANS = Spans(step=10, time=1700000001.5, mode="eval", capture="c-1", spans=[SPAN, Span(name="preprocess", category="user",
                                                                          start=1700000001.0, duration=0.2)])
OP = OpStat(name="aten::addmm", calls=20, cpu_time_ms=3.5, self_cpu_time_ms=2.0, cpu_memory_mb=0.5)
SHAPE = ModuleShape(module="fc1", type="Linear", inputs=[[32, 128]], outputs=[[32, 512]])
CAPTURE_RESULT = CaptureResult(step=20, time=1700000002.5, capture_id="c-1", last_step=24, profiled=True, ops=[OP],
                               shapes=[SHAPE], trace='{"traceEvents": []}')
CAPTURE_COMMAND = CaptureCommand(capture_id="c-1", steps=5)
RANK_INFO = RankInfo(rank=1, local_rank=1, host="node-2", world_size=4, last_step=52,
                     phases={"forward": 0.01, "allreduce": None})
TIMELINE_SPAN = TimelineSpan(rank=1, step=50, name="forward", category="phase", start=1700000001.0, duration=0.01)
OP_SUMMARY = OpSummary(name="aten::addmm", calls=20, cpu_time_ms=3.5, self_cpu_time_ms=2.0)
SHAPE_INFO = ShapeInfo(module="fc1", type="Linear", inputs=[[32, 128]], outputs=[[32, 512]])
CAPTURE_RANK = CaptureRank(rank=0, status="done", first_step=20, last_step=24, profiled=True, ops=[OP_SUMMARY],
                           shapes=[SHAPE_INFO], trace_available=True)
CAPTURE = Capture(id="c-1", run="ddp-1", status="partial", steps=5, profile=True, requested_by="mcp:claude",
                  created_at=1.0, updated_at=2.0, ranks=[CAPTURE_RANK])

SAMPLES: dict[str, BaseModel] = {m.__class__.__name__: m for m in [
    IngestBatch(batch_id="b-0001-abcd", run="mnist-1", seq=0, rank=3,
                events=[RUN_START, SCALARS, TENSOR_STATS, FIX_ACK, MESSAGE, SNAPSHOT, RUN_END, LAYER_PROFILES, SPANS,
                        CAPTURE_RESULT]),
    IngestReply(accepted=6, commands=[COMMAND, Command(fix_id="f-2", op="revert", action=FixAction.lr_scale),
                                      Command(fix_id="s-1", op="snapshot", params={"tensors": ["fc1"]})],
                captures=[CAPTURE_COMMAND]),
    SLICE, SNAPSHOT,
    RUN_START, SCALARS, TENSOR_STATS, FIX_ACK, MESSAGE, RUN_END, LAYER_PROFILE, LAYER_PROFILES, COMMAND, MODULE, PARAM,
    OPTIMIZER, ROW,
    ANOMALY, EMB_ROW, CONFLICTED_ROW, EMB_SUMMARY,
    records.EmbeddingTable(name="item.weight", step=300, summary=EMB_SUMMARY),
    records.EmbeddingTables(run="mf-1", rows=20, tables=[records.EmbeddingTable(name="item.weight", rank=1, step=300,
                                                                                summary=EMB_SUMMARY)]),
    AnomalyPage(run="mnist-1", anomalies=[ANOMALY], total=3, offset=0, next_offset=1),
    FIX,
    FixList(run="mnist-1", fixes=[FIX, ADVICE]),
    AUDIT,
    AuditTrail(run="mnist-1", entries=[AUDIT]),
    RUN,
    RunList(runs=[RUN]),
    RunSummary(run=RUN, latest={"loss": 0.42, "val_loss": None}, anomalies_by_kind={"exploding_gradient": 1},
               fixes_by_status={"effective": 1},
               messages=[RunMessage(step=203, time=1.7e9, level="error", text="the job ended: exit after RuntimeError: boom")],
               messages_total=3, config={"optim.lr": 3e-4, "tags": ["a"], "seed": None}),
    RunMessage(step=0, time=0.0, level="warning", text="the run's rule settings were ignored: ...", rank=1),
    Series(run="mnist-1", name="loss", points=[SeriesPoint(step=0, value=2.3), SeriesPoint(step=1, value=None)], downsampled=True),
    SeriesPoint(step=3, value=NAN),
    CompressionRecipe(run="mnist-1", target_sparsity=0.5, achieved_sparsity=0.49, method="fisher",
                      layers=[LAYER, LayerRecipe(name="fc2.weight", numel=10, sparsity=0.0, reason="too small")],
                      dense_size_bytes=262144, predicted_size_bytes=98304, predicted_loss_increase=None, notes=["int8 on fc1"]),
    LAYER,
    CAUSE,
    Diagnosis(run="mnist-1", summary="One root cause.", causes=[CAUSE], report="Exploding gradients from step 40."),
    Health(version="0.1.0", schema_version=schemas.SCHEMA_VERSION, data_dir=".traindx"),
    Error(error="invalid_batch", message="events[3].rows[0].name is empty.", detail=["events[3].rows[0].name: too short"]),
    SPAN, SPANS, OP, SHAPE, CAPTURE_RESULT, CAPTURE_COMMAND, RANK_INFO, TIMELINE_SPAN, OP_SUMMARY, SHAPE_INFO,
    CAPTURE_RANK, CAPTURE, CaptureList(run="ddp-1", captures=[CAPTURE]),
    Timeline(run="ddp-1", ranks=[RANK_INFO], spans=[TIMELINE_SPAN], truncated=True),
    records.RunPage(runs=[RUN], total=3, offset=0, next_offset=1),
    records.FixPage(run="mnist-1", fixes=[FIX], total=1),
    records.AuditPage(run="mnist-1", entries=[AUDIT], total=5, offset=4),
    records.SeriesSet(run="mnist-1", series=[Series(run="mnist-1", name="sys/forward",
                                                    points=[SeriesPoint(step=0, value=0.01)])]),
    records.Heatmap(run="mnist-1", collection="gradients", field="norm", tensors=["fc1.weight", "fc2.weight"],
                    steps=[0, 50], values=[[0.5, None], [0.1, 0.2]], downsampled=True),
    records.HistoryEntry(step=40, time=1.7e9, type="anomaly", ref="a-1", label="exploding_gradient", status="critical"),
    records.TimedPoint(step=40, seconds=12.5, value=None),
    records.ConfigDifference(key="optim.lr", values={"run-a": 3e-4, "run-b": [0.9, 0.95]}),
    records.ComparedRun(run=RUN, started_at=1.7e9, points=[records.TimedPoint(step=0, seconds=0.0, value=2.3)],
                        downsampled=True, marks=[records.HistoryEntry(step=40, time=1.7e9, type="anomaly", ref="a-1",
                                                                      label="exploding_gradient")], marks_total=3),
    records.RunComparison(metric="loss", runs=[records.ComparedRun(run=RUN, started_at=0.0, points=[])],
                          metrics=["loss", "val_loss"], config_same=40, config_differences=[
                              records.ConfigDifference(key="optim.lr", values={"mnist-1": 0.01, "mnist-2": None})]),
    records.DistributionPoint(step=10, min=-1.0, max=None, mean=0.0, quantiles=[-0.5, -0.3, -0.1, 0.0, 0.1, 0.3, 0.5]),
    records.Distribution(run="mnist-1", collection="weights", tensor="fc1.weight", tensors=["fc1.weight", "fc1.bias"],
                         sample=512, downsampled=True, points=[records.DistributionPoint(step=0, quantiles=[]),
                         records.DistributionPoint(step=10, min=-1.0, max=1.0, mean=None,
                                                   quantiles=[-0.5, -0.3, -0.1, 0.0, 0.1, None, 0.5])]),
    records.RunHistory(run="mnist-1", total=2, next_offset=None, entries=[
        records.HistoryEntry(step=40, time=1.7e9, type="anomaly", ref="a-1", label="exploding_gradient"),
        records.HistoryEntry(step=52, time=1.7e9, type="fix", ref="f-1", label="grad_clip applied", status="applied",
                             actor="person:ana")]),
]}

XML_PARSER = etree.XMLParser(resolve_entities=False, no_network=True)


def wire(model: BaseModel) -> object:
    """What travels: the JSON text, where NaN and Inf are null."""
    return json.loads(model.model_dump_json())


def validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(export.schema_for(name), format_checker=jsonschema.FormatChecker())


def test_checked_in_files_match_the_models() -> None:
    assert export.check() == []


def test_check_lists_drift_and_main_exits_1(tmp_path) -> None:
    export.write(tmp_path)
    assert export.check(tmp_path) == []
    xsd_path = tmp_path / export.XSD_FILE
    xsd_path.write_text(xsd_path.read_text().replace('name="Anomaly"', 'name="Anomaly2"', 1))
    (tmp_path / export.JSON_FILE).unlink()
    problems = export.check(tmp_path)
    assert len(problems) == 2 and any("missing" in p for p in problems) and any("Anomaly2" in p for p in problems)
    assert export.main(["--check", "--dir", str(tmp_path)]) == 1


def test_every_exported_model_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(m.__name__ for m in export.MODELS)


def test_the_json_schema_is_one_document_with_shared_defs() -> None:
    doc = json.loads((export.HERE / export.JSON_FILE).read_text())
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["schema_version"] == schemas.SCHEMA_VERSION and doc["$id"].endswith(schemas.SCHEMA_VERSION)
    assert set(SAMPLES) <= set(doc["$defs"])
    jsonschema.Draft202012Validator.check_schema(doc)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_validates_against_its_json_schema(name: str) -> None:
    sample = SAMPLES[name]
    validator(name).validate(wire(sample))
    validator(name).validate(sample.model_dump(mode="json"))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_xml_validates_against_the_xsd(name: str) -> None:
    doc = etree.fromstring(to_xml(SAMPLES[name]), XML_PARSER)
    assert doc.tag == name
    xsd_schema().assertValid(doc)


def test_xml_marks_null_with_xsi_nil() -> None:
    doc = etree.fromstring(to_xml(ROW), XML_PARSER)
    nil = "{http://www.w3.org/2001/XMLSchema-instance}nil"
    assert [el.tag for el in doc if el.get(nil) == "true"] == ["mean", "std", "max", "dead_frac", "saturated_frac", "quantiles",
                                                                   "embedding"]
    evidence = etree.fromstring(to_xml(ANOMALY), XML_PARSER).find("evidence")
    assert [(e.get("key"), e.get(nil), [i.text for i in e]) for e in evidence] == [
        ("grad_norm", None, []), ("baseline", None, []), ("ratio", "true", []), ("steps", None, ["40.0", "52.0"])]


def test_invalid_records_are_refused_by_both_schemas() -> None:
    body = wire(ANOMALY) | {"kind": "bogus"}
    assert not validator("Anomaly").is_valid(body)
    doc = etree.fromstring(to_xml(ANOMALY), XML_PARSER)
    doc.find("kind").text = "bogus"
    assert not xsd_schema().validate(doc)
    doc = etree.fromstring(to_xml(SAMPLES["IngestBatch"]), XML_PARSER)
    doc.find("run").text = "no spaces allowed"
    assert not xsd_schema().validate(doc)


def test_ingest_body_with_nan_as_null_validates() -> None:
    body = """{"batch_id": "b-0002-abcd", "run": "mnist-1", "seq": 1, "events": [
        {"kind": "tensor_stats", "step": 7, "time": 1700000000.5, "collection": "weights",
         "rows": [{"name": "fc1.weight", "numel": 10, "norm": null, "mean": null, "nan_count": 10, "inf_count": 0}]},
        {"kind": "scalars", "step": 7, "time": 1700000000.5, "values": {"loss": null}}]}"""
    validator("IngestBatch").validate(json.loads(body))
    batch = IngestBatch.model_validate_json(body)
    assert batch.events[0].rows[0].norm is None
    assert wire(batch)["events"][0]["rows"][0]["mean"] is None
    validator("IngestBatch").validate(wire(IngestBatch(batch_id="b-0003-abcd", run="r", seq=2, events=[
        TensorStats(step=1, time=1.0, collection=Collection.weights, rows=[StatRow(name="w", norm=math.inf)])])))


def test_ingest_body_with_defaults_left_out_validates() -> None:
    # Validation-mode schema: what a probe may omit, the schema must not require.
    validator("IngestBatch").validate({"batch_id": "b-0004-abcd", "run": "r", "seq": 0,
                                       "events": [{"kind": "run_start", "time": 0.0}]})


class _Zoned(BaseModel):
    when: datetime


class _Tagged(BaseModel):
    tags: set[str]


class _Loose(BaseModel):
    data: dict[str, object]


@pytest.mark.parametrize(("model", "field"), [(_Zoned, "_Zoned.when"), (_Tagged, "_Tagged.tags"), (_Loose, "_Loose.data")])
def test_xsd_refuses_an_unknown_field_type(model: type[BaseModel], field: str) -> None:
    with pytest.raises(TypeError, match=field):
        export.xsd([model])


def test_all_is_honest() -> None:
    for name in schemas.__all__:
        assert hasattr(schemas, name), name
    public = {
        name
        for module in (events, records, schemas.enums)
        for name, obj in vars(module).items()
        if not name.startswith("_") and inspect.isclass(obj) and obj.__module__ == module.__name__
        and issubclass(obj, (BaseModel, enum.Enum))
    }
    assert public <= set(schemas.__all__), public - set(schemas.__all__)
    assert len(schemas.__all__) == len(set(schemas.__all__))
