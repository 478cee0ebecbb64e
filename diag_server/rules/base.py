"""What a rule is: a name, a description, parameters with documented defaults, and one pure method.

``observe(state, obs)`` turns the new observations of one run into findings. It may update ``state``
(a JSON-able dict the engine persists, so a rule picks up where it was after a server restart) and
does no I/O: the same rule runs on a live stream, on an imported file and in a unit test.
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


@dataclass
class Observations:
    """A run's data that arrived in one batch, in step order, plus what is known of the run."""

    run: str
    scalars: dict[str, list[tuple[int, float | None]]] = field(default_factory=dict)
    stats: dict[str, dict[int, list[dict]]] = field(default_factory=dict)  # collection -> step -> rows
    start: dict | None = None  # the run_start event, if the run sent one
    interval: int = 50

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


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


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
