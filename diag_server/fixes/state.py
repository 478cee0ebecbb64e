"""What a fault left in the run's state, and fixes ranked by whether they can repair it.

A learning-rate fix treats a cause; it cannot take back what the fault already did. Once the weights hold
NaN, or an adaptive optimizer's second moments have taken a spike (Adam keeps a spike's squared gradients
for ~1/(1 - beta2) = 1000 steps, and every step until then is a fraction of its size: a 2-layer transformer
whose rate was raised 100x and set back sat at chance for 4,700 steps; measurement here), only restoring a
state from before the fault repairs the run. ``repair_first`` wraps the proposers of the step-size kinds
and NaN so that the rollback (carrying the rate from before the fault when the fault raised it) comes
first, a rate change that cannot repair the state never does, and with NaN weights nothing that cannot
work is proposed at all: when the job keeps no snapshots the proposal is to restart from a checkpoint,
with the evidence. ``training_stalled`` has its own proposer here.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

from schemas.enums import AnomalyKind, FixAction
from schemas.records import Anomaly

from .proposers import HIGH_UPDATE_RATIO, _start, advice
from .candidates import Candidate, fault_step, lr_rise
from ..rules.base import median
from ..rules.gradients import global_norm

Proposer = Callable[[sqlite3.Connection, Anomaly], list[Candidate]]

# Optimizers that keep a per-parameter second moment (or an accumulated one): a spike stays in their state.
ADAPTIVE = ("adam", "rmsprop", "adagrad", "adadelta", "adafactor", "lion", "lamb", "lars")
# A gradient norm this many times its median before the fault is a spike (the exploding_gradient rule's
# default factor), as is a median update ratio above HIGH_UPDATE_RATIO or a learning rate raised this much.
SPIKE_FACTOR = 10.0
RAISED = 3.0
# Rate changes and guards: they can stop further damage, not undo it.
RATE_CHANGES = (FixAction.set_lr, FixAction.lr_scale)
GUARDS = (FixAction.grad_clip, FixAction.skip_nonfinite, FixAction.grad_scale)


def _interval(start: dict) -> int:
    return int((start.get("config") or {}).get("interval") or 100)


def _adaptive(start: dict) -> bool:
    kind = ((start.get("optimizer") or {}).get("type") or "").lower()
    return any(name in kind for name in ADAPTIVE)


def nonfinite_weights(conn: sqlite3.Connection, run: str, upto: int) -> tuple[int, str] | None:
    """(first step, first tensor) of the current stretch of non-finite weights; None when the latest weights
    sample is finite (or there is none)."""
    bad = ("SELECT step, tensor FROM stats WHERE run=? AND collection='weights' AND step<=? AND rank=0 AND "
           "(coalesce(nan_count, 0) + coalesce(inf_count, 0)) > 0 ")
    latest = conn.execute("SELECT max(step) FROM stats WHERE run=? AND collection='weights' AND step<=? AND rank=0",
                          (run, upto)).fetchone()[0]
    if latest is None or conn.execute(bad + "AND step=? LIMIT 1", (run, upto, latest)).fetchone() is None:
        return None
    good = conn.execute("SELECT max(step) FROM stats WHERE run=? AND collection='weights' AND step<=? AND rank=0 AND "
                        "step NOT IN (SELECT step FROM stats WHERE run=? AND collection='weights' AND "
                        "(coalesce(nan_count, 0) + coalesce(inf_count, 0)) > 0)", (run, upto, run)).fetchone()[0]
    after = good if good is not None else -1
    row = conn.execute(bad + "AND step>? ORDER BY step, rowid LIMIT 1", (run, upto, after)).fetchone()
    return (row[0], row[1]) if row else (latest, "?")


def _lr_before(conn: sqlite3.Connection, run: str, step: int) -> float | None:
    row = conn.execute("SELECT value FROM scalars WHERE run=? AND name='lr/group0' AND rank=0 AND step<? AND value IS "
                       "NOT NULL ORDER BY step DESC LIMIT 1", (run, step)).fetchone()
    return float(row[0]) if row else None


def _max_lr_since(conn: sqlite3.Connection, run: str, step: int, upto: int) -> float | None:
    row = conn.execute("SELECT max(value) FROM scalars WHERE run=? AND name='lr/group0' AND rank=0 AND step>=? AND "
                       "step<=?", (run, step, upto)).fetchone()
    return float(row[0]) if row and row[0] is not None else None


def _grad_norms(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> list[tuple[int, float]]:
    rows = conn.execute("SELECT step, tensor, norm FROM stats WHERE run=? AND collection='gradients' AND rank=0 AND "
                        "step>=? AND step<=?", (run, lo, hi)).fetchall()
    by_step: dict[int, list[dict]] = {}
    for step, tensor, norm in rows:
        by_step.setdefault(step, []).append({"name": tensor, "norm": norm})
    return sorted((s, g) for s, g in ((s, global_norm(v)) for s, v in by_step.items()) if g is not None)


def _update_medians(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> list[float]:
    """Per sample, in step order: the median update/weight ratio of the weight matrices."""
    rows = conn.execute("SELECT step, tensor, update_ratio FROM stats WHERE run=? AND collection='updates' AND rank=0 "
                        "AND step>=? AND step<=? AND update_ratio IS NOT NULL", (run, lo, hi)).fetchall()
    by_step: dict[int, list[float]] = {}
    for step, tensor, ratio in rows:
        if tensor.endswith("weight"):
            by_step.setdefault(step, []).append(ratio)
    return [median(v) for _, v in sorted(by_step.items()) if v]


def spike(conn: sqlite3.Connection, run: str, fault: int, upto: int, interval: int) -> str | None:
    """What spike, if any, an adaptive optimizer's state took since the fault, against the run's own samples
    before it: a raised rate, a gradient-norm spike, outsized updates, or updates that collapsed with the
    rate unchanged (the moments took a spike between two samples). None when there was none, or when there
    is no healthy stretch before the fault to compare with (a fault present from the start)."""
    lo = fault - 20 * interval
    norms = _grad_norms(conn, run, lo, upto)
    healthy = [g for s, g in norms if s < fault]
    if len(healthy) < 3:
        return None
    before = _lr_before(conn, run, fault)
    most = _max_lr_since(conn, run, fault, upto)
    if before and most and most >= RAISED * before:
        return f"the learning rate was raised {most / before:.3g}x (from {before:.3g}) at step {fault}"
    after = [(g, s) for s, g in norms if s >= fault]
    if after and median(healthy) > 0:
        g, s = max(after)
        if g > SPIKE_FACTOR * median(healthy):
            return f"the gradient norm reached {g:.3g} at step {s}, {g / median(healthy):.0f}x its median before"
    ratios_before, ratios = _update_medians(conn, run, lo, fault - 1), _update_medians(conn, run, fault, upto)
    if ratios and ratios_before:
        usual = median(ratios_before)
        if max(ratios) > max(HIGH_UPDATE_RATIO, SPIKE_FACTOR * usual):
            return f"the weights moved by a median {max(ratios):.2g} of their size in one step ({usual:.2g} before)"
        now = median(ratios[-3:])
        if usual > 0 and now < usual / SPIKE_FACTOR and not (before and most and most < before / 1.5):
            return (f"with the rate unchanged, the updates collapsed to a median {now:.2g} of the weights per step "
                    f"({usual:.2g} before): the moments took a spike")
    return None


def _fault_of(conn: sqlite3.Connection, a: Anomaly, interval: int) -> int:
    """Where the fault began; for NaN, the first bad step the evidence names, or an earlier rise of the rate."""
    if a.kind == AnomalyKind.nonfinite:
        first = a.evidence.get("first_step")
        first = int(first) if isinstance(first, (int, float)) else a.first_step
        rise = lr_rise(conn, a.run, first, 5 * interval)
        return rise[0] if rise else first
    return fault_step(conn, a.run, a.first_step, a.evidence, interval)


def _restart_advice(fault: int, lr: float | None, what: str, allowed: bool) -> Candidate:
    rate = f", at the learning rate from before it ({lr:.3g})" if lr is not None else ""
    return advice(
        f"Restart from the last checkpoint saved before step {fault}{rate}: {what}, which no live change of "
        "the rate, clip or scale can undo."
        + ("" if allowed else " A job that allows rollback (probes.attach(..., allow={'rollback': {'every': 50}, "
           "...})) keeps snapshots and can be rolled back live instead."),
        f"The fault began around step {fault}; {what}. Only a state from before the fault repairs the run.",
        "The run continues from its healthy state; the steps since the checkpoint are repeated.")


def repair_first(previous: Proposer) -> Proposer:
    """Rank ``previous``'s proposals by what the fault left: a rollback first after a raised rate or a
    spike in an adaptive optimizer's state, rate changes behind it; with NaN weights, only what can repair."""

    def propose(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
        rest = previous(conn, a)
        start = _start(conn, a.run)
        interval = _interval(start)
        fault = _fault_of(conn, a, interval)
        lr = _lr_before(conn, a.run, fault)
        most = _max_lr_since(conn, a.run, fault, a.last_step)
        raised = lr is not None and most is not None and most > 1.5 * lr
        broken = nonfinite_weights(conn, a.run, a.last_step)
        hit = spike(conn, a.run, fault, a.last_step, interval) if _adaptive(start) and not broken else None
        nan = a.kind == AnomalyKind.nonfinite
        if not raised and not broken and not hit and not nan:
            return rest
        allowed = "rollback" in (start.get("allow") or [])
        if broken:
            what = f"the weights hold NaN/Inf since step {broken[0]} (first in '{broken[1]}')"
        elif nan:
            what = (f"NaN/Inf appeared at step {a.evidence.get('first_step', a.first_step)} (first in "
                    f"{a.evidence.get('first_in', '?')} "
                    f"'{a.evidence.get('first_tensor', '?')}'), and a step on it leaves the weights NaN")
        elif hit:
            what = (f"{hit}, and the optimizer's second moments hold that spike for ~1000 steps (1/(1 - beta2)): "
                    "until then every step is a fraction of its size")
        else:
            what = (f"the learning rate was raised from {lr:.3g} to {most:.3g} at step {fault}, and the weights are "
                    "wherever the large steps threw them")
        roll = next((c for c in rest if c.action == FixAction.rollback), None)
        proposed = roll is not None  # the proposer already undoes the damage (behind a guard, say): keep its order
        if roll is None:
            params: dict = {"before_step": fault}
            if raised:
                params["lr"] = lr
            roll = Candidate(
                FixAction.rollback, params,
                f"The run has gone wrong since step {fault}: {what}. Roll back to the newest snapshot from before "
                "that (weights, buffers and optimizer state)"
                + (f" and set the rate back to {lr:.3g}, the one the run was healthy at" if raised else
                   ", keeping the current rate") + ", and go on with the next batch.",
                "The loss is back at its level from before the fault from the next step; the steps since the "
                "snapshot are lost. Rejected if the job keeps no snapshot from before the fault.", "medium")
        elif raised and "lr" not in roll.params:
            roll.params["lr"] = lr
            roll.rationale += f" The rate is set back to {lr:.3g}, the one from before the fault."
        if broken:
            # Nothing but a good state brings NaN weights back: a rate, a clip or a guard changes nothing, and
            # a rollback the job does not allow would be refused.
            out = [*([roll] if allowed else []), *[c for c in rest if not c.live]]
        else:
            out = rest if proposed else [roll, *rest]
        if hit:
            # A rate change (and, unless it guards against spikes that go on, a clip) leaves the state as it is.
            cannot = RATE_CHANGES if proposed else (*RATE_CHANGES, *GUARDS)
            for c in out:
                if c.action in cannot:
                    c.repairs = False
                    c.rationale += (f" It cannot repair the run: {what}. It only keeps the fault from doing more "
                                    "damage; a rollback to before the fault undoes it.")
        if broken or hit:
            out.append(_restart_advice(fault, lr if raised else None, what, allowed))
        return out

    return propose


def training_stalled(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    """A run that stalled after a fault needs the state from before it back; nothing else is proposed live."""
    fault = fault_step(conn, a.run, a.first_step, a.evidence, _interval(_start(conn, a.run)))
    lr = _lr_before(conn, a.run, fault)
    most = _max_lr_since(conn, a.run, fault, a.last_step)
    raised = lr is not None and most is not None and most > 1.5 * lr
    allowed = "rollback" in (_start(conn, a.run).get("allow") or [])
    loss, best = a.evidence.get("loss_median"), a.evidence.get("best")
    ratio, healthy = a.evidence.get("update_ratio"), a.evidence.get("healthy_update_ratio")
    what = "the run has stalled"
    if isinstance(loss, (int, float)) and isinstance(best, (int, float)):
        what += f" at a loss of {loss:.4g} against {best:.4g} before the fault"
    if isinstance(ratio, (int, float)) and isinstance(healthy, (int, float)) and ratio < healthy:
        what += f", its updates {ratio:.2g} of the weights per step against {healthy:.2g} before"
    params: dict = {"before_step": fault}
    if raised:
        params["lr"] = lr
    roll = Candidate(
        FixAction.rollback, params,
        f"Since the fault around step {fault} {what}: the state the fault left (an adaptive optimizer's moments "
        "filled by a spike, weights thrown off) keeps it there, and a fix of the cause alone does not bring it "
        "back. Roll back to the newest snapshot from before step " + f"{fault}"
        + (f", with the rate from before the fault ({lr:.3g})" if raised else "") + ".",
        "The loss is back at its level from before the fault from the next step; the steps since the snapshot "
        "are lost. Rejected if the job keeps no snapshot from before the fault.", "medium")
    return [roll, _restart_advice(fault, lr if raised else None, what, allowed)]


# The kinds whose fault can leave damage behind in the weights or the optimizer's state.
WRAPPED = (AnomalyKind.nonfinite, AnomalyKind.exploding_gradient, AnomalyKind.loss_divergence,
           AnomalyKind.abnormal_update_ratio, AnomalyKind.oscillating_loss)


def install(proposers: dict[AnomalyKind, Proposer]) -> None:
    for kind in WRAPPED:
        if kind in proposers:
            proposers[kind] = repair_first(proposers[kind])
    proposers[AnomalyKind.training_stalled] = training_stalled


__all__ = ["install", "nonfinite_weights", "repair_first", "spike", "training_stalled"]
