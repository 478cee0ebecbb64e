"""What a rule is: a name, a description, parameters with documented defaults, and one pure method.

``observe(state, obs)`` turns the new observations of one run into findings. It may update ``state``
(a JSON-able dict the engine persists, so a rule picks up where it was after a server restart) and
does no I/O: the same rule runs on a live stream, on an imported file and in a unit test.

A rule reads its observations in step order and reports every step at which its condition holds;
``per_key`` then folds those into one finding per anomaly (kind and key) whose ``since`` is the first such
step of the batch and ``step`` the last. Rule state carries everything else across batches, so the same
events give the same findings, and the same first steps, however they were cut into batches: one file
imported whole, or a live stream of many small batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar, Iterator

from schemas.enums import AnomalyKind, Severity


@dataclass(frozen=True)
class Param:
    default: float
    source: str  # where the default comes from: a paper, smdebug's default, or a measurement here
    help: str


@dataclass
class Finding:
    kind: AnomalyKind
    severity: Severity
    step: int  # the latest step at which the condition holds
    message: str
    key: str = ""  # tells apart anomalies of one kind that hold at once (one per tensor, say)
    tensors: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    since: int | None = None  # the step it began at, when earlier than ``step``

    @property
    def first_step(self) -> int:
        return self.step if self.since is None else min(self.since, self.step)


@dataclass
class Observations:
    """A run's data that arrived in one batch, in step order, plus what is known of the run."""

    run: str
    scalars: dict[str, list[tuple[int, float | None]]] = field(default_factory=dict)
    stats: dict[str, dict[int, list[dict]]] = field(default_factory=dict)  # collection -> step -> rows
    start: dict | None = None  # the run_start event, if the run sent one
    interval: int = 50
    rank: int = 0  # the process that sent this batch; 0 for a one-process run
    world_size: int = 1
    # Spans of sampled steps: dicts with step, mode, name, category, start, duration (seconds).
    spans: list[dict] = field(default_factory=list)

    def series(self, name: str) -> list[tuple[int, float | None]]:
        return self.scalars.get(name, [])

    def sampled(self, collection: str) -> Iterator[tuple[int, list[dict]]]:
        for step in sorted(self.stats.get(collection, {})):
            yield step, self.stats[collection][step]

    def param_shapes(self) -> dict[str, list[int]]:
        """Parameter name -> shape, from the run's start event (empty when the run sent none)."""
        return {p["name"]: p.get("shape", []) for p in (self.start or {}).get("params", [])}

    def module_types(self) -> dict[str, str]:
        return {m["name"]: m["type"] for m in (self.start or {}).get("modules", [])}

    def owner_type(self, param: str) -> str | None:
        """The type of the module that owns parameter ``param`` ('Linear' for 'net.0.weight')."""
        return self.module_types().get(param.rpartition(".")[0])

    @property
    def last_step(self) -> int:
        steps = [s for v in self.scalars.values() for s, _ in v[-1:]]
        steps += [max(v) for v in self.stats.values() if v]
        return max(steps, default=0)


class Rule:
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    kinds: ClassVar[tuple[AnomalyKind, ...]] = ()
    params: ClassVar[dict[str, Param]] = {}
    # A rule that is not rank-aware sees rank 0's data only: in data-parallel training rank 0's loss,
    # weights and gradients stand for the run, and two ranks' series interleaved would read as noise.
    # Rank-aware rules (the cross-rank ones) set this and get every rank's batches.
    all_ranks: ClassVar[bool] = False

    def __init__(self, **overrides: float) -> None:
        unknown = set(overrides) - set(self.params)
        if unknown:
            raise ValueError(f"rule {self.name!r} has no parameter {sorted(unknown)}; it has {sorted(self.params)}")
        self.p = SimpleNamespace(**{**{k: v.default for k, v in self.params.items()}, **overrides})

    def initial_state(self) -> dict:
        return {}

    def observe(self, state: dict, obs: Observations) -> list[Finding]:
        raise NotImplementedError

    def describe(self) -> dict:
        return {"name": self.name, "description": self.description, "kinds": [k.value for k in self.kinds],
                "params": {k: {"value": getattr(self.p, k), "default": v.default, "source": v.source, "help": v.help}
                           for k, v in self.params.items()}}


_RANK = {Severity.info: 0, Severity.warning: 1, Severity.critical: 2}


def per_key(findings: list[Finding], interval: int) -> list[Finding]:
    """One finding per anomaly (kind and key) and episode out of those a batch gave, in step order: it holds
    from the first of them (``since``) to the last (``step``), says what the last one says, at the highest
    severity any of them had (as the engine keeps an open anomaly's highest severity). A condition that lapsed
    for more than a sampling ``interval`` and came back is a new piece: the engine resolves the earlier one
    and opens a new anomaly when the lapse was long enough to resolve it, as a live stream would have."""
    at: dict[tuple[str, str], int] = {}  # where each anomaly's current piece is in ``out``
    out: list[Finding] = []
    for f in sorted(findings, key=lambda f: f.step):
        key = (f.kind.value, f.key)
        prev = out[at[key]] if key in at else None
        if prev is None or f.first_step > prev.step + interval:
            at[key] = len(out)
            out.append(f)
            continue
        severity = max(prev.severity, f.severity, key=_RANK.__getitem__)
        out[at[key]] = Finding(f.kind, severity, max(f.step, prev.step), f.message, f.key, f.tensors, f.evidence,
                               since=min(prev.first_step, f.first_step))
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class LossHistory:
    """The run's training loss as a rule reads it beside its sampled tensors: as of each sampled step, from the
    losses at and before that step only (a batch may hold later steps, which a live stream would not have yet,
    and the same events must read the same however they were cut into batches).

    ``start`` is the median of the run's first ``WINDOW`` losses (where training began), ``now`` the median of
    the last ``SHORT`` (where it is: one batch's loss is noise), ``best`` the lowest ``now`` so far. Kept in the
    rule's state under ``loss``."""

    WINDOW = 20  # losses whose median stands for where the run began (as the loss rules' 20-step window)
    SHORT = 5  # losses whose median stands for the loss now: a minibatch outlier does not move it

    def __init__(self, state: dict, obs: Observations) -> None:
        self.s = state.setdefault("loss", {"recent": [], "first": [], "best": None, "best_step": None})
        self._points = [(s, v) for s, v in obs.series("loss") if v is not None]  # None: non-finite
        self._i = 0

    def upto(self, step: int) -> LossHistory:
        """Take in the losses up to and including ``step``."""
        s, points = self.s, self._points
        while self._i < len(points) and points[self._i][0] <= step:
            at, value = points[self._i]
            self._i += 1
            if len(s["first"]) < self.WINDOW:
                s["first"].append(value)
            push(s["recent"], value, self.SHORT)
            now = median(s["recent"])
            if len(s["recent"]) == self.SHORT and (s["best"] is None or now < s["best"]):
                s["best"], s["best_step"] = now, at
        return self

    def finish(self) -> None:
        """Take in the rest of the batch's losses."""
        self.upto(self._points[-1][0] if self._points else -1)

    @property
    def start(self) -> float | None:
        return median(self.s["first"]) if len(self.s["first"]) == self.WINDOW else None

    @property
    def now(self) -> float | None:
        return median(self.s["recent"]) if self.s["recent"] else None

    def improving(self, step: int) -> bool:
        """The loss set a new low within the last SHORT steps before ``step``: the model is learning right now."""
        return self.s["best_step"] is not None and self.s["best_step"] > step - self.SHORT

    def fallen(self, fraction: float) -> bool:
        """The loss is now below ``fraction`` of where the run began: it has learned."""
        start, now = self.start, self.now
        return start is not None and now is not None and now < fraction * start


def learning_rate(obs: Observations) -> dict[int, float]:
    """The largest learning rate of the optimizer's groups, by sampled step (the probe sends ``lr/group<i>``)."""
    out: dict[int, float] = {}
    for name, points in obs.scalars.items():
        if name.startswith("lr/group"):
            for s, v in points:
                if v is not None:
                    out[s] = max(out.get(s, v), v)
    return out


def weight_matrices(obs: Observations, rows: list[dict]) -> list[dict]:
    """Rows of weight matrices and kernels (2-D and up): biases and norm scales say little about scale."""
    shapes = obs.param_shapes()
    if not shapes:
        return [r for r in rows if r["name"].endswith("weight")]
    return [r for r in rows if len(shapes.get(r["name"], [])) >= 2]


def streak(state: dict, key: str, holds: bool) -> int:
    """Count consecutive samples for which a condition held (0 once it does not)."""
    state[key] = state.get(key, 0) + 1 if holds else 0
    return state[key]


def push(history: list, value: Any, keep: int) -> None:
    """Append to a bounded history kept in rule state."""
    history.append(value)
    del history[:-keep]
