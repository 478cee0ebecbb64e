"""The live compression actions: ``prune`` (masks kept through the rest of training) and ``sensitivity``.

``prune`` takes the recipe's per-layer sparsities, picks each layer's mask by Fisher-weighted saliency
(with the fisher collection's K-FAC factors: the OBS saliency and weight update of probes.pruning; with
only a diagonal: OBD's w^2 * F), and keeps the masks from then on: gradients of pruned weights are zeroed
before each optimizer step and the weights after it, so the job fine-tunes under the masks. Gradual
pruning (``rounds`` > 1) follows Zhu & Gupta (2017)'s cubic ramp, one round every ``every`` steps, as
movement pruning does (Sanh et al. 2020); ``every=0`` runs the rounds back to back at once. Revert
restores the weights as they were before the fix.

``sensitivity`` measures, on the batch the job handed to ``probe.set_held_batch``, the loss change when
each layer alone is pruned to several sparsities or cast to fp16 / bf16 / int8 (HAWQ's per-layer
sensitivity, Dong et al. 2019, measured rather than estimated), and sends it as a ``layer_profiles``
event. The model is left as it was.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from . import pruning
from .fisher import find
from .fixes import Applied, FixRejected, Target, need_optimizer, number

DEFAULT_SENSITIVITY_SPARSITIES = (0.5, 0.8, 0.9, 0.95)
PRECISIONS = ("fp16", "bf16", "int8")
STRUCTURES = ("unstructured", "channels")


class _Handles:
    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _list(params: Mapping, key: str) -> list:
    value = params.get(key)
    if not isinstance(value, list) or not value:
        raise FixRejected(f"parameter {key!r} must be a non-empty list")
    return value


def _plan(t: Target, params: Mapping, bounds: Mapping) -> list[tuple[str, torch.nn.Parameter, float, str]]:
    names, sparsity = _list(params, "layers"), _list(params, "sparsity")
    if len(names) != len(sparsity):
        raise FixRejected(f"'layers' has {len(names)} names but 'sparsity' {len(sparsity)} values")
    structure = params.get("structure", "unstructured")
    structures = structure if isinstance(structure, list) else [structure] * len(names)
    if len(structures) != len(names) or any(s not in STRUCTURES for s in structures):
        raise FixRejected(f"'structure' must be one of {STRUCTURES}, or a list of them, one per layer")
    named = dict(t.model.named_parameters())
    unknown = [n for n in names if n not in named]
    if unknown:
        raise FixRejected(f"no parameter named {unknown[:5]} in this model")
    hi = float(bounds.get("max_sparsity", 0.99))
    out = []
    for n, s, st in zip(names, sparsity, structures):
        s = number({"sparsity": s}, "sparsity", 0.0, hi)
        out.append((str(n), named[n], s, st))
    return out


def prune(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    opt = need_optimizer(t)
    plan = _plan(t, params, bounds)
    rounds = int(number(params, "rounds", 1, bounds.get("max_rounds", 1000), 1))
    # every=0: all rounds now, one after another (iterative OBS, as WoodFisher's multi-step pruning).
    every = int(number(params, "every", 0, bounds.get("max_every", 1e7), 1))
    fisher = find(t.probe)
    saved = {n: p.detach().clone() for n, p, _, _ in plan}
    masks = {n: torch.ones_like(p, dtype=torch.bool) for n, p, _, _ in plan}
    state = {"round": 0, "steps": 0}

    def do_round() -> None:
        state["round"] += 1
        for n, p, s, st in plan:
            target = pruning.cubic_schedule(s, state["round"], rounds)
            curv = fisher.curvature(n) if fisher is not None else None
            new, keep = pruning.prune_weight(p, curv, target, structure=st, keep=masks[n])
            masks[n] = keep
            with torch.no_grad():
                p.copy_(new)
            for v in opt.state.get(p, {}).values():  # stale momentum of pruned weights would only fight the mask
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    v.mul_(keep)

    def before_step(*_: Any) -> None:
        for n, p, _, _ in plan:
            if p.grad is not None:
                p.grad.mul_(masks[n])

    def after_step(*_: Any) -> None:
        state["steps"] += 1
        if state["round"] < rounds and every and state["steps"] % every == 0:
            do_round()
        with torch.no_grad():
            for n, p, _, _ in plan:
                p.mul_(masks[n])

    before = [float((p == 0).float().mean()) for _, p, _, _ in plan]
    do_round()
    while every == 0 and state["round"] < rounds:
        do_round()
    handles = _Handles(opt.register_step_pre_hook(before_step), opt.register_step_post_hook(after_step))
    t.hooks[fix_id] = handles
    names = [n for n, _, _, _ in plan]

    def undo() -> dict:
        handles.remove()
        t.hooks.pop(fix_id, None)
        with torch.no_grad():
            for n, p, _, _ in plan:
                p.copy_(saved[n])
        return {"layers": names, "sparsity": before}

    after = [float((~masks[n]).float().mean()) for n in names]
    return Applied({"layers": names, "sparsity": before},
                   {"layers": names, "sparsity": after, "rounds": rounds, "every": every,
                    "method": "obs-kfac" if fisher is not None and fisher.layers else "magnitude"}, undo)


def _held_loss(model: torch.nn.Module, held: tuple) -> float:
    inputs, targets, loss_fn = held
    out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    return float(loss_fn(out, targets))


def sensitivity(t: Target, params: Mapping, bounds: Mapping) -> Applied:
    probe = t.probe
    held = getattr(probe, "held_batch", None)
    if held is None:
        raise FixRejected("no held batch: call probe.set_held_batch(inputs, targets, loss_fn) in the job first")
    grid = params.get("sparsities", list(DEFAULT_SENSITIVITY_SPARSITIES))
    if not isinstance(grid, list) or not grid or len(grid) > 20:
        raise FixRejected("parameter 'sparsities' must be a list of 1 to 20 numbers")
    grid = [number({"s": s}, "s", 0.0, 0.999) for s in grid]
    fisher = find(probe)
    weights = fisher.weights() if fisher is not None and fisher.layers else \
        [(n, p) for n, p in t.model.named_parameters() if p.dim() >= 2]
    if len(weights) > int(bounds.get("max_layers", 500)):
        raise FixRejected(f"{len(weights)} layers is more than the job's bound of {bounds.get('max_layers', 500)}")
    model = t.model
    modes = {m: m.training for m in model.modules()}
    model.eval()
    layers = []
    try:
        with torch.no_grad():
            base = _held_loss(model, held)
            for n, p in weights:
                saved = p.detach().clone()
                curv = fisher.curvature(n) if fisher is not None else None
                curve = []
                for s in grid:
                    new, _ = pruning.prune_weight(saved, curv, s)
                    p.copy_(new)
                    curve.append(_held_loss(model, held) - base)
                    p.copy_(saved)
                casts = {}
                for prec in PRECISIONS:
                    p.copy_(pruning.cast(saved, prec))
                    casts[prec] = _held_loss(model, held) - base
                    p.copy_(saved)
                layers.append({"name": n, "numel": p.numel(), "shape": list(p.shape),
                               "method": "obs-kfac" if curv is not None and curv.kfac else "magnitude",
                               "sparsities": grid, "unstructured": curve, "precision": casts})
    finally:
        for m, mode in modes.items():
            m.train(mode)
    probe.sender.put({"kind": "layer_profiles", "step": probe.step_count, "time": time.time(),
                      "source": "held_batch", "base_loss": base, "layers": layers})
    return Applied({}, {"layers": len(layers), "base_loss": base}, None)
