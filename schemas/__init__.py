"""The wire and API contract of traindx: pydantic models, and the JSON Schema / XSD generated from them."""

from __future__ import annotations

from .enums import SCHEMA_VERSION, AnomalyKind, AnomalyStatus, Collection, FixAction, FixStatus, Severity
from .events import (
    MAX_EVENTS_PER_BATCH,
    Command,
    EmbeddingRow,
    EmbeddingSummary,
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
    TensorSlice,
    TensorSnapshot,
    TensorStats,
)
from .records import (
    Anomaly,
    AnomalyPage,
    AuditEntry,
    AuditTrail,
    Cause,
    CompressionRecipe,
    Diagnosis,
    Error,
    Fix,
    FixList,
    Health,
    LayerRecipe,
    Run,
    RunList,
    RunSummary,
    Series,
    SeriesPoint,
)

__all__ = [
    "SCHEMA_VERSION", "AnomalyKind", "AnomalyStatus", "Collection", "FixAction", "FixStatus", "Severity",
    "MAX_EVENTS_PER_BATCH", "Command", "EmbeddingRow", "EmbeddingSummary", "Event", "FixAck", "IngestBatch", "IngestReply",
    "LayerProfile", "LayerProfiles", "ModuleInfo",
    "OptimizerInfo", "ParamInfo", "ProbeMessage", "RunEnd", "RunStart", "Scalars", "StatRow", "TensorStats",
    "TensorSlice", "TensorSnapshot",
    "Anomaly", "AnomalyPage", "AuditEntry", "AuditTrail", "Cause", "CompressionRecipe", "Diagnosis", "Error",
    "Fix", "FixList", "Health", "LayerRecipe", "Run", "RunList", "RunSummary", "Series", "SeriesPoint",
]
