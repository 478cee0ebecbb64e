"""Root-cause diagnosis: what went wrong first, where, what changed just before, and what followed from it.

1. Anomalies are ordered by the step they began at; each later anomaly is linked to the earliest one that
   can cause it (``CAUSES``: a learning-rate or input problem leads to exploding gradients, which lead to a
   diverging loss and NaN, ...) and began within ``CONSEQUENCE_WINDOW`` steps of it.
2. For the first cause the store is searched for the first step and the first tensor in forward order at
   which a value went non-finite, for what changed just before it (a learning-rate change, an applied fix,
   a shift in the input's statistics) and for how far the gradient norm had grown.
3. History: the run's recent stretch is compared with its own healthy stretch (before the first anomaly),
   and with earlier runs in the store of the same model structure (same module names and types); a step
   time, loss or gradient-norm profile that departs from what they did is named with the run compared.
"""

from __future__ import annotations

import hashlib
import math
import sqlite3

import orjson

from schemas.enums import AnomalyKind as K
from schemas.records import Anomaly, Cause, Diagnosis

from .queries import anomalies as list_anomalies
from .queries import require_run
from ..rules.base import median
from ..rules.gradients import global_norm
from ..store import Store

# Which anomaly kinds can be a consequence of which.
CAUSES: dict[K, set[K]] = {
    K.input_not_normalized: {K.saturated_activation, K.exploding_gradient, K.vanishing_gradient, K.loss_divergence,
                             K.nonfinite, K.loss_not_decreasing, K.oscillating_loss, K.dead_relu, K.unchanged_tensor},
    K.poor_weight_init: {K.saturated_activation, K.dead_relu, K.vanishing_gradient, K.exploding_gradient,
                         K.loss_not_decreasing, K.nonfinite, K.unchanged_tensor},
    K.output_range_mismatch: {K.loss_not_decreasing, K.vanishing_gradient},
    K.abnormal_update_ratio: {K.exploding_gradient, K.loss_divergence, K.oscillating_loss, K.nonfinite, K.dead_relu,
                              K.loss_not_decreasing, K.unchanged_tensor, K.vanishing_gradient},
    K.saturated_activation: {K.vanishing_gradient, K.unchanged_tensor, K.loss_not_decreasing},
    K.dead_relu: {K.vanishing_gradient, K.unchanged_tensor, K.loss_not_decreasing},
    K.vanishing_gradient: {K.unchanged_tensor, K.loss_not_decreasing, K.abnormal_update_ratio},
    K.exploding_gradient: {K.loss_divergence, K.oscillating_loss, K.nonfinite, K.dead_relu, K.vanishing_gradient,
                           K.unchanged_tensor, K.abnormal_update_ratio},
    K.oscillating_loss: {K.loss_divergence, K.nonfinite},
    K.loss_divergence: {K.nonfinite},
    K.unchanged_tensor: {K.loss_not_decreasing},
    K.memory_growth: {K.step_time_outlier, K.gpu_memory_fragmentation},
    K.dataloader_bottleneck: {K.step_time_outlier, K.straggler_rank},
    # A slow rank makes the others wait at the all-reduce; a starved loader on one rank makes it the slow one.
    K.straggler_rank: {K.comm_bottleneck, K.step_time_outlier},
}
# At one step, which kinds come first in the usual chain of events (lower first).
CAUSAL_ORDER = {
    K.input_not_normalized: 0, K.poor_weight_init: 0, K.output_range_mismatch: 0, K.dataloader_bottleneck: 0,
    K.abnormal_update_ratio: 1, K.saturated_activation: 1, K.dead_relu: 1, K.vanishing_gradient: 2,
    K.exploding_gradient: 2, K.unchanged_tensor: 3, K.oscillating_loss: 3, K.loss_divergence: 3,
    K.loss_not_decreasing: 3, K.overfitting: 3, K.nonfinite: 4, K.straggler_rank: 1, K.comm_bottleneck: 2,
}
# Kinds about throughput and memory rather than what the model learns.
RESOURCE_KINDS = {K.dataloader_bottleneck, K.step_time_outlier, K.memory_growth, K.gpu_memory_fragmentation,
                  K.straggler_rank, K.comm_bottleneck}
# An anomaly that began within this many steps after another may be its consequence.
CONSEQUENCE_WINDOW = 500
# Departures from history worth naming: ratio of medians.
DEPARTURE = {"step_time": 2.0, "loss": 1.5, "grad_norm": 3.0}


# Embedding-row anomalies of one kind on two tables of as many rows that name mostly the same ids are one
# problem of those ids seen twice: an item table and its bias table, looked up with the same ids, both
# pulled back and forth by the same conflicting labels (measured: agent_examples.jobs.recommender_job
# flags 4-8 toggling items in item.weight, and 5-7 of the same ones in item_bias.weight 300-400 steps later).
SHARED_ROW_KINDS = {K.zombie_embedding, K.dead_embedding}
SHARED_ROW_FRACTION = 0.5  # of the smaller list of named ids


def _same_rows(cause: Anomaly, effect: Anomaly) -> bool:
    if cause.kind != effect.kind or cause.kind not in SHARED_ROW_KINDS or cause.tensors == effect.tensors:
        return False
    a, b = cause.evidence or {}, effect.evidence or {}
    if a.get("table_rows") is None or a.get("table_rows") != b.get("table_rows"):
        return False
    ra = {int(r) for r in a.get("rows") or [] if isinstance(r, (int, float))}
    rb = {int(r) for r in b.get("rows") or [] if isinstance(r, (int, float))}
    return bool(ra and rb) and len(ra & rb) >= SHARED_ROW_FRACTION * min(len(ra), len(rb))


def _explains(cause: Anomaly, effect: Anomaly) -> bool:
    if cause.id == effect.id or (cause.severity.value == "info" and effect.severity.value != "info"):
        return False
    if _same_rows(cause, effect):
        return cause.first_step <= effect.first_step
    return (effect.kind in CAUSES.get(cause.kind, set())
            and cause.first_step <= effect.first_step <= cause.first_step + CONSEQUENCE_WINDOW)


def _link(cause: Anomaly, effect: Anomaly) -> str:
    """How an explained anomaly reads in its cause's chain."""
    same = (f": the same ids in '{effect.tensors[0]}', one problem in the data; damping is per table, so its own "
            "anomaly proposes that table's" if _same_rows(cause, effect) and effect.tensors else "")
    return f" -> {effect.kind.value} at step {effect.first_step} ({effect.id}{same})"


def diagnose(store: Store, run: str) -> Diagnosis:
    conn = store.read()
    require_run(conn, run)
    page = list_anomalies(store, run, limit=500)
    # Ties broken by kind and tensor, not by id: ids follow the order anomalies were stored in, which depends on
    # how the events were cut into batches, and the same run must get the same diagnosis.
    found = sorted(page.anomalies, key=lambda a: (a.first_step, CAUSAL_ORDER.get(a.kind, 5), a.kind.value,
                                                  a.tensors, a.id))
    explained: set[str] = set()
    causes: list[Cause] = []
    for a in found:
        if a.id in explained:
            continue
        effects = [b for b in found if _explains(a, b) and b.id not in explained]
        explained.update(b.id for b in effects)
        tensor = a.tensors[0] if a.tensors else None
        chain = "".join(_link(a, b) for b in effects)
        causes.append(Cause(anomaly_id=a.id, kind=a.kind, step=a.first_step, tensor=tensor,
                            explanation=f"{a.message}{chain}", consequences=[b.id for b in effects]))
    # Alarms (warning, critical) rank above information, and problems of the training itself (values,
    # gradients, the loss) above problems of its speed or memory: those cost time, these cost the model.
    severity = {a.id: a.severity.value for a in found}
    causes.sort(key=lambda c: (severity[c.anomaly_id] == "info", c.kind in RESOURCE_KINDS, c.step))
    context = _context(conn, run, causes[0].step if causes else None)
    history = _history(conn, run, min((a.first_step for a in found if a.severity.value != "info"), default=None))
    if not causes:
        summary = f"No anomalies in run {run!r}: nothing has gone wrong that the rules can see."
    else:
        top = causes[0]
        summary = (f"{len(causes)} independent problem(s). First: {top.kind.value} at step {top.step}"
                   + (f" in '{top.tensor}'" if top.tensor else "")
                   + (f", which explains {len(top.consequences)} later anomaly(ies)" if top.consequences else "") + ".")
    lines = [f"Diagnosis of run {run}", summary, ""]
    for i, c in enumerate(causes, 1):
        lines.append(f"{i}. [{c.anomaly_id}] {c.kind.value} from step {c.step}" + (f" ({c.tensor})" if c.tensor else ""))
        lines.append(f"   {c.explanation}")
    if context:
        lines += ["", "Where it began and what changed just before:"] + [f"- {x}" for x in context]
    if history:
        lines += ["", "Compared with history:"] + [f"- {x}" for x in history]
    return Diagnosis(run=run, summary=summary, causes=causes, report="\n".join(lines), context=context,
                     history=history)


# -- where it began and what changed ----------------------------------------------------------------
def _context(conn: sqlite3.Connection, run: str, first_step: int | None) -> list[str]:
    out: list[str] = []
    bad = _first_nonfinite(conn, run)
    if bad:
        out.append(bad["text"])
        first_step = min(first_step, bad["step"]) if first_step is not None else bad["step"]
    if first_step is None:
        return out
    # Growth is measured up to where values went bad (or a little after the first anomaly).
    growth_until = bad["step"] if bad else first_step + 50
    lo = max(first_step - 200, 0)
    lr = conn.execute("SELECT step, value FROM scalars WHERE run=? AND name='lr/group0' AND step<=? AND step>=? "
                      "ORDER BY step", (run, first_step, lo)).fetchall()
    for (s0, v0), (s1, v1) in zip(lr, lr[1:]):
        if v0 and v1 and abs(v1 - v0) > 1e-9 * abs(v0):
            out.append(f"the learning rate changed from {v0:.3g} to {v1:.3g} between steps {s0} and {s1}, "
                       f"{first_step - s1} step(s) before the first anomaly at step {first_step}")
    for r in conn.execute("SELECT id, action, applied_step, params FROM fixes WHERE run=? AND applied_step IS NOT NULL "
                          "AND applied_step<=? AND applied_step>=?", (run, first_step, lo)):
        out.append(f"fix {r['id']} ({r['action']} {r['params']}) was applied at step {r['applied_step']}")
    growth = _grad_growth(conn, run, growth_until)
    if growth:
        out.append(growth)
    shift = _input_shift(conn, run, max(first_step, bad["step"]) if bad else first_step)
    if shift:
        out.append(shift)
    return out


def _first_nonfinite(conn: sqlite3.Connection, run: str) -> dict | None:
    """The first step, and the first tensor in forward order, where a value went NaN/Inf."""
    scalar = conn.execute("SELECT min(step) FROM scalars WHERE run=? AND value IS NULL AND (name='loss' OR "
                          "name LIKE 'val_%')", (run,)).fetchone()[0]
    row = conn.execute("SELECT step, collection, tensor FROM stats WHERE run=? AND (nan_count>0 OR inf_count>0) "
                       "ORDER BY step, CASE collection WHEN 'activations' THEN 0 WHEN 'gradients' THEN 1 ELSE 2 END, "
                       "rowid LIMIT 1", (run,)).fetchone()
    if scalar is None and row is None:
        return None
    if row is not None and (scalar is None or row["step"] <= scalar):
        where = {"activations": "activations of", "gradients": "gradient of", "weights": "weights of"}[row["collection"]]
        text = f"the first non-finite value (NaN/Inf) was at step {row['step']}, first in the {where} '{row['tensor']}'"
        if row["collection"] == "activations":
            text += " in forward order (the layers after it inherit it)"
        if scalar is not None:
            text += f"; the loss was non-finite from step {scalar}"
        return {"step": row["step"], "text": text}
    sampled = conn.execute("SELECT min(step) FROM stats WHERE run=? AND step>=? AND collection='activations'",
                           (run, scalar)).fetchone()[0]
    text = f"the loss was first non-finite at step {scalar} (between two sampled steps)"
    if row is not None:
        text += f"; at the next sample (step {row['step']}) it was first in {row['collection']} '{row['tensor']}'"
    elif sampled is not None:
        text += "; no sampled tensor held NaN/Inf afterwards, so one batch (its inputs or labels) was the source"
    return {"step": scalar, "text": text}


def _grad_norms(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> list[tuple[int, float]]:
    by_step: dict[int, list[dict]] = {}
    for s, name, norm in conn.execute("SELECT step, tensor, norm FROM stats WHERE run=? AND collection='gradients' "
                                      "AND step>=? AND step<=?", (run, lo, hi)):
        by_step.setdefault(s, []).append({"name": name, "norm": norm})
    return [(s, g) for s in sorted(by_step) if (g := global_norm(by_step[s])) is not None]


def _grad_growth(conn: sqlite3.Connection, run: str, step: int) -> str | None:
    norms = _grad_norms(conn, run, 0, step)
    if len(norms) < 4:
        return None
    recent = [g for s, g in norms if s >= step - 50]
    healthy = [g for s, g in norms if s < step - 50] or [g for _, g in norms[:3]]
    base, peak = median(healthy), max(recent or [0.0])
    if base > 0 and peak > 3 * base:
        at = [s for s, g in norms if g == peak][0]
        return (f"the gradient norm grew {peak / base:.3g}x (from a median {base:.3g} to {peak:.3g}) over steps "
                f"{max(step - 50, 0)}-{at}")
    return None


def _input_shift(conn: sqlite3.Connection, run: str, step: int) -> str | None:
    rows = conn.execute("SELECT step, mean, std, nan_count, inf_count FROM stats WHERE run=? AND "
                        "collection='activations' AND tensor='<input>' AND step<=? ORDER BY step",
                        (run, step + 10)).fetchall()
    bad = [r for r in rows if r["nan_count"] or r["inf_count"]]
    if bad:
        later = [r for r in rows if r["step"] > bad[0]["step"]]
        clean_after = bool(later) and not any(r["nan_count"] or r["inf_count"] for r in later)
        return (f"the model's input itself held {bad[0]['nan_count'] + bad[0]['inf_count']} NaN/Inf value(s) at step "
                f"{bad[0]['step']}" + (": one bad batch (later inputs are clean), so check the data pipeline for "
                                       "that record" if clean_after else ": check the data pipeline"))
    if len(rows) < 2:
        return None
    last = rows[-1]
    before = [r["std"] for r in rows[:-1] if r["std"] is not None]
    if before and last["std"] is not None and median(before) > 0:
        ratio = last["std"] / median(before)
        if ratio > 3 or ratio < 1 / 3:
            return (f"the input's spread changed {ratio:.2g}x at step {last['step']} (std {last['std']:.3g} vs a "
                    f"median {median(before):.3g} before): the data changed")
    return None


# -- history -----------------------------------------------------------------------------------------
def structure_of(start: dict | None) -> str | None:
    """A fingerprint of the model's structure: its module names and types, in order."""
    modules = (start or {}).get("modules") or []
    if not modules:
        return None
    return hashlib.sha1(orjson.dumps([(m["name"], m["type"]) for m in modules])).hexdigest()[:16]


def _profile(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, name in (("step_time", "sys/step_time"), ("loss", "loss")):
        vals = [r[0] for r in conn.execute("SELECT value FROM scalars WHERE run=? AND name=? AND step>=? AND step<=? "
                                           "AND value IS NOT NULL", (run, name, lo, hi))]
        if vals:
            out[key] = median(vals)
    norms = [g for _, g in _grad_norms(conn, run, lo, hi)]
    if norms:
        out["grad_norm"] = median(norms)
    return out


def _departures(now: dict[str, float], then: dict[str, float]) -> list[str]:
    out = []
    labels = {"step_time": "step time", "loss": "loss", "grad_norm": "gradient norm"}
    for key, limit in DEPARTURE.items():
        a, b = now.get(key), then.get(key)
        if a is None or b is None or not (a > 0 and b > 0) or not (math.isfinite(a) and math.isfinite(b)):
            continue
        if a > limit * b or a < b / limit:
            out.append(f"{labels[key]} median {a:.3g} vs {b:.3g} ({a / b:.2g}x)")
    return out


def _history(conn: sqlite3.Connection, run: str, first_alarm: int | None) -> list[str]:
    row = conn.execute("SELECT start, last_step, created_at FROM runs WHERE run=?", (run,)).fetchone()
    last = row["last_step"] or 0
    out: list[str] = []
    if first_alarm is not None and first_alarm > 0:
        healthy = _profile(conn, run, 0, first_alarm - 1)
        recent = _profile(conn, run, first_alarm, last)
        diff = _departures(recent, healthy)
        if diff:
            out.append(f"since step {first_alarm} vs this run's healthy stretch (steps 0-{first_alarm - 1}): "
                       + "; ".join(diff))
    structure = structure_of(orjson.loads(row["start"]) if row["start"] else None)
    if structure is None:
        return out
    lo = max(last - 200, 0)
    mine = _profile(conn, run, lo, last)
    for other in conn.execute("SELECT run, start FROM runs WHERE run!=? AND created_at<=? AND start IS NOT NULL "
                              "ORDER BY created_at DESC LIMIT 20", (run, row["created_at"])):
        if structure_of(orjson.loads(other["start"])) != structure:
            continue
        theirs = _profile(conn, other["run"], lo, last)
        if not theirs:
            continue
        diff = _departures(mine, theirs)
        out.append(f"steps {lo}-{last} vs earlier run '{other['run']}' of the same model structure: "
                   + ("; ".join(diff) if diff else "no departure (step time, loss, gradient norm within range)"))
        if len(out) >= 4:
            break
    return out
