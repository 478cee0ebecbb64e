"""Which proposer answers which anomaly kind: PROPOSERS, built here, in one place.

The step-size and embedding proposers come first (candidates.py), then the other rules' (proposers.py);
state.py wraps the spike-prone kinds so that what repairs the optimizer's state ranks first; the
distributed rules' proposers answer for their own rules' anomalies (distributed.py).
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from schemas.enums import AnomalyKind
from schemas.records import Anomaly

from . import distributed, proposers, state
from .candidates import Candidate, _divergence, _embedding, _exploding, _nonfinite

Proposer = Callable[[sqlite3.Connection, Anomaly], list[Candidate]]

PROPOSERS: dict[AnomalyKind, Proposer] = {
    AnomalyKind.exploding_gradient: _exploding,
    AnomalyKind.loss_divergence: _divergence,
    AnomalyKind.nonfinite: _nonfinite,
    AnomalyKind.zombie_embedding: _embedding,
    AnomalyKind.dead_embedding: _embedding,
}
proposers.install(PROPOSERS)
state.install(PROPOSERS)
distributed.install(PROPOSERS)
