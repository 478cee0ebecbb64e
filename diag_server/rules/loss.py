"""Loss-curve rules: divergence."""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, median, push


class LossDivergence(Rule):
    name = "loss_divergence"
    description = ("The training loss, smoothed by a running median, climbs well above the best it "
                   "reached; critical once it is worse than when training began.")
    kinds = (AnomalyKind.loss_divergence,)
    params = {
        "window": Param(20, "measurement here: a 20-step median hides minibatch noise in the suite's runs",
                        "steps in the running median"),
        "ratio": Param(3.0, "measurement here: healthy runs of the suite stay under 1.6x their best median",
                       "smoothed loss / best smoothed loss that counts as diverging"),
    }

    def initial_state(self) -> dict:
        return {"recent": [], "best": None, "first": None, "best_step": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        window = int(self.p.window)
        for step, value in obs.series("loss"):
            if value is None:
                continue  # non-finite: the nonfinite rule says so
            push(state["recent"], value, window)
            if len(state["recent"]) < window:
                continue
            smooth = median(state["recent"])
            if state["first"] is None:
                state["first"] = smooth
            best = state["best"]
            if best is None or smooth < best:
                state["best"], state["best_step"] = smooth, step
                continue
            scale = max(abs(best), 1e-12)
            if smooth > self.p.ratio * scale and smooth - best > 1e-6:
                worse_than_start = smooth > state["first"]
                f = Finding(
                    AnomalyKind.loss_divergence, Severity.critical if worse_than_start else Severity.warning,
                    step,
                    message=(f"Loss {smooth:.4g} (median of {window} steps) at step {step} is "
                             f"{smooth / scale:.1f}x its best {best:.4g} (step {state['best_step']})"
                             + ("; worse than at the start" if worse_than_start else "")
                             + ". Lower the learning rate or roll back."),
                    evidence={"loss_median": smooth, "best": best, "best_step": state["best_step"],
                              "ratio": smooth / scale, "initial": state["first"]})
                if out and out[-1].kind == f.kind:
                    out[-1] = f  # one finding per batch is enough; keep the latest evidence
                else:
                    out.append(f)
        return out
