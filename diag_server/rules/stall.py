"""A run that stalled after a fault: its loss gave back most of what it had learned and stays there, flat,
while its updates have collapsed. Open until the loss comes back.

This is the state a fix of the cause alone can leave behind: Adam's second moments filled by a spike make
every later step tiny (a 2-layer transformer whose rate was raised 100x and set back sat at chance, 2.77,
against 2.04 before the fault, with a median update/weight ratio of 5e-6 against 2.5e-3: measurement
here), and weights thrown off by large steps do not come back by themselves. No other rule sees it: the
loss has not diverged (it is below 3x its best), it learned once (loss_not_decreasing stays quiet), and the
updates are small but not below abnormal_update_ratio's floor.
"""

from __future__ import annotations

from schemas.enums import AnomalyKind, Severity

from .base import Finding, Observations, Param, Rule, median, per_key, push, weight_matrices


class TrainingStalled(Rule):
    name = "training_stalled"
    description = ("After a fault, the training loss (running median) has given back most of the progress the "
                   "run had made and stays there, while the median update/weight ratio has collapsed far below "
                   "the run's own before the fault. Open until the loss comes back.")
    kinds = (AnomalyKind.training_stalled,)
    params = {
        "window": Param(20, "measurement here: a 20-step median hides minibatch noise in the suite's runs (as "
                        "loss_divergence)", "steps in the running median"),
        "lost": Param(0.5, "measurement here: the stalled transformer gave back 95% of its progress (2.77 against "
                      "2.04 at best, 2.77 at the start); healthy suite runs give back under 10% between samples",
                      "fraction of the progress (start - best) the running median has given back"),
        "min_rise": Param(0.1, "measurement here: healthy suite runs' running medians stay within 1.6x of their "
                          "best only on losses that fell 10x or more; on a loss with little room the rise must "
                          "still exceed minibatch noise", "the running median must also be this far above its best "
                          "(relative)"),
        "collapse": Param(0.1, "measurement here: the stalled transformer's update ratio fell 400x (5e-6 against "
                          "2.5e-3); a learning-rate decay over a healthy run lowers it, but with the loss at its best",
                          "median update ratio below this fraction of the run's own before the fault"),
        "sudden": Param(0.03, "measurement here: a transformer whose Adam state took one batch's 3840x loss moved "
                        "~100x less per step from one sample to the next, with the loss near its best; a step decay "
                        "of the rate drops the updates with the rate, which this divides out",
                        "whatever the loss, a median update ratio per unit of learning rate below this fraction of "
                        "the run's own is a stall too: the optimizer's state took a spike"),
        "patience": Param(3, "measurement here: three samples of collapsed updates rule out one quiet batch",
                          "consecutive update samples the condition must hold"),
        "recover": Param(0.25, "hysteresis: half of `lost`, so a loss hovering at the line does not open and close "
                         "the anomaly over and over", "it stays open until the running median has given back less "
                         "than this fraction of the progress"),
    }

    def initial_state(self) -> dict:
        return {"recent": [], "recent_steps": [], "first": None, "best": None, "best_step": None, "smooth": None,
                "left": None, "healthy_ratios": [], "lr": None,
                "streak": 0, "streak_loss": None, "open": None}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        window = int(self.p.window)
        events = sorted([(s, "a-loss", v) for s, v in obs.series("loss") if v is not None]
                        + [(s, "b-lr", v) for s, v in obs.series("lr/group0") if v is not None]
                        + [(s, "c-updates", rows) for s, rows in obs.sampled("updates")], key=lambda e: (e[0], e[1]))
        out: list[Finding] = []
        for step, what, value in events:
            if what == "a-loss":
                self._loss(state, step, value, window)
                continue
            if what == "b-lr":
                state["lr"] = value
                continue
            ratios = [r["update_ratio"] for r in weight_matrices(obs, value) if r.get("update_ratio") is not None]
            finding = self._updates(state, step, median(ratios) if ratios else None)
            if finding is not None:
                out.append(finding)  # folded by per_key: from the first step it held, as a stream reports it
        if state["open"] is None:
            return []  # it came back within this batch
        if not out and obs.series("loss"):
            finding = self._still_open(state, obs.series("loss")[-1][0])
            out = [finding] if finding is not None else []
        return per_key(out, obs.interval)

    def _loss(self, state: dict, step: int, value: float, window: int) -> None:
        push(state["recent"], value, window)
        push(state["recent_steps"], step, window)
        if len(state["recent"]) < window:
            return
        smooth = median(state["recent"])
        state["smooth"] = smooth
        if state["first"] is None:
            state["first"] = smooth
        if state["best"] is None or smooth < state["best"]:
            state["best"], state["best_step"] = smooth, step
        if self._near_best(state):
            state["left"] = None
        elif state["left"] is None:  # the running median just left its best: the fault began within the window
            state["left"] = self._onset(state)

    def _onset(self, state: dict) -> int:
        """The step the loss left its best at: the first of the window's steps from which on (nearly) every
        value is above the line (a jump at step f reads f)."""
        line = state["best"] * (1 + self.p.min_rise)
        values, steps = state["recent"], state["recent_steps"]
        for i in range(len(values)):
            later = values[i:]
            if values[i] > line and sum(v > line for v in later) >= 0.8 * len(later):
                return steps[i]
        return steps[0]

    def _near_best(self, state: dict) -> bool:
        return state["smooth"] <= state["best"] * (1 + self.p.min_rise) + 1e-12

    def _lost(self, state: dict) -> float | None:
        """The fraction of its progress the run has given back; None before it made any."""
        first, best, smooth = state["first"], state["best"], state["smooth"]
        if first is None or smooth is None or best >= 0.95 * first:  # it has not learned yet: nothing to lose
            return None
        return (smooth - best) / (first - best)

    def _updates(self, state: dict, step: int, ratio: float | None) -> Finding | None:
        if ratio is None or state["smooth"] is None:
            return None
        history = state["healthy_ratios"]  # [ratio, rate, step] of the samples while the loss was near its best
        healthy = median([h[0] for h in history]) if len(history) >= 3 else None
        lost = self._lost(state)
        # After a fault: most of the progress given back, and the updates a fraction of the run's own.
        after_fault = (lost is not None and lost >= self.p.lost and healthy is not None and healthy > 0
                       and ratio < self.p.collapse * healthy)
        # Flat: over the streak the running median has not made up a quarter of the way back to its best.
        if after_fault and state["streak_loss"] is not None:
            gap = state["streak_loss"] - state["best"]
            after_fault = state["smooth"] > state["streak_loss"] - 0.25 * gap
        # Or, whatever the loss: the updates fell far for what the rate is (the update ratio is proportional to
        # the rate, for SGD and Adam alike: a schedule's decay moves both, a spike in the state only the first).
        per_rate = [h[0] / h[1] for h in history if h[1]] if state["lr"] else []
        sudden = (len(per_rate) >= 3 and len(per_rate) == len(history) and ratio > 0
                  and ratio / state["lr"] < self.p.sudden * median(per_rate))
        if not (after_fault or sudden):
            if self._near_best(state):
                push(history, [ratio, state["lr"], step], 20)
            state["streak"], state["streak_loss"] = 0, None
            return self._still_open(state, step, ratio)
        if state["streak_loss"] is None:
            state["streak_loss"] = state["smooth"]
        state["streak"] += 1
        if state["streak"] < self.p.patience and state["open"] is None:
            return None
        if state["open"] is None:
            if after_fault:
                fault = state["left"] if state["left"] is not None else state["best_step"]
            else:  # after the last sample whose updates were of their usual size (the fall may take a few samples)
                usual = median(per_rate)
                fault = next((h[2] + 1 for h in reversed(history) if h[0] / h[1] >= 0.5 * usual), history[0][2])
            state["open"] = {"fault_step": fault, "mode": "loss" if after_fault else "updates"}
        state["open"].update(update_ratio=ratio, healthy_update_ratio=healthy)
        return self._finding(state, step)

    def _still_open(self, state: dict, step: int, ratio: float | None = None) -> Finding | None:
        """Once stalled, the anomaly holds until the loss has come back (a stall after a fault), or the updates
        have (a stall of the updates alone)."""
        held = state["open"]
        if held is None:
            return None
        if held.get("mode") == "updates":
            back = ratio is not None and ratio >= self.p.collapse * held["healthy_update_ratio"]
        else:
            lost = self._lost(state)
            back = lost is None or lost < self.p.recover or self._near_best(state)
        if back:
            state["open"] = None
            return None
        return self._finding(state, step)

    def _finding(self, state: dict, step: int) -> Finding:
        held = state["open"]
        lost = self._lost(state) or 0.0
        fault, ratio, healthy = held["fault_step"], held["update_ratio"], held["healthy_update_ratio"]
        moves = f"the weights move by a median {ratio:.2g} of their size per step against {healthy:.2g} before"
        if held.get("mode") == "updates":
            what = (f"{moves} ({healthy / ratio:.0f}x less, from one sample to the next, and not because the "
                    "learning rate fell): the optimizer's state took a spike (Adam's second moments keep one for "
                    f"~1000 steps), and the run learns at a fraction of its pace; the loss is {state['smooth']:.4g} "
                    f"(median of {int(self.p.window)} steps)")
        else:
            what = (f"the loss (median of {int(self.p.window)} steps) is {state['smooth']:.4g}, against "
                    f"{state['best']:.4g} before (step {state['best_step']}) and {state['first']:.4g} at the start: "
                    f"{lost:.0%} of what the run had learned is gone, and {moves}")
        # Its first step is when the stall showed, after the fault: the fault itself is the cause others name.
        return Finding(
            AnomalyKind.training_stalled, Severity.warning, step,
            message=(f"Training has stalled since the fault around step {fault}: {what}. A fix of the cause alone "
                     "does not bring it back (an adaptive optimizer's state filled by a spike, weights thrown "
                     "off): roll back to before the fault."),
            evidence={"fault_step": fault, "mode": held.get("mode", "loss"), "loss_median": state["smooth"],
                      "best": state["best"], "best_step": state["best_step"], "initial": state["first"],
                      "lost_fraction": lost, "update_ratio": ratio, "healthy_update_ratio": healthy,
                      "collapse": self.p.collapse})
