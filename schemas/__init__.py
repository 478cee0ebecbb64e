"""The wire and API contract of traindx: pydantic models, and the JSON Schema / XSD generated from them."""

from __future__ import annotations

from .enums import SCHEMA_VERSION, AnomalyKind, AnomalyStatus, Collection, FixAction, FixStatus, Severity
from .events import (
    MAX_EVENTS_PER_BATCH,
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
    AuditPage,
    AuditTrail,
    Cause,
    CompressionRecipe,
    Diagnosis,
    Error,
    Fix,
    FixList,
    FixPage,
    Health,
    Heatmap,
    HistoryEntry,
    LayerRecipe,
    Run,
    RunHistory,
    RunList,
    RunPage,
    RunSummary,
    Series,
    SeriesPoint,
    SeriesSet,
)

__all__ = [
    "SCHEMA_VERSION", "AnomalyKind", "AnomalyStatus", "Collection", "FixAction", "FixStatus", "Severity",
    "MAX_EVENTS_PER_BATCH", "Command", "Event", "FixAck", "IngestBatch", "IngestReply", "LayerProfile", "LayerProfiles", "ModuleInfo",
    "OptimizerInfo", "ParamInfo", "ProbeMessage", "RunEnd", "RunStart", "Scalars", "StatRow", "TensorStats",
    "Anomaly", "AnomalyPage", "AuditEntry", "AuditPage", "AuditTrail", "Cause", "CompressionRecipe", "Diagnosis", "Error",
    "Fix", "FixList", "FixPage", "Health", "Heatmap", "HistoryEntry", "LayerRecipe", "Run", "RunHistory", "RunList", "RunPage",
    "RunSummary", "Series", "SeriesPoint", "SeriesSet",
]
