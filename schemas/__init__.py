"""The wire and API contract of traindx: pydantic models, and the JSON Schema / XSD generated from them."""

from __future__ import annotations

from .enums import SCHEMA_VERSION, AnomalyKind, AnomalyStatus, Collection, FixAction, FixStatus, Severity
from .events import (
    MAX_EVENTS_PER_BATCH,
    CaptureCommand,
    CaptureResult,
    ModuleShape,
    OpStat,
    Span,
    Spans,
    Command,
    Event,
    FixAck,
    IngestBatch,
    IngestReply,
    LayerProfile,
    LayerProfiles,
    ModuleInfo,
    OptimizerInfo,
    ParamInfo,
    ProbeMessage,
    RunEnd,
    RunStart,
    Scalars,
    StatRow,
    TensorStats,
)
from .records import (
    Anomaly,
    AnomalyPage,
    AuditEntry,
    AuditTrail,
    Capture,
    CaptureList,
    CaptureRank,
    Cause,
    CompressionRecipe,
    Diagnosis,
    Error,
    Fix,
    FixList,
    Health,
    LayerRecipe,
    OpSummary,
    RankInfo,
    Run,
    RunList,
    RunSummary,
    Series,
    SeriesPoint,
    ShapeInfo,
    Timeline,
    TimelineSpan,
)

__all__ = [
    "SCHEMA_VERSION", "AnomalyKind", "AnomalyStatus", "Collection", "FixAction", "FixStatus", "Severity",
    "MAX_EVENTS_PER_BATCH", "Command", "Event", "FixAck", "IngestBatch", "IngestReply", "LayerProfile", "LayerProfiles", "ModuleInfo",
    "OptimizerInfo", "ParamInfo", "ProbeMessage", "RunEnd", "RunStart", "Scalars", "StatRow", "TensorStats",
    "Anomaly", "AnomalyPage", "AuditEntry", "AuditTrail", "Cause", "CompressionRecipe", "Diagnosis", "Error",
    "Fix", "FixList", "Health", "LayerRecipe", "Run", "RunList", "RunSummary", "Series", "SeriesPoint",
    # distributed runs and the execution-context timeline
    "CaptureCommand", "CaptureResult", "ModuleShape", "OpStat", "Span", "Spans", "Capture", "CaptureList",
    "CaptureRank", "OpSummary", "RankInfo", "ShapeInfo", "Timeline", "TimelineSpan",
]
