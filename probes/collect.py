"""Collections: what a probe measures on a sampled step, each on/off with its own schedule.

A collection is armed at the end of the step before a sampled one (it may register one-shot hooks
then) and collected at the end of the sampled step. On a step no collection samples, none of this
runs. Results stay on the tensors' device until one stacked copy to the host.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import torch

from .stats import rows_from_stats, tensor_stats

# Activation outputs within this distance of a bound count as saturated. Same 1% band as the
# saturation check in Glorot & Bengio (2010), sec. 3.
SATURATION_MARGIN = 0.01
_RELU_FAMILY = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.SELU,
                torch.nn.CELU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Hardswish)
_BOUNDED = {torch.nn.Tanh: (-1.0, 1.0), torch.nn.Sigmoid: (0.0, 1.0), torch.nn.Hardtanh: (-1.0, 1.0),
            torch.nn.Hardsigmoid: (0.0, 1.0), torch.nn.Softmax: (0.0, 1.0)}


def compiled(model: torch.nn.Module) -> str | None:
    """'wrapper' for ``torch.compile(model)``'s result, 'in-place' after ``model.compile()``, else None."""
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        return "wrapper"
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "in-place"
    return None


class HostCopy:
    """A stacked statistics tensor on its way to the host; asynchronous on CUDA."""

    def __init__(self, collection: str, step: int, names: list[str], stacked: torch.Tensor,
                 to_rows: Callable[[list[str], list[list[float]]], list[dict]] = rows_from_stats) -> None:
        self.collection, self.step, self.names, self.to_rows = collection, step, names, to_rows
        self.time = time.time()
        if stacked.is_cuda:
            self.host = stacked.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = stacked, None

    def done(self) -> bool:
        return self.ready is None or self.ready.query()

    def event(self) -> dict:
        if self.ready is not None:
            self.ready.synchronize()
        rows = self.to_rows(self.names, self.host.tolist())
        return {"kind": "tensor_stats", "step": self.step, "time": self.time,
                "collection": self.collection, "rows": rows}


class Collection:
    name = "base"

    def __init__(self, probe: Any, interval: int) -> None:
        self.probe = probe
        self.interval = interval
        self._handles: list[Any] = []  # one-shot hooks armed for the coming sampled step

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def next_due(self, step: int) -> int:
        """The first step >= ``step`` this collection samples."""
        return -(-step // self.interval) * self.interval

    def arm(self, step: int) -> None:
        """Called at the end of step ``step - 1`` when ``due(step)``: register one-shot hooks."""

    def collect(self, step: int) -> list[HostCopy]:
        return []

    def reports(self, step: int) -> bool:
        """Whether a due step also sends (a collection may track on more steps than it reports)."""
        return True

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        self.disarm()


class Weights(Collection):
    name = "weights"

    def collect(self, step: int) -> list[HostCopy]:
        named = self.probe.params
        return [HostCopy(self.name, step, [n for n, _ in named], tensor_stats([p for _, p in named]))]


class Gradients(Collection):
    name = "gradients"

    def collect(self, step: int) -> list[HostCopy]:
        named = [(n, p.grad) for n, p in self.probe.params if p.grad is not None]
        if not named:
            return []
        grads = [g.to_dense() if g.is_sparse else g for _, g in named]
        return [HostCopy(self.name, step, [n for n, _ in named], tensor_stats(grads))]


def _update_rows(names: list[str], raw: list[list[float]]) -> list[dict]:
    import math
    rows = []
    for name, delta, base in zip(names, raw[0], raw[1]):
        ratio = delta / base if base > 0 else None
        rows.append({"name": name, "norm": delta if math.isfinite(delta) else None,
                     "update_ratio": ratio if ratio is not None and math.isfinite(ratio) else None})
    return rows


class Updates(Collection):
    """||w_after - w_before|| / ||w_before|| across the optimizer step, via one-shot step hooks."""

    name = "updates"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._before: list[torch.Tensor] | None = None
        self._names: list[str] = []
        self._result: torch.Tensor | None = None

    def arm(self, step: int) -> None:
        opt = self.probe.optimizer
        if opt is None:
            return
        self._handles = [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    def _pre(self, *_: Any) -> None:
        named = [(n, p) for n, p in self.probe.params if p.grad is not None]
        self._names = [n for n, _ in named]
        self._before = [p.detach().clone() for _, p in named]
        self._params = [p for _, p in named]

    def _post(self, *_: Any) -> None:
        # Hooks are removed in collect(), not here: torch iterates the hook dict while calling us.
        if not self._before:
            return
        after = [p.detach() for p in self._params]
        deltas = torch._foreach_sub(after, self._before)
        self._result = torch.stack([torch.stack(torch._foreach_norm(deltas)),
                                    torch.stack(torch._foreach_norm(self._before))])
        self._before = None

    def collect(self, step: int) -> list[HostCopy]:
        self.disarm()
        out = []
        if self._result is not None:
            out.append(HostCopy(self.name, step, self._names, self._result, _update_rows))
            self._result = None
        opt = self.probe.optimizer
        if opt is not None:
            self.probe.pending_scalars.update(
                {f"lr/group{i}": float(g["lr"]) for i, g in enumerate(opt.param_groups)})
        return out


_ACT_FIELDS = ("sum", "sumsq", "nan", "inf", "zero", "min", "max", "count", "dead", "saturated")


def _activation_rows(names: list[str], raw: list[list[float]]) -> list[dict]:
    import math
    rows = []
    for i, name in enumerate(names):
        s, ss, nan, inf, zero, lo, hi, n, dead, sat = (raw[j][i] for j in range(len(_ACT_FIELDS)))
        fin = n - nan - inf
        mean = s / fin if fin else None
        var = max(ss / fin - mean * mean, 0.0) if fin else None

        def f(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        rows.append({"name": name, "numel": int(n), "mean": f(mean), "std": f(math.sqrt(var)) if var is not None else None,
                     "min": f(lo), "max": f(hi), "nan_count": int(nan), "inf_count": int(inf),
                     "zero_frac": zero / n if n else None,
                     "dead_frac": dead if dead >= 0 else None, "saturated_frac": sat if sat >= 0 else None})
    return rows


def _activation_stats(y: torch.Tensor, module: torch.nn.Module | None) -> torch.Tensor:
    """Ten numbers for one activation tensor, kept on its device (see _ACT_FIELDS)."""
    y = y.detach()
    if not y.is_floating_point() or y.dtype in (torch.float16, torch.bfloat16):
        y = y.float()
    dev = y.device
    dead = sat = -1.0
    if module is not None and isinstance(module, _RELU_FAMILY) and y.dim() >= 2:
        # A unit is dead when it is <= 0 for every sample of the batch. Units are features (B, F),
        # channels (B, C, H, W) or, for sequences (B, T, D), the last dimension.
        dim = -1 if y.dim() == 3 else 1
        peak = y.movedim(dim, 0).reshape(y.shape[dim], -1).amax(dim=1)
        dead = 1.0 - (peak > 0).float().mean()
    elif module is not None and type(module) in _BOUNDED:
        lo, hi = _BOUNDED[type(module)]
        band = SATURATION_MARGIN * (hi - lo)
        sat = ((y <= lo + band) | (y >= hi - band)).float().mean()
    n = float(y.numel())
    if not y.is_cuda:
        # On the host a branch is free: finite activations (the usual case) skip the masked passes.
        ss = float(torch.linalg.vector_norm(y)) ** 2
        if math.isfinite(ss):
            lo_, hi_ = torch.aminmax(y)
            zeros = n - float(torch.count_nonzero(y))
            return torch.tensor([float(y.sum()), ss, 0.0, 0.0, zeros, float(lo_), float(hi_), n,
                                 float(dead), float(sat)])
    finite = torch.isfinite(y)
    yf = torch.where(finite, y, torch.zeros((), device=dev))
    inf = torch.tensor(float("inf"), device=dev)
    as_t = lambda v: v.float() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=dev)  # noqa: E731
    return torch.stack([yf.sum(), (yf * yf).sum(), torch.isnan(y).sum().float(), torch.isinf(y).sum().float(),
                        (y == 0).sum().float(), torch.where(finite, y, inf).min(), torch.where(finite, y, -inf).max(),
                        torch.tensor(n, device=dev), as_t(dead), as_t(sat)])


class Activations(Collection):
    """Leaf-module outputs, and the model's input and output, on sampled steps (one-shot hooks)."""

    name = "activations"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._names: list[str] = []
        self._stats: list[torch.Tensor] = []
        self._done = False
        self.leaves = [(n, m) for n, m in probe.model.named_modules() if n and not list(m.children())]
        # Inside a torch.compile'd graph, hooks added and removed on sampled steps would not fire (the
        # graph was traced without them) or would force recompiles. On torch.compile(model)'s wrapper the
        # model's input and output are still seen; after model.compile() in place, nothing is.
        self.compiled = compiled(probe.model)
        self.note = None
        if self.compiled:
            self.leaves = []
            self.note = ("the model is torch.compile'd: per-layer activations are not collected (hooks inside "
                         "a compiled graph would not fire or would force recompiles); "
                         + ("the model's input and output are" if self.compiled == "wrapper" else "no activations are")
                         + " collected; weights, gradients, updates and step times are unaffected")

    def arm(self, step: int) -> None:
        self._names, self._stats, self._done = [], [], False
        model = self.probe.model
        if self.compiled == "in-place":
            return
        self._handles.append(model.register_forward_pre_hook(self._on_input))
        for name, module in self.leaves:
            self._handles.append(module.register_forward_hook(self._on_output(name)))
        self._handles.append(model.register_forward_hook(self._on_model_output))

    def _record(self, name: str, y: Any, module: torch.nn.Module | None) -> None:
        if self._done:
            return
        if isinstance(y, (tuple, list)) and y:
            y = y[0]
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            self._names.append(name)
            self._stats.append(_activation_stats(y, module))

    def _on_input(self, module: torch.nn.Module, args: tuple) -> None:
        if args:
            self._record("<input>", args[0], None)

    def _on_output(self, name: str) -> Callable:
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            self._record(name, out, module)
        return hook

    def _on_model_output(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        self._record("<output>", out, None)
        self._done = True  # one forward per sampled step; later forwards (eval) are not this step's

    def collect(self, step: int) -> list[HostCopy]:
        self.disarm()
        if not self._stats:
            return []
        stacked = torch.stack(self._stats, dim=1)
        names, self._names, self._stats = self._names, [], []
        return [HostCopy(self.name, step, names, stacked, _activation_rows)]


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        try:
            import resource
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        except Exception:  # noqa: BLE001
            return None


class System(Collection):
    """Step time (every step, as running sums), and on sampled steps: data wait, phases, memory."""

    name = "system"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._marks: dict[str, float] = {}

    def arm(self, step: int) -> None:
        self._marks = {}
        model, opt = self.probe.model, self.probe.optimizer
        mark = self._mark
        self._handles = []
        if compiled(model) != "in-place":  # its forward hooks would run inside the compiled graph
            self._handles += [model.register_forward_pre_hook(lambda *_: mark("fwd0")),
                              model.register_forward_hook(lambda *_: mark("fwd1"))]
        if opt is not None:
            self._handles += [opt.register_step_pre_hook(lambda *_: mark("opt0")),
                              opt.register_step_post_hook(lambda *_: mark("opt1"))]

    def _mark(self, key: str) -> None:
        self._marks.setdefault(key, time.perf_counter())

    def collect(self, step: int) -> list[HostCopy]:
        self.disarm()
        p, m, out = self.probe, self._marks, {}
        if p.steps_timed:
            out["sys/step_time"] = p.step_time_sum / p.steps_timed
            out["sys/step_time_max"] = p.step_time_max
        if "fwd0" in m and p.prev_end is not None:
            out["sys/data_wait"] = max(m["fwd0"] - p.prev_end, 0.0)
        if "fwd0" in m and "fwd1" in m:
            out["sys/forward"] = m["fwd1"] - m["fwd0"]
        # Lightning calls optimizer.step(closure) and runs forward and backward inside it: there the
        # backward and optimizer phases are not separable, and would come out negative or inflated.
        if "fwd1" in m and "opt0" in m and m["opt0"] >= m["fwd1"]:
            out["sys/backward"] = m["opt0"] - m["fwd1"]
        if "opt0" in m and "opt1" in m and m["opt0"] >= m.get("fwd1", m["opt0"]):
            out["sys/optimizer"] = m["opt1"] - m["opt0"]
        rss = _rss_mb()
        if rss is not None:
            out["sys/rss_mb"] = rss
        if p.device.type == "cuda":
            dev = p.device
            alloc = torch.cuda.memory_allocated(dev) / 2**20
            reserved = torch.cuda.memory_reserved(dev) / 2**20
            out.update({"sys/cuda_allocated_mb": alloc, "sys/cuda_reserved_mb": reserved,
                        "sys/cuda_peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20,
                        "sys/cuda_fragmentation_mb": reserved - alloc})
        p.pending_scalars.update(out)
        p.reset_step_times()
        return []


COLLECTIONS: dict[str, type[Collection]] = {
    c.name: c for c in (Weights, Gradients, Updates, Activations, System)
}

from .fisher import Fisher  # noqa: E402 - opt-in curvature for compression; it subclasses Collection above
COLLECTIONS[Fisher.name] = Fisher
from .embeddings import Embeddings  # noqa: E402 - per-row embedding dynamics; it subclasses Collection above
COLLECTIONS[Embeddings.name] = Embeddings
