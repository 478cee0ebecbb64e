"""Gradient-norm rules: exploding gradients against the run's own healthy history."""

from __future__ import annotations

import math

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, median, push


def global_norm(rows: list[dict]) -> float | None:
    norms = [r["norm"] for r in rows if r.get("norm") is not None]
    if not norms or len(norms) < len(rows):
        return None  # a non-finite gradient has no norm: that is the nonfinite rule's business
    return math.sqrt(sum(n * n for n in norms))


class ExplodingGradient(Rule):
    name = "exploding_gradient"
    description = ("The global gradient norm jumps far above the median of the run's own recent healthy "
                   "samples. Names the layers whose norms grew most.")
    kinds = (AnomalyKind.exploding_gradient,)
    params = {
        "factor": Param(10.0, "measurement here: healthy runs of the fault suite stay within 4x of their "
                        "recent median; AUTOTRAINER (ICSE 2021) uses a similar relative test on gradient norms",
                        "how many times the healthy median counts as exploding"),
        "absolute": Param(1e4, "measurement here: no healthy run of the suite exceeds 1e2; cf. smdebug "
                          "ExplodingTensor, which only checks NaN/Inf", "a global norm above this is exploding "
                          "whatever the history"),
        "warmup_samples": Param(3, "measurement here", "samples to see before judging relative growth"),
        "history": Param(20, "measurement here", "healthy samples kept for the median"),
    }

    def initial_state(self) -> dict:
        return {"healthy": [], "layers": {}}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out = []
        for step, rows in obs.sampled("gradients"):
            g = global_norm(rows)
            if g is None:
                continue
            healthy = state["healthy"]
            base = median(healthy) if len(healthy) >= self.p.warmup_samples else None
            ratio = g / base if base else None
            exploding = g > self.p.absolute or (ratio is not None and ratio > self.p.factor)
            if not exploding:
                push(healthy, g, int(self.p.history))
                for r in rows:
                    push(state["layers"].setdefault(r["name"], []), r["norm"], int(self.p.history))
                continue
            grown = []
            for r in rows:
                hist = state["layers"].get(r["name"])
                if hist and median(hist) > 0:
                    grown.append((r["norm"] / median(hist), r["name"]))
            worst = [n for f, n in sorted(grown, reverse=True) if f > self.p.factor / 2] or [
                max(rows, key=lambda r: r["norm"])["name"]]
            order = {r["name"]: i for i, r in enumerate(rows)}
            worst.sort(key=order.get)
            severe = (ratio is not None and ratio > 10 * self.p.factor) or g > 100 * self.p.absolute
            out.append(Finding(
                AnomalyKind.exploding_gradient, Severity.critical if severe else Severity.warning, step,
                tensors=worst,
                message=(f"Gradient norm {g:.3g} at step {step} is "
                         + (f"{ratio:.0f}x the run's healthy median {base:.3g}" if ratio else "above the absolute limit")
                         + f"; largest growth in '{worst[0]}'. Clip gradients or lower the learning rate."),
                evidence={"global_norm": g, "healthy_median": base, "ratio": ratio,
                          "worst_tensor": worst[0], "factor": self.p.factor}))
        return out
