"""Embedding dynamics: per-row statistics of every nn.Embedding / nn.EmbeddingBag table of the model.

Dense-model statistics (one norm per tensor) say nothing about a table of a million rows of which a batch
touches a thousand. The ``embeddings`` collection keeps, for each row, a few scalars on the table's device
(touches, velocity, consistency, snr, noise, run_noise, run_score: docs/embeddings.md says what each
means) and updates them only for the rows a step touched. O(rows) memory, never a copy of the table.

    constants.py   what the statistics and a report mean: windows, thresholds, list sizes
    maths.py       the pure tensor maths: EMA recurrences and their scan, scores, spreads, effective rank
    state.py       TableState, one table's statistics, and the tracked step that reaches them
    native.py      the same tracking by the native kernel (probes/_fastats.c) for float32 CPU tables
    fold.py        folding queued steps into the statistics (the queued path: CUDA, other dtypes)
    report.py      the report a table sends, packed into one tensor, and its decoding into the event
    worker.py      the background thread that folds and reports the queued path's CPU tables
    lookups.py     how a tracked module's lookups are kept (a subclass of its class, or a forward hook)
    collection.py  the Embeddings collection: which tables, when they are tracked and reported
    action.py      the live fix embedding_grad_scale and the per-row factors it applies
"""

from __future__ import annotations

from .action import embedding_grad_scale, row_factors
from .collection import MAX_STATE_SHARE, Embeddings, find_tables, free_bytes, tied_to
from .constants import (COLLAPSE_SAMPLE, CONFLICT_FLOOR, EMA_ALPHA, LISTED_ROWS, MAD_SIGMA, MIN_TOUCHES, NOISE_SNR,
                        RARE_FLOOR, RUN_SETTLED, SAMPLE_ROWS, SKETCH_DIM, SLOW_ALPHA, TOP_ROWS, ZOMBIE_FLOOR)
from .state import TableState, state_bytes_of
from .worker import MAX_JOBS

__all__ = [
    "COLLAPSE_SAMPLE", "CONFLICT_FLOOR", "EMA_ALPHA", "LISTED_ROWS", "MAD_SIGMA", "MAX_JOBS", "MAX_STATE_SHARE",
    "MIN_TOUCHES", "NOISE_SNR", "RARE_FLOOR", "RUN_SETTLED", "SAMPLE_ROWS", "SKETCH_DIM", "SLOW_ALPHA", "TOP_ROWS",
    "ZOMBIE_FLOOR", "Embeddings", "TableState", "embedding_grad_scale", "find_tables", "free_bytes", "row_factors",
    "state_bytes_of", "tied_to",
]
