"""When to sample: a plain function of the step, as torch.profiler's ``schedule`` is.

A schedule answers one question, ``schedule(step) -> bool``. The probe calls it once per step; nothing
else runs on a step it says no to, so a skipped step costs a counter and a branch.
"""

from __future__ import annotations

from typing import Callable

Schedule = Callable[[int], bool]


def every(n: int, *, first: int = 0) -> Schedule:
    """Sample step ``first`` and every ``n``-th step after it."""
    if n < 1:
        raise ValueError(f"sampling interval must be >= 1, got {n}")

    def schedule(step: int) -> bool:
        return step >= first and (step - first) % n == 0

    schedule.interval = n  # type: ignore[attr-defined]  # read by rules that size windows in steps
    return schedule


def never(step: int) -> bool:
    return False


def interval_of(schedule: Schedule) -> int | None:
    return getattr(schedule, "interval", None)
