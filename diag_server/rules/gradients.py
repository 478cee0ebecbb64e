"""Gradient-norm rules: exploding gradients against the run's own healthy history."""

from __future__ import annotations

import math

from schemas.enums import AnomalyKind, Severity

from .base import (Finding, LossHistory, Observations, Param, Rule, median, per_key, push, streak,
                   weight_matrices)


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
        return per_key(out, obs.interval)


def _rms(row: dict) -> float | None:
    n, norm = row.get("numel"), row.get("norm")
    return norm / math.sqrt(n) if norm is not None and n else None


class VanishingGradient(Rule):
    name = "vanishing_gradient"
    description = ("Gradients shrink to nothing on their way back: the first weight layer's RMS gradient is "
                   "a tiny fraction of the last one's, or every gradient is near zero while the loss is not.")
    kinds = (AnomalyKind.vanishing_gradient,)
    params = {
        "ratio": Param(1e-3, "after AUTOTRAINER (ICSE 2021), which compares the first and last layers' gradients; "
                       "value a measurement here: healthy suite runs stay above 0.05, a 12-layer sigmoid MLP "
                       "sits near 1e-10", "first / last RMS gradient below this is vanishing"),
        "absolute": Param(1e-7, "smdebug VanishingGradient default threshold (1e-7)",
                          "a global RMS gradient below this is vanishing (when the loss is not already ~0)"),
        "min_loss": Param(1e-4, "measurement here: a fitted run's loss (memorised suite run ~2e-6) makes tiny "
                          "gradients legitimate", "below this loss, tiny gradients are not a problem"),
        "patience": Param(1, "measurement here: one sample is enough at a 1000x gap", "samples the condition must hold"),
    }

    def initial_state(self) -> dict:
        return {"streak": 0}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        loss = LossHistory(state, obs)
        for step, rows in obs.sampled("gradients"):
            loss.upto(step)
            mats = [r for r in weight_matrices(obs, rows) if _rms(r) is not None]
            if len(mats) < 2:
                continue
            first, last = _rms(mats[0]), _rms(mats[-1])
            ratio = first / last if last else None
            total = math.sqrt(sum(r["norm"] ** 2 for r in mats) / max(sum(r["numel"] for r in mats), 1))
            loss_matters = loss.now is None or loss.now > self.p.min_loss
            vanishing = loss_matters and ((ratio is not None and ratio < self.p.ratio) or total < self.p.absolute)
            if streak(state, "streak", vanishing) < self.p.patience:
                continue
            tiny = [r["name"] for r in mats if (_rms(r) or 0) < self.p.ratio * (last or 0)] or [mats[0]["name"]]
            why = (f"the first weight layer '{mats[0]['name']}' gets {ratio:.2g}x the RMS gradient of the last "
                   f"'{mats[-1]['name']}'" if ratio is not None and ratio < self.p.ratio
                   else f"the RMS gradient over all weights is {total:.2g}")
            out.append(Finding(AnomalyKind.vanishing_gradient, Severity.warning, step, tensors=tiny,
                               message=(f"Vanishing gradients at step {step}: {why}, so the early layers barely learn. "
                                        "Use ReLU-family activations, normalisation layers, residual connections or "
                                        "a better initialisation."),
                               evidence={"first_last_ratio": ratio, "rms_gradient": total, "first": mats[0]["name"],
                                         "last": mats[-1]["name"], "ratio_threshold": self.p.ratio}))
        loss.finish()
        return per_key(out, obs.interval)
