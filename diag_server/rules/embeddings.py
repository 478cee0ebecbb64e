"""Embedding-table rules over the ``embeddings`` collection: zombie, dead and collapsed rows.

The probe sends, per table and report, a summary (counts, median update frequency, effective rank,
mean cosine) and the worst rows of each kind with their statistics (see schemas.EmbeddingSummary).
These rules apply their thresholds to those rows. The probe lists the worst 32 rows of each kind and
every further row past a floor below these rules' defaults, up to LISTED_MAX: the fraction of the table
they report is exact unless the list is full and every listed row qualifies, in which case it is a lower
bound (``fraction_is_lower_bound``).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, per_key

EVIDENCE_ROWS = 256  # row ids named in evidence, worst first
NAMED_KEPT = 1024  # row ids a table's zombie warnings have named in the run, kept in the rule's state
LISTED_MAX = 256  # the most rows the probe lists of a kind (probes/embeddings.py TOP_ROWS): a full list may be cut


def _tables(obs: Observations) -> list[tuple[int, str, dict]]:
    out = []
    for step, rows in obs.sampled("embeddings"):
        for r in rows:
            if r.get("embedding"):
                out.append((step, r["name"], r["embedding"]))
    return out


def report_gap(obs: Observations) -> int:
    """Steps between a batch's consecutive embedding reports, at least the sampling interval: the probe reports
    tables on a schedule of their own, and a condition held at consecutive reports held all along."""
    steps = sorted(step for step, _ in obs.sampled("embeddings"))
    return max([obs.interval, *(b - a for a, b in zip(steps, steps[1:]))])


def unused_tail(dead_ids: list, rows: int, never: int) -> int | None:
    """The first of the table's last ids when its rows never updated are exactly those (the report lists them
    lowest first, so the first listed is where they start): a table sized past the ids the data holds. None
    otherwise."""
    start = rows - never
    return start if never > 0 and dead_ids and int(dead_ids[0]) == start else None


def id_span(start: int, end: int) -> str:
    """Ids start..end as a message says them: '7', or '3-9'."""
    return f"{start}" if start == end else f"{start}-{end}"


def _by_chance(e: dict, row: dict) -> float | None:
    """Rows of the table expected by chance to stand as far out as a listed ``row``: its eligible rows' zombie
    scores (ln(noise) - consistency, as the probe ranks them) a normal of the reported median and spread above
    it. From the log energy per lookup alone (noise_spread) for a probe that sends no score spread; None
    without either (an older probe)."""
    if e.get("score_spread") and e.get("score_median") is not None:
        z = (math.log(max(row["noise"], 1e-6)) - row["consistency"] - e["score_median"]) / e["score_spread"]
    elif e.get("noise_spread"):
        z = math.log(row["noise"]) / e["noise_spread"]
    else:
        return None
    return (e.get("eligible_rows") or 0) * NormalDist().cdf(-z)


class ZombieEmbedding(Rule):
    name = "zombie_embedding"
    description = ("Rows updated often whose updates keep reversing: each lookup pulls the row harder than its "
                   "peers' lookups pull them, yet the pulls cancel over time (temporal SNR no higher than white "
                   "noise gives, successive gradients not agreeing), in consecutive reports. The row moves a lot "
                   "and learns nothing: conflicting or oscillating targets for that id (a warning) when more such "
                   "rows stand out than the table's spread gives by chance; else the table's noisiest rows, a "
                   "table starting to fit noise (info).")
    kinds = (AnomalyKind.zombie_embedding,)
    params = {
        "min_noise": Param(2.5, "measurement here (benchmarks/embeddings.py): on ML-100k, rows with toggling targets "
                           "sit at 3-8x the median per-lookup gradient energy once the model fits (Adam 1e-2), healthy "
                           "rows at 0.6-2x (5th-95th percentile)", "gradient energy per lookup, over the table's median, "
                           "at or above which a row's data keeps pulling it hard"),
        "max_chance": Param(0.5, "measurement here (benchmarks/embeddings.py, the rule replayed over the reports of 5 "
                            "seeds a regime, docs/embeddings.md): rows named by unplanted ML-100k runs that stand out "
                            "SGD 10 18-28 -> 0, Adam 1e-2 0-4 -> 0; users of a healthy 1M-row long-tailed table "
                            "100 -> 0; "
                            "(a)'s recall unchanged under SGD 10, Adam 1e-2 and Adam 1e-2 + wd. At 0.2 Adam 1e-2 + wd "
                            "loses 0.02-0.16 of (a)'s recall. Read on the zombie score above its median (2026-12-01): "
                            "(a) under Adam 1e-3 at 15 epochs 0.91-0.98 / 0.92-1.00 on either item table (was "
                            "0.76-1.00 recall), no new warning on unplanted runs",
                            "rows that the table's own spread of zombie scores above their median (score_spread, as "
                            "if normal; of the log energy per lookup, noise_spread, from a probe that sends no score "
                            "spread) "
                            "gives by chance, per row named: rows past the thresholds are zombies (a warning) where at "
                            "least 1 / max_chance times as many stand that far out as chance gives (the false "
                            "discovery rate of Benjamini & Hochberg, 1995), else the table's tail (info)"),
        "max_consistency": Param(0.0, "definition: a row whose successive gradients agree on average (> 0) is still "
                                 "drifting somewhere, not reversing; measurement here: toggling rows of ML-100k bias "
                                 "tables sit at -0.5 to -0.2", "direction consistency at or below which the row's "
                                 "updates do not agree"),
        "max_snr": Param(0.1, "definition: independent zero-mean gradients give snr = alpha / (2 - alpha) = 0.053 with the "
                         "probe's EMA (probes/embeddings.py NOISE_SNR); twice that still means noise dominates, as in "
                         "the variance-ratio test of Lo & MacKinlay (1988)", "temporal SNR at or below which the "
                         "row's gradient is noise"),
        "min_touch_ratio": Param(1.0, "issue 7 ('rows updated often'): at least as often as the table's median "
                                 "touched row", "a row must be updated at least this times the table's median "
                                 "touches to count"),
        "min_rows": Param(3, "measurement here: healthy ML-100k tables have 0-2 rows past the thresholds",
                          "zombie rows needed to report a table"),
        "min_median_touches": Param(50, "the probe's slow statistics average over ~100 touches (SLOW_ALPHA = 0.01); "
                                    "half a window is the least that separates reversal from early noise",
                                    "judge only once the table's median touched row has this many updates"),
        "reports": Param(2, "measurement here (docs/embeddings.md): on unplanted ML-100k under Adam 1e-2, healthy rows "
                         "crossing the thresholds for one report made 2-9 of 32 reports fire; in two consecutive "
                         "reports, 0-1, while planted zombies keep recall 0.94-0.96", "consecutive reports in which a "
                         "row must qualify (a row's EMAs cross a threshold now and then; a zombie's stay past it)"),
    }

    def _past_chance(self, rows: list[dict], e: dict) -> list[dict]:
        """Of ``rows`` (past the fixed thresholds), those that stand out of the table's spread: with N eligible
        rows and p the chance that a healthy row's zombie score lies as far above the median (a normal of the
        table's score_spread), the most extreme k rows for the largest k at which N x p of the k-th is at most
        max_chance x k (Benjamini-Hochberg). A wide table's tail, not its zombies, crosses a fixed ratio: ten
        thousand healthy rows put dozens past 2.5x the median. All of ``rows`` without a spread (an older probe)."""
        chance = [(_by_chance(e, r), i) for i, r in enumerate(rows)] if e.get("eligible_rows") else []
        if not chance or chance[0][0] is None:
            return rows
        chance.sort()
        k = max((j for j, (c, _) in enumerate(chance, 1) if c <= self.p.max_chance * j), default=0)
        named = {i for _, i in chance[:k]}
        return [r for i, r in enumerate(rows) if i in named]

    def _qualifying(self, e: dict) -> list[dict] | None:
        """The listed rows past every threshold, worst first; None before the table can be judged."""
        median = e.get("median_touches") or 0.0
        if median < self.p.min_median_touches:
            return None
        return [r for r in e.get("zombies") or []
                if r.get("noise") is not None and r["noise"] >= self.p.min_noise
                and r.get("consistency") is not None and r["consistency"] <= self.p.max_consistency
                and r.get("snr") is not None and r["snr"] <= self.p.max_snr
                and r["touches"] >= self.p.min_touch_ratio * median]

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        # Per table, the qualifying row ids of its last reports (state: JSON-able, kept across batches), and
        # every row a warning has named in the run: a zombie's statistics hover about the thresholds, so the
        # rows one report names are not all the rows the fault has shown.
        recent: dict[str, list[list[int]]] = state.setdefault("recent", {})
        named: dict[str, list[int]] = state.setdefault("named", {})
        keep = max(int(self.p.reports) - 1, 0)
        reports: list[tuple[str, int, dict, list[dict], int]] = []  # each report, its confirmed and qualifying rows
        for step, name, e in _tables(obs):
            now = self._qualifying(e)
            if now is None:
                recent.pop(name, None)
                continue
            before = [set(ids) for ids in recent.get(name, [])[-keep:]] if keep else []
            confirmed = [r for r in now if all(r["row"] in ids for ids in before)] if len(before) == keep else []
            if keep:
                recent[name] = (recent.get(name, []) + [sorted(r["row"] for r in now)])[-keep:]
            reports.append((name, step, e, confirmed, len(now)))
        out = []
        for name, step, e, confirmed, qualifying in reports:
            if len(confirmed) < self.p.min_rows:
                continue
            standing = self._past_chance(confirmed, e)
            zombies = len(standing) >= self.p.min_rows
            bad = standing if zombies else confirmed
            least = min(r["noise"] for r in bad)
            chances = [_by_chance(e, r) for r in bad]  # None for every row, or for none
            chance = None if chances[0] is None else max(chances)  # rows as far out as the least of them
            listed = e.get("zombies") or []
            rows = max(e.get("rows") or 1, 1)
            fraction = len(bad) / rows
            lower = len(bad) == len(confirmed) and qualifying == len(listed) and len(listed) >= LISTED_MAX
            worst = bad[0]
            count = f"{len(bad)}{'+' if lower else ''} rows of '{name}' ({100 * fraction:.2g}% of the table)"
            pulls = (f"each lookup pulls them {worst['noise']:.1f}x harder than the median row and the pulls cancel "
                     f"(worst: row {worst['row']}, consistency {worst['consistency']:.2f}, SNR {worst['snr']:.2g})")
            if zombies:
                severity = Severity.warning if fraction < 0.01 else Severity.critical
                message = (f"{count} are updated often but learn nothing: {pulls}"
                           + (f"; the table's spread of zombie scores gives {chance:.2g} rows as far out as the least "
                              "of them by chance" if chance is not None else "")
                           + ". Look for conflicting targets for these ids (labels that disagree, a broken join), "
                             "or a step too large for these rows (an adaptive optimizer's normalised step overshoots "
                             "on rows it updates rarely: a lower learning rate for the table); damping their updates "
                             "(embedding_grad_scale) helps either way. The table's 'conflicted' rows (get_embeddings) "
                             "are those whose data has pulled them hardest over the whole run, fitted since or not.")
            else:  # as many as the table's spread gives: its tail, not ids of their own
                severity = Severity.info
                message = (f"{count} learn nothing: {pulls}. A table of this spread of zombie scores has "
                           f"{chance:.2g} rows as far out by chance: they are its tail, not ids with conflicting targets. "
                           "A table whose noisiest rows learn nothing has started fitting noise: if the validation "
                           "loss rises, damping them (embedding_grad_scale over the table) helps.")
            ids = [float(r["row"]) for r in bad[:EVIDENCE_ROWS]]
            so_far = named.get(name, [])
            if zombies:
                so_far = named[name] = sorted(set(so_far) | {int(r["row"]) for r in bad})[:NAMED_KEPT]
            out.append(Finding(
                AnomalyKind.zombie_embedding, severity, step, key=name, tensors=[name], message=message,
                evidence={"table": name, "rows": ids, "zombie_rows": len(bad), "fraction": fraction,
                          "fraction_is_lower_bound": lower, "table_rows": e.get("rows"),
                          "stand_out": zombies, "past_thresholds": len(confirmed),
                          "worst_row": worst["row"], "worst_noise": worst["noise"],
                          "worst_consistency": worst["consistency"], "worst_snr": worst["snr"],
                          "median_touches": e.get("median_touches"), "reports": int(self.p.reports),
                          "noise": [r["noise"] for r in bad[:EVIDENCE_ROWS]],
                          "consistency": [r["consistency"] for r in bad[:EVIDENCE_ROWS]],
                          "snr": [r["snr"] for r in bad[:EVIDENCE_ROWS]],
                          "min_noise": self.p.min_noise, "least_noise": least, "noise_spread": e.get("noise_spread"),
                          "score_median": e.get("score_median"), "score_spread": e.get("score_spread"),
                          "expected_by_chance": chance, "max_chance": self.p.max_chance,
                          "rows_named_in_run": [float(r) for r in so_far[:EVIDENCE_ROWS]],
                          "rows_named_in_run_count": len(so_far),
                          "max_consistency": self.p.max_consistency, "max_snr": self.p.max_snr}))
        return per_key(out, report_gap(obs))


class DeadEmbedding(Rule):
    name = "dead_embedding"
    description = ("Rows never or almost never updated once the table's typical row has been updated many "
                   "times: cold-start ids, ids the data never reaches, or broken negative sampling. A row is "
                   "updated when the model looks it up and it gets a gradient, so a whole-table L2 penalty does "
                   "not hide dead rows; rows gone NaN are non-finite, not dead. In a table tied to another "
                   "module's parameter (an output projection), or whose weight learns outside its lookups (an "
                   "output matrix, as in a full softmax over its ids), such rows still learn there: an info. So is "
                   "a table whose rows never updated are exactly its last ids (positions past the longest "
                   "sequence, a vocabulary padded to a round size): it is sized past the ids the data holds.")
    kinds = (AnomalyKind.dead_embedding,)
    params = {
        "min_median_touches": Param(10, "measurement here: by the time the median row has 10 updates, every id "
                                    "present in ML-100k's training split has at least one", "judge only once the "
                                    "table's median touched row has this many updates"),
        "rare_ratio": Param(0.01, "measurement here: the rarest ids present in ML-100k's training split are updated "
                            "at ~4% of the median rate", "rows updated less than this fraction of the median count "
                            "as almost never updated"),
        "warn_fraction": Param(0.01, "measurement here", "dead fraction at which severity rises from info to warning"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out = []
        for step, name, e in _tables(obs):
            median = e.get("median_touches")
            if median is None or median < self.p.min_median_touches:
                continue
            rare = [r for r in (e.get("rarest") or []) if r["touches"] < self.p.rare_ratio * median]
            never = e.get("never_updated") or 0
            dead = never + len(rare)
            if dead == 0:
                continue
            rows = max(e.get("rows") or 1, 1)
            fraction = dead / rows
            ids = [float(i) for i in (e.get("dead_ids") or [])] + [float(r["row"]) for r in rare]
            lower = len(rare) == len(e.get("rarest") or []) >= LISTED_MAX
            nonfinite = e.get("nonfinite_rows") or 0
            tied = e.get("tied_to") or []
            outside = bool(e.get("learns_outside_lookups"))
            # The rows never updated are exactly the table's last ids: a table sized past the ids the data
            # holds, by design.
            past = not rare and unused_tail(e.get("dead_ids") or [], rows, never) is not None
            # A tied table's rows learn through the tied parameter (as outputs), and so do those of a weight used
            # outside its lookups (rows not looked up had a gradient): rows never looked up are ids the inputs do
            # not hold, not rows that never learn.
            learns = bool(tied) or outside
            severity = Severity.warning if fraction >= self.p.warn_fraction and not (learns or past) else Severity.info
            verb = "looked up" if learns else "updated"
            if tied:
                why = (f"The table is tied to {', '.join(repr(t) for t in tied)}, through which these rows still "
                       "learn (as outputs): ids the inputs never hold, such as vocabulary the data does not use.")
            elif outside:
                why = ("Rows not looked up had a gradient: the table's weight also learns outside its lookups (an "
                       "output matrix, as in a full softmax over its ids, or a functional call), where these rows "
                       "still learn: ids the inputs never hold, not rows that learn nothing.")
            elif past:
                why = (f"They are the table's last {'id' if never == 1 else 'ids'} ({id_span(rows - never, rows - 1)}), "
                       "none below: the table is "
                       "sized past the ids the data holds (positions beyond the longest sequence, a vocabulary padded "
                       "to a round size, ids added after the data was made). Nothing to fix unless ids in that "
                       "range should occur.")
            else:
                why = "Cold-start ids, ids missing from the data, or broken negative sampling."
            message = (f"{dead} {'row' if dead == 1 else 'rows'} of '{name}' ({100 * fraction:.2g}% of the table) "
                       f"{'was' if dead == 1 else 'were'} never or almost never "
                       f"{verb} in {e.get('tracked_steps')} tracked steps, while the median row was {verb} "
                       f"{median:.0f} times (first: rows {', '.join(str(int(i)) for i in ids[:5])}). " + why
                       + (f" {nonfinite} rows hold NaN/Inf: those are non-finite, not dead." if nonfinite else ""))
            out.append(Finding(
                AnomalyKind.dead_embedding, severity, step, key=name, tensors=[name], message=message,
                evidence={"table": name, "rows": ids[:EVIDENCE_ROWS], "dead_rows": dead, "never_updated": never,
                          "rare_rows": len(rare), "fraction": fraction, "fraction_is_lower_bound": lower,
                          "table_rows": e.get("rows"), "median_touches": median,
                          "tracked_steps": e.get("tracked_steps"), "nonfinite_rows": nonfinite, "tied_to": tied,
                          "learns_outside_lookups": outside, "past_data_range": past}))
        return per_key(out, report_gap(obs))


class EmbeddingCollapse(Rule):
    name = "embedding_collapse"
    description = ("Rows of a table collapsing together: the effective rank of a sample of touched rows falls to "
                   "a small fraction of its dimension, or their mean pairwise cosine approaches 1. The table can no "
                   "longer tell its ids apart.")
    kinds = (AnomalyKind.embedding_collapse,)
    params = {
        "min_rank_ratio": Param(0.1, "effective rank of Roy & Vetterli (2007); measurement here: healthy ML-100k "
                                "32-dim tables stay above 0.5 of their width", "effective rank / min(rows sampled, dim) "
                                "below which the table has collapsed"),
        "max_mean_cosine": Param(0.8, "measurement here: healthy ML-100k tables stay below 0.3; cf. the 'dimensional "
                                 "collapse' of Jing et al. (ICLR 2022)", "mean pairwise cosine above which rows have "
                                 "collapsed onto one direction"),
        "min_sampled_rows": Param(32, "measurement here", "rows that must be sampled for a verdict"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out = []
        for step, name, e in _tables(obs):
            n = e.get("sampled_rows") or 0
            rank, cos = e.get("effective_rank"), e.get("mean_cosine")
            if n < self.p.min_sampled_rows or rank is None or cos is None:
                continue
            width = max(min(n, e.get("dim") or 1), 1)
            ratio = rank / width
            if ratio >= self.p.min_rank_ratio and cos <= self.p.max_mean_cosine:
                continue
            out.append(Finding(
                AnomalyKind.embedding_collapse, Severity.warning, step, key=name, tensors=[name],
                message=(f"Rows of '{name}' are collapsing together: effective rank {rank:.2g} of {width} "
                         f"({100 * ratio:.2g}%), mean pairwise cosine {cos:.2f} over {n} sampled rows. Check for a "
                         "missing normalisation, a too-strong shared gradient, or negatives that are too easy."),
                evidence={"table": name, "effective_rank": rank, "rank_ratio": ratio, "mean_cosine": cos,
                          "sampled_rows": n, "fraction": 1.0, "table_rows": e.get("rows"),
                          "min_rank_ratio": self.p.min_rank_ratio, "max_mean_cosine": self.p.max_mean_cosine}))
        return per_key(out, report_gap(obs))
