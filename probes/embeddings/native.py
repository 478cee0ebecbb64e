"""The native kernel's side of tracking (probes/_fastats.c): which tables it reads, and its calls per step.

A float32 CPU table is tracked by the kernel instead of the queue and fold: each tracked step applies the
fold's recurrences to its rows in the optimizer step's hooks (``track_pre`` reduces the looked-up
gradient rows to their sketch and copies the rows; ``track_post`` updates their statistics once the
optimizer moved them): O(lookups x width) a step, in two calls per table, with O(lookups) scratch.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from .. import stats
from .constants import EMA_ALPHA, MIN_TOUCHES, SLOW_ALPHA

if TYPE_CHECKING:
    from .state import ChangedRows


def kernel() -> ModuleType | None:
    """The native kernel (probes.stats' import of probes/_fastats.c), None where it is not built. Read at
    each call: tests switch it off to hold the torch path to the same results."""
    return stats._fastats


def kernel_reads(weight: torch.Tensor) -> bool:
    """Whether the native kernel can track this table: it reads float32 rows in place, on the CPU."""
    return (kernel() is not None and weight.is_cpu and weight.dtype is torch.float32
            and weight.is_contiguous())


class Scratch:
    """One tracked step's scratch for the native kernel (see NativeTracker.pre), for up to ``cap``
    lookups: O(lookups), allocated again only when a step has more. ``pre`` and ``post``: the pointers
    track_pre and track_post take, in their order."""

    def __init__(self, cap: int, k: int, dim: int, sparse: bool) -> None:
        self.cap = cap
        h = 1 << (2 * cap - 1).bit_length()  # the hash table of distinct rows: a power of two >= 2 cap
        self.keys, self.slots = torch.empty(h, dtype=torch.long), torch.empty(h, dtype=torch.long)
        self.uniq, self.cnt = torch.empty(cap, dtype=torch.long), torch.empty(cap)
        self.gsk, self.before = torch.empty(cap, k + 1), torch.empty(cap, dim)
        self.acc = torch.empty(cap, dim) if sparse else None  # a sparse gradient's entries, summed per row
        self.pre = (self.keys.data_ptr(), self.slots.data_ptr(), h, self.uniq.data_ptr(), self.cnt.data_ptr(),
                    self.gsk.data_ptr(), self.before.data_ptr(), self.acc.data_ptr() if sparse else 0)
        self.post = (self.uniq.data_ptr(), self.cnt.data_ptr(), self.gsk.data_ptr(), self.before.data_ptr())


class NativeTracker:
    """One table's kernel calls: the pointers that last from step to step (the weight's, checked every
    step, the state's, the counters', the projection's and the padding rows'; those of the scratch as
    track_pre and track_post take them, set at the first tracked step and when the scratch grows), so that
    a tracked step only looks up the rest."""

    def __init__(self, weight: torch.Tensor, state: torch.Tensor, counts: torch.Tensor, changed: ChangedRows,
                 proj: torch.Tensor | None, padding: torch.Tensor, k: int) -> None:
        self.rows, self.dim = weight.shape
        self.k = k
        self.weight_ptr = weight.data_ptr()
        self.scratch: Scratch | None = None
        self.distinct = 0  # the distinct rows of the last track_pre (a table tracked next may take them)
        self._nonzero: torch.Tensor | None = None  # nonzero_rows' buffer
        self._tail: tuple | None = None
        self._post_head: tuple = ()
        self._changed_ptr = changed.ids.data_ptr()
        self._fixed_pre = (self.rows, self.dim, k, proj.data_ptr() if proj is not None else 0,
                           padding.data_ptr(), padding.numel())
        self._fixed_post = (self.dim, k, state.data_ptr(), counts.data_ptr(), changed.flags.data_ptr(),
                            EMA_ALPHA, SLOW_ALPHA, MIN_TOUCHES)

    def moved(self, weight: torch.Tensor) -> None:
        """The table's weight was replaced or moved (model.to(), .data = ...): its pointer from now on."""
        self.weight_ptr, self._tail = weight.data_ptr(), None

    def pre(self, ids: torch.Tensor, grad: torch.Tensor, entries: tuple | None, src: NativeTracker | None = None,
            extra: torch.Tensor | None = None) -> int:
        """track_pre over this step's lookups (``entries``: a sparse gradient's (row, values) entries);
        ``src``: a table tracked just before from the same lookups, whose distinct rows and counts are
        taken; ``extra``: rows of the step with no lookup here (other ranks'), counted 0. Returns the
        step's distinct rows, which post() updates."""
        if ids.dtype is not torch.int64 or not ids.is_contiguous():
            ids = ids.long().contiguous()
        n = ids.numel()
        sparse = entries is not None
        if extra is not None and (extra.dtype is not torch.int64 or not extra.is_contiguous()):
            extra = extra.long().contiguous()
        n_extra = 0 if extra is None else extra.numel()
        if sparse:
            gi, gv = entries[0].contiguous(), entries[1].float().contiguous()
            gpart = (0, gi.data_ptr(), gv.data_ptr(), gv.shape[0])
        else:
            if grad.dtype is not torch.float32 or not grad.is_contiguous():
                grad = grad.float().contiguous()
            gpart = (grad.data_ptr(), 0, 0, 0)
        sc, tail = self.scratch, self._tail
        if sc is None or sc.cap < n + n_extra or (sparse and sc.acc is None):
            sc = self.scratch = Scratch(max(n + n_extra, 2 * sc.cap if sc is not None else 0), self.k, self.dim, sparse)
            tail = None
        if tail is None:
            tail = self._tail = (self.weight_ptr, *self._fixed_pre, *sc.pre)
            self._post_head = (*sc.post, self.weight_ptr)
        shared = (0, 0, 0) if src is None else (src.scratch.uniq.data_ptr(), src.scratch.cnt.data_ptr(), src.distinct)
        self.distinct = kernel().track_pre(ids.data_ptr(), n, *gpart, *shared, *tail,  # the step's distinct rows
                                           0 if extra is None else extra.data_ptr(), n_extra)
        return self.distinct

    def post(self, distinct: int, with_delta: bool, changed: ChangedRows) -> None:
        """track_post: the rows' statistics, once the optimizer moved them; the rows go to ``changed``."""
        n = changed.n
        changed.n = n + kernel().track_post(distinct, *self._post_head, with_delta, self._changed_ptr + n * 8,
                                            self.rows - n, *self._fixed_post)

    def nonzero_rows(self, grad: torch.Tensor) -> torch.Tensor:
        """The rows of a dense gradient with a nonzero element (NaN counts), in order, into a reused buffer
        of the table's rows (8 bytes a row, allocated at the first call)."""
        if grad.dtype is not torch.float32 or not grad.is_contiguous():
            grad = grad.float().contiguous()
        if self._nonzero is None:
            self._nonzero = torch.empty(self.rows, dtype=torch.long)
        n = kernel().nonzero_rows(grad.data_ptr(), self.rows, self.dim, self._nonzero.data_ptr())
        return self._nonzero[:n]
