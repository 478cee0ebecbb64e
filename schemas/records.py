"""Records the server returns over HTTP and MCP."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .enums import AnomalyKind, AnomalyStatus, FixAction, FixStatus, Severity
from .events import Finite, Number, Params, RunId, TensorSlice, Time


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Anomaly(_Record):
    id: str = Field(description="Stable id, e.g. 'a-12'.")
    run: RunId
    kind: AnomalyKind
    severity: Severity
    status: AnomalyStatus
    first_step: int = Field(ge=0)
    last_step: int = Field(ge=0)
    resolved_step: int | None = None
    tensors: list[str] = Field(default_factory=list, description="Tensors involved, in forward order.")
    message: str = Field(description="One sentence a person can act on.")
    evidence: Params = Field(default_factory=dict, description="The numbers that triggered it.")
    rule: str = Field(description="Name of the rule that raised it.")
    created_at: Time
    updated_at: Time
    snapshot: list[TensorSlice] = Field(default_factory=list, description="Slices of the offending tensors, taken "
                                        "by the job when the anomaly opened critical (evidence on demand).")


class AnomalyPage(_Record):
    run: RunId
    anomalies: list[Anomaly]
    total: int = Field(description="Matching anomalies, before paging.")
    offset: int = 0
    next_offset: int | None = Field(None, description="Pass as offset for the next page; null on the last.")


class Fix(_Record):
    id: str = Field(description="Stable id, e.g. 'f-3'.")
    run: RunId
    anomaly_id: str | None
    action: FixAction
    params: Params = Field(default_factory=dict)
    rationale: str
    expected_effect: str = ""
    risk: Literal["low", "medium", "high"] = "low"
    live: bool = Field(True, description="Can be applied to the running job (false: needs a restart).")
    rank: int = Field(1, ge=1, description="1 is the best candidate for its anomaly.")
    status: FixStatus
    reason: str | None = Field(None, description="Why it was rejected, failed, expired or judged.")
    requested_by: str | None = None
    created_at: Time
    updated_at: Time
    applied_step: int | None = None
    before: Params = Field(default_factory=dict)
    after: Params = Field(default_factory=dict)


class FixList(_Record):
    run: RunId
    fixes: list[Fix]


class AuditEntry(_Record):
    run: RunId
    time: Time
    actor: str = Field(description="Who asked: an MCP client's name, 'http:<addr>', or 'job'.")
    action: str = Field(description="proposed, apply_requested, applied, rejected, failed, verdict, revert_requested, ...")
    fix_id: str | None = None
    detail: Params = Field(default_factory=dict)


class AuditTrail(_Record):
    run: RunId
    entries: list[AuditEntry]


class Run(_Record):
    run: RunId
    status: Literal["active", "ended", "stale"]
    created_at: Time
    last_seen: Time
    last_step: int
    device: str = ""
    total_params: int = 0
    allow: list[FixAction] = Field(default_factory=list)
    open_anomalies: int = 0


class RunList(_Record):
    runs: list[Run]


class RunSummary(_Record):
    run: Run
    latest: dict[str, Number] = Field(default_factory=dict, description="Latest value of each scalar.")
    anomalies_by_kind: dict[str, int] = Field(default_factory=dict, description="Open anomalies per kind.")
    fixes_by_status: dict[str, int] = Field(default_factory=dict)


class SeriesPoint(_Record):
    step: int
    value: Number


class Series(_Record):
    run: RunId
    name: str
    points: list[SeriesPoint]
    downsampled: bool = False


class LayerRecipe(_Record):
    name: str = Field(description="Parameter tensor name.")
    numel: int
    sparsity: float = Field(ge=0.0, le=1.0)
    structure: Literal["unstructured", "channels"] = "unstructured"
    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    saliency: Number = Field(None, description="Mean Fisher-weighted saliency per weight (w^2 * F).")
    reason: str
    size_bytes: int | None = Field(None, ge=0, description="Predicted stored size: kept values + bitmask.")
    loss_increase: Number = Field(None, description="Predicted loss increase of this layer's sparsity and cast.")


class CompressionRecipe(_Record):
    run: RunId
    target_sparsity: float | None = Field(None, ge=0.0, lt=1.0)
    target_size_bytes: int | None = Field(None, ge=0, description="Size budget, when the target was a size.")
    achieved_sparsity: Finite
    method: str
    layers: list[LayerRecipe]
    dense_size_bytes: int
    predicted_size_bytes: int
    predicted_loss_increase: Number = None
    notes: list[str] = Field(default_factory=list)


class Cause(_Record):
    anomaly_id: str
    kind: AnomalyKind
    step: int
    tensor: str | None = None
    explanation: str
    consequences: list[str] = Field(default_factory=list, description="Ids of anomalies this one explains.")


class Diagnosis(_Record):
    run: RunId
    summary: str
    causes: list[Cause]
    report: str = Field(description="The same, as text a person can read.")
    context: list[str] = Field(default_factory=list, description="Where the first problem began (first step, first "
                               "tensor in forward order) and what changed just before it (learning rate, a fix, data).")
    history: list[str] = Field(default_factory=list, description="Departures from the run's own healthy stretch and "
                               "from earlier runs of the same model structure, naming the run compared against.")


class Health(_Record):
    status: Literal["ok"] = "ok"
    version: str
    schema_version: str
    data_dir: str
    store: str = Field("ok", description="SQLite 'PRAGMA quick_check' of the store at start: 'ok', or what is wrong.")
    data_bytes: int | None = Field(None, description="Size of the data directory now.")
    max_data_bytes: int | None = Field(None, description="The data directory's size cap (null: none).")
    warnings: list[str] = Field(default_factory=list, description="What needs a person's attention (store, disk).")


class Error(_Record):
    """The one shape of every error the server returns."""

    error: str = Field(description="A short machine-readable code, e.g. 'invalid_batch', 'unknown_run'.")
    message: str = Field(description="What is wrong, in a sentence a person can act on.")
    detail: list[str] = Field(default_factory=list, description="Each problem found, with where it is.")
