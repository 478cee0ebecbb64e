"""Collections: what a probe measures on a sampled step, each on/off with its own schedule.

A collection is armed at the end of the step before a sampled one (it may register one-shot hooks
then) and collected at the end of the sampled step. Its hooks come off after that unless the next step
is sampled too (then they stay, and ``arm`` only resets what they record: with every step sampled,
registering them every step would cost more than some statistics). On a step no collection samples,
none of this runs. Results stay on the tensors' device until one stacked copy to the host; on the CPU
they are host lists from the start.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import torch

from . import quantiles
from .stats import alive_units, copy_norms, cpu_row, diff_norms, host_stats, local, outside, rows_from_stats

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


def guarded(probe: Any, where: str, fn: Callable) -> Callable:
    """``fn`` as a hook that never raises into the training step: an error goes to ``probe.hook_failed``
    (reported, and counted against the probe, at its next step). Returns None, so that a forward hook never
    replaces the module's output."""
    def hook(*args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - inside the job's forward, backward or optimizer step
            probe.hook_failed(where, e)
    return hook


class HostCopy:
    """A stacked statistics tensor on its way to the host; asynchronous on CUDA. ``stacked`` may also be
    the host lists already (rows of fields, columns of tensors), as the CPU paths make them."""

    def __init__(self, collection: str, step: int, names: list[str], stacked: torch.Tensor | list[list[float]],
                 to_rows: Callable[[list[str], list[list[float]]], list[dict]] = rows_from_stats) -> None:
        self.collection, self.step, self.names, self.to_rows = collection, step, names, to_rows
        self.time = time.time()
        if isinstance(stacked, torch.Tensor) and stacked.is_cuda:
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
        host = self.host
        rows = self.to_rows(self.names, host.tolist() if isinstance(host, torch.Tensor) else host)
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
        """Called at the end of step ``step - 1`` when ``due(step)``: register one-shot hooks (or, when
        they are still on from a sampled step just before, reset what they record)."""

    def collect(self, step: int) -> list[HostCopy]:
        return []

    def reports(self, step: int) -> bool:
        """Whether a due step also sends (a collection may track on more steps than it reports)."""
        return True

    def quiet(self, step: int) -> int:
        """The first step >= ``step`` at which this collection, due at ``step``, does more than track: until
        then it is due at every step, and its hooks do all its work (tick() ends each step). ``step``: none."""
        return step

    def tick(self, step: int) -> bool:
        """The end of a quiet step (see quiet()): what collect(step) would do, sending nothing, then
        arm(step + 1). False when the collection is no longer quiet at ``step + 1`` (its schedule changed
        since). Only a collection whose quiet() can pass its step is ticked, and it says how."""
        raise NotImplementedError(f"{type(self).__name__} is never quiet")

    def before_optimizer_step(self) -> None:
        """In the probe's deferred mode (Probe.defer_step_fixes: Lightning runs the forward and backward inside
        optimizer.step(closure), after its pre hooks): after the backward, before the update, where an
        optimizer pre hook would have run. Nothing by default."""

    def phase_hooks(self) -> dict[str, Callable] | None:
        """What this collection runs at the step's phase boundaries (see ``Phases``), by boundary: None
        when it needs none of them, ``{}`` when it only reads their times."""
        return None

    def disarm(self) -> None:
        """Take the hooks off; the probe calls it after a sampled step that the next one does not follow."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        self.disarm()


class Phases:
    """The boundaries of a sampled step, shared by every collection due in it: one forward pre-hook and
    one forward hook on the model, one step pre-hook and one step post-hook on the optimizer, registered
    once for the step (not once per collection that needs them: on a sampled step, hook registrations
    are a good part of what the probe costs) and kept while consecutive steps are sampled.

    ``marks`` holds the clock at each boundary: ``fwd0``, ``fwd1`` (the first forward's start and end),
    ``fwd1_last`` (the last forward's end, with several forwards in a step), ``opt0``, ``opt1``. At a
    start boundary the collections' callbacks run before the mark and at an end boundary after it, so
    the phase times leave out what the probe itself does there.
    """

    KEYS = ("fwd0", "fwd1", "opt0", "opt1")

    def __init__(self, model: torch.nn.Module, optimizer: Any, on_error: Callable[[str, Exception], None]) -> None:
        self.model, self.optimizer, self.on_error = model, optimizer, on_error
        self.model_hooks = compiled(model) != "in-place"  # hooks would run inside the compiled graph
        self.marks: dict[str, float] = {}
        self.step: int | None = None  # the step armed for
        self._calls: dict[str, tuple[Callable, ...]] = {k: () for k in self.KEYS}
        self._handles: list[Any] = []
        self._due: tuple[Collection, ...] | None = None  # the collections armed for, with self._calls

    def arm(self, step: int, collections: list[Collection]) -> None:
        """Before ``step``: the callbacks of the collections due then; the hooks go on when any wants them."""
        self.marks, self.step = {}, step
        due = tuple(collections)
        if due == self._due:
            return  # armed for the same collections since the last step (every step tracked): as it is
        calls: dict[str, list[Callable]] = {k: [] for k in self.KEYS}
        wanted = False
        for c in collections:
            hooks = c.phase_hooks()
            if hooks is not None:
                wanted = True
                for key, fn in hooks.items():
                    calls[key].append(fn)
        self._calls = {k: tuple(v) for k, v in calls.items()}
        if not wanted:
            self.disarm()
        self._due = due
        if wanted and not self._handles:
            if self.model_hooks:
                self._handles += [self.model.register_forward_pre_hook(self._fwd0),
                                  self.model.register_forward_hook(self._fwd1)]
            if self.optimizer is not None:
                self._handles += [self.optimizer.register_step_pre_hook(self._opt0),
                                  self.optimizer.register_step_post_hook(self._opt1)]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._calls = {k: () for k in self.KEYS}
        self._due = None

    def _run(self, key: str, args: tuple) -> None:
        for fn in self._calls[key]:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - inside the job's forward or optimizer step: never raise there
                self.on_error(f"{key} hook", e)

    def _fwd0(self, *args: Any) -> None:
        self._run("fwd0", args)
        self.marks.setdefault("fwd0", time.perf_counter())

    def _fwd1(self, *args: Any) -> None:
        now = time.perf_counter()
        self.marks.setdefault("fwd1", now)
        self.marks["fwd1_last"] = now
        self._run("fwd1", args)

    def _opt0(self, *args: Any) -> None:
        self._run("opt0", args)
        self.marks.setdefault("opt0", time.perf_counter())

    def _opt1(self, *args: Any) -> None:
        self.marks.setdefault("opt1", time.perf_counter())
        # torch iterates the hook dict while calling us: hooks are removed by the probe after collect()
        self._run("opt1", args)


# Statistics rows with each tensor's quantiles (probes/quantiles.py) below them, as weights, gradients and
# activations send them: the value distributions the dashboard draws.
_rows_with_quantiles = quantiles.rows_with_quantiles(rows_from_stats)


class _Distributed(Collection):
    """A collection that sends its tensors' quantiles too, at most every ``quantiles.MIN_STEPS_APART`` steps."""

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._quantiles_at: int | None = None  # the step of the last quantiles

    def quantiles_due(self, step: int) -> bool:
        if self._quantiles_at is not None and step - self._quantiles_at < quantiles.MIN_STEPS_APART:
            return False
        self._quantiles_at = step
        return True

    def host_copy(self, step: int, names: list[str], tensors: list[torch.Tensor]) -> HostCopy:
        stats = host_stats(tensors)
        if not self.quantiles_due(step):
            return HostCopy(self.name, step, names, stats)
        return HostCopy(self.name, step, names, quantiles.with_quantiles(stats, quantiles.of(tensors)),
                        _rows_with_quantiles)


class Weights(_Distributed):
    name = "weights"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._names = [n for n, _ in probe.params]
        self._params = [p for _, p in probe.params]

    def collect(self, step: int) -> list[HostCopy]:
        if not self._params:
            return [HostCopy(self.name, step, self._names, host_stats([]))]
        return [self.host_copy(step, self._names, [local(p) for p in self._params])]


class Gradients(_Distributed):
    name = "gradients"

    def collect(self, step: int) -> list[HostCopy]:
        named = [(n, p.grad) for n, p in self.probe.params if p.grad is not None]
        if not named:
            return []
        grads = [g.to_dense() if g.is_sparse else local(g) for _, g in named]
        return [self.host_copy(step, [n for n, _ in named], grads)]


def _update_rows(names: list[str], raw: list[list[float]]) -> list[dict]:
    rows = []
    for name, delta, base in zip(names, raw[0], raw[1]):
        ratio = delta / base if base > 0 else None
        rows.append({"name": name, "norm": delta if math.isfinite(delta) else None,
                     "update_ratio": ratio if ratio is not None and math.isfinite(ratio) else None})
    return rows


class Updates(Collection):
    """||w_after - w_before|| / ||w_before|| across the optimizer step, via step hooks.

    The weights before the step are copied into buffers that stay allocated while consecutive steps are
    sampled (one copy of the trainable weights, what a clone per step would take anyway), and the
    difference is taken in place: no allocation per step.
    """

    name = "updates"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._names: list[str] = []
        self._owners: list[torch.Tensor] = []  # the parameters the buffers were made for
        self._params: list[torch.Tensor] = []
        self._before: list[torch.Tensor] = []
        self._base: list[torch.Tensor] | list[float] = []  # ||w_before||: host floats from the native kernel
        self._copied = False
        self._result: torch.Tensor | list[list[float]] | None = None

    def phase_hooks(self) -> dict[str, Callable] | None:
        return {"opt0": self._pre, "opt1": self._post} if self.probe.optimizer is not None else None

    def _pre(self, *_: Any) -> None:
        named = [(n, p) for n, p in self.probe.params if p.grad is not None]
        owners = [p for _, p in named]
        # Detached: the hooks run in the caller's grad mode, and the buffers must not join the graph. A
        # sharded parameter's own shard (see stats.local): the optimizer updates it in place.
        params = [local(p.detach()) for p in owners]
        if (len(owners) != len(self._owners) or any(a is not b for a, b in zip(owners, self._owners))
                or any(b.shape != p.shape or b.dtype != p.dtype or b.device != p.device
                       for b, p in zip(self._before, params))):
            self._names = [n for n, _ in named]
            self._before = [torch.empty_like(p) for p in params]
        self._owners, self._params = owners, params
        # ||w_before|| now, while the weights are in cache (the optimizer's step evicts them). On the CPU
        # the native kernel takes it while copying (one pass); else one foreach pass each.
        base = copy_norms(self._before, params) if params else None
        if base is not None:
            self._base = base
        elif params:
            self._base = torch._foreach_norm(params)
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(self._before, params)
            else:  # a torch without it
                for b, p in zip(self._before, params):
                    b.copy_(p)
        self._copied = bool(params)

    def _post(self, *_: Any) -> None:
        if not self._copied:
            return
        self._copied = False
        if self._base and isinstance(self._base[0], float):  # the native kernel's: host lists
            self._result = [diff_norms(self._params, self._before), self._base]
            return
        torch._foreach_sub_(self._before, self._params)  # w_before - w_after: the update's norm, negated
        self._result = torch.stack([torch.stack(torch._foreach_norm(self._before)), torch.stack(self._base)])

    def collect(self, step: int) -> list[HostCopy]:
        out = []
        if self._result is not None:
            out.append(HostCopy(self.name, step, self._names, self._result, _update_rows))
            self._result = None
        opt = self.probe.optimizer
        if opt is not None:
            self.probe.pending_scalars.update(
                {f"lr/group{i}": float(g["lr"]) for i, g in enumerate(opt.param_groups)})
        return out

    def disarm(self) -> None:
        super().disarm()
        self._before, self._base, self._owners, self._params, self._copied = [], [], [], [], False


_ACT_FIELDS = ("sum", "sumsq", "nan", "inf", "zero", "min", "max", "count", "dead", "saturated")


def _activation_rows(names: list[str], raw: list[list[float]]) -> list[dict]:
    rows = []
    isfinite, sqrt = math.isfinite, math.sqrt
    for name, s, ss, nan, inf, zero, lo, hi, n, dead, sat in zip(names, *raw[:len(_ACT_FIELDS)]):
        fin = n - nan - inf
        if fin:
            mean = s / fin
            std = sqrt(max(ss / fin - mean * mean, 0.0))
            mean = mean if isfinite(mean) else None
            std = std if isfinite(std) else None
        else:
            mean = std = None
        rows.append({"name": name, "numel": int(n), "mean": mean, "std": std,
                     "min": lo if isfinite(lo) else None, "max": hi if isfinite(hi) else None,
                     "nan_count": int(nan), "inf_count": int(inf), "zero_frac": zero / n if n else None,
                     "dead_frac": dead if dead >= 0 else None, "saturated_frac": sat if sat >= 0 else None})
    return rows


_activation_rows_with_quantiles = quantiles.rows_with_quantiles(_activation_rows)


def _activation_stats(y: torch.Tensor, module: torch.nn.Module | None) -> torch.Tensor | list[float]:
    """Ten numbers for one activation tensor (see _ACT_FIELDS): on CUDA a tensor kept on the device, on
    the CPU a host list."""
    y = y.detach()
    if not y.is_floating_point() or y.dtype in (torch.float16, torch.bfloat16):
        y = y.float()
    dev = y.device
    dead: torch.Tensor | float = -1.0
    sat: torch.Tensor | float = -1.0
    if module is not None and isinstance(module, _RELU_FAMILY) and y.dim() >= 2:
        # A unit is dead when it is <= 0 for every sample of the batch. Units are features (B, F),
        # channels (B, C, H, W) or, for sequences (B, T, D), the last dimension.
        dim = y.dim() - 1 if y.dim() == 3 else 1
        units = y.shape[dim]
        if y.is_cuda:
            peak = y.amax(dim=[d for d in range(y.dim()) if d != dim])
            dead = 1.0 - (peak > 0).sum() / units
        else:
            dead = 1.0 - alive_units(y, dim) / units
    elif module is not None and type(module) in _BOUNDED:
        lo, hi = _BOUNDED[type(module)]
        band = SATURATION_MARGIN * (hi - lo)
        if y.is_cuda:
            sat = ((y <= lo + band) | (y >= hi - band)).sum() / y.numel()
        else:
            sat = outside(y, lo + band, hi - band) / y.numel()
    if not y.is_cuda:
        # on the host one fused pass (probes.stats.cpu_row), NaN/Inf masked in it
        return [*cpu_row(y), float(dead), float(sat)]
    n = float(y.numel())
    finite = torch.isfinite(y)
    yf = torch.where(finite, y, torch.zeros((), device=dev))
    inf = torch.tensor(float("inf"), device=dev)
    as_t = lambda v: v.float() if isinstance(v, torch.Tensor) else torch.tensor(float(v), device=dev)  # noqa: E731
    stats = torch.stack([yf.sum(), (yf * yf).sum(), torch.isnan(y).sum().float(), torch.isinf(y).sum().float(),
                         (y == 0).sum().float(), torch.where(finite, y, inf).min(), torch.where(finite, y, -inf).max(),
                         torch.tensor(n, device=dev), as_t(dead), as_t(sat)])
    return stats


class Activations(_Distributed):
    """Leaf-module outputs, and the model's input and output, on sampled steps (one-shot hooks)."""

    name = "activations"

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self._names: list[str] = []
        self._stats: list[torch.Tensor | list[float]] = []
        self._samples: list[Any] = []  # each output's quantile sample (probes/quantiles.py), on steps that take them
        self._sampling = False
        self._last: tuple[torch.Tensor, int, Any, bool] | None = None
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
        self._names, self._stats, self._samples, self._done, self._last = [], [], [], False, None
        self._sampling = self.quantiles_due(step)  # the outputs are gone by collect(): sampled as they pass
        if self.compiled == "in-place" or self._handles:
            return
        for name, module in self.leaves:
            self._handles.append(module.register_forward_hook(self._on_output(name)))

    def phase_hooks(self) -> dict[str, Callable] | None:
        # the model's input and output: its own forward hooks, shared (see Phases)
        return None if self.compiled == "in-place" else {"fwd0": self._on_input, "fwd1": self._on_model_output}

    def _record(self, name: str, y: Any, module: torch.nn.Module | None) -> None:
        if self._done:
            return
        if isinstance(y, (tuple, list)) and y:
            y = y[0]
        if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel():
            last = self._last
            plain = module is None or not (isinstance(module, _RELU_FAMILY) or type(module) in _BOUNDED)
            # The model's output is its last layer's output, and Dropout(p=0) returns its input: the same
            # tensor, unchanged since (same version), has the same statistics, unless one of the two also
            # has a dead or saturated fraction.
            if last is not None and last[0] is y and last[1] == y._version and plain and last[3]:
                stats = last[2]
            else:
                stats = _activation_stats(y, module)
            self._last = (y, y._version, stats, plain)  # one tensor kept at most, until the next or collect()
            self._names.append(name)
            self._stats.append(stats)
            if self._sampling:
                self._samples.append(quantiles.sample(y))

    def _on_input(self, module: torch.nn.Module, args: tuple) -> None:
        if args:
            self._record("<input>", args[0], None)

    def _on_output(self, name: str) -> Callable:
        return guarded(self.probe, "activations hook", lambda module, args, out: self._record(name, out, module))

    def _on_model_output(self, module: torch.nn.Module, args: tuple, out: Any) -> None:
        self._record("<output>", out, None)
        self._done = True  # one forward per sampled step; later forwards (eval) are not this step's

    def collect(self, step: int) -> list[HostCopy]:
        stats, names, samples = self._stats, self._names, self._samples
        # kept hooks record nothing until re-armed
        self._names, self._stats, self._samples, self._done, self._last = [], [], [], True, None
        if not stats:
            return []
        on_device = [t for t in stats if isinstance(t, torch.Tensor)]
        if not on_device:
            host = [list(f) for f in zip(*stats)]
            if len(samples) != len(stats):
                return [HostCopy(self.name, step, names, host, _activation_rows)]
            return [HostCopy(self.name, step, names, quantiles.with_quantiles(host, quantiles.quantiles(samples)),
                             _activation_rows_with_quantiles)]
        dev = on_device[0].device  # an input still on the host, say, joins the rest on the device
        stacked = torch.stack([t.to(dev) if isinstance(t, torch.Tensor) else torch.tensor(t, device=dev)
                               for t in stats], dim=1)
        if len(samples) != len(stats):
            return [HostCopy(self.name, step, names, stacked, _activation_rows)]
        q = quantiles.quantiles(samples, device=dev)
        return [HostCopy(self.name, step, names, quantiles.with_quantiles(stacked, q), _activation_rows_with_quantiles)]


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20


def _rss_mb(statm: int | None = None) -> float | None:
    """Resident set size now; ``statm`` is a descriptor of /proc/self/statm kept open (a read of it
    costs a few microseconds, an open several times that: it matters when every step is sampled)."""
    try:
        if statm is not None:
            return int(os.pread(statm, 128, 0).split()[1]) * _PAGE_MB
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE_MB
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
        self._statm: int | None = None
        self._pid = os.getpid()  # a forked child reads its own statm, not ours through our descriptor
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        except (OSError, AttributeError):
            pass

    def phase_hooks(self) -> dict[str, Callable] | None:
        return {}  # reads the phase times only

    def collect(self, step: int) -> list[HostCopy]:
        p, m, out = self.probe, self.probe.phases.marks, {}
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
        rss = _rss_mb(self._statm if os.getpid() == self._pid else None)
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

    def close(self) -> None:
        super().close()
        if self._statm is not None:
            try:
                os.close(self._statm)
            except OSError:
                pass
            self._statm = None
