"""The ``reinit_dead_units`` fix action: give dead ReLU units a fresh start.

A unit is dead when the activation's output is zero for every sample (and position) of a batch: it passes
no gradient, so nothing will revive it. Its incoming weights and bias are re-initialised the way the layer
type initialises itself (nn.Linear / nn.ConvNd: Kaiming-uniform with a=sqrt(5), bias uniform in
+-1/sqrt(fan_in)), and the optimizer's state for those rows (momentum, Adam moments) is zeroed so that
old momentum does not push them straight back. Other units are untouched.

Which units are dead comes from the server (``units``) or, usually, from the job itself: the action arms
one-shot forward hooks and decides on the next forward pass, then re-initialises at the step boundary
after it (never inside the forward, where autograd still holds the weights).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .fixes import Applied, Deferred, FixRejected, Target

_WEIGHTED = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _unit_dim(layer: torch.nn.Module) -> int:
    return -1 if isinstance(layer, torch.nn.Linear) else 1  # features last for Linear; channels for conv


def dead_units(out: torch.Tensor, dim: int) -> torch.Tensor:
    """Indices of units whose output is <= 0 (zero after a ReLU) for every sample and position."""
    moved = out.detach().movedim(dim, -1)
    alive = (moved > 0).reshape(-1, moved.shape[-1]).any(0)
    return (~alive).nonzero().flatten()


def _resolve(t: Target, name: Any) -> tuple[str, torch.nn.Module]:
    if not isinstance(name, str) or not name:
        raise FixRejected("parameter 'module' must name a module, e.g. '2' or 'encoder.fc1'")
    modules = dict(t.model.named_modules())
    if name not in modules:
        raise FixRejected(f"no module named {name!r} in the model")
    return name, modules[name]


def _reinit(t: Target, layer_name: str, layer: torch.nn.Module, units: list[int], max_fraction: float,
            dead_fraction: float | None) -> Applied:
    weight, bias = layer.weight, getattr(layer, "bias", None)
    n = weight.shape[0]
    bad = [u for u in units if not 0 <= u < n]
    if bad:
        raise FixRejected(f"'{layer_name}' has {n} units; no unit {bad[:5]}")
    if not units:
        raise FixRejected(f"no unit of '{layer_name}' is dead on this batch: nothing to re-initialise")
    if len(units) / n > max_fraction:
        raise FixRejected(f"{len(units)} of {n} units is more than the job allows ({max_fraction:.0%})")
    idx = torch.tensor(units, dtype=torch.long, device=weight.device)
    with torch.no_grad():
        old_w = weight[idx].clone()
        old_b = bias[idx].clone() if bias is not None else None
        fresh = torch.empty_like(weight)
        torch.nn.init.kaiming_uniform_(fresh, a=math.sqrt(5))  # what nn.Linear / nn.ConvNd do at construction
        weight[idx] = fresh[idx]
        if bias is not None:
            fan_in = weight[0].numel()
            bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
            bias[idx] = torch.empty(len(units), device=bias.device, dtype=bias.dtype).uniform_(-bound, bound)
        if t.optimizer is not None:
            for p in (weight, bias):
                for value in (t.optimizer.state.get(p) or {}).values() if p is not None else ():
                    if isinstance(value, torch.Tensor) and value.shape == p.shape:
                        value[idx] = 0

    def undo() -> dict:
        with torch.no_grad():
            weight[idx] = old_w
            if bias is not None and old_b is not None:
                bias[idx] = old_b
        return {"module": layer_name, "restored_units": len(units)}

    return Applied({"module": layer_name, "units": units, "dead_fraction": dead_fraction},
                   {"module": layer_name, "reinitialised": len(units), "of": n}, undo)


def reinit_dead_units(t: Target, params: Mapping, bounds: Mapping) -> Applied | Deferred:
    name, module = _resolve(t, params.get("module"))
    max_fraction = float(bounds.get("max_fraction", 1.0))
    units = params.get("units")
    if units is not None:
        if not isinstance(units, list) or not all(isinstance(u, (int, float)) and int(u) == u for u in units):
            raise FixRejected("parameter 'units' must be a list of unit indices")
        if not isinstance(module, _WEIGHTED):
            raise FixRejected(f"with 'units', 'module' must be the Linear/Conv layer itself; {name!r} is "
                              f"{type(module).__name__}")
        return _reinit(t, name, module, [int(u) for u in units], max_fraction, None)

    # Find the dead units on the next forward pass. Given an activation, its producer is the weighted
    # layer whose output tensor is the activation's input (true of nn.Sequential and most forward()s).
    seen: dict[str, Any] = {}
    handles: list[Any] = []
    if isinstance(module, _WEIGHTED):
        def on_layer(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if "dead" not in seen and isinstance(out, torch.Tensor):
                seen.update(layer=(name, mod), dead=dead_units(out, _unit_dim(mod)), units=out.shape[_unit_dim(mod)])
        handles.append(module.register_forward_hook(on_layer))
    else:
        outputs: dict[int, tuple[str, torch.nn.Module]] = {}
        for lname, mod in t.model.named_modules():
            if isinstance(mod, _WEIGHTED):
                handles.append(mod.register_forward_hook(
                    lambda m, a, o, lname=lname: outputs.__setitem__(id(o), (lname, m)) if "dead" not in seen else None))

        def on_act(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if "dead" in seen or not args or not isinstance(out, torch.Tensor):
                return
            producer = outputs.get(id(args[0]))
            if producer is None:
                seen["error"] = (f"cannot tell which layer feeds {name!r} (its input is not a Linear/Conv output); "
                                 "name the Linear/Conv layer in 'module' instead")
                return
            seen.update(layer=producer, dead=dead_units(out, _unit_dim(producer[1])),
                        units=out.shape[_unit_dim(producer[1])])
        handles.append(module.register_forward_hook(on_act))

    def cancel() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def finish() -> Applied | None:
        if "error" in seen:
            cancel()
            raise FixRejected(seen["error"])
        if "dead" not in seen:
            return None
        cancel()
        lname, layer = seen["layer"]
        dead = seen["dead"].tolist()
        return _reinit(t, lname, layer, dead, max_fraction, len(dead) / max(int(seen["units"]), 1))

    return Deferred(finish, cancel)
