"""The tensor maths of the per-row statistics: the EMA recurrences, scores, spreads and effective rank.

Pure functions of tensors (no table, no state): the fold applies ``fold_rows`` to a queue of tracked
steps, the report ranks and summarises rows with the rest. Each runs on the tensors' device with no host
synchronisation.
"""

from __future__ import annotations

import math

import torch

from .constants import EMA_ALPHA, LISTED_ROWS, MAD_SIGMA, MIN_TOUCHES, RUN_SETTLED, SLOW_ALPHA


def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return num / den.clamp_min(1e-30)


def snr(grad_sq: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """||mean g||^2 over the variance of g (E||g||^2 - ||mean g||^2)."""
    return ratio(mean_sq, grad_sq - mean_sq)


def max_abs(x: torch.Tensor) -> torch.Tensor:
    """Per row: the largest |element|, NaN when the row holds a NaN, inf when it holds an inf."""
    return x.abs().amax(dim=1)


def measured(occ: torch.Tensor) -> torch.Tensor:
    """Whether a row's energy per lookup was measured: it has been looked up here. A row of a replicated
    table that only other ranks look up is updated (its gradient is all-reduced) with no lookup here, and
    its energy stays 0: counted in the median energy, it read as the typical row's, and the rows looked up
    here stood out by 1e28x, critical zombies (a 2-rank DDP recommender, tests/test_distributed.py)."""
    return occ > 0


def row_counts(state_rows: torch.Tensor) -> torch.Tensor:
    """How many of these rows were updated at least once, are non-finite, are eligible."""
    t, bad = state_rows[:, 0], state_rows[:, 7] > 0
    return torch.stack([(t > 0).sum(), bad.sum(), ((t >= MIN_TOUCHES) & ~bad).sum()])


def zombie_score(eligible: torch.Tensor, noise: torch.Tensor, consistency: torch.Tensor) -> torch.Tensor:
    """log(noise excess) - consistency where ``eligible``, else -inf (TableState.zombie_score)."""
    score = torch.log(noise.clamp_min(1e-6)) - consistency
    return torch.where(eligible, score, torch.full_like(score, float("-inf")))


def ranked(key: torch.Tensor, k: int, largest: bool, floor: torch.Tensor | float) -> torch.Tensor:
    """Positions in ``key`` (over candidates sorted by row id) of a report's list: the worst LISTED_ROWS of
    the finite keys, and further ones up to ``k`` while past ``floor`` (at least it when ``largest``, else
    below it). Ties go to the lower row id."""
    val, pos = torch.sort(key, descending=largest, stable=True)
    val, pos = val[:k], pos[:k]
    keep = torch.isfinite(val) & ((torch.arange(val.numel(), device=key.device) < LISTED_ROWS)
                                  | (val >= floor if largest else val < floor))
    return pos[keep]


def conflict_score(run: torch.Tensor) -> torch.Tensor:
    """run_score of rows of the run's record (sum of ln(noise), count, sum in spreads, its mean's peak): the
    peak once the count is RUN_SETTLED, the mean in spreads before; -inf where the count is 0."""
    mean = torch.where(run[:, 1] > 0, run[:, 2] / run[:, 1].clamp_min(1.0), torch.full_like(run[:, 0], -math.inf))
    return torch.where(run[:, 1] >= RUN_SETTLED, run[:, 3], mean)


def run_noise(run: torch.Tensor) -> torch.Tensor:
    """run_noise of rows of the run's record: exp of the mean ln(noise); NaN where the count is 0."""
    mean = run[:, 0] / run[:, 1].clamp_min(1.0)
    return torch.where(run[:, 1] > 0, torch.exp(mean), torch.full_like(mean, math.nan))


def upper_spread(x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """MAD_SIGMA x the median excess over ``centre`` of the values of ``x`` above it (NaN: not counted), a
    robust standard deviation of that side; NaN when none is above."""
    return torch.where(x > centre, x - centre, torch.full_like(x, float("nan"))).nanmedian() * MAD_SIGMA


def log_spread(occ: torch.Tensor, eligible: torch.Tensor, median: torch.Tensor) -> torch.Tensor:
    """The spread of the log energy per lookup of the ``eligible`` rows above their median, the side the
    zombie rule reads: MAD_SIGMA x the median of ln(occ / median) over those rows. A standard deviation that
    the few outlying rows a rule looks for barely move; for symmetric log energies, that of the whole. A
    table that fits its data spreads its rows below the median wider (rows it memorises go quiet) than above
    it: measured on both sides, that width was read as the upper tail's (docs/embeddings.md). NaN without a
    positive median or a row above it."""
    logs = torch.where(eligible, (occ / median).log(), torch.full_like(occ, float("nan")))
    return torch.where(median > 0, upper_spread(logs, torch.zeros_like(median)), torch.full_like(median, float("nan")))


def score_spread(occ: torch.Tensor, num: torch.Tensor, den: torch.Tensor, eligible: torch.Tensor,
                 median: torch.Tensor) -> torch.Tensor:
    """The median zombie score (as the zombies are ranked) of the ``eligible`` rows and the spread of those
    above it: what the zombie rule reads a listed row's score against. Two NaN without a positive median."""
    score = torch.where(eligible, zombie_score(eligible, ratio(occ, median), ratio(num, den)),
                        torch.full_like(occ, float("nan")))
    centre = score.nanmedian()
    return torch.where(median > 0, torch.stack([centre, upper_spread(score, centre)]),
                       torch.full((2,), float("nan"), dtype=occ.dtype, device=occ.device))


def gram(x: torch.Tensor) -> torch.Tensor:
    """The smaller Gram matrix of the rows of ``x``: its eigenvalues are their squared singular values (a
    third of svdvals' time on 512 x 32 rows in float64, the same values to ~1e-8 of the largest)."""
    return x.T @ x if x.shape[0] >= x.shape[1] else x @ x.T


def effective_rank(x: torch.Tensor) -> torch.Tensor:
    """exp(entropy of the normalised singular values) of the rows of ``x`` (float64), Roy & Vetterli
    (2007), on x's device (no host sync)."""
    s = torch.linalg.eigvalsh(gram(x)).clamp_min(0.0).sqrt()
    p = s / s.sum().clamp_min(1e-30)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())


def rank_of(eigenvalues: list[float]) -> float:
    """effective_rank from the Gram matrix's eigenvalues on the host: the native report's, where a few
    float operations cost less than eight tensor ones."""
    s = [math.sqrt(max(v, 0.0)) for v in eigenvalues]
    total = max(math.fsum(s), 1e-30)
    return math.exp(-math.fsum(v / total * math.log(max(v / total, 1e-30)) for v in s))


def ema_scan(rate: torch.Tensor, y: torch.Tensor, x0: torch.Tensor, first: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Every x_j of x_j = (1 - rate_j) x_{j-1} + rate_j y_j along each row's run of consecutive entries
    (one column per entry), starting from x0 (given per entry; read at a run's first entry, where
    ``first`` is 1); a run (one row's touches) is at most n_steps long. An inclusive Hillis-Steele scan
    over the affine maps x -> c x + b: ceil(log2(n_steps)) rounds of three element-wise operations. The
    row's stored value is folded into its first entry, whose map becomes constant (c = 0), so that a
    combination reaching into the previous row multiplies it by 0: no segment masks, given finite
    values. The same products as the step-by-step update, in another order."""
    c = (1.0 - rate) * (1.0 - first)
    b = rate * y + (1.0 - rate) * first * x0
    b = torch.nan_to_num(b, nan=0.0, posinf=1e30, neginf=-1e30)  # finite, so that 0 * b is 0
    d = 1
    while d < n_steps:
        b[:, d:] += c[:, d:] * b[:, :-d]
        if 2 * d < n_steps:
            c[:, d:] = c[:, d:] * c[:, :-d]
        d *= 2
    return b


def fold_rows(e: torch.Tensor, count: torch.Tensor, old: torch.Tensor, seg: torch.Tensor, per_row: torch.Tensor,
              n_steps: int, k: int) -> torch.Tensor:
    """The new state rows of the rows a queue of tracked steps touched, every step applied in order.

    ``e``: one column per (row, step) entry, sorted by row then step, one row per quantity (the row's
    largest |element| after the step, the norm of its step, whether the step was measured, the gradient's
    largest |element|, then its k-wide sketch); ``count``: each entry's lookups; ``old``: the rows' stored
    state (one row each, in order); ``seg`` and ``per_row``: each entry's row and each row's entries
    (torch.unique_consecutive). Each statistic is a recurrence x_j = (1 - a_j) x_{j-1} + a_j y_j over a
    row's touches, solved for all rows at once by ema_scan."""
    E = e.shape[1]
    end = per_row.cumsum(0) - 1
    start = (end - per_row + 1).index_select(0, seg)  # per entry: where its row's run starts
    at = torch.arange(E, device=e.device)
    first = (at == start).float()
    old_e = old.index_select(0, seg).t()

    finite = torch.isfinite(e[0]) & torch.isfinite(e[3])
    fin = finite.float()
    cum = fin.cumsum(0)
    t = old_e[0] + cum - (cum - fin).index_select(0, start)  # a non-finite step keeps the row's statistics
    inv_t = 1.0 / t.clamp_min(1.0)
    # Running means until a row has 1/alpha observations, EMAs after, so that a rarely touched row is
    # not dominated by its first values.
    a_fast = inv_t.clamp_min(EMA_ALPHA) * fin
    a_slow = inv_t.clamp_min(SLOW_ALPHA) * fin
    # The first innovation is against a mean of one gradient: pairs count from the third touch.
    a_pair = (1.0 / (t - 2).clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (t >= 3))
    warm = t - 1.0 / EMA_ALPHA  # ||mean||^2 over the fast window, averaged once the window is full
    a_mean = (1.0 / warm.clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (warm >= 1))
    gs = torch.nan_to_num(e[4:] * fin, nan=0.0, posinf=0.0, neginf=0.0)
    m, inno, prev, last_fin = _innovations(gs, a_fast, old_e[8:8 + k], old_e[8 + k:], first, finite, start, at,
                                           n_steps)
    gn2 = gs.pow(2).sum(dim=0)
    targets = torch.stack([
        torch.nan_to_num(e[1], nan=0.0, posinf=0.0, neginf=0.0),
        (inno * prev).sum(dim=0),
        (inno.pow(2).sum(dim=0) * prev.pow(2).sum(dim=0)).sqrt(),
        gn2,
        m.pow(2).sum(dim=0),
        # Energy per lookup: a step's gradient sums one term per lookup, so ||g||^2 / lookups is what a
        # row's data says each time, comparable between popular and rare rows. (Only from the steps that
        # looked the row up here: one only other ranks looked up has no count to divide by.)
        gn2 / count.clamp_min(1.0),
    ])
    rates = torch.stack([a_fast * e[2], a_pair, a_pair, a_slow, a_mean, a_slow * (count > 0)])
    ema = ema_scan(rates, targets, old_e[1:7], first, n_steps)
    last_fin_row = last_fin.index_select(0, end)
    has_last = (last_fin_row >= start.index_select(0, end))[:, None]
    prev_row = torch.where(has_last, inno.index_select(1, last_fin_row.clamp_min(0)).t(), old[:, 8 + k:])
    return torch.cat([t.index_select(0, end)[:, None], ema.index_select(1, end).t(),
                      1.0 - fin.index_select(0, end)[:, None], m.index_select(1, end).t(), prev_row], dim=1)


def _innovations(gs: torch.Tensor, a_fast: torch.Tensor, old_m: torch.Tensor, old_prev: torch.Tensor,
                 first: torch.Tensor, finite: torch.Tensor, start: torch.Tensor, at: torch.Tensor,
                 n_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each entry's mean gradient after it (``m``), its innovation against the mean before it, the previous
    innovation it is correlated with, and the last finite entry up to it (for the stored one).

    Direction consistency is the correlation of the row's successive gradient steps around their recent
    mean (lag-1 autocorrelation of the innovations g_t - mean_{t-1}, as an EMA of inner products over an
    EMA of norm products: a magnitude-weighted mean cosine in [-1, 1]). Centred, so that a trend common to
    successive steps (a row still drifting towards its optimum) does not hide the reversals; on gradients,
    not the optimizer's deltas, since momentum (Adam's beta1 = 0.9) averages successive gradients and its
    deltas agree even when every gradient reverses the last one."""
    m = ema_scan(a_fast[None], gs, old_m, first, n_steps)
    m_before = torch.roll(m, 1, dims=1) * (1.0 - first) + old_m * first
    inno = gs - m_before
    # The previous innovation: that of the row's last finite touch before this one, else the stored one.
    last_fin = torch.cummax(torch.where(finite, at, torch.full_like(at, -1)), dim=0).values
    last_before = torch.roll(last_fin, 1, dims=0)
    has_prev = ((last_before >= start) & (first == 0)).float()
    prev = inno.index_select(1, last_before.clamp_min(0)) * has_prev + old_prev * (1.0 - has_prev)
    return m, inno, prev, last_fin
