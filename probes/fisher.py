"""The ``fisher`` collection: curvature estimates for compression, accumulated on sampled steps.

Opt-in, per module: ``probes.attach(model, opt, collections={..., "fisher": 10}, fisher_modules=["fc*"])``.
For every parameter of a chosen module it keeps a diagonal empirical Fisher, a running mean (EMA) of the
squared gradient (LeCun et al. 1990, Optimal Brain Damage), on the parameter's device. For a
``nn.Linear`` whose input is at most ``MAX_KFAC_DIM`` wide it also keeps the two Kronecker factors of
K-FAC (Martens & Grosse 2015): A = E[x x^T] over the layer's inputs and the diagonal of
G = E[delta delta^T] over per-sample gradients of the loss with respect to its outputs. A is what lets
the pruner do an Optimal Brain Surgeon weight update (Hassibi & Stork 1993; WoodFisher, Singh &
Alistarh 2020) instead of zeroing weights blind.

Memory is bounded: the statistics of the chosen modules may hold at most ``fisher_max_elements`` numbers
(parameters' size for the diagonal, in_features^2 per K-FAC factor); a module past the budget is left
out and the probe says so in a message. On a step the schedule skips, nothing here runs.

Every ``PROFILE_EVERY`` samples (and at close) it sends a ``layer_profiles`` event: for each weight, the
predicted loss increase at each sparsity of a grid (unstructured and whole output channels) and for each
cast (fp16, bf16, int8). The server's compression recipe allocates sparsity and precision from these.
"""

from __future__ import annotations

import fnmatch
import time
from typing import Any

import torch

from . import pruning
from .collect import Collection, HostCopy, guarded
from .stats import tensor_stats

# EMA decay per sample: the estimate averages the last ~1/(1-decay) = 100 samples, so it describes
# the weights as they are now, not as they were early in training (WoodFisher, sec. 5, uses a few
# hundred recent gradients for the same reason).
DEFAULT_DECAY = 0.99
# Inputs wider than this keep only the diagonal: A would cost in_features^2 numbers.
MAX_KFAC_DIM = 2048
# Numbers held by all the Fisher statistics together, at most: 64 Mi floats = 256 MiB in fp32.
DEFAULT_MAX_ELEMENTS = 1 << 26
# Send layer profiles every this many samples (and at close): one matrix inverse per layer each time.
PROFILE_EVERY = 100


def _selected(model: torch.nn.Module, patterns: Any) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for name, module in model.named_modules():
        if not name or not any(True for _ in module.parameters(recurse=False)):
            continue
        if patterns is None:
            out.append((name, module))
        elif any(fnmatch.fnmatchcase(name, p) or name == p or name.startswith(p + ".") for p in patterns):
            out.append((name, module))
    return out


class LayerStats:
    """The statistics of one module: diagonal Fisher per parameter, K-FAC factors for a Linear."""

    def __init__(self, name: str, module: torch.nn.Module, kfac: bool) -> None:
        self.name, self.module = name, module
        self.params = {f"{name}.{n}" if name else n: p for n, p in module.named_parameters(recurse=False)}
        self.diag = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in self.params.items()}
        self.kfac = kfac
        if kfac:
            w = module.weight
            self.A = torch.zeros(w.shape[1], w.shape[1], device=w.device)
            self.G = torch.zeros(w.shape[0], device=w.device)
        self._x2: torch.Tensor | None = None
        self._g2: torch.Tensor | None = None

    @property
    def weight_name(self) -> str | None:
        return next((n for n in self.params if n.endswith("weight")), None)

    def elements(self) -> int:
        n = sum(t.numel() for t in self.diag.values())
        return n + (self.A.numel() + self.G.numel() if self.kfac else 0)


class Fisher(Collection):
    name = "fisher"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self.decay = float(getattr(probe, "fisher_decay", None) or DEFAULT_DECAY)
        budget = int(getattr(probe, "fisher_max_elements", None) or DEFAULT_MAX_ELEMENTS)
        self.layers: list[LayerStats] = []
        self.left_out: list[str] = []
        used = 0
        for name, module in _selected(probe.model, getattr(probe, "fisher_modules", None)):
            kfac = isinstance(module, torch.nn.Linear) and module.in_features <= MAX_KFAC_DIM
            layer = LayerStats(name, module, kfac)
            if used + layer.elements() > budget and kfac:
                layer = LayerStats(name, module, False)  # the diagonal may still fit
            if used + layer.elements() > budget:
                self.left_out.append(name)
                continue
            used += layer.elements()
            self.layers.append(layer)
        self.elements = used
        self.samples = 0
        self._handles: list[Any] = []
        # The probe's sender does not exist yet while collections are built: say it on the first sample.
        self._warning = (f"fisher: left out {len(self.left_out)} module(s) past the budget of {budget} numbers: "
                         f"{', '.join(self.left_out[:20])}"[:4000]) if self.left_out else None

    # -- sampled steps --------------------------------------------------------------------------------
    def arm(self, step: int) -> None:
        if self._warning:
            self.probe.sender.put({"kind": "message", "step": step, "time": time.time(), "level": "warning",
                                   "text": self._warning})
            self._warning = None
        for layer in self.layers:
            if layer.kfac:
                hook = guarded(self.probe, "fisher hook", self._on_forward(layer))
                self._handles.append(layer.module.register_forward_hook(hook))

    def _on_forward(self, layer: LayerStats) -> Any:
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            if layer._x2 is not None or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) \
                    or not out.requires_grad:
                return  # one forward per sampled step; an eval pass under no_grad is not this step's
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            rows = x.shape[0]
            layer._x2 = x.T @ x / rows

            def on_grad(g: torch.Tensor) -> None:
                # Per-sample output gradients of a mean-reduced loss are rows * g: G = E[delta^2].
                g = g.detach().reshape(-1, g.shape[-1]).float()
                layer._g2 = (g * g).sum(0) * rows
            out.register_hook(guarded(self.probe, "fisher hook", on_grad))
        return hook

    def collect(self, step: int) -> list[HostCopy]:
        for h in self._handles:
            h.remove()
        self._handles = []
        d = self.decay
        names, grads, states = [], [], []
        for layer in self.layers:
            for n, p in layer.params.items():
                if p.grad is not None:
                    names.append(n)
                    grads.append(p.grad.detach().float())
                    states.append(layer.diag[n])
            if layer.kfac and layer._x2 is not None and layer._g2 is not None:
                layer.A.mul_(d).add_(layer._x2, alpha=1 - d)
                layer.G.mul_(d).add_(layer._g2, alpha=1 - d)
            layer._x2 = layer._g2 = None
        if not states:
            return []
        torch._foreach_mul_(states, d)
        torch._foreach_addcmul_(states, grads, grads, value=1 - d)
        self.samples += 1
        if self.samples % PROFILE_EVERY == 0:
            self.send_profiles(step)
        correction = 1.0 / (1 - d ** self.samples)
        return [HostCopy(self.name, step, names, tensor_stats([s * correction for s in states]))]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.samples:
            try:
                self.send_profiles(self.probe.step_count)
            except Exception as e:  # noqa: BLE001 - the training job comes first
                self.probe._degrade("fisher.close", e)

    # -- what the pruner and the recipe read ----------------------------------------------------------
    def _correction(self) -> float:
        return 1.0 / (1 - self.decay ** self.samples) if self.samples else 0.0

    def diagonal(self, param: str) -> torch.Tensor | None:
        """The diagonal empirical Fisher of a parameter (bias-corrected EMA of grad^2), or None."""
        for layer in self.layers:
            if param in layer.diag:
                return layer.diag[param] * self._correction() if self.samples else None
        return None

    def curvature(self, param: str) -> pruning.Curvature | None:
        """What the pruner needs for one weight: K-FAC factors when kept, else the diagonal."""
        if not self.samples:
            return None
        c = self._correction()
        for layer in self.layers:
            if param in layer.diag:
                if layer.kfac and param == layer.weight_name:
                    return pruning.Curvature(diag=layer.diag[param] * c, A=layer.A * c, G=layer.G * c)
                return pruning.Curvature(diag=layer.diag[param] * c)
        return None

    def weights(self) -> list[tuple[str, torch.nn.Parameter]]:
        out = []
        for layer in self.layers:
            n = layer.weight_name
            if n is not None and layer.params[n].dim() >= 2:
                out.append((n, layer.params[n]))
        return out

    def profiles(self) -> list[dict]:
        return [pruning.layer_profile(n, p.detach(), self.curvature(n)) for n, p in self.weights()]

    def send_profiles(self, step: int) -> None:
        layers = self.profiles()
        if layers:
            self.probe.sender.put({"kind": "layer_profiles", "step": step, "time": time.time(), "source": "fisher",
                                   "samples": self.samples, "layers": layers})


def find(probe: Any) -> Fisher | None:
    return next((c for c in getattr(probe, "collections", []) if isinstance(c, Fisher)), None)
