"""Whether a fix worked: the run's objectives after it, against the run's own healthy stretch before the fault.

Pure: given each tracked objective's points (the training loss, and a validation loss when the run logs
one) and the steps that matter (the fault, the fix, now), ``judge`` says effective, ineffective, or "not
yet", with a reason that names what was compared with what. The engine reads the points from the store
and records the verdict; tests call ``judge`` on synthetic series.

What "recovered" means, per objective:

- When the run had a healthy stretch before the fault (enough points, and the training loss had learned: its
  level then is clearly below where it started), the objective's level now (median of the last quarter of
  the window) must be back near that level: above it by at most a tenth of it and a quarter of the
  progress the run had made (so a cross-entropy at chance, 2.77 against 2.04, is far; 0.062 against 0.058
  is near), or by the noise of the two medians, whichever is larger. A validation loss is held to its own
  level before the fault.
- When it had none (a fault present from the start, or a fix applied before the run learned anything), the
  level now must be clearly below both the level before the fix and where the run started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..rules.base import median

Points = Sequence[tuple[int, "float | None"]]  # (step, value); None is a non-finite value

# A level within this fraction of the healthy one, and within this fraction of the progress the run had
# made before the fault, counts as back. 0.10 on the relative side, the engine's margin for "worse": the
# healthy level is the run's before the fault, and a healthy run goes on learning, so a run 14% above it 400
# steps later had fallen behind for good (repair benchmark, corrupt labels, seed 1: a clip alone, 0.086
# against 0.076, ended 1.44x the job without the fault, where 1.25x is the line); rollbacks that recovered
# sat 4-5% above it at their verdicts. 0.25 on the progress side keeps a loss with little room between
# chance and healthy (cross-entropy over 16 tokens: 2.77 at chance, 2.04 healthy) from being called
# recovered at 2.5.
RECOVERED_REL = 0.10
RECOVERED_PROGRESS = 0.25
# Without a healthy stretch the fix must have brought the objective this far below where it was before the
# fix and where the run started (a fix that leaves the loss where it was is not a fix). 0.9: measurement
# here: the repair suite's faults present from the start fall 10x or more under the right fix within the
# window; a plateau moves by a few percent.
PROGRESS_RATIO = 0.9
# The run had learned before the fault if its healthy level is below this fraction of where it started.
LEARNED = 0.95
# Noise allowance: this many standard errors of the difference of two medians (the noise itself from the
# step-to-step changes of the healthy stretch, which a trend does not inflate).
NOISE_SIGMAS = 3.0
# Still falling: the level now is below this fraction of the level of the quarter before (a transient that
# is paying off; given more time, up to the engine's max windows).
FALLING = 0.9
# Points of the healthy stretch (the newest before the fault) and of the run's start that make their levels.
REFERENCE_POINTS = 50
START_POINTS = 20
# Fewer steps of training loss before the fault: no healthy stretch to compare with. A fault found within
# the first samples (a layer left out of the optimizer, units dead from the start) was there from the start;
# the few steps before its anomaly opened are not a healthy run (the repair suite's frozen layer: its head
# alone took the loss from 6.1 to 4.7 in the 30 steps before unchanged_tensor opened).
MIN_STRETCH_POINTS = 50


@dataclass
class Level:
    value: float
    lo: int  # first and last step of the points it is the median of
    hi: int
    n: int
    nonfinite: int = 0

    def where(self) -> str:
        return f"step {self.lo}" if self.lo == self.hi else f"steps {self.lo}-{self.hi}"


@dataclass
class Objective:
    """One tracked objective, judged."""

    name: str
    start: Level | None = None
    healthy: Level | None = None  # the stretch before the fault, when the run had learned by then
    before: Level | None = None  # just before the fix (since the fault, when it is recent)
    now: Level | None = None  # the last quarter of the window
    earlier: Level | None = None  # the quarter before that
    threshold: float | None = None
    recovered: bool | None = None  # None: not enough points to say
    falling: bool = False
    worse: bool = False
    # The fault began long enough before the fix that the level before it shows what the fault did; when it
    # did not, the rise after the fix may be the rest of the fault's, and the fix is not called worse for it.
    settled: bool = True

    def text(self) -> str:
        if self.now is None:
            return f"{self.name}: no value since the fix"
        if self.now.nonfinite * 2 > self.now.n:
            return f"{self.name} is not finite at {self.now.nonfinite} of {self.now.n} values ({self.now.where()})"
        now = f"{self.name} {self.now.value:.4g} ({self.now.where()})"
        if self.healthy is not None:
            return f"{now} against {self.healthy.value:.4g} before the fault ({self.healthy.where()})"
        if self.before is not None:
            return f"{now} against {self.before.value:.4g} before the fix ({self.before.where()})"
        return now

    def detail(self) -> dict[str, Any]:
        return {"now": _v(self.now), "healthy": _v(self.healthy), "before": _v(self.before), "start": _v(self.start),
                "threshold": self.threshold, "recovered": self.recovered, "falling": self.falling, "worse": self.worse}


def _v(level: Level | None) -> float | None:
    return None if level is None else level.value


@dataclass
class Verdict:
    status: str | None  # "effective", "ineffective", or None: not yet
    reason: str = ""
    revert_suggested: bool = False
    objectives: list[Objective] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reason = self.reason.strip()

    def detail(self) -> dict[str, Any]:
        loss = next((o for o in self.objectives if o.name == "loss"), None)
        return {"loss_before": _v(loss.before) if loss else None, "loss_after": _v(loss.now) if loss else None,
                "loss_healthy": _v(loss.healthy) if loss else None, "revert_suggested": self.revert_suggested,
                "objectives": {o.name: o.detail() for o in self.objectives}}


def level(points: Points, *, last: int | None = None, first: int | None = None) -> Level | None:
    """The median of the finite values among ``points`` (their last ``last`` or first ``first``)."""
    pts = list(points)
    if last is not None:
        pts = pts[-last:]
    if first is not None:
        pts = pts[:first]
    if not pts:
        return None
    finite = [v for _, v in pts if v is not None and math.isfinite(v)]
    value = median(finite) if finite else math.inf
    return Level(value, pts[0][0], pts[-1][0], len(pts), len(pts) - len(finite))


def _noise(points: Points) -> float:
    """The standard deviation of a point's noise around the trend: median |step-to-step change| / 0.954
    (the median of |N(0, 2 sigma^2)| is 0.954 sigma)."""
    vals = [v for _, v in points if v is not None and math.isfinite(v)]
    diffs = [abs(b - a) for a, b in zip(vals, vals[1:])]
    return median(diffs) / 0.954 if diffs else 0.0


def objective(name: str, points: Points, *, fault_step: int | None, applied_step: int, now_step: int,
              window: int, primary: bool = True) -> Objective:
    """Judge one objective's points (sorted by step) for a fix applied at ``applied_step``. The primary one
    (the training loss) has a value at every step; the others (a validation loss) come every so many."""
    pts = [(s, v) for s, v in points if s <= now_step]
    o = Objective(name)
    dense = primary
    o.start = level(pts, first=START_POINTS if dense else 1)
    pre = [p for p in pts if p[0] <= applied_step]
    # The level the fix found: since the fault when there are enough points since (a fix applied soon after a
    # fault must not be blamed for the rest of the fault's rise), else the newest points before it.
    recent = [p for p in pre if p[0] > applied_step - REFERENCE_POINTS]
    since = [p for p in recent if fault_step is not None and p[0] >= fault_step]
    o.before = level(since if len(since) >= (5 if dense else 1) else recent or pre[-1:])
    o.settled = fault_step is None or applied_step - fault_step >= REFERENCE_POINTS
    post = [p for p in pts if p[0] > applied_step]
    tail_from = now_step - max(window // 4, 1)
    tail = [p for p in post if p[0] > tail_from] or post[-1:]
    o.now = level(tail)
    o.earlier = level([p for p in post if tail_from - max(window // 4, 1) < p[0] <= tail_from])
    stretch = [p for p in pts if fault_step is not None and p[0] < fault_step]
    learned = False
    if len(stretch) >= (MIN_STRETCH_POINTS if dense else 1):
        # The newest points before the fault: up to 50 of a training loss (half its stretch when shorter), the
        # last 3 evaluations of a validation loss (it moves between them).
        healthy = level(stretch, last=max(min(REFERENCE_POINTS, len(stretch) // 2), 1) if dense else 3)
        if healthy is not None and healthy.nonfinite == 0 and o.start is not None:
            learned = healthy.value < LEARNED * o.start.value
            # The training loss must have learned before the fault for its level then to mean "healthy" (a
            # run stuck from the start is judged on progress instead); another objective is held to its
            # level before the fault whatever it was (a validation loss need not have moved yet).
            if learned or not primary:
                o.healthy = healthy
    if o.now is None or o.before is None:
        return o
    if o.now.nonfinite * 2 > o.now.n:
        o.recovered = False
        return o
    # The noise of a healthy process: the healthy stretch's, or (without one) the level now's: the swings of
    # a fault before the fix (an oscillating loss swings by 20x its level) say nothing about it.
    sigma = _noise(stretch[-REFERENCE_POINTS:] if o.healthy else tail)
    n = max(min(o.now.n - o.now.nonfinite, (o.healthy or o.before).n), 1)
    noise = NOISE_SIGMAS * 1.25 * sigma * math.sqrt(2.0 / n)  # the difference of two medians of n points
    if o.healthy is not None and o.start is not None:
        h = o.healthy.value
        room = RECOVERED_REL * abs(h)
        if learned:
            room = min(room, RECOVERED_PROGRESS * (o.start.value - h))
        o.threshold = h + max(room, noise)
    else:
        ref = min(o.before.value, o.start.value if o.start else o.before.value)
        o.threshold = min(PROGRESS_RATIO * ref, ref - noise)
    o.recovered = o.now.value <= o.threshold
    o.falling = o.earlier is not None and o.now.value < FALLING * o.earlier.value
    return o


def judge(series: dict[str, Points], *, fault_step: int | None, applied_step: int, now_step: int, window: int,
          max_windows: int, cleared_step: int | None, still_open: bool, kind: str, mitigation: bool = False,
          worse_margin: float = 0.10) -> Verdict:
    """The verdict on a fix, or Verdict(None) while there is not enough to say.

    ``series``: each tracked objective's points, the training loss first under 'loss'. ``cleared_step``:
    when the fix's anomaly resolved (None while it holds or if it never resolved); ``still_open``: it holds.
    """
    elapsed = now_step - applied_step
    objectives = [objective(name, pts, fault_step=fault_step, applied_step=applied_step, now_step=now_step,
                            window=window, primary=i == 0) for i, (name, pts) in enumerate(series.items()) if pts]
    judged = [o for o in objectives if o.recovered is not None]
    full = elapsed >= window
    for o in judged:
        # A mitigation has no fault that could still be unfolding: its symptom was there all along.
        o.worse = (full and (o.settled or mitigation) and o.now is not None and o.before is not None and not o.falling
                   and o.now.value > o.before.value * (1 + worse_margin) + 1e-12)
    worse = [o for o in judged if o.worse]
    anomaly = _anomaly_text(kind, cleared_step, applied_step, still_open)
    if not judged:  # the run sends no objective the server can read: the anomaly is all there is to go by
        if not full and cleared_step is None:
            return Verdict(None, objectives=objectives)
        if cleared_step is not None:
            return Verdict("effective", f"effective: the {kind} anomaly cleared at step {cleared_step}; the run "
                           "sends no loss, so its outcome could not be compared", objectives=objectives)
        return Verdict("ineffective", f"ineffective: the {kind} anomaly still held {elapsed} steps after the fix; "
                       "the run sends no loss to compare", objectives=objectives)
    compared = "; ".join(o.text() for o in judged)
    if worse:
        if not full:
            return Verdict(None, objectives=objectives)
        names = ", ".join(o.name for o in worse)
        return Verdict("ineffective", f"ineffective: {names} is worse {elapsed} steps after the fix than before it "
                       f"({'; '.join(_against_before(o) for o in worse)}): revert it. {anomaly}",
                       revert_suggested=True, objectives=objectives)
    if mitigation:
        if not full:
            return Verdict(None, objectives=objectives)
        held = (f"The {kind} anomaly still holds, as expected: the data behind it is unchanged." if still_open
                else anomaly)
        return Verdict("effective", f"effective: the fix damps a symptom whose cause stays, so it is judged on not "
                       f"costing the run; {elapsed} steps after it, {'; '.join(_against_before(o) for o in judged)}: "
                       f"not worse. {held}", objectives=objectives)
    recovered = all(o.recovered for o in judged)
    healthy = any(o.healthy for o in judged)
    if recovered and (full or (cleared_step is not None and elapsed >= window // 4)):
        claim = ("the run is back near its level before the fault" if healthy else
                 "the loss is well below its level before the fix and where the run started")
        return Verdict("effective", f"effective: {claim} {elapsed} steps after the fix: {compared}. {anomaly}",
                       objectives=objectives)
    if not full:
        return Verdict(None, objectives=objectives)
    if not recovered and any(o.falling for o in judged if not o.recovered) and elapsed < max_windows * window:
        return Verdict(None, objectives=objectives)  # still coming down: give it more time
    stuck = [o for o in judged if not o.recovered]
    how = "still falling, but slowly" if any(o.falling for o in stuck) else "no longer falling"
    claim = ("the run is not back near its level before the fault" if healthy else
             "the loss is not clearly below its level before the fix and where the run started")
    return Verdict("ineffective", f"ineffective: {elapsed} steps after the fix {claim}, and it is {how}: "
                   f"{compared}. {anomaly}", objectives=objectives)


def _against_before(o: Objective) -> str:
    assert o.now is not None and o.before is not None
    return (f"{o.name} {o.now.value:.4g} ({o.now.where()}) against {o.before.value:.4g} before the fix "
            f"({o.before.where()})")


def _anomaly_text(kind: str, cleared_step: int | None, applied_step: int, still_open: bool) -> str:
    if cleared_step is not None and cleared_step <= applied_step:
        return f"The {kind} anomaly had already cleared at step {cleared_step}, before the fix at step {applied_step}."
    if cleared_step is not None:
        return f"The {kind} anomaly cleared at step {cleared_step}."
    if still_open:
        return f"The {kind} anomaly still holds."
    return ""
