"""The ranks of a data-parallel job agreeing on the step at which a fix is applied.

A fix that changes what a step does (a learning rate, a per-row scale of the embeddings' updates) must
change it on every replica at the same step: DDP averages the gradients but never the parameters again, so
a replica that applied it a few steps earlier than another stays apart from it for the rest of the run
(measured: a 2-rank recommender whose ranks applied ``embedding_grad_scale`` as each picked it up ended
with different weights). Each rank picks its commands up on its own ingest replies, steps apart.

So, with other ranks, a fix's apply or revert is held, and the ranks agree through torch.distributed's
key-value store (the one ``init_process_group`` rendezvoused on: no collective, so a rank that does
not take part never blocks the others; a few store round trips a fix, none on other steps):

- a rank picking the command up proposes a step a lead ahead of its own; the first proposal stands
  (``at``), so every rank reads the same one; it counts itself in (``seen``) unless it is past that step;
- at that step, the first rank to get there writes the verdict: go if every rank had counted itself in,
  else abort; every rank reads that one verdict and applies the fix there, or refuses it with the reason.

The steps are the probe's training steps, which data-parallel ranks take in lockstep. A rank that picks
the command up only after the step reads the verdict already written (abort: it never counted). The
lead is ``LEAD_S`` of this rank's steps (at least ``MIN_LEAD`` steps): several of the sender's flush
intervals, so that every rank's reply carries the command by then.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

LEAD_S = 2.0  # seconds of steps between the first rank's pick-up and the step the ranks apply at
MIN_LEAD = 5  # steps


class Agreement:
    """The store's keys of one run, under ``traindx/<run>/``: per command (fix id, op and attempt: asked for
    again, a fix is agreed on anew) ``seen`` (a counter), ``at`` and ``verdict`` (written once)."""

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.world_size = world_size

    @classmethod
    def for_job(cls, run: str, world_size: int) -> Agreement | None:
        """The job's, or None in a single-process job (or where torch.distributed gives no store)."""
        if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a process group without a store: nothing to agree through
            return None
        return cls(dist.PrefixStore(f"traindx/{run}/", store), world_size)

    def propose(self, key: tuple[str, ...], step: int, step_time: float | None) -> int:
        """The step the ranks apply ``key`` after (the first rank's proposal: a lead after its ``step``, the
        step just taken), this rank counted in only if that step is still ahead of it or now."""
        lead = MIN_LEAD if not step_time else max(MIN_LEAD, math.ceil(LEAD_S / step_time))
        key = "/".join(key)
        at = int(self.store.compare_set(f"{key}/at", "", str(step + lead)))
        if step <= at:  # this rank will be there: it asks for the verdict after that step
            self.store.add(f"{key}/seen", 1)
        return at

    def verdict(self, key: tuple[str, ...], step: int, at: int) -> str | None:
        """After step ``at`` (or past it, picked up late): None to apply, else why not. The first rank to ask
        writes the verdict: go only if every rank counted itself in, and so asks after that same step (the
        ranks step in lockstep: one that was past it when it picked the command up was not counted)."""
        key = "/".join(key)
        seen = self.store.add(f"{key}/seen", 0)
        mine = ("go" if step == at and seen >= self.world_size else
                f"only {seen} of {self.world_size} ranks had it by step {at}")
        said = self.store.compare_set(f"{key}/verdict", "", mine).decode()
        if said == "go":
            return None if step == at else mine  # (past it, this rank was not counted: no go was said then)
        return said
