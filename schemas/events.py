"""Events that a probe sends to the server, and what the server answers.

Floats that are not finite (NaN, +/-Inf) are sent as ``null``: JSON has no literal for them. Where it
matters which one it was, the tensor statistics carry ``nan_count`` and ``inf_count``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .enums import RUN_ID_PATTERN, Collection, FixAction

NAME_PATTERN = r"^[^\x00-\x1f]{1,256}$"
MAX_EVENTS_PER_BATCH = 5000
MAX_ROWS_PER_EVENT = 20000
# Integers are stored as SQLite INTEGERs and written by orjson: both 64-bit signed. Nothing larger fits.
INT64_MAX = 2**63 - 1
# Steps stay exact as doubles, so a JavaScript client (the dashboard) reads every step as sent.
MAX_STEP = 2**53
# torch.distributed numbers ranks with a C int: at most 2**31 - 1 processes.
MAX_WORLD_SIZE = 2**31 - 1

RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN, description="Run id: letters, digits, '.', '_', ':', '-'; at most 128.")]
TensorName = Annotated[str, Field(pattern=NAME_PATTERN, description="A parameter, module or scalar name.")]
# The wire is strict: an integer is a JSON integer, never true/false, "12" or 12.0 coerced into one; a
# number is a JSON number (an integer is one too), never a boolean or a string; a boolean is true/false.
Step = Annotated[int, Field(ge=0, le=MAX_STEP, strict=True, description="Training step, counted by the probe from 0.")]
Count = Annotated[int, Field(ge=0, le=INT64_MAX, strict=True)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX, strict=True)]
Rank = Annotated[int, Field(ge=0, le=MAX_WORLD_SIZE - 1, strict=True)]
Flag = Annotated[bool, Field(strict=True)]
Number = Annotated[float | None, Field(strict=True, description="A finite number, or null when the value was NaN or "
                                                                "infinite.")]
Finite = Annotated[float, Field(allow_inf_nan=False, strict=True)]
Time = Annotated[float, Field(allow_inf_nan=False, ge=0, strict=True, description="Unix time in seconds.")]
ParamValue = Union[bool, Int64, Finite, str, list[str], list[Number], None]
Params = Annotated[dict[str, ParamValue], Field(max_length=64)]
# A run's own configuration (probes.attach(config=...)): hyper-parameters, model size, data, flattened to
# dotted keys by the probe ("optimizer.lr"). Bounded like every wire field: a Hugging Face run's
# TrainingArguments and model config come to ~250 keys; a string value is a name or a path, not a file.
MAX_CONFIG_KEYS = 512
MAX_CONFIG_TEXT = 1024
MAX_CONFIG_LIST = 64
ConfigText = Annotated[str, Field(max_length=MAX_CONFIG_TEXT)]
ConfigValue = Union[bool, Int64, Finite, ConfigText,
                    Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=MAX_CONFIG_LIST)],
                    Annotated[list[Number], Field(max_length=MAX_CONFIG_LIST)], None]
RunConfig = Annotated[dict[TensorName, ConfigValue], Field(max_length=MAX_CONFIG_KEYS, description=(
    "The run's own configuration as the job gave it (probes.attach(config=...), or the Hugging Face "
    "Trainer's arguments and model config): dotted keys, scalar or list values."))]
# Value distributions: the quantiles a probe estimates on sampled steps, at these levels. They are
# TensorBoard's distribution bands (the normal CDF at -1.5, -1, -0.5, 0, 0.5, 1 and 1.5 standard
# deviations: tensorboard/plugins/distribution/compressor.py, NORMAL_HISTOGRAM_BPS), without the 0 and 1
# ends, which are each row's exact min and max.
QUANTILE_LEVELS = (0.0668, 0.1587, 0.3085, 0.5, 0.6915, 0.8413, 0.9332)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ModuleInfo(_Model):
    name: TensorName
    type: str = Field(max_length=128)


class ParamInfo(_Model):
    name: TensorName
    shape: list[Count] = Field(max_length=16)
    numel: Count
    trainable: Flag = True
    dtype: str = Field("float32", max_length=32)
    local_numel: Count | None = Field(None, description=(
        "A sharded parameter (FSDP2's DTensor): the elements this rank holds. Its statistics (weights, "
        "gradients, updates) and snapshots from this rank cover that shard."))
    placements: str | None = Field(None, max_length=256, description=(
        "A sharded parameter: how it is laid out across the ranks (the DTensor's placements, e.g. 'Shard(dim=0)')."))


class OptimizerInfo(_Model):
    type: str = Field(max_length=128)
    param_groups: list[Params] = Field(default_factory=list, max_length=256)


class RunStart(_Model):
    """Sent once when a probe attaches: what the job is, so that rules and people can read the rest."""

    kind: Literal["run_start"] = "run_start"
    step: Step = 0
    time: Time
    modules: list[ModuleInfo] = Field(default_factory=list, max_length=100000)
    params: list[ParamInfo] = Field(default_factory=list, max_length=100000)
    total_params: Count = 0
    optimizer: OptimizerInfo | None = None
    torch_version: str = Field("", max_length=64)
    device: str = Field("cpu", max_length=64)
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE, strict=True)
    rank: Rank = 0
    local_rank: Rank = Field(0, description="Rank within its host (LOCAL_RANK under torchrun).")
    host: str = Field("", max_length=256)
    allow: list[FixAction] = Field(default_factory=list, description="Fix actions this job accepts.")
    config: Params = Field(default_factory=dict, description="The probe's own configuration.")
    run_config: RunConfig = Field(default_factory=dict)

    @field_validator("config")
    @classmethod
    def _interval_is_a_step_count(cls, config: dict) -> dict:
        """The server paces its rules by ``config.interval``: when present it must be a positive integer."""
        interval = config.get("interval")
        if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
            raise ValueError(f"config.interval must be a positive integer (steps between samples), got {interval!r}")
        return config


class Scalars(_Model):
    """Loss and user scalars (val_loss, accuracy, learning rate, step time, ...) at one step."""

    kind: Literal["scalars"] = "scalars"
    step: Step
    time: Time
    values: dict[TensorName, Number] = Field(max_length=1024)


MAX_EMBEDDING_ROWS = 512


class EmbeddingRow(_Model):
    """One row of an embedding table and its dynamics, as the embeddings collection measured them."""

    row: Count = Field(description="Row index in the table.")
    touches: Count = Field(description="Tracked steps in which the row was looked up and got a non-zero gradient.")
    velocity: Number = Field(None, description="EMA of ||row after - row before|| across the optimizer step.")
    consistency: Number = Field(None, description="EMA of the cosine between the row's successive updates (-1: every "
                                "update reverses the last one).")
    snr: Number = Field(None, description="Temporal gradient SNR: ||mean g||^2 / mean ||g - mean g||^2 across the "
                        "steps that touched the row.")
    noise: Number = Field(None, description="The row's gradient energy per lookup over the median of the table's "
                          "rows (> 1: its data pulls it harder than its peers' data pulls them).")


class ConflictedRow(_Model):
    """A row whose data has pulled it harder than its peers' over the run (EmbeddingSummary.conflicted)."""

    row: Count = Field(description="Row index in the table.")
    touches: Count = Field(description="Tracked steps in which the row was looked up and got a non-zero gradient.")
    noise: Number = Field(None, description="The row's gradient energy per lookup over the median row's, now "
                          "(EmbeddingRow.noise).")
    run_noise: Number = Field(None, description="The geometric mean of the row's noise at the reports that found it "
                              "updated since the one before: how hard its data has pulled it, relative to its "
                              "peers', over the run. A row whose data conflicts (its ratings flip for one group of "
                              "users) keeps a high run_noise after the model has fitted the conflict and its noise "
                              "has fallen back towards 1.")
    run_score: Number = Field(None, description="The same readings in spreads (ln(noise) over that report's "
                              "noise_spread, the table's robust standard deviation of ln(noise) above its median), "
                              "averaged over the run, at its highest once 10 reports had read the row: how far "
                              "above its peers the row has stood, comparable across tables, and not worn down by "
                              "the epochs in which the model memorises the conflict. The list is ranked by it.")
    reports: Count = Field(0, description="Reports run_noise and run_score average over.")


class EmbeddingSummary(_Model):
    """Per-table summary of the embeddings collection, with the worst rows of each kind."""

    rows: Count
    dim: Count
    sparse: Flag = Field(False, description="The table's gradients were sparse.")
    tracked_steps: Count = Field(0, description="Steps the collection tracked the table since the probe attached.")
    touched_rows: Count = Field(0, description="Rows updated at least once.")
    window_touched_rows: Count = Field(0, description="Rows updated since the previous report.")
    never_updated: Count = Field(0, description="Finite rows never updated (padding_idx excluded).")
    nonfinite_rows: Count = Field(0, description="Rows holding NaN or Inf (never counted as dead).")
    median_touches: Number = Field(None, description="Median touches among rows updated at least once.")
    eligible_rows: Count = Field(0, description="Rows touched often enough for their direction statistics to count.")
    negative_consistency_rows: Count = Field(0, description="Eligible rows whose updates reverse on average.")
    noise_spread: Number = Field(None, description="Spread of the eligible rows' log energy per lookup above the "
                                 "median: 1.4826 x the median ln(noise) of the table's sampled rows above the median "
                                 "row (a robust standard deviation of the side zombie_embedding reads: how many rows of "
                                 "a healthy table pass a row's noise by chance).")
    score_median: Number = Field(None, description="Median zombie score (ln(noise) - consistency, as zombies are "
                                 "ranked) of the table's sampled eligible rows.")
    score_spread: Number = Field(None, description="Spread of the sampled eligible rows' zombie scores above their "
                                 "median: 1.4826 x the median excess over it (a robust standard deviation: "
                                 "zombie_embedding reads how many rows of a healthy table score as high as a listed "
                                 "row by chance).")
    effective_rank: Number = Field(None, description="exp(entropy of normalised singular values) of sampled rows.")
    mean_cosine: Number = Field(None, description="Mean pairwise cosine of sampled rows.")
    sampled_rows: Count = Field(0, description="Rows sampled for effective_rank and mean_cosine.")
    zombies: list[EmbeddingRow] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS,
                                        description="Eligible rows with the highest zombie score (ln(noise) - "
                                        "consistency: noisy and reversing), worst first: the worst 32, and every "
                                        "further row scoring at least ln 2, up to 256.")
    rarest: list[EmbeddingRow] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS,
                                       description="Rows updated at least once, least often first: the rarest 32, "
                                       "and every further row updated under 2% as often as the median row, up to 256.")
    conflicted: list[ConflictedRow] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS,
                                            description="Rows highest on run_score, worst first: the worst 32, and "
                                            "every further row whose run_score is at least 2, up to 256. Where the "
                                            "zombies say which rows fight their data now, these say which rows' data "
                                            "has disagreed all along: a data problem (conflicting or corrupted "
                                            "labels) the model may have memorised since.")
    dead_ids: list[Count] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS,
                                description="Finite rows never updated, lowest ids first.")
    nonfinite_ids: list[Count] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS)
    tied_to: list[TensorName] = Field(default_factory=list, max_length=MAX_EMBEDDING_ROWS,
                                      description="Parameters of other modules that are this table's weight (weight "
                                      "tying, e.g. an output projection): through them every row learns, looked up "
                                      "or not, so a row never looked up is not one that never learns.")
    learns_outside_lookups: Flag = Field(False, description="Rows not looked up in a step had a gradient: the weight "
                                         "also learns outside the table's lookups (an output matrix, as in a full "
                                         "softmax over its ids, or a functional call), so a row never looked up is "
                                         "not one that never learns. Checked on the rows a report lists as never "
                                         "or rarely updated; once seen, kept.")


class StatRow(_Model):
    """Statistics of one tensor at one step. Fields a collection does not compute are null/absent."""

    name: TensorName
    numel: Count | None = None
    norm: Number = None
    mean: Number = None
    std: Number = None
    min: Number = None
    max: Number = None
    nan_count: Count | None = None
    inf_count: Count | None = None
    zero_frac: Number = None
    dead_frac: Number = Field(None, description="Activations: fraction of units zero for the whole batch (ReLU family).")
    saturated_frac: Number = Field(None, description="Activations: fraction of outputs within 1% of a tanh/sigmoid bound.")
    update_ratio: Number = Field(None, description="Updates: ||w_after - w_before|| / ||w_before||.")
    quantiles: list[Number] = Field(default_factory=list, max_length=len(QUANTILE_LEVELS), description=(
        "Weights, gradients, activations, on some sampled steps: the finite values' quantiles at QUANTILE_LEVELS, "
        "estimated from an evenly spread sample of the tensor's elements (config.quantile_sample of them at most); "
        "empty when not estimated."))
    embedding: EmbeddingSummary | None = Field(None, description="Embeddings: the table's row dynamics.")

    @field_validator("quantiles")
    @classmethod
    def _every_level(cls, quantiles: list) -> list:
        if quantiles and len(quantiles) != len(QUANTILE_LEVELS):
            raise ValueError(f"quantiles holds one value per level ({len(QUANTILE_LEVELS)}: {list(QUANTILE_LEVELS)}) "
                             f"or none, got {len(quantiles)}")
        return quantiles


class TensorStats(_Model):
    kind: Literal["tensor_stats"] = "tensor_stats"
    step: Step
    time: Time
    collection: Collection
    rows: list[StatRow] = Field(max_length=MAX_ROWS_PER_EVENT)


class FixAck(_Model):
    """The job's answer to a fix command: what it did, with the values before and after. ``scheduled``: a
    rank of a multi-rank job holds the command for the step every rank applies it after (``step``), and
    its answer follows then (probes/agreement.py)."""

    kind: Literal["fix_ack"] = "fix_ack"
    step: Step
    time: Time
    fix_id: str = Field(max_length=64)
    op: Literal["apply", "revert"] = "apply"
    status: Literal["applied", "rejected", "failed", "reverted", "scheduled"]
    before: Params = Field(default_factory=dict)
    after: Params = Field(default_factory=dict)
    reason: str | None = Field(None, max_length=2000)


class ProbeMessage(_Model):
    """Something the probe wants a person to know: it degraded, dropped events, skipped a hook."""

    kind: Literal["message"] = "message"
    step: Step
    time: Time
    level: Literal["info", "warning", "error"] = "warning"
    text: str = Field(max_length=4000)


SPAN_CATEGORIES = ("step", "phase", "comm", "user")
MAX_TRACE_CHARS = 8 << 20


class Span(_Model):
    """One timed stretch of a step on one rank: a phase, the gradient all-reduce, or a user's stage."""

    name: TensorName = Field(description="data_wait, forward, backward, allreduce, comm_wait, optimizer, step, "
                                         "or a user's own span name.")
    category: Literal["step", "phase", "comm", "user"] = "phase"
    start: Time = Field(description="Wall-clock start (Unix seconds), comparable across ranks and hosts.")
    duration: float = Field(ge=0, allow_inf_nan=False, strict=True, description="Seconds.")
    gpu_duration: float | None = Field(None, ge=0, allow_inf_nan=False, strict=True,
                                       description="Seconds of GPU work, timed with CUDA events, where present.")


class Spans(_Model):
    """The execution context of one sampled step (or one step of a capture) on the sending rank."""

    kind: Literal["spans"] = "spans"
    step: Step
    time: Time
    mode: str = Field("train", pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="train, eval, or a user's mode.")
    spans: list[Span] = Field(max_length=4096)
    capture: str | None = Field(None, max_length=64, description="Set on steps a diagnostic capture recorded: "
                                "the profiler slows them, so timing rules leave them out.")


class OpStat(_Model):
    """One operator of a torch.profiler capture, aggregated over the captured steps."""

    name: str = Field(max_length=512)
    calls: Count
    cpu_time_ms: Finite = Field(description="Total CPU time, children included.")
    self_cpu_time_ms: Finite
    device_time_ms: Finite = 0.0
    self_device_time_ms: Finite = 0.0
    cpu_memory_mb: Finite = Field(0.0, description="Self CPU memory allocated (negative: freed).")
    device_memory_mb: Finite = 0.0


class ModuleShape(_Model):
    module: TensorName
    type: str = Field(max_length=128)
    inputs: list[list[Count]] = Field(default_factory=list, max_length=64)
    outputs: list[list[Count]] = Field(default_factory=list, max_length=64)


class CaptureResult(_Model):
    """What a diagnostic capture recorded on this rank: operator breakdown, tensor shapes, profiler trace."""

    kind: Literal["capture"] = "capture"
    step: Step = Field(description="The first captured step.")
    time: Time
    capture_id: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    last_step: Step
    status: Literal["done", "failed"] = "done"
    reason: str | None = Field(None, max_length=2000)
    profiled: Flag = False
    ops: list[OpStat] = Field(default_factory=list, max_length=500)
    shapes: list[ModuleShape] = Field(default_factory=list, max_length=10000)
    trace: str | None = Field(None, max_length=MAX_TRACE_CHARS,
                              description="torch.profiler's Chrome trace (JSON text); null when too large.")
    trace_dropped: str | None = Field(None, max_length=500, description="Why the trace is not attached.")


class LayerProfile(_Model):
    """One weight's loss increase at each sparsity of a grid, whole output channels, and each cast."""

    name: TensorName
    numel: Count
    shape: list[Count] = Field(default_factory=list, max_length=16)
    method: str = Field("", max_length=64, description="obs-kfac, obd-diagonal or magnitude: how weights were chosen.")
    fisher_mean: Number = None
    saliency_mean: Number = Field(None, description="Mean predicted loss increase per weight removed alone.")
    sparsities: list[Finite] = Field(max_length=1000)
    unstructured: list[Number] = Field(max_length=1000, description="Loss increase at each sparsity.")
    channels: list[Number] | None = Field(None, max_length=1000, description="The same, pruning whole output channels.")
    precision: dict[str, Number] = Field(default_factory=dict, max_length=8, description="Loss increase per cast.")


class LayerProfiles(_Model):
    """What compressing each layer costs: predicted from the Fisher, or measured on a held batch."""

    kind: Literal["layer_profiles"] = "layer_profiles"
    step: Step
    time: Time
    source: Literal["fisher", "held_batch"]
    samples: Count = Field(0, description="Fisher samples averaged (source fisher).")
    base_loss: Number = Field(None, description="Held-batch loss of the unchanged model (source held_batch).")
    layers: list[LayerProfile] = Field(max_length=MAX_ROWS_PER_EVENT)


class TensorSlice(_Model):
    """A bounded piece of one tensor: its shape and dtype, and up to a few hundred of its values."""

    name: TensorName
    source: Literal["parameter", "gradient", "activation"]
    shape: list[Count] = Field(max_length=16)
    dtype: str = Field(max_length=32)
    numel: Count
    offset: Count = Field(0, description="Index in the flattened tensor of values[0] (centred on the first NaN/Inf).")
    values: list[Number] = Field(default_factory=list, max_length=1024)
    nan_count: Count = 0
    inf_count: Count = 0


class TensorSnapshot(_Model):
    """The job's answer to a ``snapshot`` command: slices of the tensors the server asked about."""

    kind: Literal["tensor_snapshot"] = "tensor_snapshot"
    step: Step
    time: Time
    request_id: str = Field(max_length=64)
    tensors: list[TensorSlice] = Field(default_factory=list, max_length=16)
    missing: list[str] = Field(default_factory=list, max_length=16, description="Names the job could not find.")


class RunEnd(_Model):
    kind: Literal["run_end"] = "run_end"
    step: Step
    time: Time
    reason: str = Field("closed", max_length=256)


Event = Annotated[
    Union[RunStart, Scalars, TensorStats, FixAck, ProbeMessage, RunEnd, LayerProfiles, TensorSnapshot, Spans,
          CaptureResult],
    Field(discriminator="kind"),
]


class IngestBatch(_Model):
    """One POST /v1/ingest body. ``batch_id`` makes a retried or replayed batch count once."""

    batch_id: str = Field(pattern=r"^[A-Za-z0-9_\-]{8,64}$")
    run: RunId
    seq: Count = Field(description="Order of this batch within the probe's stream.")
    rank: Rank = Field(0, description="The sending process's rank (RANK under torchrun); 0 for one process.")
    events: list[Event] = Field(max_length=MAX_EVENTS_PER_BATCH)


class Command(_Model):
    """A fix for the job to apply (or revert) at its next step boundary, or (op ``snapshot``) a request for
    bounded slices of the tensors named in ``params.tensors``, answered with a TensorSnapshot event."""

    fix_id: str = Field(max_length=64, description="The fix's id, or the snapshot request's id.")
    op: Literal["apply", "revert", "snapshot"] = "apply"
    action: FixAction | None = Field(None, description="The fix action; null for a snapshot.")
    params: Params = Field(default_factory=dict)
    attempt: int = Field(1, ge=1, le=INT64_MAX, description="How many times this op of this fix has been asked for: a job "
                         "that answered an earlier attempt (a refusal) takes a later one as a new request.")


class CaptureCommand(_Model):
    """Record everything for the next ``steps`` steps (and run torch.profiler), then sample as before."""

    capture_id: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    steps: int = Field(ge=1, le=100)
    profile: bool = True


class IngestReply(_Model):
    accepted: int = Field(ge=0, le=INT64_MAX, description="Events stored from this batch (0 for a duplicate).")
    duplicate: bool = False
    commands: list[Command] = Field(default_factory=list)
    captures: list[CaptureCommand] = Field(default_factory=list)
