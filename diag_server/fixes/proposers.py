"""Proposers for the anomaly kinds beyond the first three, and advice with code-level instructions.

Each proposer reads the anomaly's evidence (keys as the rules in diag_server/rules/ write them; looked
up defensively, since a user rule may report the same kind with less) and the run's stored history, and
returns ranked candidates with parameters computed from them. ``install(PROPOSERS)`` adds them to the
fix loop's table; diag_server/fixes/registry.py calls it once.
"""

from __future__ import annotations

import sqlite3
from typing import Callable

import orjson

from schemas.enums import AnomalyKind, FixAction
from schemas.records import Anomaly

from .candidates import Candidate, _clip_fix, _lr_history
from ..read.queries import get_anomaly
from ..rules.base import median

# The update/weight ratio to raise a too-small learning rate to. CS231n's rule of thumb puts a healthy
# ratio "around 1e-3" for a trained net; early in training healthy runs move faster: the repair suite's
# healthy run (SGD 0.01, momentum 0.9) sits at 3e-3 to 1.4e-2 in its first 120 steps (measurement here).
# 1e-2 is the top of that band; an overshoot is caught by the verification loop and set_lr reverts.
HEALTHY_UPDATE_RATIO = 1e-2
# Bounds on a learning-rate change the server proposes in one go. The update ratio is proportional to
# the rate (measurement here: SGD at 1e-5, 1e-6, 1e-7 moves 2.3e-5, 2.3e-6, 2.3e-7 per step), so the
# raise it implies is trusted up to five decades; cuts go down to 0.01x.
MAX_LR_RAISE = 1e5
MIN_LR_FACTOR, MAX_LR_CUT = 0.01, 0.5
# Healthy suite runs have median update ratios <= 0.05 even at step 0 (the abnormal_update_ratio rule's
# measurement); above it, the step size is the first suspect.
HIGH_UPDATE_RATIO = 0.05
HEALTHY_SWING = 0.1  # median |loss change| per step / initial loss in healthy runs (oscillating_loss rule)


# -- what the run's history says ---------------------------------------------------------------------
def _start(conn: sqlite3.Connection, run: str) -> dict:
    row = conn.execute("SELECT start FROM runs WHERE run=?", (run,)).fetchone()
    return orjson.loads(row[0]) if row and row[0] else {}


def _current_lr(conn: sqlite3.Connection, run: str, upto: int, start: dict) -> float | None:
    row = conn.execute("SELECT value FROM scalars WHERE run=? AND name='lr/group0' AND step<=? AND value IS NOT NULL "
                       "ORDER BY step DESC LIMIT 1", (run, upto)).fetchone()
    if row:
        return float(row[0])
    groups = (start.get("optimizer") or {}).get("param_groups") or []
    lr = groups[0].get("lr") if groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _update_ratio(conn: sqlite3.Connection, run: str, upto: int, samples: int = 5) -> float | None:
    """Median, over the last few samples, of the median update/weight ratio of the weight matrices."""
    rows = conn.execute("SELECT step, tensor, update_ratio FROM stats WHERE run=? AND collection='updates' AND step<=? "
                        "AND update_ratio IS NOT NULL ORDER BY step DESC LIMIT 2000", (run, upto)).fetchall()
    by_step: dict[int, list[float]] = {}
    for step, tensor, ratio in rows:
        if tensor.endswith("weight") and ratio > 0:
            by_step.setdefault(step, []).append(ratio)
    per_step = [median(v) for _, v in sorted(by_step.items(), reverse=True)[:samples]]
    return median(per_step) if per_step else None


def _num(evidence: dict, key: str) -> float | None:
    v = evidence.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _names(a: Anomaly, *keys: str) -> list[str]:
    for key in keys:
        v = a.evidence.get(key)
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            return list(v)
        if isinstance(v, str) and v:
            return [v]
    return list(a.tensors)


def _g(x: float) -> float:
    return float(f"{x:.3g}")


def _raise_lr(conn: sqlite3.Connection, a: Anomaly, start: dict, why: str) -> Candidate | None:
    """set_lr to the rate whose updates would sit at the healthy update/weight ratio (SGD's update is
    proportional to the rate; Adam's is too, to first order)."""
    lr = _current_lr(conn, a.run, a.last_step, start)
    ratio = _update_ratio(conn, a.run, a.last_step)
    if lr is None or lr <= 0:
        return None
    if ratio is not None:
        factor = min(max(HEALTHY_UPDATE_RATIO / ratio, 2.0), MAX_LR_RAISE)
        basis = (f"the weights move by a median {ratio:.2g} of their size per step, against ~{HEALTHY_UPDATE_RATIO:g} "
                 f"in healthy runs, so the rate is raised {factor:.3g}x (bounded to [2, {MAX_LR_RAISE:g}])")
    else:
        factor = 10.0
        basis = "no update statistics were collected, so the rate is raised one decade"
    new = _g(lr * factor)
    return Candidate(FixAction.set_lr, {"lr": new},
                     f"{why} The learning rate is {lr:.3g}; {basis}: set it to {new:g}.",
                     "The loss starts to fall within a few sampling intervals; the update/weight ratio moves "
                     f"towards {HEALTHY_UPDATE_RATIO:g}.", "medium")


def _cut_lr(conn: sqlite3.Connection, a: Anomaly, factor: float, why: str, effect: str) -> Candidate:
    prev, now, changed_at = _lr_history(conn, a.run, a.last_step)
    if prev is not None and now is not None and now > prev:
        return Candidate(FixAction.set_lr, {"lr": prev},
                         f"{why} The learning rate was raised from {prev:.3g} to {now:.3g} (step {changed_at}); the "
                         "run was steady at the old rate.", effect, "low")
    factor = _g(min(max(factor, MIN_LR_FACTOR), MAX_LR_CUT))
    return Candidate(FixAction.lr_scale, {"factor": factor}, f"{why} Scale the learning rate by {factor}.", effect,
                     "medium")


def advice(instructions: str, rationale: str, effect: str) -> Candidate:
    return Candidate(FixAction.advice, {"instructions": instructions}, rationale, effect, "low", live=False)


def _module_types(start: dict) -> dict[str, str]:
    return {m["name"]: m["type"] for m in start.get("modules") or [] if isinstance(m, dict) and "name" in m}


def _feeding_layer(start: dict, activation: str) -> str | None:
    """The weighted module registered just before ``activation`` (the layer that feeds it in a Sequential)."""
    names = [m["name"] for m in start.get("modules") or [] if isinstance(m, dict)]
    types = _module_types(start)
    if activation not in names:
        return None
    for name in reversed(names[:names.index(activation)]):
        if types.get(name, "").startswith(("Linear", "Conv")):
            return name
    return None


def _attr(name: str) -> str:
    """A module name as Python code: 'encoder.0.fc' -> model.encoder[0].fc."""
    out = "model"
    for part in name.split("."):
        out += f"[{part}]" if part.isdigit() else f".{part}"
    return out


# -- proposers ---------------------------------------------------------------------------------------
# Anomalies that say the step size is too large. Units that die while one of them holds were killed by
# it, and re-initialised units would die again: the step size is fixed first.
_STEP_TOO_LARGE = ("loss_divergence", "oscillating_loss", "exploding_gradient", "abnormal_update_ratio")


def _step_size_cause(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    # Open or already resolved: an oscillation that stopped once the units died still killed them.
    rows = conn.execute(f"SELECT id, kind, evidence FROM anomalies WHERE run=? AND id != ? AND first_step <= ? AND "
                        f"kind IN ({','.join('?' * len(_STEP_TOO_LARGE))}) ORDER BY status='open' DESC, first_step",
                        (a.run, a.id, a.last_step, *_STEP_TOO_LARGE))
    for row in rows:
        if row["kind"] == "abnormal_update_ratio" and orjson.loads(row["evidence"] or "{}").get("direction") == "low":
            continue
        cause = get_anomaly(conn, a.run, row["id"])
        proposer = _PROPOSERS.get(cause.kind)
        lr = [c for c in (proposer(conn, cause) if proposer else [])
              if c.live and c.action in (FixAction.rollback, FixAction.set_lr, FixAction.lr_scale)]
        for c in lr:
            c.rationale = (f"The units died while the step size was too large ({cause.kind.value} {cause.id} since "
                           f"step {cause.first_step}); re-initialised units would die again, so that comes first. "
                           + c.rationale)
        if lr:
            return lr
    # No such anomaly (units die within the first samples): the update sizes when they died may tell.
    ratio = _update_ratio(conn, a.run, a.first_step, samples=3)
    if ratio is not None and ratio > HIGH_UPDATE_RATIO:
        factor = _g(min(max(HEALTHY_UPDATE_RATIO / ratio, MIN_LR_FACTOR), MAX_LR_CUT))
        return [Candidate(FixAction.lr_scale, {"factor": factor},
                          f"The weights move by a median {ratio:.2g} of their size per step, above the {HIGH_UPDATE_RATIO:g} "
                          "healthy runs stay under: steps that large kill units, and re-initialised units would die "
                          f"again. Scale the learning rate by {factor:g} to bring the ratio to {HEALTHY_UPDATE_RATIO:g} "
                          "first.", "Updates of a healthy size; fewer units die. Re-initialise the dead ones after.",
                          "medium")]
    return []


def dead_relu(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    start = _start(conn, a.run)
    layers = _names(a, "layers")
    frac = _num(a.evidence, "dead_frac")
    out: list[Candidate] = _step_size_cause(conn, a)
    if layers:
        layer = layers[0]
        feeding = _feeding_layer(start, layer)
        out.append(Candidate(
            FixAction.reinit_dead_units, {"module": layer},
            f"{'Most' if frac is None else f'{frac:.0%}'} of the units of '{layer}' are zero for every sample: they pass no gradient and cannot "
            "recover by themselves. Re-initialise their incoming weights and bias "
            f"({'in ' + repr(feeding) if feeding else 'in the layer that feeds it'}) the way the layer was "
            "initialised; the job finds which units are dead on its next forward pass."
            + (f" {len(layers) - 1} more layer(s) are dead too: propose again once this one is fixed."
               if len(layers) > 1 else ""),
            f"The dead fraction of '{layer}' drops below the rule's threshold at the next samples and the loss "
            "resumes falling; live units keep what they learned.", "low"))
    prev, now, _ = _lr_history(conn, a.run, a.last_step)
    if prev is not None and now is not None and now > prev and not any(c.action == FixAction.set_lr for c in out):
        out.append(_cut_lr(conn, a, prev / now, "A rate raised mid-run is a common cause of units dying.",
                           "Fewer units die from now on; already dead ones stay dead without a re-init."))
    target = layers[0] if layers else "the activation"
    feeding = _feeding_layer(start, target) if layers else None
    out.append(advice(
        f"Replace {_attr(target) if layers else 'nn.ReLU()'} = nn.ReLU() with nn.LeakyReLU(0.01) so that units "
        "cannot die"
        + (f", and initialise the layer feeding it with torch.nn.init.kaiming_normal_({_attr(feeding)}.weight, "
           f"nonlinearity='relu'); torch.nn.init.zeros_({_attr(feeding)}.bias)" if feeding else "")
        + ". Then restart training.",
        "A restart with a leaky activation and a ReLU-aware initialisation prevents units from dying at all.",
        "No dead units from the start."))
    return out


def vanishing_gradient(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    """Advice only: no live fix helps. Measured here on sigmoid MLPs of 6 to 12 layers (SGD 0.1, 1500
    steps, the fault suite's data): scaling the starved layers' gradients by what lifts the first/last ratio
    to the rule's threshold (47x at 6 layers, the 100x bound beyond) left each at chance (1.390), exactly
    where the run without it ended; raising the rate 10x or 100x left them at chance or worse (2.01). Even the
    last layers learn nothing: the signal has vanished on the way forward as well."""
    start = _start(conn, a.run)
    ratio = _num(a.evidence, "first_last_ratio")
    types = _module_types(start)
    squashing = sorted({n for n, t in types.items() if t in ("Sigmoid", "Tanh")})
    return [advice(
        ("Replace the saturating activations " + ", ".join(f"{_attr(n)} ({types[n]})" for n in squashing[:6])
         + " with nn.ReLU(); " if squashing else "")
        + "insert an nn.LayerNorm(features) (or nn.BatchNorm1d/2d) after each hidden Linear/Conv, initialise "
        "hidden layers with torch.nn.init.kaiming_normal_(layer.weight, nonlinearity='relu'), and for deep "
        "stacks add residual connections (x = x + block(x)). Then restart training.",
        (f"The first weight layer gets {ratio:.2g}x the RMS gradient of the last. " if ratio else "")
        + "No live fix helps here: scaling the starved layers' gradients (up to 100x) or raising the learning "
        "rate left sigmoid MLPs of 6-12 layers at chance, where they ended without it (measurement here), since "
        "the signal vanishes on the way forward too. Gradients vanish through stacks of saturating activations "
        "without normalisation; these are the standard remedies (Glorot & Bengio 2010; Ioffe & Szegedy 2015; "
        "He et al. 2016).",
        "The first/last gradient ratio stays within 1e-2 of 1 and every layer learns.")]


def oscillating_loss(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    jump, initial = _num(a.evidence, "median_jump"), _num(a.evidence, "initial")
    amplitude = _num(a.evidence, "amplitude") or 0.5
    # The swings shrink roughly in proportion to the step size. Healthy suite runs swing by under 0.1 of
    # their initial loss (the oscillating_loss rule's measurement); aim at half that.
    factor = HEALTHY_SWING / 2 * initial / jump if jump and initial else 0.1
    out = [_cut_lr(conn, a, factor,
                   (f"The loss swings by a median {jump:.3g} per step ({jump / initial:.2g}x its initial value)."
                    if jump and initial else "The loss swings from step to step.")
                   + " The step is too large for the gradient noise; swings shrink roughly with the step size, so "
                   f"the factor aims at {HEALTHY_SWING / 2:g}x the initial loss, half of what healthy runs show "
                   f"(the rule fires at {amplitude:g}x; bounded to [{MIN_LR_FACTOR}, {MAX_LR_CUT}]).",
                   "The step-to-step swings shrink within a few intervals and the loss descends again.")]
    restart = _restart_at_lower_lr(conn, a, out[0])
    if restart is not None:
        out.insert(0, restart)
    out.append(advice("Increase the batch size (DataLoader(..., batch_size=4 * current)) or accumulate gradients "
                      "over 4 batches before optimizer.step(); then restart with the learning rate scaled to match.",
                      "Larger batches average out the gradient noise that makes the loss oscillate.",
                      "Smoother loss at the same learning rate."))
    return out


# Below this fraction of its initial value the loss has come down enough that a rollback to the start
# would throw away real progress: cut the rate in place instead. The oscillating fault of the repair suite
# sits at 0.58-0.83 of its initial loss (medians of 50 steps) over its first 200 steps, a healthy run at
# 0.02 by steps 50-100 (measurement here); the rule itself asks for swings of half the initial loss.
LEARNED_LITTLE = 0.3


def _early_update_ratio(conn: sqlite3.Connection, run: str, samples: int = 2) -> float | None:
    """Median, over the run's first sampled steps, of the median update/weight ratio of the weight matrices:
    the step size at the state a rollback to the start returns to."""
    rows = conn.execute("SELECT step, tensor, update_ratio FROM stats WHERE run=? AND collection='updates' AND "
                        "update_ratio IS NOT NULL AND step IN (SELECT DISTINCT step FROM stats WHERE run=? AND "
                        "collection='updates' ORDER BY step LIMIT ?)", (run, run, samples)).fetchall()
    by_step: dict[int, list[float]] = {}
    for step, tensor, ratio in rows:
        if tensor.endswith("weight") and ratio > 0:
            by_step.setdefault(step, []).append(ratio)
    per_step = [median(v) for v in by_step.values()]
    return median(per_step) if per_step else None


def _restart_at_lower_lr(conn: sqlite3.Connection, a: Anomaly, cut: Candidate) -> Candidate | None:
    """A run that has swung at the same rate since its start, and learned little, has nothing worth keeping
    and may carry damage a rate cut does not undo (ReLU units killed by the first large steps stay dead):
    go back to its first snapshot (step 0) with a lower rate, as a restart would, without a restart."""
    prev, now, _ = _lr_history(conn, a.run, a.last_step)
    initial = _num(a.evidence, "initial")
    if cut.action != FixAction.lr_scale or prev is not None or not now or not initial:
        return None  # the rate was changed mid-run: set_lr back to it is the fix
    row = conn.execute("SELECT value FROM scalars WHERE run=? AND name='loss' AND step<=? AND value IS NOT NULL "
                       "ORDER BY step DESC LIMIT 50", (a.run, a.last_step)).fetchall()
    recent = median([r[0] for r in row]) if row else None
    if recent is None or recent < LEARNED_LITTLE * initial:
        return None
    # The rate for the new start, from the step sizes of the first samples (the update ratio is proportional
    # to the rate: at 0.1 and 0.01 the repair suite's MLP moves 0.16-0.18 and 0.011-0.012 per step over its
    # first 10 steps, seeds 0-2: measurement here). The swings are not: far from stable they grow faster than
    # the rate, and the swing-based factor can cut 100x where 10x is right (seed 2 of the suite).
    ratio = _early_update_ratio(conn, a.run)
    if ratio:
        factor = _g(min(max(HEALTHY_UPDATE_RATIO / ratio, MIN_LR_FACTOR), MAX_LR_CUT))
        basis = (f"at the start the weights moved by a median {ratio:.2g} of their size per step, against "
                 f"~{HEALTHY_UPDATE_RATIO:g} in healthy runs: the rate is cut {factor:g}x")
    else:
        factor = cut.params["factor"]
        basis = f"the rate is cut {factor:g}x, as the swings suggest"
    lr = _g(now * factor)
    return Candidate(FixAction.rollback, {"before_step": 1, "lr": lr},
                     f"The learning rate has been {now:.3g} since the start and the loss is still {recent:.3g}, "
                     f"{recent / initial:.0%} of its initial {initial:.3g}: the run has learned little, and the "
                     "large steps may have done damage a rate cut leaves in place (dead units). Roll back to the "
                     f"snapshot of step 0 (the job keeps its first one) with a lower rate; {basis}, to {lr:g}. That "
                     "is what a restart at that rate would do, without restarting.",
                     "The loss descends from the start at the lower rate; the steps since the snapshot are lost, and "
                     "they taught the model little. Rejected if the job keeps no snapshot from then: apply the rate "
                     "cut instead.", "medium")


def loss_not_decreasing(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    start = _start(conn, a.run)
    out: list[Candidate] = []
    ratio = _update_ratio(conn, a.run, a.last_step)
    initial, now = _num(a.evidence, "initial"), _num(a.evidence, "loss_median")
    why = (f"The loss has not decreased ({now:.4g} vs {initial:.4g} at the start)." if initial and now
           else "The loss has not decreased.")
    if ratio is None or ratio < HEALTHY_UPDATE_RATIO / 10:
        raise_lr = _raise_lr(conn, a, start, why)
        if raise_lr:
            out.append(raise_lr)
    frozen = [p["name"] for p in start.get("params") or [] if isinstance(p, dict) and p.get("trainable") is False]
    if frozen:
        out.append(Candidate(FixAction.unfreeze, {"pattern": frozen},
                             f"{why} {len(frozen)} parameter tensor(s) have requires_grad=False: unfreeze them.",
                             "The frozen layers start to learn.", "medium"))
    out.append(advice("Check that the labels match the inputs (print a few (x, y) pairs), that the optimizer was "
                      "built from model.parameters() after the model was complete, and that loss.backward() and "
                      "optimizer.step() are both called each step.",
                      "When the updates are of a healthy size and the loss still does not fall, the data or the "
                      "training loop is at fault, which no live fix can repair.", "The loss falls after the fix."))
    return out


def abnormal_update_ratio(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    start = _start(conn, a.run)
    m = _num(a.evidence, "median_update_ratio") or _update_ratio(conn, a.run, a.last_step)
    direction = a.evidence.get("direction") or ("low" if m is not None and m < HEALTHY_UPDATE_RATIO else "high")
    if direction == "low":
        c = _raise_lr(conn, a, start, f"The weights move by a median {m:.2g} of their size per step: too little to "
                      "learn." if m else "The updates are too small to learn.")
        return [c] if c else []
    high = _num(a.evidence, "high") or 0.2
    factor = (high / 10) / m if m else 0.1  # aim a decade under the rule's 'too large' line
    return [_cut_lr(conn, a, factor, (f"The weights move by a median {m:.2g} of their size per step: every step "
                                      "rewrites them." if m else "The updates are too large.")
                    + f" The factor brings the ratio to {high / 10:g}, a decade under the rule's {high:g} limit.",
                    "Updates shrink to a fraction of the weights; the loss stops jumping."),
            *([_clip_fix(conn, a)] if _clip_fix(conn, a) else [])]


def unchanged_tensor(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
    start = _start(conn, a.run)
    tensors = _names(a, "tensors")
    if not tensors:
        return []
    trainable = {p["name"]: p.get("trainable", True) for p in start.get("params") or [] if isinstance(p, dict)}
    frozen = [t for t in tensors if trainable.get(t) is False]
    if frozen:
        why = (f"{len(frozen)} tensor(s) ({', '.join(frozen[:4])}) have requires_grad=False, so they never learn.")
    else:
        why = (f"{', '.join(tensors[:4])} get gradients but never change: they are missing from the optimizer "
               "(built before the layer was added, or from a filtered list).")
    modules = sorted({t.rsplit(".", 1)[0] for t in tensors if "." in t})
    return [Candidate(FixAction.unfreeze, {"pattern": tensors},
                      why + " Unfreeze them: requires_grad on, and those the optimizer does not hold are added to it "
                      "as a new param group with its default settings.",
                      "Their update ratio leaves zero at the next sample and the loss falls further.", "medium"),
            advice("Build the optimizer after the model is complete, from all of its parameters: "
                   "optimizer = torch.optim.<Optimizer>(model.parameters(), ...)"
                   + (f"; and remove any requires_grad_(False) on {', '.join(_attr(m) for m in modules[:4])}"
                      if modules else "") + ". Then restart training.",
                   "Fixes the cause for the next run; the live fix only adds the tensors for this one.",
                   "Every layer learns from the start.")]


# -- advice for the kinds no live action fixes ---------------------------------------------------------
def _advice_for(kind: AnomalyKind, text: Callable[[Anomaly, dict], str], why: str, effect: str) -> Callable:
    def propose(conn: sqlite3.Connection, a: Anomaly) -> list[Candidate]:
        return [advice(text(a, _start(conn, a.run)), why, effect)]

    return propose


def _input_text(a: Anomaly, start: dict) -> str:
    mean, std = _num(a.evidence, "mean"), _num(a.evidence, "std")
    stats = f"mean={mean:.4g}, std={std:.4g}" if mean is not None and std else "mean and std of the training set"
    return (f"Standardise the inputs before the first layer ({stats} as measured): compute mean = X_train.mean(0) "
            "and std = X_train.std(0) once, then feed (x - mean) / (std + 1e-8) (torchvision: "
            "transforms.Normalize(mean, std); tabular: sklearn.preprocessing.StandardScaler). Then restart training.")


def _init_text(a: Anomaly, start: dict) -> str:
    names = _names(a, "tensors", "tensor")
    layers = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    target = ", ".join(_attr(m) for m in layers[:4]) or "the flagged layers"
    return (f"Re-initialise {target} with the standard scale: for ReLU nets torch.nn.init.kaiming_normal_"
            "(layer.weight, nonlinearity='relu'); for tanh/sigmoid torch.nn.init.xavier_uniform_(layer.weight); "
            "biases torch.nn.init.zeros_(layer.bias) (or delete the custom init and keep PyTorch's default). "
            "Then restart training.")


def _saturation_text(a: Anomaly, start: dict) -> str:
    layers = _names(a, "layers")
    where = ", ".join(_attr(n) for n in layers[:4]) or "the saturated activation"
    return (f"Insert a normalisation layer before {where}: nn.LayerNorm(features) (or nn.BatchNorm1d(features) "
            "for MLPs, nn.BatchNorm2d(channels) for convs), standardise the inputs, or use nn.ReLU / nn.GELU "
            "instead of tanh/sigmoid. Then restart training.")


def _loader_text(a: Anomaly, start: dict) -> str:
    return ("Load batches in background workers: DataLoader(dataset, batch_size=..., num_workers=min(8, "
            "os.cpu_count()), pin_memory=True, persistent_workers=True, prefetch_factor=4); move per-sample "
            "decoding into Dataset.__getitem__ so the workers do it. Then restart training.")


def _output_text(a: Anomaly, start: dict) -> str:
    last = a.evidence.get("last_module") or "Softmax"
    return (f"Remove the final {last} from the model: nn.CrossEntropyLoss / nn.BCEWithLogitsLoss expect raw "
            "logits and apply (log-)softmax themselves (apply torch.softmax only at inference). Then restart.")


def _overfit_text(a: Anomaly, start: dict) -> str:
    step = a.evidence.get("best_step")
    return ("Regularise and stop early: add weight_decay=1e-4 (AdamW) or nn.Dropout(0.1) after hidden layers, "
            "augment or add data, and keep the checkpoint of the best validation loss"
            + (f" (step {step})" if step is not None else "") + ".")


def _memory_text(a: Anomaly, start: dict) -> str:
    return ("Do not keep tensors that hold the graph: log loss.item() (or tensor.detach().cpu()) instead of the "
            "tensor, clear lists of outputs each epoch, and wrap evaluation in torch.no_grad().")


def _fragmentation_text(a: Anomaly, start: dict) -> str:
    return ("Start the job with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and keep tensor shapes fixed "
            "across steps (pad variable-length batches to a few bucket sizes).")


_ADVICE: dict[AnomalyKind, Callable] = {
    AnomalyKind.input_not_normalized: _advice_for(AnomalyKind.input_not_normalized, _input_text,
                                                  "Inputs far from unit scale saturate activations and distort "
                                                  "gradients; standardising them is the usual first step.",
                                                  "Activations in range from the first step."),
    AnomalyKind.poor_weight_init: _advice_for(AnomalyKind.poor_weight_init, _init_text,
                                              "An initial scale far from the standard ones makes activations "
                                              "explode or vanish with depth (He et al. 2015; Glorot & Bengio 2010).",
                                              "Activations and gradients of similar size in every layer."),
    AnomalyKind.saturated_activation: _advice_for(AnomalyKind.saturated_activation, _saturation_text,
                                                  "Saturated tanh/sigmoid units have ~0 gradient; normalising what "
                                                  "feeds them keeps them in their linear range.",
                                                  "The saturated fraction drops below the threshold."),
    AnomalyKind.dataloader_bottleneck: _advice_for(AnomalyKind.dataloader_bottleneck, _loader_text,
                                                   "The training loop waits for data; workers load the next "
                                                   "batches while the model computes.",
                                                   "Data wait falls to near zero; steps per second rise."),
    AnomalyKind.output_range_mismatch: _advice_for(AnomalyKind.output_range_mismatch, _output_text,
                                                   "A softmax before a loss that applies its own squashes the "
                                                   "gradient and slows or stalls learning.",
                                                   "Faster, lower loss after the restart."),
    AnomalyKind.overfitting: _advice_for(AnomalyKind.overfitting, _overfit_text,
                                         "The validation loss rises while the training loss falls.",
                                         "A smaller gap between training and validation loss."),
    AnomalyKind.memory_growth: _advice_for(AnomalyKind.memory_growth, _memory_text,
                                           "Memory that grows every step is almost always tensors kept alive.",
                                           "Flat memory use over steps."),
    AnomalyKind.gpu_memory_fragmentation: _advice_for(AnomalyKind.gpu_memory_fragmentation, _fragmentation_text,
                                                      "Reserved memory far above allocated memory is fragmentation.",
                                                      "Reserved memory close to allocated memory."),
}


_PROPOSERS: dict = {}  # the fix loop's table, once installed: dead_relu consults the step-size proposers


def install(proposers: dict[AnomalyKind, Callable[[sqlite3.Connection, Anomaly], list[Candidate]]]) -> None:
    global _PROPOSERS
    _PROPOSERS = proposers
    proposers.update({
        AnomalyKind.dead_relu: dead_relu,
        AnomalyKind.vanishing_gradient: vanishing_gradient,
        AnomalyKind.oscillating_loss: oscillating_loss,
        AnomalyKind.loss_not_decreasing: loss_not_decreasing,
        AnomalyKind.abnormal_update_ratio: abnormal_update_ratio,
        AnomalyKind.unchanged_tensor: unchanged_tensor,
    })
    for kind, fn in _ADVICE.items():
        proposers.setdefault(kind, fn)


__all__ = ["advice", "install"]
