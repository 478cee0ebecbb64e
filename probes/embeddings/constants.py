"""What the per-row statistics and a table's report mean: their windows, thresholds and list sizes.

Defined once here: the statistics' modules, the report and the native kernel (which takes them as
arguments) read the same values. Mechanics that one module owns (the queue's bounds, the worker's, the
memory a table may take) live with that module.
"""

from __future__ import annotations

import math

# Width of the random projections that stand in for a row's vectors. 8 keeps the state at 96 bytes a
# row (vs 128-256 for a 32-64 wide float32 row); JL error ~ 1/sqrt(8) per estimate.
SKETCH_DIM = 8
# EMA weight of a new gradient in the row's mean (a 10-touch window, GradTracer's default window).
EMA_ALPHA = 0.1
# EMA weight for the slower averages (consistency, squared norms): a 50-touch window, so that the
# per-row noise of a cosine (+-1 for a bias row) averages down to ~0.14.
SLOW_ALPHA = 0.01
# The snr that independent zero-mean gradients give with these EMAs: E||m||^2 / E||g||^2 for an EMA
# of white noise is alpha / (2 - alpha). Below it, successive gradients cancel (variance-ratio test,
# Lo & MacKinlay 1988); above it, they drift together.
NOISE_SNR = EMA_ALPHA / (2 - EMA_ALPHA)
# A row's direction statistics count once it was touched this many times (10 observations past the
# fast window).
MIN_TOUCHES = 20
# A median absolute deviation times this is the standard deviation of a normal distribution: the
# reports' ``noise_spread`` is the median ln(energy / median) of a table's sampled rows above the median
# times it.
MAD_SIGMA = 1.4826
# Rows listed per table and kind (zombies, rarest) in a report: the worst LISTED_ROWS, and further ones, up to
# TOP_ROWS, while they are past the floor of their kind: a zombie score (ln(noise) - consistency) of at least
# ZOMBIE_FLOOR, touches below RARE_FLOOR x the median. Those floors sit below the rules' defaults
# (zombie_embedding's min_noise 2.5 with consistency <= 0: a score of at least ln 2.5; dead_embedding's
# rare_ratio 0.01), so every row those could name is listed; a healthy table's filler rows are not. Listing
# TOP_ROWS of each kind for every table cost ~3 ms a report on ML-100k's four tables (dicts made, sent, parsed).
TOP_ROWS = 256
LISTED_ROWS = 32
ZOMBIE_FLOOR = math.log(2.0)
RARE_FLOOR = 0.02
# A row's run_score is its running mean's peak once this many reports have read it (before: the mean).
# A mean alone fades once the model has memorised a conflict: on ML-100k's planted group conflict
# (benchmarks/embeddings.py, case b) run_noise's AUC falls from 0.81-0.82 at 5 epochs to 0.66-0.78 at 30
# under Adam 1e-2, where run_score holds 0.80-0.82 (docs/embeddings.md). Before ten readings the mean's
# standard error is over a third of one reading's, and a peak over so few would be mostly noise; from 20,
# the peak comes too late in a run that fits fast (0.03 lower under Adam 1e-2, 0.02 higher under 1e-3).
RUN_SETTLED = 10
# The conflicted list's floor: a run_score of at least this many spreads (LISTED_ROWS are listed whatever
# their score).
CONFLICT_FLOOR = 2.0
# Rows sampled for effective rank and mean pairwise cosine.
COLLAPSE_SAMPLE = 512
# A fixed random sample of each table's rows, for medians (touches, energy per lookup) and collapse.
SAMPLE_ROWS = 4096
