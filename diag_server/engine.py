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

from .fixes import MITIGATIONS
from .rules import BUILTIN, Finding, Observations, Rule
from .store import add_message

_SEVERITY_ORDER = {Severity.info.value: 0, Severity.warning.value: 1, Severity.critical.value: 2}


@dataclass
class EngineSettings:
    # An anomaly is resolved when its rule has not reported it for this many sampling intervals.
    resolve_after_intervals: int = 3
    # A fix is judged this many sampling intervals (and at least verify_min_steps) after it was applied,
    # sooner if its anomaly clears. 200 steps: the demo's loss needs ~100 steps to settle after a
    # learning-rate fix, and the anomaly another 3 intervals to resolve (measurement here).
    verify_after_intervals: int = 6
    verify_min_steps: int = 200
    # A fix after which the loss median is this much higher than before is flagged for revert.
    worse_margin: float = 0.10
    # A fix after which the loss is below this fraction of what it was before counts as effective even if
    # its anomaly still holds (the demo's learning-rate fix takes the loss from ~5 to ~0.06 while the dead
    # ReLU units the spike left behind stay dead: measurement here).
    recovered_ratio: float = 0.5
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
        from .pipeline.evidence import request_snapshot

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
                new_id = self._record(conn, obs.run, rule, f, key, now)
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

    def _record(self, conn: sqlite3.Connection, run: str, rule: Rule, f: Finding, key: str, now: float) -> str | None:
        evidence = orjson.dumps(f.evidence).decode()
        row = conn.execute("SELECT id, severity, last_step FROM anomalies WHERE run=? AND key=? AND status='open'",
                           (run, key)).fetchone()
        if row:
            severity = max(row["severity"], f.severity.value, key=_SEVERITY_ORDER.get)
            conn.execute("UPDATE anomalies SET last_step=max(last_step, ?), severity=?, message=?, evidence=?, "
                         "tensors=?, updated_at=? WHERE id=?",
                         (f.step, severity, f.message, evidence, orjson.dumps(f.tensors).decode(), now, row["id"]))
            return None
        cur = conn.execute(
            "INSERT INTO anomalies(run, kind, severity, status, first_step, last_step, tensors, message, evidence,"
            " rule, key, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run, f.kind.value, f.severity.value, AnomalyStatus.open.value, min(f.since or f.step, f.step), f.step,
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
        rows = conn.execute("SELECT f.id, f.action, f.applied_step, f.verify, a.status AS astatus, a.last_step AS alast, "
                            "a.resolved_step AS aresolved "
                            "FROM fixes f LEFT JOIN anomalies a ON a.id = f.anomaly_id "
                            # A fix with no anomaly (prune, sensitivity) has nothing to clear: no verdict.
                            "WHERE f.run=? AND f.status='applied' AND f.anomaly_id IS NOT NULL", (obs.run,)).fetchall()
        for r in rows:
            applied = r["applied_step"] or 0
            window = max(self.settings.verify_after_intervals * obs.interval, self.settings.verify_min_steps)
            verify = orjson.loads(r["verify"]) if r["verify"] else {}
            resolved = r["astatus"] == AnomalyStatus.resolved.value
            # An anomaly that had cleared before the fix was applied says nothing about the fix: judge it
            # by the loss once the window has passed.
            early = resolved and (r["aresolved"] or 0) <= applied
            if (not resolved or early) and obs.last_step < applied + window:
                continue
            # Every verdict compares the loss since the fix with the loss before it: a fix that cleared its
            # anomaly but left the loss worse by the margin is flagged for revert too.
            # Where the loss is now (the last quarter of the window), not its median since the fix: a fix
            # that lets more of the model train may cost a transient before it pays off.
            after = loss_median(conn, obs.run, max(applied, obs.last_step - window // 4), obs.last_step)
            before = verify.get("loss_before")
            # ... and only while it is not coming down: a loss still falling fast is a transient, not harm.
            first = loss_median(conn, obs.run, applied, min(applied + window // 4, obs.last_step))
            falling = first is not None and after is not None and after < 0.8 * first
            # Judged on a full window only: an anomaly that clears within a few steps of its fix leaves the loss
            # where the fault put it, which says nothing yet about the fix (measurement here: a clip applied
            # after three corrupt batches, flagged at 35 steps and reverted, let the run blow up).
            full = obs.last_step - applied >= window
            worse = (full and before is not None and after is not None
                     and after > before * (1 + self.settings.worse_margin) and not falling)
            worse_text = f"; loss is worse ({after:.4g} vs {before:.4g} before): revert it" if worse else ""
            detail = {"loss_before": before, "loss_after": after, "revert_suggested": worse}
            if early:
                self._verdict(conn, obs.run, r["id"], FixStatus.ineffective if worse else FixStatus.effective,
                              f"the anomaly had cleared before the fix (step {r['aresolved']}); over the "
                              f"{obs.last_step - applied} steps since, the loss is "
                              + (f"{after:.4g} vs {before:.4g} before" if after is not None and before is not None
                                 else "not comparable") + worse_text, now, detail)
            elif resolved:
                self._verdict(conn, obs.run, r["id"], FixStatus.effective,
                              f"the anomaly cleared within {obs.last_step - applied} steps of the fix" + worse_text,
                              now, detail)
            elif r["action"] in MITIGATIONS and full and before is not None and after is not None and not worse:
                # Damping a table's noisy rows cannot clear what makes them noisy (their data is unchanged):
                # the anomaly holding is the expected state. What the fix promises is that those rows stop
                # chasing it without costing the run; measured, that gains validation MSE
                # (docs/embeddings.md), which the server does not see. So: judged on the loss, not on the anomaly.
                self._verdict(conn, obs.run, r["id"], FixStatus.effective,
                              f"the rows are damped; their data, which the anomaly describes, is unchanged, so the "
                              f"anomaly still holds, as expected; over the {obs.last_step - applied} steps since the "
                              f"fix the loss is {after:.4g} vs {before:.4g} before: not worse", now, detail)
            elif full and before is not None and after is not None and after < self.settings.recovered_ratio * before:
                # The run recovered (the loss fell by more than half) though this anomaly still holds: the
                # fix did its job; what remains (dead units a spike left behind, say) needs its own fix.
                self._verdict(conn, obs.run, r["id"], FixStatus.effective,
                              f"the loss fell from {before:.4g} to {after:.4g} within {obs.last_step - applied} "
                              "steps of the fix; the anomaly itself still holds and needs its own fix", now, detail)
            else:
                self._verdict(conn, obs.run, r["id"], FixStatus.ineffective,
                              f"the anomaly still held {obs.last_step - applied} steps after the fix" + worse_text,
                              now, detail)

    @staticmethod
    def _verdict(conn: sqlite3.Connection, run: str, fix_id: str, status: FixStatus, reason: str, now: float,
                 detail: dict[str, Any] | None = None) -> None:
        conn.execute("UPDATE fixes SET status=?, reason=?, updated_at=? WHERE id=?", (status.value, reason, now, fix_id))
        conn.execute("INSERT INTO audit(run, time, actor, action, fix_id, detail) VALUES (?,?,?,?,?,?)",
                     (run, now, "server", "verdict", fix_id,
                      orjson.dumps({"status": status.value, "reason": reason, **(detail or {})}).decode()))


def loss_median(conn: sqlite3.Connection, run: str, lo: int, hi: int) -> float | None:
    vals = [r[0] for r in conn.execute("SELECT value FROM scalars WHERE run=? AND name='loss' AND step>=? AND step<=? "
                                       "AND value IS NOT NULL", (run, lo, hi))]
    if not vals:
        return None
    vals.sort()
    return vals[len(vals) // 2]

