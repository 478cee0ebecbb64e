"""Loss-curve rules: divergence, no progress, oscillation, overfitting."""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, learning_rate, median, per_key, push, streak, weight_matrices


class LossDivergence(Rule):
    name = "loss_divergence"
    description = ("The training loss, smoothed by a running median, climbs well above the best it reached, by "
                   "a part of what the run has learned (a converged loss wandering near zero is not diverging); "
                   "critical once it is worse than when training began.")
    kinds = (AnomalyKind.loss_divergence,)
    params = {
        "window": Param(20, "measurement here: a 20-step median hides minibatch noise in the suite's runs",
                        "steps in the running median"),
        "ratio": Param(3.0, "measurement here: healthy runs of the suite stay under 1.6x their best median",
                       "smoothed loss / best smoothed loss that counts as diverging"),
        "min_rise": Param(0.05, "measurement here (benchmarks/healthy.py): a converged run's smoothed loss wanders "
                          "3x above its best by under 1% of where it began (a CNN at 0.006 from 2.3; an MLP at 2e-6); "
                          "a learning-rate fault's rise is 25% or more of it",
                          "the rise above the best must also exceed this fraction of the run's starting loss"),
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
            # Relative to the best alone, a converged loss is all noise (2e-6 is 3x a best of 6e-7): the rise must
            # also be a part of what the run has learned.
            if smooth > self.p.ratio * scale and smooth - best > max(self.p.min_rise * abs(state["first"]), 1e-6):
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
                out.append(f)
        return per_key(out, obs.interval)


class LossNotDecreasing(Rule):
    name = "loss_not_decreasing"
    description = ("After a fair number of steps past any learning-rate warmup, the training loss (running median) "
                   "is no lower than where it started: the run is not learning. A warning when the weights barely "
                   "move (a learning rate far too small, parameters left out of the optimizer); only an info while "
                   "they move at a healthy rate, since a plateau that a run crosses later (some tasks learn late) and "
                   "labels that do not match the inputs look the same until it does.")
    kinds = (AnomalyKind.loss_not_decreasing,)
    params = {
        "window": Param(20, "measurement here: a 20-step median hides minibatch noise in the suite's runs",
                        "steps in the running median"),
        "min_steps": Param(60, "smdebug LossNotDecreasing compares every num_steps=10 steps; 3 windows here so a "
                           "slow start is not flagged", "steps (after the warmup) before the rule judges"),
        "min_drop": Param(0.01, "smdebug LossNotDecreasing diff_percent=0.1%, loosened to 1% for minibatch noise "
                          "(measurement here: healthy suite runs drop >10% within 60 steps)",
                          "relative drop from the first window's median that counts as learning"),
        "moving": Param(1e-5, "100x below cs231n's ~1e-3 rule of thumb; measurement here: the suite's tiny-lr "
                        "fault moves its weights by ~1e-8 a step, a sparse-parity MLP on its plateau by 3e-3",
                        "median update/weight ratio at or above which the weights move at a healthy rate"),
    }

    def initial_state(self) -> dict:
        return {"recent": [], "first": None, "first_step": None, "learned": False, "lr": None, "warm_until": None,
                "moving": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        window = int(self.p.window)
        rates = learning_rate(obs)
        moves = {s: median(r) for s, rows in obs.sampled("updates")
                 if (r := [x["update_ratio"] for x in weight_matrices(obs, rows) if x.get("update_ratio") is not None])}
        # The loss in step order, with what the probe sampled at or before each step (the learning rate, the
        # update ratio), so that the same events read the same however they were cut into batches.
        marks = sorted({*rates, *moves})
        samples_updates = "updates" in (((obs.start or {}).get("config") or {}).get("collections") or [])
        at = 0
        for step, value in obs.series("loss"):
            while at < len(marks) and marks[at] <= step:
                s = marks[at]
                at += 1
                if s in rates:
                    if state["lr"] is not None and rates[s] > state["lr"]:
                        state["warm_until"] = s  # still warming up: the run cannot be judged before its peak rate
                    state["lr"] = rates[s]
                if s in moves:
                    state["moving"], state["moving_step"] = moves[s], s
            if value is None or state["learned"]:
                continue
            push(state["recent"], value, window)
            if len(state["recent"]) < window:
                continue
            smooth = median(state["recent"])
            if state["first"] is None:
                state["first"], state["first_step"] = smooth, step
                continue
            if smooth < state["first"] * (1 - self.p.min_drop):
                state["learned"] = True  # it learned once; a later plateau is not this rule's business
                continue
            since = max(state["first_step"] - window, state["warm_until"] if state["warm_until"] is not None else -1)
            if step - since < self.p.min_steps:
                continue
            # How fast the weights move, as sampled since the first window (a first step's update says nothing:
            # under a warmup from 0 it is exactly 0); a run that samples no updates is judged on its loss alone.
            if samples_updates and (state.get("moving_step") is None or state["moving_step"] < state["first_step"]):
                continue
            moving = state["moving"]
            healthy = moving is not None and moving >= self.p.moving
            out.append(Finding(
                AnomalyKind.loss_not_decreasing, Severity.info if healthy else Severity.warning, step,
                message=(f"The loss has not decreased in {step} steps (median {smooth:.4g} vs {state['first']:.4g} at "
                         "the start)"
                         + (f", though the weights move at a healthy rate (median update ratio {moving:.2g}): a "
                            "plateau that the run may yet cross (some tasks learn late), or labels that do not match "
                            "the inputs. Check the labels; if they are right, give it time." if healthy else
                            ". Check the learning rate (too small?), that the optimizer holds the model's parameters, "
                            "and that labels match inputs.")),
                evidence={"loss_median": smooth, "initial": state["first"], "steps": step,
                          "min_drop": self.p.min_drop, "median_update_ratio": moving}))
        return per_key(out, obs.interval)


class OscillatingLoss(Rule):
    name = "oscillating_loss"
    description = ("The training loss jumps up and down by a large part of its starting value from one step to "
                   "the next, instead of descending: the step size is too large for the batch noise.")
    kinds = (AnomalyKind.oscillating_loss,)
    params = {
        "window": Param(10, "measurement here", "steps whose step-to-step changes are looked at"),
        "amplitude": Param(0.5, "after AUTOTRAINER's oscillating-loss symptom; value a measurement here: healthy "
                           "suite runs stay below 0.1 of their initial loss, Adam at lr 0.1 on batches of 2 exceeds 1",
                           "median |loss change| per step, relative to the initial loss, that counts as oscillating"),
        "min_turns": Param(0.3, "measurement here: a diverging loss rises steadily, an oscillating one turns",
                           "fraction of steps where the direction changes"),
    }

    def initial_state(self) -> dict:
        return {"recent": [], "initial": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        window = int(self.p.window)
        for step, value in obs.series("loss"):
            if value is None:
                continue
            push(state["recent"], value, window + 1)
            if len(state["recent"]) <= window:
                continue
            if state["initial"] is None:
                state["initial"] = median(state["recent"])
            xs = state["recent"]
            deltas = [b - a for a, b in zip(xs, xs[1:])]
            jump = median([abs(d) for d in deltas])
            turns = sum(1 for a, b in zip(deltas, deltas[1:]) if a * b < 0) / max(len(deltas) - 1, 1)
            scale = max(abs(state["initial"]), 1e-12)
            if jump / scale > self.p.amplitude and turns >= self.p.min_turns:
                out.append(Finding(
                    AnomalyKind.oscillating_loss, Severity.warning, step,
                    message=(f"The loss swings by a median {jump:.3g} per step around step {step} "
                             f"({jump / scale:.1f}x its initial value {scale:.3g}). Lower the learning rate "
                             "or use larger batches."),
                    evidence={"median_jump": jump, "initial": scale, "turns": turns,
                              "amplitude": self.p.amplitude}))
        return per_key(out, obs.interval)


class Overfitting(Rule):
    name = "overfitting"
    description = ("The validation loss (a scalar named val_loss, or valid_loss/eval_loss) rises above its best "
                   "while the training loss keeps falling.")
    kinds = (AnomalyKind.overfitting,)
    params = {
        "margin": Param(0.1, "smdebug Overfit ratio_threshold default (0.1)",
                        "relative rise of val loss over its best that counts"),
        "patience": Param(2, "smdebug Overfit patience default is 1; 2 here because a validation loss on a few "
                          "hundred samples moves ~10% between evaluations (measurement here)",
                          "consecutive evaluations the rise must hold"),
        "min_rise": Param(0.05, "measurement here: near its minimum a healthy CNN's val loss moves by up to 3% of "
                          "its initial value between evaluations; evaluated every 100 steps, a converged CNN's val "
                          "loss moves 0.028 -> 0.033, one of 300 digits (benchmarks/healthy.py)",
                          "the rise must also exceed this fraction of the loss the run began at (the first "
                          "validation loss or the first training losses, whichever is larger)"),
    }
    names = ("val_loss", "valid_loss", "validation_loss", "eval_loss")

    def initial_state(self) -> dict:
        return {"best": None, "best_step": None, "train_at_best": None, "train": None, "streak": 0, "first": None,
                "train_first": []}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        out: list[Finding] = []
        points = sorted([(s, v, "val") for n in self.names for s, v in obs.series(n)]
                        + [(s, v, "train") for s, v in obs.series("loss")], key=lambda p: (p[0], p[2] == "val"))
        for step, value, what in points:
            if value is None:
                continue
            if what == "train":
                state["train"] = value if state["train"] is None else 0.8 * state["train"] + 0.2 * value
                first_train = state.setdefault("train_first", [])
                if len(first_train) < 20:  # as the loss rules' 20-step window: where training began
                    first_train.append(value)
                held = state.get("holding")
                if held:  # validation runs rarely: the finding holds until the next evaluation says otherwise
                    out.append(Finding(AnomalyKind.overfitting, Severity.warning, step, message=held["message"],
                                       evidence=held["evidence"]))
                continue
            if state["first"] is None:
                state["first"] = value
            if state["best"] is None or value < state["best"]:
                state.update(best=value, best_step=step, train_at_best=state["train"], streak=0, holding=None)
                continue
            # A run evaluated for the first time once it has learned has a small first validation loss, and a
            # rise of one misclassified sample is a part of it: the scale is where the run began.
            began = max(abs(state["first"]), median(state["train_first"]) if state.get("train_first") else 0.0)
            rising = value > state["best"] * (1 + self.p.margin) and value - state["best"] > self.p.min_rise * began
            falling = state["train"] is not None and state["train_at_best"] is not None and \
                state["train"] < state["train_at_best"]
            if streak(state, "streak", rising and falling) < self.p.patience:
                state["holding"] = None
                continue
            held = {"message": (f"Validation loss {value:.4g} at step {step} is {value / state['best'] - 1:.0%} "
                                f"above its best {state['best']:.4g} (step {state['best_step']}) while the "
                                f"training loss fell to {state['train']:.4g}: the model is memorising. Add "
                                "data or regularisation, or stop at the best checkpoint."),
                    "evidence": {"val_loss": value, "best_val_loss": state["best"], "best_step": state["best_step"],
                                 "train_loss": state["train"], "margin": self.p.margin}}
            state["holding"] = held
            out.append(Finding(AnomalyKind.overfitting, Severity.warning, step, message=held["message"],
                               evidence=held["evidence"]))
        return per_key(out, obs.interval)
