"""Closed vocabularies of the wire and API contract.

Renaming or removing a member is a breaking change: bump ``SCHEMA_VERSION`` when you do.
Adding a member is backwards compatible for readers that ignore what they do not know.
"""

from __future__ import annotations

from enum import Enum

SCHEMA_VERSION = "1"
# What a run id may be (the probe checks it at attach, the server at ingest).
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$"


class AnomalyKind(str, Enum):
    nonfinite = "nonfinite"
    exploding_gradient = "exploding_gradient"
    vanishing_gradient = "vanishing_gradient"
    dead_relu = "dead_relu"
    saturated_activation = "saturated_activation"
    poor_weight_init = "poor_weight_init"
    abnormal_update_ratio = "abnormal_update_ratio"
    unchanged_tensor = "unchanged_tensor"
    loss_not_decreasing = "loss_not_decreasing"
    loss_divergence = "loss_divergence"
    training_stalled = "training_stalled"  # after a fault: loss far above its level before, updates collapsed
    oscillating_loss = "oscillating_loss"
    overfitting = "overfitting"
    input_not_normalized = "input_not_normalized"
    output_range_mismatch = "output_range_mismatch"
    dataloader_bottleneck = "dataloader_bottleneck"
    step_time_outlier = "step_time_outlier"
    memory_growth = "memory_growth"
    gpu_memory_fragmentation = "gpu_memory_fragmentation"
    zombie_embedding = "zombie_embedding"
    dead_embedding = "dead_embedding"
    embedding_collapse = "embedding_collapse"
    straggler_rank = "straggler_rank"
    comm_bottleneck = "comm_bottleneck"


class Severity(str, Enum):
    info = "info"
    warning = "warning"
    critical = "critical"


class AnomalyStatus(str, Enum):
    open = "open"
    resolved = "resolved"


class FixAction(str, Enum):
    lr_scale = "lr_scale"
    set_lr = "set_lr"
    grad_clip = "grad_clip"
    grad_scale = "grad_scale"
    skip_nonfinite = "skip_nonfinite"
    rollback = "rollback"
    reinit_dead_units = "reinit_dead_units"
    freeze = "freeze"
    unfreeze = "unfreeze"
    set_probe = "set_probe"
    prune = "prune"
    sensitivity = "sensitivity"  # measure per-layer pruning/cast sensitivity on the job's held batch
    embedding_grad_scale = "embedding_grad_scale"
    advice = "advice"


class FixStatus(str, Enum):
    proposed = "proposed"  # computed by propose_fix, not yet asked for
    pending = "pending"  # apply_fix was called; waiting for the job to pick it up
    applied = "applied"  # the job acknowledged it; the server is watching the anomaly
    rejected = "rejected"  # the job refused it (action not allowed, parameter out of bounds)
    failed = "failed"  # the job tried and could not apply it
    expired = "expired"  # the job ended or stopped answering before it picked the fix up
    effective = "effective"  # applied, and the run's loss came back near its healthy level before the fault
    ineffective = "ineffective"  # applied, and the run had not come back by the end of the window
    reverted = "reverted"  # undone in the job after revert_fix
    advice = "advice"  # needs a restart: instructions only, never claimed as applied


class Collection(str, Enum):
    scalars = "scalars"
    weights = "weights"
    gradients = "gradients"
    updates = "updates"
    activations = "activations"
    system = "system"
    embeddings = "embeddings"
    fisher = "fisher"
