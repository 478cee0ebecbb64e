"""Weight and update rules: poor initial scale, update/weight ratios off the healthy band, tensors that never change."""

from __future__ import annotations

import math

from schemas.enums import AnomalyKind, Severity

from .base import (Finding, LossHistory, Observations, Param, Rule, learning_rate, median, per_key, streak,
                   weight_matrices)

_INIT_CHECKED = ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
                 "Bilinear")


class PoorWeightInit(Rule):
    name = "poor_weight_init"
    description = ("A Linear/Conv weight's scale is far from what the standard initialisations give "
                   "(std * sqrt(fan_in) is ~0.6 for PyTorch's default, ~1 for LeCun/Xavier, ~1.4 for Kaiming), "
                   "or it is all zeros, so units start symmetric. Too small is not flagged in a model with "
                   "normalisation layers, which rescale it (transformers draw every weight with std 0.02).")
    kinds = (AnomalyKind.poor_weight_init,)
    params = {
        "factor": Param(10.0, "smdebug PoorWeightInitialization threshold default (10)",
                        "std * sqrt(fan_in) above this factor (or below 1/(factor*2)) is poor"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        if state.get("done"):
            return []
        shapes = obs.param_shapes()
        # Transformer recipes (BERT, GPT-2, ViT) draw every weight with one small std (0.02) whatever its fan-in,
        # and normalisation layers rescale what small weights make: in a model that normalises, a small scale
        # neither vanishes through depth nor leaves units symmetric (measurement here: ViT's 2x2 patch projection
        # of a 1-channel image starts at 0.04 and trains well).
        normalises = any("Norm" in t for t in obs.module_types().values())
        out: list[Finding] = []
        for step, rows in obs.sampled("weights"):
            state["done"] = True  # judged on the first sample: the initial weights
            bad = []
            for r in rows:
                shape = shapes.get(r["name"], [])
                if len(shape) < 2 or obs.owner_type(r["name"]) not in _INIT_CHECKED or r.get("std") is None:
                    continue
                fan_in = math.prod(shape[1:])
                scaled = r["std"] * math.sqrt(fan_in)
                if scaled > self.p.factor or (scaled < 1 / (2 * self.p.factor) and not normalises):
                    bad.append((r["name"], scaled))
            if bad:
                name, scaled = bad[0]
                out.append(Finding(
                    AnomalyKind.poor_weight_init, Severity.warning, step, tensors=[n for n, _ in bad],
                    message=(f"'{name}' starts with std*sqrt(fan_in) = {scaled:.3g} (standard inits give "
                             "0.6-1.4): activations will " + ("explode" if scaled > 1 else "vanish or stay "
                             "symmetric") + " through depth. Use the default, Kaiming or Xavier init."),
                    evidence={"tensor": name, "scaled_std": scaled, "factor": self.p.factor,
                              "tensors": [n for n, _ in bad]}))
            break
        return per_key(out, obs.interval)


class AbnormalUpdateRatio(Rule):
    name = "abnormal_update_ratio"
    description = ("The size of an optimizer step relative to the weights (||dW|| / ||W||, median over weight "
                   "matrices) is far outside the healthy band around 1e-3: too small to learn, or so large that "
                   "each step rewrites the weights. Small is judged at the run's peak learning rate (a warmup or a "
                   "decay makes steps small by design) and only while the run has not learned (a fitted model "
                   "stops moving).")
    kinds = (AnomalyKind.abnormal_update_ratio,)
    params = {
        "low": Param(1e-6, "cs231n's rule of thumb puts healthy ratios near 1e-3; 1e-6 is 1000x below it (smdebug "
                     "WeightUpdateRatio's small_threshold is 1e-8)", "median ratio (scaled to the run's peak learning "
                     "rate) below this is too small"),
        "high": Param(0.2, "measurement here: healthy suite runs (Adam up to 3e-3) have medians <= 0.05 even at "
                      "step 0; smdebug's large_threshold is 10", "median ratio above this is too large"),
        "patience": Param(1, "measurement here", "consecutive samples"),
        "min_loss": Param(1e-4, "measurement here: a run that has fitted its data legitimately stops moving",
                          "tiny updates at a loss below this are not flagged"),
        "learned": Param(0.5, "as vanishing_gradient.learned: a run whose loss fell below half its start moves "
                         "enough to learn", "tiny updates once the loss is below this fraction of its start are "
                         "not flagged"),
    }

    def initial_state(self) -> dict:
        return {"lr": None, "peak_lr": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        loss = LossHistory(state, obs)
        rates = learning_rate(obs)
        for step, rows in obs.sampled("updates"):
            loss.upto(step)
            lr, rising = state.get("lr"), False
            if step in rates:
                rising = lr is not None and rates[step] > lr  # a warmup: the rate is still climbing to its peak
                lr = state["lr"] = rates[step]
                state["peak_lr"] = max(state.get("peak_lr") or 0.0, lr)
            ratios = [r["update_ratio"] for r in weight_matrices(obs, rows) if r.get("update_ratio") is not None]
            if not ratios:
                continue
            m = median(ratios)
            peak = state.get("peak_lr")
            at_peak = m * peak / lr if lr and peak else m  # what the step would be at the run's peak rate
            fitted = (loss.now is not None and loss.now < self.p.min_loss) or loss.fallen(self.p.learned)
            low = at_peak < self.p.low and m > 0 and not fitted and not rising
            high = m > self.p.high
            if streak(state, "streak", low or high) < self.p.patience:
                continue
            what = "too small to learn: check the learning rate" if low else \
                "so large that every step rewrites the weights: lower the learning rate"
            scaled = f" ({at_peak:.2g} at the run's peak learning rate {peak:.3g})" if low and at_peak != m else ""
            out.append(Finding(AnomalyKind.abnormal_update_ratio, Severity.warning, step,
                               message=f"Median update/weight ratio {m:.2g}{scaled} at step {step} is {what} "
                                       "(healthy is ~1e-3).",
                               evidence={"median_update_ratio": m, "at_peak_lr": at_peak, "lr": lr, "peak_lr": peak,
                                         "low": self.p.low, "high": self.p.high,
                                         "direction": "low" if low else "high"}))
        loss.finish()
        return per_key(out, obs.interval)


class UnchangedTensor(Rule):
    name = "unchanged_tensor"
    description = ("A trainable parameter receives a non-zero gradient but the optimizer step leaves it exactly "
                   "as it was: it is missing from the optimizer, its learning rate is 0, or its update underflows.")
    kinds = (AnomalyKind.unchanged_tensor,)
    params = {
        "samples": Param(2, "smdebug UnchangedTensor num_steps default is 3 saved steps; 2 samples here, since "
                         "an update of exactly 0 under a non-zero gradient is never noise", "consecutive samples"),
        "rtol": Param(1e-12, "float32 cannot represent a relative change below ~6e-8, so only exact no-ops pass",
                      "update ratio at or below this counts as unchanged"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        # The tensors with a gradient at each sampled step. The probe sends a step's gradients before its
        # updates; the last sample's are kept, for a batch that ends between the two.
        moved = {step: [r["name"] for r in rows if r.get("norm")] for step, rows in obs.sampled("gradients")}
        last = state.pop("_gradients", None)
        if last and last["step"] not in moved:
            moved[last["step"]] = last["names"]
        if moved:
            step = max(moved)
            state["_gradients"] = {"step": step, "names": moved[step]}
        for step, rows in obs.sampled("updates"):
            with_grad = set(moved.get(step, ()))
            held = []
            for r in rows:
                unchanged = (r.get("update_ratio") is not None and r["update_ratio"] <= self.p.rtol
                             and r["name"] in with_grad)
                if streak(state, r["name"], unchanged) >= self.p.samples:
                    held.append(r["name"])
            if held:
                out.append(Finding(
                    AnomalyKind.unchanged_tensor, Severity.warning, step, tensors=held,
                    message=(f"'{held[0]}'" + (f" and {len(held) - 1} more" if len(held) > 1 else "")
                             + f" get gradients but have not changed over {int(self.p.samples)} samples "
                             f"(step {step}). Is the parameter in the optimizer? Is its learning rate 0?"),
                    evidence={"tensors": held, "samples": self.p.samples}))
        return per_key(out, obs.interval)
