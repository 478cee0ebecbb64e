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
    description = ("The global gradient norm jumps far above the median of the run's own recent healthy samples "
                   "and above anything the run produced while healthy, while the loss is not reaching new lows. "
                   "Names the layers whose norms grew most. A healthy run's gradients grow too: when it starts "
                   "learning after a plateau (the loss falls as they grow), and on a hard batch once it has "
                   "converged (its recent median has shrunk far below the norms it had early on).")
    kinds = (AnomalyKind.exploding_gradient,)
    params = {
        "factor": Param(10.0, "measurement here: healthy runs of the fault suite stay within 4x of their "
                        "recent median; AUTOTRAINER (ICSE 2021) uses a similar relative test on gradient norms",
                        "how many times the healthy median counts as exploding"),
        "peak": Param(1.0, "measurement here (benchmarks/healthy.py): a converged CNN's hard batch reaches 18x its "
                      "recent median yet 0.2x the norm of its first step; the suite's faults exceed every earlier "
                      "norm by 10-1e13x", "the norm must also exceed this times the largest healthy norm so far"),
        "absolute": Param(1e4, "measurement here: no healthy run of the suite exceeds 1e2; cf. smdebug "
                          "ExplodingTensor, which only checks NaN/Inf", "a global norm above this is exploding "
                          "whatever the history"),
        "warmup_samples": Param(3, "measurement here", "samples to see before judging relative growth"),
        "history": Param(20, "measurement here", "healthy samples kept for the median"),
    }

    def initial_state(self) -> dict:
        return {"healthy": [], "layers": {}, "peak": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out = []
        loss = LossHistory(state, obs)
        for step, rows in obs.sampled("gradients"):
            g = global_norm(rows)
            loss.upto(step)
            if g is None:
                continue
            healthy = state["healthy"]
            base = median(healthy) if len(healthy) >= self.p.warmup_samples else None
            ratio = g / base if base else None
            peak = state.get("peak")
            relative = (ratio is not None and ratio > self.p.factor and peak is not None
                        and g > self.p.peak * peak and not loss.improving(step))
            exploding = g > self.p.absolute or relative
            if not exploding:
                push(healthy, g, int(self.p.history))
                state["peak"] = g if peak is None else max(peak, g)
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
                         + (f"{ratio:.0f}x the run's healthy median {base:.3g} and above its largest healthy norm "
                            f"{peak:.3g}" if relative else "above the absolute limit")
                         + f"; largest growth in '{worst[0]}'. Clip gradients or lower the learning rate."),
                evidence={"global_norm": g, "healthy_median": base, "ratio": ratio,
                          "worst_tensor": worst[0], "factor": self.p.factor}))
        loss.finish()
        return per_key(out, obs.interval)


def _rms(row: dict) -> float | None:
    n, norm = row.get("numel"), row.get("norm")
    return norm / math.sqrt(n) if norm is not None and n else None


def _span(rows: list[dict]) -> str:
    """'first'..'last' of a run of tensors, or the one."""
    return f"'{rows[0]['name']}'" if len(rows) == 1 else f"'{rows[0]['name']}'..'{rows[-1]['name']}'"


# Parameters of these modules are looked up, not multiplied: a batch touches a few rows, so their RMS gradient
# over the table measures how few rows it touched, not how much signal reached the start of the network.
_LOOKUP_TYPES = ("Embedding", "EmbeddingBag")


class VanishingGradient(Rule):
    name = "vanishing_gradient"
    description = ("Gradients shrink to nothing on their way back while the run has not learned: the largest RMS "
                   "gradient of the first half of the weight layers is a tiny fraction of the second half's, or "
                   "every gradient is near zero. Embedding tables are left out (a batch touches a few of their "
                   "rows). A run whose loss has fallen well below where it began is learning, and a converged one "
                   "has tiny gradients by design: neither is flagged.")
    kinds = (AnomalyKind.vanishing_gradient,)
    params = {
        "ratio": Param(1e-3, "after AUTOTRAINER (ICSE 2021), which compares the first and last layers' gradients; "
                       "value a measurement here: healthy suite runs stay above 0.05, a 12-layer sigmoid MLP "
                       "sits near 3e-7", "first / second half's largest RMS gradient below this is vanishing"),
        "absolute": Param(1e-7, "smdebug VanishingGradient default threshold (1e-7)",
                          "a global RMS gradient below this is vanishing (when the loss is not already ~0)"),
        "min_loss": Param(1e-4, "measurement here: a fitted run's loss (memorised suite run ~2e-6) makes tiny "
                          "gradients legitimate", "below this loss, tiny gradients are not a problem"),
        "learned": Param(0.5, "measurement here: the deep sigmoid fault's loss stays within 10% of where it began; "
                         "the healthy corpus (benchmarks/healthy.py) falls below half of it, and a converged BERT "
                         "to 1e-3 of it", "a loss below this fraction of the run's starting loss has learned: "
                         "its gradients are not vanishing"),
        "patience": Param(1, "measurement here: one sample is enough at a 1000x gap",
                          "samples the condition must hold"),
    }

    def initial_state(self) -> dict:
        return {"streak": 0}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        loss = LossHistory(state, obs)
        for step, rows in obs.sampled("gradients"):
            loss.upto(step)
            mats = [r for r in weight_matrices(obs, rows)
                    if _rms(r) is not None and obs.owner_type(r["name"]) not in _LOOKUP_TYPES]
            if len(mats) < 2:
                continue
            # The first and the second half of the weight matrices, each by its largest RMS gradient: the layers
            # of one block learn at different rates by role (a transformer's query and key projections get ~1e-4
            # of its value projection's gradient at initialisation, while attention is uniform), while gradients
            # that vanish with depth are small across the whole first half (a 12-layer sigmoid MLP: 3e-7 of the
            # second half's).
            k = max(1, len(mats) // 2)
            head, tail = mats[:k], mats[-k:]
            first, last = max(_rms(r) for r in head), max(_rms(r) for r in tail)
            ratio = first / last if last else None
            total = math.sqrt(sum(r["norm"] ** 2 for r in mats) / max(sum(r["numel"] for r in mats), 1))
            now = loss.now
            loss_matters = (now is None or now > self.p.min_loss) and not loss.fallen(self.p.learned)
            vanishing = loss_matters and ((ratio is not None and ratio < self.p.ratio) or total < self.p.absolute)
            if streak(state, "streak", vanishing) < self.p.patience:
                continue
            tiny = [r["name"] for r in mats if (_rms(r) or 0) < self.p.ratio * (last or 0)] or [mats[0]["name"]]
            why = (f"the first weight layers {_span(head)} get {ratio:.2g}x the RMS gradient of the last "
                   f"{_span(tail)}" if ratio is not None and ratio < self.p.ratio
                   else f"the RMS gradient over all weights is {total:.2g}")
            start = loss.start
            out.append(Finding(
                AnomalyKind.vanishing_gradient, Severity.warning, step, tensors=tiny,
                message=(f"Vanishing gradients at step {step}: {why}, so the early layers barely learn"
                         + (f", and the loss ({now:.4g}) is still near where it began ({start:.4g})"
                            if start is not None and now is not None else "")
                         + ". Use ReLU-family activations, normalisation layers, residual connections or a better "
                           "initialisation."),
                evidence={"first_last_ratio": ratio, "rms_gradient": total, "first": head[0]["name"],
                          "last": tail[-1]["name"], "ratio_threshold": self.p.ratio, "loss": now,
                          "loss_at_start": start}))
        loss.finish()
        return per_key(out, obs.interval)
