"""Runs the rules over each batch as it arrives, and keeps anomalies and fix verdicts up to date.

Runs only in the store's writer thread (it is called from ingest's write function), so per-run rule
state needs no lock. State is persisted with the batch, in the same transaction.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any

import orjson

from schemas.enums import AnomalyStatus, FixStatus, Severity

from ..fixes import MITIGATIONS, fault_step
from ..rules import BUILTIN, Finding, Observations, Rule
from ..store import add_message
from ..fixes.verdict import REFERENCE_POINTS, START_POINTS, judge
from .evidence import request_snapshot

_SEVERITY_ORDER = {Severity.info.value: 0, Severity.warning.value: 1, Severity.critical.value: 2}


@dataclass
class EngineSettings:
    # An anomaly is resolved when its rule has not reported it for this many sampling intervals.
    resolve_after_intervals: int = 3
    # A fix is judged this many sampling intervals (and at least verify_min_steps) after it was applied,
    # sooner (from a quarter of that on) if its anomaly clears and the run is back near its healthy level.
    # 200 steps: the demo's loss needs ~100 steps to settle after a learning-rate fix, and the anomaly
    # another 3 intervals to resolve (measurement here). What "back" means: diag_server/fixes/verdict.py.
    verify_after_intervals: int = 6
    verify_min_steps: int = 200
    # A run whose loss is still coming down at the end of the window is given up to this many windows.
    verify_max_windows: int = 3
    # A fix after which an objective's median is this much higher than before is flagged for revert.
    worse_margin: float = 0.10
    rule_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    disabled: set[str] = field(default_factory=set)
    extra_rules: list[type[Rule]] = field(default_factory=list)


def run_rule_config(start: dict | None) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """A run's own rule settings, from its start event's config: ``rules.disable`` (a list of rule names)
    and ``rules.<rule>.<param>`` (a number), as ``probes.attach(..., rules={...})`` writes them."""
    config = (start or {}).get("config") or {}
    disabled = {str(x) for x in (config.get("rules.disable") or [])}
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in config.items():
        if key.startswith("rules.") and key != "rules.disable":
            rule, _, param = key[len("rules."):].partition(".")
            if rule and param:
                overrides.setdefault(rule, {})[param] = value
    return overrides, disabled


class Engine:
    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        self.rules: list[Rule] = self._build({}, set())  # the server's rules; a run may tune its own copy
        self._run_rules: dict[str, tuple[bytes, list[Rule]]] = {}
        self._starts: dict[str, tuple[str, dict]] = {}
        self._states: dict[tuple[str, str], dict] = {}

    def _build(self, overrides: dict[str, dict[str, Any]], disabled: set[str]) -> list[Rule]:
        classes = [*BUILTIN, *self.settings.extra_rules]
        known = {c.name for c in classes}
        unknown = (set(overrides) | disabled | set(self.settings.rule_params) | self.settings.disabled) - known
        if unknown:
            raise ValueError(f"no rule named {sorted(unknown)}; rules: {sorted(known)}")
        return [cls(**{**self.settings.rule_params.get(cls.name, {}), **overrides.get(cls.name, {})})
                for cls in classes if cls.name not in self.settings.disabled and cls.name not in disabled]

    def describe(self) -> list[dict]:
        return [r.describe() for r in self.rules]

    def rules_for(self, conn: sqlite3.Connection, run: str, start: dict | None) -> list[Rule]:
        """The rules for one run: the server's, tuned or disabled by the run's own config."""
        overrides, disabled = run_rule_config(start)
        if not overrides and not disabled:
            return self.rules
        fingerprint = orjson.dumps([overrides, sorted(disabled)], option=orjson.OPT_SORT_KEYS)
        cached = self._run_rules.get(run)
        if cached and cached[0] == fingerprint:
            return cached[1]
        try:
            rules = self._build(overrides, disabled)
        except (ValueError, TypeError) as e:  # a bad setting must not stop the rules: run the defaults, say why
            rules = self.rules
            add_message(conn, run, 0, 0.0, "warning", f"the run's rule settings were ignored: {e}")
        self._run_rules[run] = (fingerprint, rules)
        return rules

    def _start(self, conn: sqlite3.Connection, run: str) -> dict | None:
        row = conn.execute("SELECT start FROM runs WHERE run=?", (run,)).fetchone()
        if not row or not row[0]:
            return None
        cached = self._starts.get(run)
        if cached is None or cached[0] != row[0]:
            cached = (row[0], orjson.loads(row[0]))
            self._starts[run] = cached
        return cached[1]

    # -- called from ingest, in the writer thread ------------------------------------------------------
    def process(self, conn: sqlite3.Connection, obs: Observations, now: float) -> list[str]:
        """Run every rule over ``obs``; return ids of anomalies opened by this batch."""
        opened: list[str] = []
        seen: set[str] = set()
        if obs.start is None:
            obs.start = self._start(conn, obs.run)
        for rule in self.rules_for(conn, obs.run, obs.start):
            if obs.rank and not rule.all_ranks:
                continue
            state = self._state(conn, obs.run, rule)
            findings = rule.observe(state, obs)
            conn.execute("INSERT OR REPLACE INTO rule_state(run, rule, state) VALUES (?,?,?)",
                         (obs.run, rule.name, orjson.dumps(state).decode()))
            for f in findings:
                key = f"{f.kind.value}:{f.key}"
                seen.add(key)
                new_id = self._record(conn, obs.run, rule, f, key, now, obs.interval)
                if new_id:
                    opened.append(new_id)
                if f.severity == Severity.critical and f.tensors:
                    request_snapshot(conn, obs.run, key, f.tensors, now)
        self._resolve(conn, obs, seen, now)
        self._verify_fixes(conn, obs, now)
        return opened

    def _state(self, conn: sqlite3.Connection, run: str, rule: Rule) -> dict:
        key = (run, rule.name)
        if key not in self._states:
            row = conn.execute("SELECT state FROM rule_state WHERE run=? AND rule=?", key).fetchone()
            self._states[key] = orjson.loads(row[0]) if row else rule.initial_state()
        return self._states[key]

    def forget(self, run: str) -> None:
        for key in [k for k in self._states if k[0] == run]:
            del self._states[key]
        self._run_rules.pop(run, None)
        self._starts.pop(run, None)

    def _record(self, conn: sqlite3.Connection, run: str, rule: Rule, f: Finding, key: str, now: float,
                interval: int) -> str | None:
        evidence = orjson.dumps(f.evidence).decode()
        row = conn.execute("SELECT id, severity, last_step FROM anomalies WHERE run=? AND key=? AND status='open'",
                           (run, key)).fetchone()
        lapse = self.settings.resolve_after_intervals * interval
        if row and f.first_step > row["last_step"] + lapse:
            # The condition lapsed long enough to resolve the anomaly and came back, within one batch: resolved
            # and reopened here as a stream of small batches would have, so that the same events give the same
            # anomalies however they were cut into batches.
            conn.execute("UPDATE anomalies SET status='resolved', resolved_step=?, updated_at=? WHERE id=?",
                         (row["last_step"] + lapse, now, row["id"]))
            row = None
        if row:
            severity = max(row["severity"], f.severity.value, key=_SEVERITY_ORDER.get)
            conn.execute("UPDATE anomalies SET last_step=max(last_step, ?), severity=?, message=?, evidence=?, "
                         "tensors=?, updated_at=? WHERE id=?",
                         (f.step, severity, f.message, evidence, orjson.dumps(f.tensors).decode(), now, row["id"]))
            return None
        cur = conn.execute(
            "INSERT INTO anomalies(run, kind, severity, status, first_step, last_step, tensors, message, evidence,"
            " rule, key, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run, f.kind.value, f.severity.value, AnomalyStatus.open.value, f.first_step, f.step,
             orjson.dumps(f.tensors).decode(), f.message, evidence, rule.name, key, now, now))
        anomaly_id = f"a-{cur.lastrowid}"
        conn.execute("UPDATE anomalies SET id=? WHERE seq=?", (anomaly_id, cur.lastrowid))
        return anomaly_id

    def _resolve(self, conn: sqlite3.Connection, obs: Observations, seen: set[str], now: float) -> None:
        horizon = obs.last_step - self.settings.resolve_after_intervals * obs.interval
        conn.execute("UPDATE anomalies SET status='resolved', resolved_step=?, updated_at=? "
                     "WHERE run=? AND status='open' AND last_step < ?",
                     (obs.last_step, now, obs.run, horizon))

    def _verify_fixes(self, conn: sqlite3.Connection, obs: Observations, now: float) -> None:
        rows = conn.execute("SELECT f.id, f.action, f.applied_step, a.kind, a.status AS astatus, "
                            "a.first_step AS afirst, a.resolved_step AS aresolved, a.evidence AS aevidence "
                            "FROM fixes f LEFT JOIN anomalies a ON a.id = f.anomaly_id "
                            # A fix with no anomaly (prune, sensitivity) has nothing to clear: no verdict.
                            "WHERE f.run=? AND f.status='applied' AND f.anomaly_id IS NOT NULL", (obs.run,)).fetchall()
        if not rows:
            return
        window = max(self.settings.verify_after_intervals * obs.interval, self.settings.verify_min_steps)
        names = objectives(conn, obs.run)
        for r in rows:
            applied = r["applied_step"] or 0
            if obs.last_step <= applied:
                continue
            evidence = orjson.loads(r["aevidence"]) if r["aevidence"] else {}
            fault = fault_step(conn, obs.run, r["afirst"] or 0, evidence, obs.interval)
            series = {name: objective_points(conn, obs.run, name, fault, applied, obs.last_step) for name in names}
            resolved = r["astatus"] == AnomalyStatus.resolved.value
            v = judge(series, fault_step=fault, applied_step=applied, now_step=obs.last_step, window=window,
                      max_windows=self.settings.verify_max_windows,
                      cleared_step=(r["aresolved"] or applied) if resolved else None,
                      still_open=r["astatus"] == AnomalyStatus.open.value, kind=r["kind"] or "its",
                      mitigation=r["action"] in MITIGATIONS, worse_margin=self.settings.worse_margin)
            if v.status is not None:
                self._verdict(conn, obs.run, r["id"], FixStatus(v.status), v.reason, now, v.detail())

    @staticmethod
    def _verdict(conn: sqlite3.Connection, run: str, fix_id: str, status: FixStatus, reason: str, now: float,
                 detail: dict[str, Any] | None = None) -> None:
        conn.execute("UPDATE fixes SET status=?, reason=?, updated_at=? WHERE id=?", (status.value, reason, now, fix_id))
        conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                     (run, now, "server", "verdict", fix_id,
                      orjson.dumps({"status": status.value, "reason": reason, **(detail or {})}).decode()))


def loss_median(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> float | None:
    vals = [r[0] for r in conn.execute("SELECT value FROM scalars WHERE run=? AND name='loss' AND step>=? AND step<=? "
                                       "AND value IS NOT NULL AND rank=0", (run, lo, hi))]
    if not vals:
        return None
    vals.sort()
    return vals[len(vals) // 2]


# Validation objectives a verdict also reads when the run logs them (the overfitting rule's names).
VALIDATION_NAMES = ("val_loss", "valid_loss", "validation_loss", "eval_loss")


def objectives(conn: sqlite3.Connection, run: str) -> list[str]:
    """The run's tracked objectives: the training loss and the validation losses it logs."""
    logged = {r[0] for r in conn.execute(
        f"SELECT DISTINCT name FROM scalars WHERE run=? AND name IN ({','.join('?' * len(VALIDATION_NAMES))})",
        (run, *VALIDATION_NAMES))}
    return ["loss", *[n for n in VALIDATION_NAMES if n in logged]]


def objective_points(conn: sqlite3.Connection, run: str, name: str, fault: int | None, applied: int,
                     now: int) -> list[tuple[int, float | None]]:
    """What a verdict reads of one objective (rank 0's, as the rules): the run's first points, the stretch
    before the fault, and everything from just before the fix until now; bounded whatever the run's length."""
    base = "SELECT step, value FROM scalars WHERE run=? AND name=? AND rank=0 AND "
    points = dict(conn.execute(base + "step>=0 ORDER BY step LIMIT ?", (run, name, START_POINTS)).fetchall())
    if fault is not None:
        points.update(conn.execute(base + "step<? ORDER BY step DESC LIMIT ?",
                                   (run, name, fault, 2 * REFERENCE_POINTS)).fetchall())
    points.update(conn.execute(base + "step>? AND step<=? ORDER BY step",
                               (run, name, applied - REFERENCE_POINTS, now)).fetchall())
    return sorted(points.items())
