"""The rule catalog. Each module holds one family; ``BUILTIN`` lists every rule the server runs.

To add a rule of your own, subclass ``Rule`` and name it in the server's ``--rule module:Class``
option (or ``TRAINDX_RULES``); see the README.
"""

from __future__ import annotations

import importlib

from .activations import DeadRelu, InputNotNormalized, OutputRangeMismatch, SaturatedActivation
from .base import Finding, Observations, Param, Rule
from .distributed import RULES as DISTRIBUTED
from .embeddings import DeadEmbedding, EmbeddingCollapse, ZombieEmbedding
from .gradients import ExplodingGradient, VanishingGradient
from .loss import LossDivergence, LossNotDecreasing, OscillatingLoss, Overfitting
from .nonfinite import NonFinite
from .stall import TrainingStalled
from .system import DataloaderBottleneck, GpuMemoryFragmentation, MemoryGrowth, StepTimeOutlier
from .weights import AbnormalUpdateRatio, PoorWeightInit, UnchangedTensor

BUILTIN: list[type[Rule]] = [
    NonFinite, ExplodingGradient, VanishingGradient, DeadRelu, SaturatedActivation, PoorWeightInit,
    AbnormalUpdateRatio, UnchangedTensor, LossNotDecreasing, LossDivergence, OscillatingLoss, Overfitting,
    InputNotNormalized, OutputRangeMismatch, DataloaderBottleneck, StepTimeOutlier, MemoryGrowth,
    GpuMemoryFragmentation, ZombieEmbedding, DeadEmbedding, EmbeddingCollapse, *DISTRIBUTED, TrainingStalled,
]


def load(path: str) -> type[Rule]:
    """Load a user rule from 'package.module:ClassName'."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"a rule path looks like 'package.module:ClassName', got {path!r}")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, Rule)) or not cls.name:
        raise ValueError(f"{path!r} is not a Rule subclass with a name")
    return cls


__all__ = ["BUILTIN", "Finding", "Observations", "Param", "Rule", "load"]
