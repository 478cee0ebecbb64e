"""The report a table sends: its summary packed into one float64 tensor (one host copy), and its decoding.

A report costs O(rows touched since the last report + TOP_ROWS + SAMPLE_ROWS): counters are kept as rows
change, the worst-row lists are re-ranked over the rows that changed plus the previous lists (a row
nobody touched kept its statistics), medians and the collapse statistics come from a fixed random sample
of rows, and the list of never-updated rows is refilled by a forward scan that is never repeated. A
natively tracked table is summarised by the kernel (``report_rows``: the same lists and counts); the
torch operations here gather each set of rows once, ~60 operations a table. Ties go to the lower row id.

Layout of the packed tensor (see decode): 12 scalars, the non-finite ids, the zombies' ids and five
columns, the rarest's, the collapse statistics (3), the dead ids, whether rows not looked up had a
gradient (1, 0; NaN: not checked, TableState.look_outside), the conflicted rows' ids and five columns.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import maths
from .constants import (COLLAPSE_SAMPLE, CONFLICT_FLOOR, LISTED_ROWS, MAD_SIGMA, MIN_TOUCHES, RARE_FLOOR,
                        RUN_SETTLED, TOP_ROWS, ZOMBIE_FLOOR)
from .native import kernel, kernel_reads

if TYPE_CHECKING:
    from .state import TableState

# A listed row's fields, in the order of the report's six columns (see pack).
ROW_KEYS = ("row", "touches", "velocity", "consistency", "snr", "noise")


def pack(table: TableState, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The table's summary as one float64 tensor and the plan that decodes it (how many rows each list
    holds). ``sampled``: TableState.snapshot() taken at the report's step (else the rows are read now).
    Updates the table's lists, medians, run record and window: the next report starts from them."""
    if table.native and kernel_reads(table.weight):
        return pack_native(table, sampled)
    dev, w, f64 = table.weight.device, table.weight.detach(), torch.float64
    window = table.changed.n
    win = table.changed.take()
    k = min(TOP_ROWS, table.rows)
    ss = table.refresh_medians()
    t, bad, cols, zpos, rpos = _rank_lists(table, win, k)
    # The fixed sample: the share of eligible rows with negative consistency, the spread of their
    # energy per lookup, and the collapse.
    el = (ss[0] >= MIN_TOUCHES) & ~(ss[7] > 0)
    neg = torch.stack([(el & (ss[2] < 0)).sum(), el.sum()])  # consistency < 0: its numerator < 0
    el_measured = el & maths.measured(ss[6])
    spread = maths.log_spread(ss[6], el_measured, table.occ_median)
    scores = maths.score_spread(ss[6], ss[2], ss[3], el_measured, table.occ_median)
    rank, cosine, sampled = _collapse(table, sampled, (ss[0] > 0) & ~(ss[7] > 0))
    nf = table.nonfinite_ids.numel()
    if nf:  # on the worker, read a step or two after the report's step: a row gone NaN or inf stays so
        vals = w.index_select(0, table.nonfinite_ids)
        bad_stats = torch.stack([(t[bad][:k] == 0).sum(), torch.isnan(vals).sum(), torch.isinf(vals).sum()])
    else:
        bad_stats = torch.zeros(3, dtype=torch.long, device=dev)
    parts = [torch.cat([table.counts, neg]).to(f64), table.touch_median.to(f64)[None], bad_stats.to(f64),
             spread.to(f64)[None], scores.to(f64), table.nonfinite_ids.to(f64),
             table.zombie_ids.to(f64), cols.index_select(1, zpos).to(f64).reshape(-1),
             table.rare_ids.to(f64), cols.index_select(1, rpos).to(f64).reshape(-1),
             torch.stack([rank, cosine, sampled]).to(f64), table.dead_ids.to(f64)]
    seen = table.outside_verdict()
    parts.append(torch.full((1,), math.nan, dtype=f64, device=dev) if seen is None else seen.to(f64)[None])
    conflicts, nc = _conflicts(table, win, k, spread)
    parts.append(conflicts)
    plan = {"window": window, "dead": table.dead_ids.numel(), "nonfinite": nf,
            "zombies": zpos.numel(), "rarest": rpos.numel(), "conflicted": nc}
    return torch.cat(parts), plan


def _rank_lists(table: TableState, win: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Re-rank the zombie, rarest and non-finite lists over the rows that changed and the previous lists
    (every candidate's statistics in one gather), and refill the dead list. Returns the candidates'
    touches, non-finite flags and five columns, and the positions of the zombies and rarest among them."""
    dev, inf = table.weight.device, float("inf")
    cand = torch.unique(torch.cat([win, table.zombie_ids, table.rare_ids, table.nonfinite_ids]))
    c = table.state[:, :8].index_select(0, cand).t()
    t, bad = c[0], c[7] > 0
    cols = torch.stack([t, c[1], maths.ratio(c[2], c[3]), maths.snr(c[4], c[5]), maths.ratio(c[6], table.occ_ref())])
    often = (t > 0) & (t >= torch.nan_to_num(table.touch_median, nan=inf))  # as the table's median row
    zkey = maths.zombie_score(often & (t >= MIN_TOUCHES) & ~bad & maths.measured(c[6]), cols[4], cols[2])
    zpos = maths.ranked(zkey, k, True, torch.tensor(ZOMBIE_FLOOR, dtype=zkey.dtype, device=dev))
    rpos = maths.ranked(torch.where((t > 0) & ~bad, t, inf), k, False,
                        (RARE_FLOOR * table.touch_median).to(t.dtype))
    table.zombie_ids, table.rare_ids = cand.index_select(0, zpos), cand.index_select(0, rpos)
    table.nonfinite_ids = cand[bad][:k]
    _refill_dead(table, k)
    return t, bad, cols, zpos, rpos


def _conflicts(table: TableState, win: torch.Tensor, k: int, spread: torch.Tensor) -> tuple[torch.Tensor, int]:
    """After the medians: add each row of the window (updated since the last report) that is eligible, with
    its energy measured, its ln(noise) to the run's record, and the same over the report's ``spread``
    (noise_spread; none when it is not finite and positive), raising run_score's peak once RUN_SETTLED
    readings are in; then rank the window and the previous list by conflict_score, as the zombies are: of
    the finite rows updated at least as often as the median row (a rarer row's energy is averaged over
    fewer lookups, and the model has fitted it less), the worst LISTED_ROWS, and further ones up to ``k``
    while at least CONFLICT_FLOOR. Returns the packed ids and five columns (touches, noise, run_noise,
    run_score, reports), and how many rows. ~20 operations over the window and the list, on the table's
    device; reading the list's length is a host sync on CUDA, as the other lists' are."""
    st = table.row_state
    c = st.index_select(0, win)
    ref = table.occ_ref()
    ok = ((c[:, 0] >= MIN_TOUCHES) & ~(c[:, 7] > 0) & maths.measured(c[:, 6]) & torch.isfinite(ref)
          & (spread > 0) & torch.isfinite(spread))
    ln = torch.log(maths.ratio(c[:, 6], ref).clamp_min(1e-6))
    zero = torch.zeros_like(ln)
    add = torch.stack([torch.where(ok, ln, zero), ok.to(ln.dtype), torch.where(ok, ln / spread, zero)], dim=1)
    run = table.run_record.index_select(0, win)
    run[:, :3] += add  # the window holds each row once
    mean = run[:, 2] / run[:, 1].clamp_min(1.0)
    run[:, 3] = torch.where(ok & (run[:, 1] >= RUN_SETTLED), torch.maximum(run[:, 3], mean), run[:, 3])
    table.run_record.index_copy_(0, win, run)
    cand = torch.unique(torch.cat([win, table.conflicted_ids]))
    score = maths.conflict_score(table.run_record.index_select(0, cand))
    cs = st.index_select(0, cand)
    often = (cs[:, 0] >= torch.nan_to_num(table.touch_median, nan=math.inf)) & ~(cs[:, 7] > 0)
    pos = maths.ranked(torch.where(often, score, torch.full_like(score, -math.inf)), k, True, CONFLICT_FLOOR)
    ids = table.conflicted_ids = cand.index_select(0, pos)
    rows, run = st.index_select(0, ids), table.run_record.index_select(0, ids)
    cols = torch.stack([rows[:, 0], maths.ratio(rows[:, 6], ref), maths.run_noise(run), maths.conflict_score(run),
                        run[:, 1]])
    return torch.cat([ids.to(torch.float64), cols.to(torch.float64).reshape(-1)]), ids.numel()


def pack_native(table: TableState, sampled: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
    """pack() by the kernel: its lists, counts and collapse statistics in one call (report_rows, the same
    ranking), but for the effective rank's eigenvalues. O(SAMPLE_ROWS + candidates x log TOP_ROWS), a few
    operations."""
    k = min(TOP_ROWS, table.rows)
    z, r, nf, dead, cl = table.list_storage  # the five lists view these (the torch report never ran here)
    window, table.changed.n = table.changed.n, 0  # the kernel clears the window's flags: it starts again empty
    out = torch.empty(16 + 20 * k, dtype=torch.float64)
    # The collapse statistics' rows, as float64 (the kernel copies them in and sums their unit vectors).
    x = table.collapse_rows
    if x is None and table.dim >= 4:
        x = table.collapse_rows = torch.empty(min(COLLAPSE_SAMPLE, table.sample.numel()), table.dim,
                                              dtype=torch.float64)
    state, changed = table.row_state, table.changed
    nz, nr, nnf, nd, table.dead_scan, touch_median, occ_median, m, nc = kernel().report_rows(
        state.data_ptr(), state.shape[1], table.rows, table.dim, table.weight.data_ptr(),
        changed.flags.data_ptr(), table.counts.data_ptr(), changed.ids.data_ptr(), window,
        z.data_ptr(), table.zombie_ids.numel(), r.data_ptr(), table.rare_ids.numel(),
        nf.data_ptr(), table.nonfinite_ids.numel(), dead.data_ptr(), table.dead_ids.numel(),
        table.sample.data_ptr(), table.sample.numel(), table.padding.data_ptr(),
        table.padding.numel(), k, table.dead_scan, MIN_TOUCHES, MAD_SIGMA, out.data_ptr(),
        0 if x is None else x.data_ptr(), 0 if x is None else x.shape[0], LISTED_ROWS, ZOMBIE_FLOOR, RARE_FLOOR,
        table.run_record.data_ptr(), cl.data_ptr(), table.conflicted_ids.numel(), RUN_SETTLED, CONFLICT_FLOOR)
    table.zombie_ids, table.rare_ids, table.nonfinite_ids, table.dead_ids = z[:nz], r[:nr], nf[:nnf], dead[:nd]
    table.conflicted_ids = cl[:nc]
    table.touch_median, table.occ_median = torch.tensor(touch_median), torch.tensor(occ_median)
    at = 12 + nnf + 6 * (nz + nr)
    if m >= 2:  # the kernel wrote the mean cosine and the rows; the rank, from the rows' eigenvalues
        out[at] = maths.rank_of(torch.linalg.eigvalsh(maths.gram(x[:m])).tolist())
    seen = table.outside_verdict()
    out[at + 3 + nd] = math.nan if seen is None else float(seen)
    plan = {"window": window, "dead": nd, "nonfinite": nnf, "zombies": nz, "rarest": nr, "conflicted": nc}
    return out[:at + 4 + nd + 6 * nc], plan


def _refill_dead(table: TableState, k: int, chunk: int = 1 << 16) -> None:
    """Lowest-id finite rows never updated. A row once updated never becomes dead again, so the list only
    shrinks and is refilled by one forward scan over the ids: O(rows) once, not per report."""
    dev = table.weight.device
    ids = table.dead_ids
    if ids.numel():
        d = table.state.index_select(0, ids)
        ids = ids[(d[:, 0] == 0) & ~(d[:, 7] > 0)]
    while ids.numel() < k and table.dead_scan < table.rows:
        lo, hi = table.dead_scan, min(table.dead_scan + chunk, table.rows)
        span = torch.arange(lo, hi, device=dev)
        ok = (table.touches[lo:hi] == 0) & ~(table.state[lo:hi, 7] > 0)
        if table.padding.numel():
            ok &= ~torch.isin(span, table.padding)
        found = span[ok][: k - ids.numel()]
        ids = torch.cat([ids, found])
        table.dead_scan = int(found[-1]) + 1 if ids.numel() >= k and found.numel() else hi
    table.dead_ids = ids


def _collapse(table: TableState, sampled: torch.Tensor | None,
              ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Effective rank and mean pairwise cosine of up to COLLAPSE_SAMPLE of the sampled rows (``ok``: which
    of them were updated and are finite), and how many rows they are over."""
    dev = table.weight.device
    nan = torch.tensor(float("nan"), device=dev)
    if table.dim < 4:
        return nan, nan, torch.zeros((), device=dev)
    x = (table.weight.detach().index_select(0, table.sample) if sampled is None else sampled)[ok][:COLLAPSE_SAMPLE]
    x = x[torch.isfinite(x).all(dim=1)].float()  # a row can go NaN without a touch (dense optimizer state)
    m = x.shape[0]
    if m < 2:
        return nan, nan, torch.tensor(float(m), device=dev)
    g = x.double()
    xn = g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
    cos = ((xn.sum(dim=0).pow(2).sum() - m) / (m * (m - 1)))
    return maths.effective_rank(g), cos, torch.tensor(float(m), device=dev)


def listed_rows(raw: list[float], start: int, n: int) -> list[dict]:
    """The ``n`` listed rows whose six columns (ROW_KEYS) start at ``raw[start]``, as the event's dicts: row
    ids and touches as ints, a non-finite statistic as None (by the kernel's row_dicts where it is built)."""
    native = kernel()
    if native is not None:
        return native.row_dicts(raw, start, n, ROW_KEYS)
    isfinite = math.isfinite
    cols = [raw[start + c * n:start + (c + 1) * n] for c in range(6)]
    if all(isfinite(sum(c)) for c in cols[2:]):  # as the listed rows' statistics always are: no checks per row
        return [{"row": int(i), "touches": int(t), "velocity": v, "consistency": c, "snr": s, "noise": x}
                for i, t, v, c, s, x in zip(*cols)]
    return [{"row": int(i), "touches": int(t), "velocity": v if isfinite(v) else None,
             "consistency": c if isfinite(c) else None, "snr": s if isfinite(s) else None,
             "noise": x if isfinite(x) else None}
            for i, t, v, c, s, x in zip(*cols)]


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def decode(name: str, table: TableState, raw: list[float], plan: dict, tracked_steps: int) -> dict:
    """One table's row of the report's ``tensor_stats`` event, from its packed values (pack's layout) and
    plan; its ``embedding`` field is an EmbeddingSummary (schemas/events.py). ``table``: the TableState
    (its shape and flags; a table seen learning outside its lookups is marked so from here on)."""
    touched, nonfinite, eligible, neg_sample, eligible_sample, median, untouched_bad, nan_count, inf_count = raw[:9]
    spread, score_median, score_spread = raw[9:12]
    at = 12

    def take(n: int) -> list[float]:
        nonlocal at
        at += n
        return raw[at - n:at]

    nf_idx = take(plan["nonfinite"])
    z_at, r_at = at, at + 6 * plan["zombies"]
    at = r_at + 6 * plan["rarest"]
    rank, cosine, sampled = take(3)
    dead_idx = take(plan["dead"])
    if take(1)[0] == 1.0:  # rows not looked up had a gradient (see TableState.look_outside)
        table.outside = True
    nc = plan["conflicted"]
    conflicted_ids, touches, noise, run_noise, run_score, reports = (take(nc) for _ in range(6))
    summary = {
        "rows": table.rows, "dim": table.dim, "sparse": table.sparse, "tracked_steps": tracked_steps,
        "touched_rows": int(touched), "window_touched_rows": plan["window"],
        "never_updated": table.rows - int(touched) - int(untouched_bad) - table.padding.numel(),
        "nonfinite_rows": int(nonfinite), "median_touches": _num(median), "eligible_rows": int(eligible),
        # estimated from the fixed sample of rows
        "negative_consistency_rows": round(neg_sample / max(eligible_sample, 1.0) * eligible),
        "noise_spread": _num(spread), "score_median": _num(score_median), "score_spread": _num(score_spread),
        "effective_rank": _num(rank), "mean_cosine": _num(cosine), "sampled_rows": int(sampled),
        "zombies": listed_rows(raw, z_at, plan["zombies"]),
        "rarest": listed_rows(raw, r_at, plan["rarest"]),
        "dead_ids": [int(i) for i in dead_idx],
        "nonfinite_ids": [int(i) for i in nf_idx],
        "conflicted": [{"row": int(i), "touches": int(t), "noise": _num(x), "run_noise": _num(r),
                        "run_score": _num(z), "reports": int(n)}
                       for i, t, x, r, z, n in zip(conflicted_ids, touches, noise, run_noise, run_score, reports)],
    }
    if table.tied:
        summary["tied_to"] = list(table.tied)
    if table.outside:
        summary["learns_outside_lookups"] = True
    return {"name": name, "numel": table.rows * table.dim, "nan_count": int(nan_count),
            "inf_count": int(inf_count), "embedding": summary}
