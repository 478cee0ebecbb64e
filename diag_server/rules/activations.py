"""Activation rules: dead ReLUs, saturated tanh/sigmoid, inputs off scale, probabilities where logits belong.

All read the ``activations`` collection, whose rows come in the order modules ran in the forward pass,
with ``<input>`` first and ``<output>`` last.
"""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, per_key, streak

_SPECIAL = ("<input>", "<output>")


class DeadRelu(Rule):
    name = "dead_relu"
    description = ("A ReLU-family layer has most of its units at zero for every sample of the batch: they "
                   "pass no gradient and no longer learn.")
    kinds = (AnomalyKind.dead_relu,)
    params = {
        "threshold": Param(0.5, "smdebug DeadRelu threshold_layer default (50% of a layer's units)",
                           "fraction of dead units reported (info below `warning`)"),
        "warning": Param(0.7, "measurement here: a healthy CNN's hidden FC layer settles at 27-56% dead units "
                         "over 5 seeds while it learns well; the faults reach 89-100%",
                         "fraction of dead units that is an alarm (warning)"),
        "critical": Param(0.95, "measurement here: a layer killed by a -10 bias is 100% dead",
                          "fraction at which the layer is effectively gone (critical)"),
        "patience": Param(2, "measurement here: healthy CNN layers sit at up to 45% on single batches",
                          "consecutive samples the layer must stay dead"),
    }

    def initial_state(self) -> dict:
        return {}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        for step, rows in obs.sampled("activations"):
            # NaN is not > 0, so a layer full of NaN would look dead: that is the nonfinite rule's business.
            dead = [(r["name"], r["dead_frac"]) for r in rows if r.get("dead_frac") is not None
                    and not (r.get("nan_count") or r.get("inf_count"))]
            # A layer that is (nearly) all dead is flagged at once; a partly dead one must stay so.
            held = [(n, f) for n, f in dead if streak(state, n, f > self.p.threshold) >= self.p.patience
                    or f >= self.p.critical]
            if not held:
                continue
            worst = max(f for _, f in held)
            names = [n for n, _ in sorted(held, key=lambda nf: -nf[1])]
            severity = (Severity.critical if worst >= self.p.critical else
                        Severity.warning if worst >= self.p.warning else Severity.info)
            out.append(Finding(
                AnomalyKind.dead_relu, severity,
                step, tensors=names,
                message=(f"{worst:.0%} of the units of '{names[0]}' are dead (zero for the whole batch) "
                         f"at step {step}" + (f", and {len(names) - 1} more layer(s)" if len(names) > 1 else "")
                         + ". Check bias initialisation and the learning rate; LeakyReLU or reinitialising "
                         "the dead units brings them back."),
                evidence={"dead_frac": worst, "layers": names, "threshold": self.p.threshold}))
        return per_key(out, obs.interval)


class SaturatedActivation(Rule):
    name = "saturated_activation"
    description = ("A tanh/sigmoid layer has most outputs pinned within 1% of its bounds, where its "
                   "gradient is ~0.")
    kinds = (AnomalyKind.saturated_activation,)
    params = {
        "threshold": Param(0.5, "smdebug SaturatedActivation threshold_layer default (50%); the 1% band matches "
                           "its threshold_tanh=0.97 closely", "fraction of saturated outputs that makes a layer saturated"),
        "patience": Param(1, "measurement here: healthy suite runs never exceed 1%", "consecutive samples"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        types = obs.module_types()
        for step, rows in obs.sampled("activations"):
            sat = [(r["name"], r["saturated_frac"]) for r in rows if r.get("saturated_frac") is not None
                   and types.get(r["name"]) not in ("Softmax",)  # softmax near 0/1 is its job
                   and not (r.get("nan_count") or r.get("inf_count"))]
            held = [(n, f) for n, f in sat if streak(state, n, f > self.p.threshold) >= self.p.patience]
            if not held:
                continue
            worst = max(f for _, f in held)
            names = [n for n, _ in held]
            out.append(Finding(AnomalyKind.saturated_activation, Severity.warning, step, tensors=names,
                               message=(f"{worst:.0%} of the outputs of '{names[0]}' are saturated at step {step}: its "
                                        "gradient is ~0 there. Normalise the inputs, lower the initial weight scale or "
                                        "use a non-saturating activation."),
                               evidence={"saturated_frac": worst, "layers": names, "threshold": self.p.threshold}))
        return per_key(out, obs.interval)


class InputNotNormalized(Rule):
    name = "input_not_normalized"
    description = "The model's input has a mean or spread far from unit scale (raw features, 0-255 pixels)."
    kinds = (AnomalyKind.input_not_normalized,)
    params = {
        "scale": Param(10.0, "UMLAUT (CHI 2021) flags inputs outside a unit range; 10 is a measurement here "
                       "(standardised suite inputs stay near 1; raw features reach 100s)",
                       "max(|mean|, std) of the input above this is off scale"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        for step, rows in obs.sampled("activations"):
            row = next((r for r in rows if r["name"] == "<input>"), None)
            if row is None or row.get("mean") is None or row.get("std") is None:
                continue
            scale = max(abs(row["mean"]), row["std"])
            if scale <= self.p.scale:
                continue
            out.append(Finding(
                AnomalyKind.input_not_normalized, Severity.warning, step, tensors=["<input>"],
                message=(f"The model's input has mean {row['mean']:.3g} and std {row['std']:.3g} at step "
                         f"{step} (range {row.get('min')}..{row.get('max')}). Standardise it (subtract the "
                         "mean, divide by the std) before the first layer."),
                evidence={"mean": row["mean"], "std": row["std"], "min": row.get("min"),
                          "max": row.get("max"), "scale_threshold": self.p.scale}))
        return per_key(out, obs.interval)


class OutputRangeMismatch(Rule):
    name = "output_range_mismatch"
    description = ("The model outputs probabilities (each row of C values in [0, 1] summing to 1: a softmax), "
                   "while losses such as CrossEntropyLoss expect raw logits and apply the softmax themselves. The "
                   "output must hold whole rows of C values, and the layer that made it, if it has weights, C "
                   "outputs.")
    kinds = (AnomalyKind.output_range_mismatch,)
    params = {
        "tolerance": Param(1e-3, "float32 rounding over a batch stays within 1e-4 here",
                           "relative distance of mean*classes from 1 that still counts as rows summing to 1"),
    }

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        modules = list(obs.module_types().items())
        last_type = modules[-1][1] if modules else None
        shapes = obs.param_shapes()
        for step, rows in obs.sampled("activations"):
            at = next((i for i, r in enumerate(rows) if r["name"] == "<output>"), None)
            row = rows[at] if at is not None else None
            if row is None or None in (row.get("min"), row.get("max"), row.get("mean")):
                continue
            lo, hi, mean = row["min"], row["max"], row["mean"]
            if lo < 0 or hi > 1 or mean <= 0:
                continue
            classes = round(1 / mean)
            if classes < 2 or abs(mean * classes - 1) > self.p.tolerance:
                continue
            # Rows of C probabilities: the output holds a whole number of rows of C values, and the layer that
            # made it, if it has weights, has C outputs. A regression's single column that happens to average
            # 1/13 (a run whose units died, say) is neither.
            if row.get("numel") and row["numel"] % classes:
                continue
            maker = rows[at - 1] if at and rows[at - 1].get("numel") == row.get("numel") else None
            width = (shapes.get(f"{maker['name']}.weight") or [None])[0] if maker else None
            if width is not None and width != classes:
                continue
            out.append(Finding(
                AnomalyKind.output_range_mismatch, Severity.warning, step, tensors=["<output>"],
                message=(f"The model's output looks like probabilities over {classes} classes at step {step} "
                         f"(all in [{lo:.3g}, {hi:.3g}], mean exactly 1/{classes})"
                         + (f"; its last layer is {last_type}" if last_type else "")
                         + ". CrossEntropyLoss and BCEWithLogitsLoss expect logits: drop the final "
                         "softmax/sigmoid (or use NLLLoss on log-probabilities)."),
                evidence={"min": lo, "max": hi, "mean": mean, "classes": classes, "last_module": last_type}))
        return per_key(out, obs.interval)
