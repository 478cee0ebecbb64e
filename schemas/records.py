"""Records the server returns over HTTP and MCP."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .enums import AnomalyKind, AnomalyStatus, FixAction, FixStatus, Severity
from .events import (INT64_MAX, MAX_EMBEDDING_ROWS, MAX_STEP, MAX_WORLD_SIZE, QUANTILE_LEVELS, ConfigValue,
                     EmbeddingSummary, Params, RunConfig, RunId, TensorName, TensorSlice)

# What the server answers is built by the server from what it stored, so the integers carry the wire's
# ranges (events.py) without its strictness.
StepNo = Annotated[int, Field(ge=0, le=MAX_STEP)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
Rank = Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE - 1)]
Number = Annotated[float | None, Field(description="A finite number, or null when the value was NaN or infinite.")]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Time = Annotated[float, Field(allow_inf_nan=False, ge=0, description="Unix time in seconds.")]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Anomaly(_Record):
    id: str = Field(description="Stable id, e.g. 'a-12'.")
    run: RunId
    kind: AnomalyKind
    severity: Severity
    status: AnomalyStatus
    first_step: StepNo
    last_step: StepNo
    resolved_step: StepNo | None = None
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
    total: Count = Field(description="Matching anomalies, before paging.")
    offset: Count = 0
    next_offset: Count | None = Field(None, description="Pass as offset for the next page; null on the last.")


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
    rank: int = Field(1, ge=1, le=INT64_MAX, description="1 is the best candidate for its anomaly.")
    status: FixStatus
    reason: str | None = Field(None, description="Why it was rejected, failed, expired or judged.")
    requested_by: str | None = None
    created_at: Time
    updated_at: Time
    applied_step: StepNo | None = None
    scheduled_step: StepNo | None = Field(None, description="While pending in a multi-rank job: the step its ranks "
                                       "agreed to apply (or revert) it after; the answer follows then.")
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
    last_step: StepNo
    device: str = ""
    total_params: Count = 0
    allow: list[FixAction] = Field(default_factory=list)
    open_anomalies: Count = 0


class RunList(_Record):
    runs: list[Run]


class RunMessage(_Record):
    """Something a person should know about the job that is not an anomaly: the probe degraded or
    skipped a hook, the run's rule settings were ignored, the job ended without closing its probe, on an
    uncaught exception or killed by a signal."""

    step: StepNo
    time: Time
    level: Literal["info", "warning", "error"]
    text: str
    rank: Rank = 0


class RunSummary(_Record):
    run: Run
    latest: dict[str, Number] = Field(default_factory=dict, description="Latest value of each scalar.")
    anomalies_by_kind: dict[str, Count] = Field(default_factory=dict, description="Open anomalies per kind.")
    fixes_by_status: dict[str, Count] = Field(default_factory=dict)
    messages: list[RunMessage] = Field(default_factory=list,
                                       description="The run's latest messages (at most 20), oldest first.")
    messages_total: Count = Field(0, description="Messages the run has sent in all.")
    config: RunConfig = Field(default_factory=dict, description="The run's own configuration, as its job sent it "
                              "(probes.attach(config=...)): hyper-parameters, model size, data.")


class SeriesPoint(_Record):
    step: StepNo
    value: Number


class Series(_Record):
    run: RunId
    name: str
    points: list[SeriesPoint]
    downsampled: bool = False


class RunPage(_Record):
    """One page of runs (GET /v1/runs): paging and filters as on every list."""

    runs: list[Run]
    total: Count = Field(description="Matching runs, before paging.")
    offset: Count = 0
    next_offset: Count | None = Field(None, description="Pass as offset for the next page; null on the last.")


class FixPage(_Record):
    """One page of a run's fixes (GET /v1/runs/{run}/fixes)."""

    run: RunId
    fixes: list[Fix]
    total: Count = Field(description="Matching fixes, before paging.")
    offset: Count = 0
    next_offset: Count | None = Field(None, description="Pass as offset for the next page; null on the last.")


class AuditPage(_Record):
    """One page of a run's audit trail (GET /v1/runs/{run}/audit)."""

    run: RunId
    entries: list[AuditEntry]
    total: Count = Field(description="Matching entries, before paging.")
    offset: Count = 0
    next_offset: Count | None = Field(None, description="Pass as offset for the next page; null on the last.")


class SeriesSet(_Record):
    """Several series of one run on one step axis: what one chart draws."""

    run: RunId
    series: list[Series]


class Heatmap(_Record):
    """One statistic of many tensors over steps: ``values[i][j]`` is tensor ``tensors[i]`` in the step
    bucket that starts at ``steps[j]`` (the bucket's largest value, so a spike survives downsampling)."""

    run: RunId
    collection: str
    field: str
    tensors: list[str]
    steps: list[StepNo]
    values: list[list[Number]]
    downsampled: bool = False


class HistoryEntry(_Record):
    """One mark on the run's timeline: an anomaly began or cleared, a fix was proposed, applied, judged."""

    step: StepNo
    time: Time
    type: Literal["anomaly", "resolved", "fix", "verdict"]
    ref: str = Field(description="The anomaly id ('a-3') or fix id ('f-5') it is about.")
    label: str = Field(description="A short text for a person, e.g. 'exploding_gradient (critical)'.")
    status: str | None = Field(None, description="The anomaly's severity, or the fix's status at that mark.")
    actor: str | None = Field(None, description="Who asked, for fix marks.")


class RunHistory(_Record):
    """The run's anomalies, fixes and their verdicts on the step axis, oldest first."""

    run: RunId
    entries: list[HistoryEntry]
    total: Count = Field(description="Matching entries, before paging.")
    offset: Count = 0
    next_offset: Count | None = Field(None, description="Pass as offset for the next page; null on the last.")


class LayerRecipe(_Record):
    name: str = Field(description="Parameter tensor name.")
    numel: Count
    sparsity: float = Field(ge=0.0, le=1.0)
    structure: Literal["unstructured", "channels"] = "unstructured"
    precision: Literal["fp32", "fp16", "bf16", "int8"] = "fp32"
    saliency: Number = Field(None, description="Mean Fisher-weighted saliency per weight (w^2 * F).")
    reason: str
    size_bytes: Count | None = Field(None, description="Predicted stored size: kept values + bitmask.")
    loss_increase: Number = Field(None, description="Predicted loss increase of this layer's sparsity and cast.")


class CompressionRecipe(_Record):
    run: RunId
    target_sparsity: float | None = Field(None, ge=0.0, lt=1.0)
    target_size_bytes: Count | None = Field(None, description="Size budget, when the target was a size.")
    achieved_sparsity: Finite
    method: str
    layers: list[LayerRecipe]
    dense_size_bytes: Count
    predicted_size_bytes: Count
    predicted_loss_increase: Number = None
    notes: list[str] = Field(default_factory=list)


class Cause(_Record):
    anomaly_id: str
    kind: AnomalyKind
    step: StepNo
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
    data_bytes: Count | None = Field(None, description="Size of the data directory now.")
    max_data_bytes: Count | None = Field(None, description="The data directory's size cap (null: none).")
    warnings: list[str] = Field(default_factory=list, description="What needs a person's attention (store, disk).")


class Error(_Record):
    """The one shape of every error the server returns."""

    error: str = Field(description="A short machine-readable code, e.g. 'invalid_batch', 'unknown_run'.")
    message: str = Field(description="What is wrong, in a sentence a person can act on.")
    detail: list[str] = Field(default_factory=list, description="Each problem found, with where it is.")


class RankInfo(_Record):
    """One process of a (possibly distributed) run, with its median phase times over recent samples."""

    rank: Rank
    local_rank: Rank = 0
    host: str = ""
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE)
    last_step: StepNo = 0
    ended: bool = False
    phases: dict[str, Number] = Field(default_factory=dict, description="Median seconds per phase, recent samples.")


class TimelineSpan(_Record):
    rank: Rank
    step: StepNo
    mode: str = "train"
    name: str
    category: Literal["step", "phase", "comm", "user"]
    start: Time
    duration: Finite = Field(ge=0)
    gpu_duration: Number = None


class Timeline(_Record):
    """The run's execution context across ranks: what each rank did, when, on sampled steps."""

    run: RunId
    ranks: list[RankInfo]
    spans: list[TimelineSpan]
    truncated: bool = Field(False, description="More spans were stored than returned; ask with a step range.")


class OpSummary(_Record):
    name: str
    calls: Count
    cpu_time_ms: Finite
    self_cpu_time_ms: Finite
    device_time_ms: Finite = 0.0
    self_device_time_ms: Finite = 0.0
    cpu_memory_mb: Finite = 0.0
    device_memory_mb: Finite = 0.0


class ShapeInfo(_Record):
    module: str
    type: str
    inputs: list[list[Count]] = Field(default_factory=list)
    outputs: list[list[Count]] = Field(default_factory=list)


class CaptureRank(_Record):
    rank: Rank
    status: Literal["done", "failed"]
    reason: str | None = None
    first_step: StepNo
    last_step: StepNo
    profiled: bool = False
    ops: list[OpSummary] = Field(default_factory=list, description="Operators by total CPU (or device) time.")
    shapes: list[ShapeInfo] = Field(default_factory=list)
    trace_available: bool = Field(False, description="GET .../captures/{id}/trace?rank=N returns the Chrome trace.")
    trace_dropped: str | None = None


class Capture(_Record):
    id: str = Field(description="Stable id, e.g. 'c-2'.")
    run: RunId
    status: Literal["pending", "partial", "done", "expired"] = Field(
        description="pending: sent, no rank has finished; partial: some ranks have; done: every rank has.")
    steps: Count
    profile: bool
    requested_by: str | None = None
    created_at: Time
    updated_at: Time
    ranks: list[CaptureRank] = Field(default_factory=list)


class CaptureList(_Record):
    run: RunId
    captures: list[Capture]


class EmbeddingTable(_Record):
    """One embedding table as its latest report described it (the embeddings collection)."""

    name: str = Field(description="The table's parameter, e.g. 'item.weight'.")
    rank: Rank = Field(0, description="The process that reported it (0 in a one-process run).")
    step: StepNo = Field(description="The step of the report.")
    summary: EmbeddingSummary = Field(description="Counts, collapse statistics and the worst rows of each kind, "
                                      "each list cut to the request's ``rows``.")


class EmbeddingTables(_Record):
    """A run's embedding tables as last reported (GET /v1/runs/{run}/embeddings, get_embeddings)."""

    run: RunId
    rows: int = Field(ge=0, le=MAX_EMBEDDING_ROWS, description="Most rows listed in each of a table's lists.")
    tables: list[EmbeddingTable] = Field(description="By name, then rank; empty when the run sent no embeddings "
                                         "report (the collection is off, or the model has no embedding table).")


class TimedPoint(_Record):
    """A point of a compared series: its step, and its time since the run's first point."""

    step: StepNo
    seconds: Finite = Field(description="Seconds since the run's first stored point of any scalar.")
    value: Number


class ComparedRun(_Record):
    """One run of a comparison: the metric's points, and its anomalies and fixes on the same axis."""

    run: Run
    started_at: Time = Field(description="When the run's first scalar was stored: seconds count from here.")
    points: list[TimedPoint] = Field(description="The metric, downsampled keeping each bucket's min and max.")
    downsampled: bool = False
    marks: list[HistoryEntry] = Field(default_factory=list, description="Anomalies began and cleared, fix "
                                      "requests and answers, verdicts (the run's history), oldest first.")
    marks_total: Count = Field(0, description="The run's marks before the cut to the request's max_marks.")


class ConfigDifference(_Record):
    """A configuration key whose value is not the same in every compared run."""

    key: TensorName
    values: dict[str, ConfigValue] = Field(description="Run id -> its value; a run that did not set the key "
                                           "is absent.")


class RunComparison(_Record):
    """Several runs side by side (GET /v1/compare): one metric overlaid, where their configs differ, and
    each run's anomalies and fixes on the same axis."""

    metric: str
    runs: list[ComparedRun]
    metrics: list[str] = Field(default_factory=list, description="Scalars at least one of the runs reported (at "
                               "most 200, by name): what else can be compared.")
    config_differences: list[ConfigDifference] = Field(default_factory=list, description="By key.")
    config_same: Count = Field(0, description="Keys every run set to the same value.")


class DistributionPoint(_Record):
    """One tensor's values at one sampled step: exact extremes and mean, estimated quantiles."""

    step: StepNo
    min: Number = None
    max: Number = None
    mean: Number = None
    quantiles: list[Number] = Field(default_factory=list, description="At the Distribution's levels; empty where "
                                    "the probe sent none (an older probe, or a collection that sends none).")


class Distribution(_Record):
    """A tensor's value distribution over steps (weights, gradients or activations of one layer), as
    TensorBoard's distributions chart draws it: bands between quantiles, within the exact min and max."""

    run: RunId
    collection: str
    tensor: str
    tensors: list[str] = Field(description="The collection's tensors in forward order: what else can be shown.")
    levels: list[float] = Field(default_factory=lambda: list(QUANTILE_LEVELS), description="The quantile levels.")
    sample: Count | None = Field(None, description="Elements each quantile was estimated from at most (the probe's "
                                 "quantile_sample; a smaller tensor's quantiles are exact). Null: no quantiles.")
    points: list[DistributionPoint]
    downsampled: bool = Field(False, description="Steps were grouped into buckets: a point is the bucket's last "
                              "sampled step, with the bucket's lowest min and highest max, and the quantiles of its "
                              "last step that has them.")
