"""NaN or Inf in the loss, a user scalar, gradients, weights or activations: one anomaly per run.

Evidence says where it began: the first step, and the first tensor in forward order (activations are
reported in the order modules ran, so the first bad one is where the values went bad; the rest follow).
"""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule

# Scalars whose nulls mean "not finite". Anything else a user logs may legitimately be missing.
_WATCHED_PREFIXES = ("loss", "val_", "sys/", "lr/")
# Where a NaN shows first, from the earliest point of a step to the latest.
_COLLECTIONS = ("activations", "gradients", "weights", "embeddings")
# The probe sends this scalar (1.0) at each step an AMP GradScaler skipped (probes/amp.py): Inf/NaN in
# that step's gradients is the scaler doing its job, not a fault. It always arrives no later than the
# step's gradients (the probe sends scalars first), so remembering the last few such steps is enough.
AMP_SKIPPED = "amp/skipped"
_KEEP_SKIPPED = 256


class NonFinite(Rule):
    name = "nonfinite"
    description = ("NaN or Inf in the loss, in gradients, weights or activations. Names the first step "
                   "and the first tensor in forward order that went bad, since the rest follow from it.")
    kinds = (AnomalyKind.nonfinite,)

    params = {
        "episode_gap": Param(3, "measurement here: matches the engine's resolve-after of 3 intervals",
                             "sampling intervals without NaN/Inf after which a new NaN is a new episode"),
    }

    def initial_state(self) -> dict:
        return {"first": None, "last": None, "amp_skipped": []}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        skipped = state.setdefault("amp_skipped", [])
        new = [s for s, v in obs.series(AMP_SKIPPED) if v]
        if new:
            skipped[:] = sorted(set(skipped) | set(new))[-_KEEP_SKIPPED:]
        bad_steps: list[int] = []
        where: dict[str, tuple[int, str]] = {}  # what -> (first step in this batch, first name)
        for name, points in obs.scalars.items():
            if name.startswith(_WATCHED_PREFIXES):
                steps = [s for s, v in points if v is None]
                if steps:
                    bad_steps += steps
                    where.setdefault(f"scalar:{name}", (steps[0], name))
        tensors: list[str] = []
        for collection in _COLLECTIONS:
            for step, rows in obs.sampled(collection):
                if collection == "gradients" and step in skipped:
                    continue
                names = [r["name"] for r in rows if (r.get("nan_count") or 0) + (r.get("inf_count") or 0) > 0]
                if names:
                    bad_steps.append(step)
                    where.setdefault(collection, (step, names[0]))
                    if not tensors:
                        tensors = names
        if not bad_steps:
            return []
        latest = max(bad_steps)
        if state["last"] is not None and min(bad_steps) > state["last"] + self.p.episode_gap * obs.interval:
            state["first"] = None  # the run recovered (a rollback, say) and broke again: a new episode
        state["last"] = latest
        first = state["first"] or {}
        if not first:
            step0 = min(bad_steps)
            origin = min(where.items(), key=lambda kv: (kv[1][0], _rank(kv[0])))
            first = {"step": step0, "in": origin[0], "name": origin[1][1]}
            state["first"] = first
        message = (f"NaN/Inf since step {first['step']}, first in {first['in'].replace('scalar:', '')} "
                   f"'{first['name']}'; still present at step {latest}. Training has broken down: roll back "
                   "or skip non-finite steps, then find the cause (learning rate, a bad batch, a log/div by 0).")
        return [Finding(AnomalyKind.nonfinite, Severity.critical, latest, since=first["step"], tensors=tensors,
                        message=message,
                        evidence={"first_step": first["step"], "first_in": first["in"], "first_tensor": first["name"],
                                  "latest_step": latest, "seen_in": sorted(where)})]


def _rank(what: str) -> int:
    # At one step, forward order: activations (from <input> on), then the loss computed from them, then
    # gradients and weights. A scalar alone (between samples) still names the step.
    return {"activations": 0, "gradients": 2, "weights": 3}.get(what, 1)
