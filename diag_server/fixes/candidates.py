"""Fix candidates: what a proposal is, the helpers that read the run's history for one, and the
proposers of the step-size and embedding faults (the others: proposers.py, state.py, distributed.py).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any


from schemas.enums import AnomalyKind, FixAction
from schemas.records import Anomaly

from ..rules.base import median
from ..rules.embeddings import id_span
from ..rules.gradients import global_norm


@dataclass
class Candidate:
    action: FixAction
    params: dict[str, Any]
    rationale: str
    expected_effect: str
    risk: str = "low"
    live: bool = True
    # False for a fix that cannot repair what the fault left in the run's state (a rate change after the
    # weights went NaN or an adaptive optimizer's moments took a spike): ranked after every one that can.
    repairs: bool = True


# -- what the run's history says ---------------------------------------------------------------------
def _healthy_grad_norm(conn: sqlite3.Connection, run: str, before_step: int) -> float | None:
    """Median global gradient norm over the samples before the anomaly began."""
    rows = conn.execute("SELECT step, norm, tensor FROM stats WHERE run=? AND collection='gradients' AND step<? "
                        "ORDER BY step DESC LIMIT 2000", (run, before_step)).fetchall()
    by_step: dict[int, list[dict]] = {}
    for step, norm, tensor in rows:
        by_step.setdefault(step, []).append({"name": tensor, "norm": norm})
    norms = [g for g in (global_norm(v) for v in by_step.values()) if g is not None]
    return median(norms[:20]) if norms else None


def _lr_history(conn: sqlite3.Connection, run: str, upto: int) -> tuple[float | None, float | None, int | None]:
    """(lr before the latest change, lr now, step of the change) for param group 0."""
    rows = conn.execute("SELECT step, value FROM scalars WHERE run=? AND name='lr/group0' AND step<=? ORDER BY step",
                        (run, upto)).fetchall()
    if not rows:
        return None, None, None
    now = rows[-1][1]
    for step, value in reversed(rows):
        if value is not None and now is not None and abs(value - now) > 1e-12 * max(abs(now), 1e-30):
            return value, now, step
    return None, now, None


def lr_rise(conn: sqlite3.Connection, run: str, upto: int, lookback: int) -> tuple[int, float, float] | None:
    """(step, old rate, new rate) of the first rise of the learning rate within ``lookback`` steps up to
    ``upto``: the first step at the new rate (the rate is sampled, so the step after the last sample at the
    old one). A rise is more than 1.5x: a schedule's steps are smaller."""
    lrs = conn.execute("SELECT step, value FROM scalars WHERE run=? AND name='lr/group0' AND rank=0 AND step BETWEEN ? "
                       "AND ? AND value IS NOT NULL ORDER BY step", (run, upto - lookback, upto)).fetchall()
    for (s0, v0), (_, v1) in zip(lrs, lrs[1:]):
        if v1 > v0 * 1.5:
            return s0 + 1, v0, v1
    return None


def fault_step(conn: sqlite3.Connection, run: str, first_step: int, evidence: dict, interval: int) -> int:
    """The step a fault began at, as far as an anomaly and the run's history tell: the anomaly's own fault
    step when it names one (training_stalled); else a learning-rate rise up to 5 sampling intervals before
    the first warning of that stretch (the rise is the fault); else that warning's first step less one
    interval (a rule sees a fault up to one sample after it began). The first warning is the earliest of the
    run's warnings opened up to 5 intervals before the anomaly: the fault's first symptom."""
    named = evidence.get("fault_step")
    lookback = 5 * interval
    if isinstance(named, int) and not isinstance(named, bool):
        # A rule that names the fault reads it off the loss, which moves a few steps after a rise of the rate.
        rise = lr_rise(conn, run, named, lookback)
        return min(named, rise[0]) if rise else named
    row = conn.execute("SELECT min(first_step) FROM anomalies WHERE run=? AND severity IN ('warning', 'critical') "
                       "AND first_step BETWEEN ? AND ?", (run, first_step - lookback, first_step)).fetchone()
    onset = min(row[0], first_step) if row and row[0] is not None else first_step
    rise = lr_rise(conn, run, onset, lookback)
    return rise[0] if rise else max(onset - interval, 0)


def _lr_fix(conn: sqlite3.Connection, a: Anomaly, severity_ratio: float | None) -> Candidate:
    prev, now, changed_at = _lr_history(conn, a.run, a.last_step)
    if prev is not None and now is not None and now > prev:
        return Candidate(FixAction.set_lr, {"lr": prev},
                         f"The learning rate was raised from {prev:.3g} to {now:.3g} shortly before step "
                         f"{a.first_step} (last seen at {prev:.3g} at step {changed_at}); the run was healthy at the "
                         "old rate.", "Restores the rate the run was healthy at; the loss should fall again within "
                         "a few sampling intervals.", "low")
    factor = 0.1 if severity_ratio is None else min(max(1.0 / severity_ratio ** 0.5, 0.01), 0.5)
    factor = float(f"{factor:.2g}")
    return Candidate(FixAction.lr_scale, {"factor": factor},
                     (f"Scale the learning rate by {factor} (1/sqrt of the {severity_ratio:.3g}x growth, bounded to "
                      "[0.01, 0.5])" if severity_ratio else f"Scale the learning rate by {factor}")
                     + " so updates shrink back to the size the run tolerated.",
                     "Smaller steps; the loss should stop rising within a few sampling intervals.", "medium")


def _clip_fix(conn: sqlite3.Connection, a: Anomaly) -> Candidate | None:
    healthy = _healthy_grad_norm(conn, a.run, a.first_step)
    if healthy is None:
        return None
    max_norm = float(f"{2 * healthy:.3g}")
    return Candidate(FixAction.grad_clip, {"max_norm": max_norm},
                     f"Clip the global gradient norm at {max_norm} (2x the healthy median {healthy:.3g} "
                     f"measured before step {a.first_step}).",
                     "Caps each update at twice its healthy size; spikes can no longer throw the weights off.", "low")


# A relative clip clips at this many times the running median of the gradient norm. AutoClip
# (Seetharaman et al., MLSP 2020) clips at the 10th percentile of the norms seen; the median is milder and
# was enough here. On the repair suite's corrupt-label fault (a torch-only replay, seeds 0-2, the clip and
# the rollback behind it applied 235 steps after the first spike) it ends 5-7% above the healthy run's
# final loss, where a fixed clip at 2x the healthy median ends 13-18% above: the healthy norm falls by a
# third over the run (0.92 -> 0.63), and a fixed threshold lets more of each spike through (measurement here).
RELATIVE_CLIP = 1.0


def _relative_clip_fix(conn: sqlite3.Connection, a: Anomaly) -> Candidate | None:
    healthy = _healthy_grad_norm(conn, a.run, a.first_step)
    if healthy is None:
        return None
    cap = float(f"{2 * healthy:.3g}")
    return Candidate(FixAction.grad_clip, {"max_norm": cap, "relative": RELATIVE_CLIP},
                     f"Clip the global gradient norm at {RELATIVE_CLIP:g}x the median of the last steps' norms, and "
                     f"never above {cap} (2x the healthy median {healthy:.3g} measured before step {a.first_step}). "
                     "The spikes keep coming, and the healthy norm shrinks as training goes on: a threshold that "
                     "follows it keeps each spike at the size of an ordinary step, where a fixed one would let "
                     "them through later.",
                     "The gradient norm stays at its running median; the spikes can no longer throw the weights off.",
                     "low")


def _damage_rollback(a: Anomaly) -> Candidate:
    """Undo what the spikes did before the guard was on: a clip stops new damage, it does not repair the
    weights (units the spikes killed stay dead)."""
    min_step = a.first_step // 2
    return Candidate(FixAction.rollback, {"before_step": a.first_step, "min_step": min_step},
                     f"The gradients have been exploding since step {a.first_step}: the weights took every spike "
                     "until the clip. Apply it after the clip (which stays in force): roll back to the newest "
                     f"snapshot from before step {a.first_step}, but not one older than step {min_step} (losing more "
                     "training than that costs more than the damage).",
                     "The loss is back at its level from before the spikes; the steps since the snapshot are lost. "
                     "Rejected if the job keeps no snapshot in that range.", "medium")


def _exploding(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    ratio = a.evidence.get("ratio")
    lr = _lr_fix(conn, a, ratio if isinstance(ratio, (int, float)) else None)
    # If the learning rate was just raised, restoring it treats the cause; clipping treats the symptom.
    if lr.action == FixAction.set_lr:
        return [c for c in (lr, _clip_fix(conn, a)) if c is not None]
    # Otherwise the spikes come from the data or the gradients themselves and go on: clip them as they
    # come, undo what they did, and say how to stop them at the source.
    return [c for c in (_relative_clip_fix(conn, a), _damage_rollback(a), lr, Candidate(
        FixAction.advice, {"instructions": "Find the batches whose loss is far above the others' (log the per-sample "
                                           "loss) and fix or drop those records; or train with a loss that caps an "
                                           "outlier's pull: torch.nn.HuberLoss(delta=1.0) instead of MSELoss."},
        "Gradient spikes on some batches and not others usually come from a few bad records (labels off by a unit, "
        "say); a robust loss or clean data removes the cause.", "No spikes from the start.", "low", live=False))
            if c is not None]


def _divergence(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    ratio = a.evidence.get("ratio")
    return [c for c in (_lr_fix(conn, a, ratio if isinstance(ratio, (int, float)) else None), _clip_fix(conn, a)) if c]


def _nonfinite(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    out = [Candidate(FixAction.skip_nonfinite, {},
                     f"Skip optimizer steps whose gradients contain NaN/Inf (first seen in "
                     f"{a.evidence.get('first_tensor') or a.evidence.get('scalar') or 'the run'} at step {a.first_step}), "
                     "so one bad batch cannot poison the weights.",
                     "Bad steps become no-ops; weights that are already non-finite stay so (roll back for that).",
                     "low")]
    out.append(_lr_fix(conn, a, None))
    clip = _clip_fix(conn, a)
    if clip:
        out.append(clip)
    return out


# The zombie fix damps a row whose temporal SNR is below this, by snr / ZOMBIE_SNR_REF (at least 0.1).
# Definition: three times the SNR that white noise gives under the probe's EMA (alpha / (2 - alpha) = 0.053,
# probes/embeddings.py NOISE_SNR), below which a row's measured signal is not told apart from noise.
# Measurement here (benchmarks/embeddings.py fix, ML-100k, 30 epochs, docs/embeddings.md): a higher reference
# lowers the best validation MSE more where the run overfits (Adam 1e-3, one seed: +0.005 at 0.1, +0.009 at
# 0.15, +0.011 at 0.2, +0.015 at 1) and slows the runs that do not (SGD 1, its worst seed: -0.0002, -0.0007,
# -0.0016, -0.0073; Adam 1e-3 + weight decay: -0.018 at 1). At 0.16 no regime's best is worse on the mean.
ZOMBIE_SNR_REF = 0.16
# ... with its factors recomputed this often (optimizer steps) from the rows' statistics then, so that rows
# turning noisy as the model starts to memorise are damped when they do: the probe's slow statistics move
# over ~100 touches (SLOW_ALPHA = 0.01). Factors fixed when the fix is applied moved the best validation
# MSE by at most 0.0017 on the mean of any regime (the same benchmark).
ZOMBIE_REFRESH_STEPS = 100


def embedding_scale_params(kind: AnomalyKind, evidence: dict, *, scope: str = "table") -> dict[str, Any] | None:
    """Parameters of embedding_grad_scale for an embedding anomaly's evidence (pure: the benchmark uses it).

    For zombies, ``scope='table'`` damps every eligible row of the table whose temporal SNR is below
    ZOMBIE_SNR_REF, by clamp(snr / ZOMBIE_SNR_REF, 0.1, 1), recomputed every ZOMBIE_REFRESH_STEPS steps;
    ``scope='rows'`` only the rows the rule named."""
    table = evidence.get("table")
    if not isinstance(table, str):
        return None
    if kind == AnomalyKind.zombie_embedding:
        params: dict[str, Any] = {"table": table, "min_factor": 0.1, "mode": "update", "snr_ref": ZOMBIE_SNR_REF,
                                  "refresh": ZOMBIE_REFRESH_STEPS}
        if scope == "rows":
            params["rows"] = [int(r) for r in evidence.get("rows") or [] if isinstance(r, (int, float))]
        return params
    # A tied table's rare rows learn mostly as outputs (as do those of a weight that learns outside its
    # lookups): up-weighting their gradient would push those outputs harder, not help their lookups.
    if (kind == AnomalyKind.dead_embedding and (evidence.get("rare_rows") or 0) > 0 and not evidence.get("tied_to")
            and not evidence.get("learns_outside_lookups")):
        return {"table": table, "starved_below": 0.25, "max_factor": 4.0, "min_factor": 1.0, "mode": "update"}
    return None


def _embedding(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    params = embedding_scale_params(a.kind, a.evidence)
    tied = a.evidence.get("tied_to") or []
    outside = bool(a.evidence.get("learns_outside_lookups"))
    if params is None and a.kind == AnomalyKind.dead_embedding and (tied or outside):  # advice, no up-weighting
        table = a.evidence.get("table")
        where = f"'{tied[0]}'" if tied else f"the output use of '{table}'"
        return [Candidate(
            FixAction.advice, {"instructions": f"Nothing to apply if these ids are meant to be absent from the inputs "
                               f"(vocabulary the data does not use). If they should appear, check the tokenizer and "
                               f"the data pipeline. If the outputs should never predict them either, mask their logits "
                               f"(set them to -inf before the loss) so that {where} stops pushing them down."},
            (f"'{table}' is tied to {', '.join(tied)}: its rows never looked up still learn there as outputs"
             if tied else f"'{table}' also learns outside its lookups (rows not looked up had a gradient: an output "
             "matrix, as in a full softmax over its ids): its rows never looked up still learn there")
            + ", so they are unused ids, not rows that learn nothing; up-weighting their gradient would only "
            "push those outputs harder.", "None needed for unused ids.", "low", live=False)]
    if params is None and a.kind == AnomalyKind.dead_embedding and a.evidence.get("past_data_range"):
        table, rows, never = a.evidence.get("table"), a.evidence.get("table_rows"), a.evidence.get("never_updated")
        span = id_span(rows - never, rows - 1) if isinstance(rows, int) and isinstance(never, int) else "at its end"
        return [Candidate(
            FixAction.advice, {"instructions": f"Nothing to apply if ids {span} of '{table}' are meant to be absent "
                               "(positions past the longest sequence, a vocabulary padded to a round size): the rows "
                               "cost memory only. If they should occur, check the range of ids the data pipeline "
                               "produces (a maximum length, an id mapping built on part of the data)."},
            f"The rows of '{table}' never updated are exactly its last ids ({span}): the table is sized past the ids "
            "the data holds. No gradient reaches them, so no scaling can make them learn.",
            "None needed for ids the data does not hold.", "low", live=False)]
    if params is None:
        return []
    if a.kind == AnomalyKind.zombie_embedding:
        rows = embedding_scale_params(a.kind, a.evidence, scope="rows") or {}
        return [
            Candidate(FixAction.embedding_grad_scale, params,
                      f"Damp the updates of every row of '{params['table']}' whose temporal gradient SNR is below "
                      f"{ZOMBIE_SNR_REF} (three times white noise's: its signal is not told apart from noise), by "
                      f"clamp(SNR / {ZOMBIE_SNR_REF}, 0.1, 1), each from its own measured SNR, recomputed every "
                      f"{ZOMBIE_REFRESH_STEPS} steps. The zombie "
                      f"rows ({a.evidence.get('zombie_rows')} named) are the extreme of a table whose noisiest rows "
                      "chase noise; rows with a real signal keep their full step, and a row stops learning when its "
                      "signal runs out, as if early-stopped one row at a time (docs/embeddings.md: on ML-100k it "
                      "lowered the best validation MSE of runs that overfit late).",
                      "Noisy rows move less, so they overfit less; validation loss should fall or hold, and the "
                      "training loss may stop falling as fast. Revert to restore every row's full step.", "low"),
            Candidate(FixAction.embedding_grad_scale, rows,
                      f"Damp only the {len(rows.get('rows', []))} rows the rule named, by the same SNR-derived factor.",
                      "Those rows stop oscillating; a handful of rows rarely moves the validation loss.", "low"),
        ]
    return [Candidate(FixAction.embedding_grad_scale, params,
                      f"Up-weight rows of '{params['table']}' updated less than a quarter as often as the median row, "
                      "by sqrt(median / their count), at most 4x. Rows never updated get no gradient and need the data "
                      "or the negative sampler fixed.", "Rare rows catch up; never-updated rows are unchanged.", "medium")]


# Actions the job cannot undo (see probes.fixes.IRREVERSIBLE): revert_fix refuses them up front.
IRREVERSIBLE = {FixAction.rollback}
# Actions that damp a symptom whose cause stays (zombie rows' conflicting data, dead rows' missing lookups):
# the engine takes their verdict on the loss once the window has passed, not on the anomaly clearing.
MITIGATIONS = {FixAction.embedding_grad_scale}
# A pending fix the job has not acknowledged after it ran this many sampling intervals (and at least
# ACK_MIN_STEPS steps) past the request is expired: the job applies commands at its next step boundary,
# so a live job that keeps stepping without answering is not going to (measurement here: acks arrive
# within 2 intervals on the suite's jobs).
ACK_INTERVALS, ACK_MIN_STEPS = 5, 50


def _advice(a: Anomaly) -> Candidate:
    return Candidate(FixAction.advice, {"instructions": f"No live fix is known for {a.kind.value}; see the message: "
                                        f"{a.message}"}, "Needs a change to the training code.",
                     "None until the job is restarted with the change.", "low", live=False)
