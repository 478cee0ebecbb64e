"""One table's per-row statistics on its device, and how a tracked step reaches them.

Every per-row statistic lives in one (rows, 8 + 2k) float32 tensor, so that a step reads and writes a
touched row's state with one gather and one scatter. A tracked step gathers the looked-up rows before the
optimizer step and reads them again after it (``gather``, ``update``): a natively tracked table
(native.py) updates their statistics there and then; any other table queues copies, which ``fold``
(fold.py) applies at the next report or once the queue is at its bound. O(rows) memory, never a copy of
the table.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import maths
from .constants import MIN_TOUCHES, NOISE_SNR, SAMPLE_ROWS, SKETCH_DIM, TOP_ROWS
from .fold import fold_steps
from .native import NativeTracker, kernel_reads

if TYPE_CHECKING:
    from .worker import Worker

# Tracked steps are queued and folded into the statistics together (see TableState.flush) at a report,
# or once this many steps or this many looked-up values (lookups x width: 8 MB of float32 per copy of
# the rows, three copies) are queued, whichever comes first.
FLUSH_STEPS = 64
FLUSH_VALUES = 1 << 21
# |cos| between a row's gradient and the row at or above which the gradient pulls the row along itself (a
# penalty on its norm, as an L2 term in the loss), not towards anything it learns (look_outside).
PARALLEL_COS = 0.99
# Tracked steps a table is checked for learning outside its lookups (look_outside), at most: an output
# matrix gives every row a gradient at every step, so the first check tells; each costs ~0.15 ms of torch
# operations a table (on ML-100k's four, every report, ~1% of the step time).
OUTSIDE_CHECKS = 4


def state_bytes_of(rows: int, dim: int, sketch_dim: int = SKETCH_DIM) -> int:
    """What TableState keeps for a table: 8 + 2k float32 a row, 9 bytes a row for the window and 16 for the
    run's record (run_noise, run_score)."""
    return rows * (4 * (8 + 2 * min(sketch_dim, dim)) + 25)


def joined_lookups(lookups: list[torch.Tensor]) -> torch.Tensor:
    """A step's lookups of a table as one tensor of ids (the one lookup as it came, else flattened)."""
    return lookups[0] if len(lookups) == 1 else torch.cat([x.reshape(-1) for x in lookups])


class QueuedStep(NamedTuple):
    """A tracked step's copies, waiting for the fold: its ids (lookups first, then rows only other ranks
    looked up), the gradient rows at those ids (or a sparse gradient's (row, values) entries, or its
    coalesced values, one row per id), the rows before the optimizer step (None: no optimizer step
    measured) and after it, and how many of the ids are lookups (None: all)."""

    ids: torch.Tensor
    grad: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    before: torch.Tensor | None
    after: torch.Tensor
    n_local: int | None


class ChangedRows:
    """The rows whose statistics changed since the last report (what it re-ranks), each once, unsorted, in
    the first ``n`` entries of ``ids``: a row is appended when its flag is set (by the fold, or the native
    kernel), and a report clears the flags of the rows it read. 9 bytes a row."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ids = torch.empty(rows, dtype=torch.long, device=device)
        self.n = 0
        self.flags = torch.zeros(rows, dtype=torch.uint8, device=device)

    def add(self, rows: torch.Tensor) -> None:
        rows = rows[self.flags.index_select(0, rows) == 0]  # not in the window yet
        self.flags.index_fill_(0, rows, 1)
        self.ids[self.n:self.n + rows.numel()] = rows
        self.n += rows.numel()

    def take(self) -> torch.Tensor:
        """The rows changed since the last report, their flags cleared: the window starts again empty (read
        before the next tracked step writes it again)."""
        rows = self.ids[:self.n]
        self.flags.index_fill_(0, rows, 0)
        self.n = 0
        return rows

    def nbytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.flags.numel()


class TableState:
    """Per-row statistics of one table, on its device. O(rows) memory."""

    def __init__(self, name: str, weight: torch.nn.Parameter, modules: list[torch.nn.Module],
                 sketch_dim: int = SKETCH_DIM, seed: int = 0, tied: tuple[str, ...] = (),
                 other_ranks: bool = False) -> None:
        self.name, self.weight, self.modules = name, weight, modules
        # One of several ranks (collection.other_ranks): the gradient may hold other ranks' lookups (see gather).
        self.other_ranks = other_ranks
        self.tied = tied  # other modules' parameters that are this weight (collection.tied_to)
        # How far this step's tracking got: 0 waiting, 1 gathered before an optimizer step, 2 updated after it.
        self.phase = 0
        self.stepper: torch.optim.Optimizer | None = None  # the optimizer whose step gathered the rows (phase 1)
        rows, dim = weight.shape
        dev = weight.device
        self.rows, self.dim = rows, dim
        self.k = min(sketch_dim, dim)
        if dim <= sketch_dim:
            self.proj = None  # narrow table: keep the vectors themselves, exactly
        else:
            g = torch.Generator().manual_seed(seed)
            self.proj = (torch.randn(dim, self.k, generator=g) / math.sqrt(self.k)).to(dev)
        # Columns: touches, velocity, consistency numerator and denominator, mean ||g||^2, mean ||mean g||^2,
        # energy per lookup, non-finite flag, then the mean gradient (k) and the previous innovation (k); the
        # properties below name them.
        self.row_state = torch.zeros(rows, 8 + 2 * self.k, device=dev)
        pad = sorted({m.padding_idx % rows for m in modules if getattr(m, "padding_idx", None) is not None})
        self.padding = torch.tensor(pad, dtype=torch.long, device=dev)
        # Tables with equal keys find the same distinct rows in the same lookups (see gather's ``seen``).
        self.same_rows = (rows, tuple(pad))
        self.sparse = any(getattr(m, "sparse", False) for m in modules)
        self.tracked_steps = 0
        # What a report needs, kept so that it costs O(rows touched since the last report), not O(rows):
        # counters, the rows touched since then, the lists of the previous report, and a fixed random
        # sample of rows for medians and the collapse statistics.
        self.sample = torch.randperm(rows, generator=torch.Generator().manual_seed(seed + 1))[:SAMPLE_ROWS].sort().values.to(dev)
        self.changed = ChangedRows(rows, dev)
        self._init_report_state(dev)
        self._init_queue(dev)
        # A float32 CPU table with the native kernel skips the queue: each tracked step updates its rows'
        # statistics in the optimizer step's hooks (native.py), the same recurrences as the fold, one step
        # at a time, with O(lookups) scratch.
        self.native = kernel_reads(weight)
        self.shape = weight.shape
        self.kernel = (NativeTracker(weight, self.row_state, self.counts, self.changed, self.proj, self.padding,
                                     self.k) if self.native else None)

    def _init_report_state(self, dev: torch.device) -> None:
        # The report's lists (zombies, rarest, non-finite, dead, conflicted: TOP_ROWS each), kept in place: the
        # native report reads them and rewrites them (report.pack_native), the torch one replaces them.
        self.list_storage = torch.empty(5, min(TOP_ROWS, self.rows), dtype=torch.long, device=dev).unbind()
        self.zombie_ids, self.rare_ids, self.nonfinite_ids, self.dead_ids, self.conflicted_ids = (
            ids[:0] for ids in self.list_storage)
        self.collapse_rows: torch.Tensor | None = None  # the native report's, allocated at its first
        self.dead_scan = 0
        # The run's record of each row's pull: the sum of ln(noise) over the reports that found the row updated
        # since the one before (eligible, its energy measured, the table's spread known), how many, the sum of
        # the same readings in spreads, and that sum's mean at its highest once RUN_SETTLED are in (run_score,
        # conflict_score). The rows a report lists highest on it are the fifth list (conflicted_ids).
        self.run_record = torch.zeros(self.rows, 4, device=dev)
        self.run_record[:, 3] = -math.inf
        # Whether the weight learns outside the table's lookups (an output matrix, as in a full softmax over
        # its ids, or a functional call): rows not looked up in a step then have a gradient, and a row never
        # looked up is not one that never learns. Checked at the first tracked step after a report that
        # listed never or rarely updated rows (look_outside; OUTSIDE_CHECKS times at most), said by the report
        # after it; once seen, kept.
        self.outside = False
        self._check_outside = False
        self._checks_left = OUTSIDE_CHECKS
        self._outside_seen: torch.Tensor | None = None  # the check's verdict, on the table's device
        self.occ_median = torch.tensor(float("nan"), device=dev)
        self.touch_median = torch.tensor(float("nan"), device=dev)
        # Rows updated at least once, non-finite, and eligible (>= MIN_TOUCHES updates, finite), kept as
        # rows change so that a report does not count them over the whole table.
        self.counts = torch.zeros(3, dtype=torch.long, device=dev)

    def _init_queue(self, dev: torch.device) -> None:
        # One tracked step's scratch (looked-up indices, then their gradient rows and values; an int: the
        # distinct rows the kernel gathered), and the tracked steps queued for flush().
        self.lookups: list[torch.Tensor] = []
        self._cur: tuple | int | None = None
        self.pending: list[QueuedStep] = []
        self.pending_rows = 0
        # On the CPU the copies go into a reused (3, capacity, width) buffer (gradient rows, rows before,
        # rows after) instead of three fresh tensors a step: the allocations and the memory they churned
        # cost ~0.25 ms of a 1.3 ms ML-100k step. A queue takes its buffer to fold(), which hands it back
        # as the spare; a step that does not fit gets fresh tensors.
        self.reuse_buffers = dev.type == "cpu"
        self.buf: torch.Tensor | None = None
        self._buf_at = 0
        self._spare: torch.Tensor | None = None
        # The collection's background worker (CPU tables), which folds queued steps into row_state: every
        # reader outside it waits for the folds in flight (see state).
        self.worker: Worker | None = None

    def state_bytes(self) -> int:
        return (self.row_state.numel() * self.row_state.element_size()
                + self.run_record.numel() * self.run_record.element_size() + self.changed.nbytes())

    @property
    def state(self) -> torch.Tensor:
        """The per-row statistics, with every queued step folded in. Outside the worker thread this waits
        for the folds in flight, then folds what is still queued; on it (a fold, a report), it is the
        state as folded so far (the queue belongs to the training thread)."""
        worker = self.worker
        if worker is None or not worker.on_thread():
            if worker is not None:
                worker.wait()
            if self.pending:
                self.flush()
        return self.row_state

    # Views of the state's columns (reads; the tracked step writes whole rows).
    touches = property(lambda self: self.state[:, 0])
    velocity = property(lambda self: self.state[:, 1])
    cons_num = property(lambda self: self.state[:, 2])
    cons_den = property(lambda self: self.state[:, 3])
    grad_sq = property(lambda self: self.state[:, 4])
    mean_sq = property(lambda self: self.state[:, 5])
    occ_sq = property(lambda self: self.state[:, 6])
    grad_mean = property(lambda self: self.state[:, 8:8 + self.k])
    prev = property(lambda self: self.state[:, 8 + self.k:])

    @property
    def nonfinite(self) -> torch.Tensor:
        return self.state[:, 7] > 0

    def bad_of(self, idx: torch.Tensor) -> torch.Tensor:
        return self.state[:, 7].index_select(0, idx) > 0

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.proj is None else x @ self.proj

    # -- one tracked step: record the touched rows; the statistics are folded in by flush() -------------
    def gather(self, seen: list | None = None) -> None:
        """Before the optimizer step: copy the looked-up rows' gradients and values (no arithmetic), or,
        with the native kernel, reduce them to what track_post needs. ``seen``: the step's (lookup, table)
        pairs of the tables natively tracked so far from one lookup with a dense gradient, which this one
        joins: a table looked up with the same tensor (a bias beside its embedding) takes their distinct
        rows instead of finding them again."""
        self._cur = None
        w = self.weight
        grad = w.grad
        lookups, self.lookups = self.lookups, []
        if grad is None:
            return
        # torch keeps a gradient at its parameter's shape; this also catches a weight swapped for one of
        # another shape (``weight.data = ...``) since attach, which the kernel would read out of bounds
        if grad.shape != self.shape:
            raise ValueError(f"{self.name}: a gradient of shape {tuple(grad.shape)} for a table of {tuple(self.shape)}")
        if self._check_outside:
            self.look_outside(grad, lookups)
        if self.native and w.data_ptr() != self.kernel.weight_ptr:  # the table was replaced or moved
            self.native = kernel_reads(w)  # else another dtype, device or layout: the queued path from now
            self.kernel.moved(w)
        sparse = grad.is_sparse
        # the usual step, in as few torch calls as can be
        if self.native and len(lookups) == 1 and not sparse and not self.other_ranks:
            ids = lookups[0]
            self._cur = self.kernel.pre(ids, grad, None, self._shared_rows(ids, seen))
            return
        if sparse and grad.sparse_dim() != 1:  # not an embedding's (row, width) layout: read it dense
            grad, sparse = grad.to_dense(), False
        step = self._step_rows(grad, sparse, lookups)
        if step is None:
            return
        ids, grad, entries, extra = step
        if self.native:
            self._cur = self.kernel.pre(ids, grad, entries, extra=extra)
            return
        self._copy_step(ids, grad, entries, extra, bool(lookups))

    def _shared_rows(self, ids: torch.Tensor, seen: list | None) -> NativeTracker | None:
        """The kernel of a table tracked just before in this step from the same lookup tensor and with the
        same rows (see gather), whose distinct rows this one takes; this table joins ``seen``."""
        if seen is None:
            return None
        src = None
        for x, t in seen:
            if x is ids and t.same_rows == self.same_rows:
                src = t.kernel
                break
        seen.append((ids, self))
        return src

    def _step_rows(self, grad: torch.Tensor, sparse: bool, lookups: list[torch.Tensor]) -> tuple | None:
        """The step's ids, gradient, sparse entries and rows with no lookup here; None: nothing to track.

        A sparse gradient: its uncoalesced (row, values) entries, where duplicates add up and the entries
        of rows no forward hook saw drop (a row gets a gradient only where it was looked up); or, looked
        up outside the modules' forward (a functional call), its coalesced rows: one lookup per row.
        With other ranks (data parallel), the gradient is reduced across them: rows only they looked up have
        one here too, and the optimizer moves them. They are rows of the step with no lookup here (``extra``,
        count 0): their statistics are updated, and a row no rank looks up is the only dead one. Found in the
        gradient: for a dense one, its rows with a nonzero element (rows_with_grad: O(rows x width) a step,
        what its all-reduce already moves); for a sparse one, its entries' rows."""
        entries = extra = None
        if lookups:
            ids = joined_lookups(lookups)
        if sparse and lookups:
            entries = (grad._indices()[0], grad._values().detach())
            if self.other_ranks:
                extra = entries[0]
        elif sparse:
            grad = grad.coalesce()
            ids = grad.indices()[0]
            entries = (ids, grad.values().detach())
        elif self.other_ranks:
            extra = self.rows_with_grad(grad)
            if not lookups:
                ids = extra[:0]
        elif not lookups:
            return None
        return ids, grad, entries, extra

    def _copy_step(self, ids: torch.Tensor, grad: torch.Tensor, entries: tuple | None, extra: torch.Tensor | None,
                   looked_up: bool) -> None:
        """The queued path's copies of the step's gradient rows (or entries) and rows before the step."""
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        n_local = None  # every id a lookup
        if extra is not None:
            n_local = ids.numel()
            ids = torch.cat([ids.long(), extra.long()])
        if entries is None:
            g = None
        elif looked_up:  # copied: the optimizer may not leave them be
            g = (entries[0].clone(), entries[1].clone())
        else:
            g = entries[1].clone()  # one row per id, in their order
        at = self._reserve(ids.numel()) if self.reuse_buffers else None
        if g is None:
            g = self._copy_rows(grad, ids, 0, at)
        self._cur = (ids, g, self._copy_rows(self.weight.detach(), ids, 1, at), at, n_local)

    def rows_with_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The rows of a dense gradient with a nonzero element (NaN counts), in order: by the kernel into a
        reused buffer, else two row reductions (on CUDA, reading how many is a host synchronisation)."""
        if self.native:
            return self.kernel.nonzero_rows(grad)
        return torch.nonzero((grad.amax(dim=1) != 0) | (grad.amin(dim=1) != 0)).reshape(-1)  # NaN != 0

    def look_outside(self, grad: torch.Tensor, lookups: list[torch.Tensor]) -> None:
        """Whether rows this step did not look up have a gradient: read on the rows the last report listed
        as never or rarely updated, less this step's lookups (a few hundred rows, once a report; no host
        read: the next report carries the verdict). A sparse gradient holds the looked-up rows only: a
        weight that also learns elsewhere accumulates a dense one."""
        self._check_outside = False
        self._checks_left -= 1
        if grad.is_sparse:
            return
        cand = torch.cat([self.dead_ids, self.rare_ids])
        if cand.numel():
            g = grad.index_select(0, cand).double()  # float64: a decayed row's (1e-20) products stay normal
            w = self.weight.detach().index_select(0, cand).double()
            # A penalty on the rows' norms (an L2 term in the loss) pulls each row along itself: that is not
            # learning elsewhere, and its rows never looked up are still dead. (A width-1 row is always
            # along itself: only a zero row's gradient tells there.)
            dot, norms = (g * w).sum(dim=1).abs(), g.norm(dim=1) * w.norm(dim=1)
            along = (norms > 0) & (dot >= PARALLEL_COS * norms)
            learns = (g != 0).any(dim=1) & torch.isfinite(g).all(dim=1) & ~along
            if lookups:  # rows this step looked up have a gradient of their own (a mask: no host read)
                learns &= ~torch.isin(cand, joined_lookups(lookups).reshape(-1).to(cand.device))
            seen = learns.any()
            self._outside_seen = seen if self._outside_seen is None else self._outside_seen | seen

    def outside_verdict(self) -> torch.Tensor | None:
        """The check's verdict since the last report (a bool tensor; None: not checked), and whether the next
        tracked step checks: while the weight is not known to learn outside its lookups, the report lists
        rows never or rarely updated, and fewer than OUTSIDE_CHECKS checks have run."""
        seen, self._outside_seen = self._outside_seen, None
        self._check_outside = (not self.outside and not self.other_ranks and self._checks_left > 0
                               and bool(self.dead_ids.numel() or self.rare_ids.numel()))
        return seen

    def _reserve(self, n: int) -> int | None:
        """Where this step's rows go in the queue's buffer; None: fresh tensors."""
        buf = self.buf
        if buf is None:
            buf, self._spare = self._spare, None
            # Room for the queue's bound (FLUSH_STEPS steps of this size, at most FLUSH_VALUES values).
            cap = max(n, min(n * FLUSH_STEPS, FLUSH_VALUES // self.dim + n))
            if buf is None or buf.shape[1] < cap or buf.dtype != self.weight.dtype:
                buf = torch.empty(3, cap, self.dim, dtype=self.weight.dtype, device=self.weight.device)
            self.buf, self._buf_at = buf, 0
        at = self._buf_at
        if at + n > buf.shape[1]:
            return None
        self._buf_at = at + n
        return at

    def _copy_rows(self, src: torch.Tensor, ids: torch.Tensor, slot: int, at: int | None) -> torch.Tensor:
        if at is None or src.dtype != self.buf.dtype:
            return src.index_select(0, ids)
        return torch.index_select(src, 0, ids, out=self.buf[slot, at:at + ids.numel()])

    def update(self, step: int, with_delta: bool) -> None:
        """After the optimizer step (or at probe.step without an optimizer): the rows' values after it.
        The step is queued; flush() folds the queue into the statistics."""
        self.tracked_steps += 1
        cur, self._cur = self._cur, None
        if cur is None:
            return
        if cur.__class__ is int:  # natively tracked: the step's distinct rows (see NativeTracker.pre)
            self.kernel.post(cur, with_delta, self.changed)
            return
        ids, g, before, at, n_local = cur
        after = self._copy_rows(self.weight.detach(), ids, 2, at)
        self.pending.append(QueuedStep(ids, g, before if with_delta else None, after, n_local))
        self.pending_rows += ids.numel()

    def drop_step(self) -> None:
        """Forget the rows gathered this step: their optimizer skipped it (or took the gradient away), and
        the rows learnt nothing."""
        self._cur = None

    def flush_due(self) -> bool:
        return len(self.pending) >= FLUSH_STEPS or self.pending_rows * self.dim >= FLUSH_VALUES

    def take(self) -> tuple[list[QueuedStep], torch.Tensor | None]:
        """The queued steps and the buffer holding their copies, handed to fold() (here or on the worker);
        the queue starts empty again, in another buffer."""
        pending, self.pending, self.pending_rows = self.pending, [], 0
        buf, self.buf = self.buf, None
        cur = self._cur
        if cur is not None and cur.__class__ is not int and cur[3] is not None:  # taken mid-step: its copies leave
            ids, g, before, _, n_local = cur
            self._cur = (ids, g if isinstance(g, tuple) else g.clone(), before.clone(), None, n_local)
        return pending, buf

    def flush(self, entries: dict | None = None) -> None:
        """Fold the queued steps into the statistics now (after the folds in flight on the worker)."""
        if self.worker is not None:
            self.worker.wait()
        self.fold(*self.take(), entries=entries)

    def fold(self, pending: list[QueuedStep], buf: torch.Tensor | None = None, entries: dict | None = None) -> None:
        """Fold queued steps into the rows' statistics, in step order, with a fixed number of vectorised
        operations whatever the number of steps (fold.fold_steps). O(lookups queued x width)."""
        try:
            if pending:
                with torch.no_grad():
                    fold_steps(self, pending, entries, buf)
        finally:
            if buf is not None:
                self._spare = buf  # read again only once the fold is done with it

    # -- derived per-row values ------------------------------------------------------------------------
    def snr(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """||mean g||^2 / variance of g across the steps that touched the row (over the EMA window)."""
        ms = self.mean_sq if idx is None else self.mean_sq.index_select(0, idx)
        sq = self.grad_sq if idx is None else self.grad_sq.index_select(0, idx)
        return maths.snr(sq, ms)

    def drift_ratio(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """snr over its value for independent zero-mean gradients: < 1 when successive gradients cancel."""
        s = self.snr(idx)
        return s / NOISE_SNR

    @property
    def consistency(self) -> torch.Tensor:
        return self.consistency_of(None)

    def consistency_of(self, idx: torch.Tensor | None) -> torch.Tensor:
        num = self.cons_num if idx is None else self.cons_num.index_select(0, idx)
        den = self.cons_den if idx is None else self.cons_den.index_select(0, idx)
        return maths.ratio(num, den)

    def eligible(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        t = self.touches if idx is None else self.touches.index_select(0, idx)
        bad = self.nonfinite if idx is None else self.bad_of(idx)
        return (t >= MIN_TOUCHES) & ~bad

    def refresh_medians(self) -> torch.Tensor:
        """Median touches and per-lookup energy of the table, from its fixed sample of rows: O(sample).
        Returns the sample's statistics, one row per column of the state (a report reads more of them)."""
        nan = torch.tensor(float("nan"), device=self.weight.device)
        ss = self.state[:, :8].index_select(0, self.sample).t()
        t = ss[0]
        self.touch_median = torch.where(t > 0, t, nan).nanmedian()
        el = (t >= MIN_TOUCHES) & ~(ss[7] > 0) & maths.measured(ss[6])
        self.occ_median = torch.where(el, ss[6], nan).nanmedian()
        return ss

    def noise_excess(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The row's gradient energy per lookup over the median of the table's eligible rows: > 1 is a row
        whose data keeps pulling it harder than its peers' data pulls them (conflicting targets)."""
        occ = self.occ_sq if idx is None else self.occ_sq.index_select(0, idx)
        return maths.ratio(occ, self.occ_ref())

    def occ_ref(self) -> torch.Tensor:
        """What noise_excess divides by: the median per-lookup energy (inf while there is none)."""
        return torch.nan_to_num(self.occ_median, nan=float("inf"))

    def zombie_score(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Higher is more zombie-like: a row whose data pulls it harder than its peers' (log noise
        excess) and whose successive gradients reverse (negative consistency). Rows not eligible score
        -inf. Call refresh_medians() first."""
        occ = self.occ_sq if idx is None else self.occ_sq.index_select(0, idx)
        return maths.zombie_score(self.eligible(idx) & maths.measured(occ), self.noise_excess(idx),
                                  self.consistency_of(idx))

    def conflict_score(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """run_score: the row's ln(noise) in spreads, averaged over the reports that read it, at its highest
        since RUN_SETTLED of them had; -inf for a row no report has read. Higher is a row whose data has
        pulled it harder than its peers' over the run, whether or not the model has since fitted it."""
        _ = self.state  # the folds and reports in flight first (see state)
        return maths.conflict_score(self.run_record if idx is None else self.run_record.index_select(0, idx))

    def run_noise(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The geometric mean of the row's noise over the reports that read it; NaN for a row none has."""
        _ = self.state
        run = self.run_record if idx is None else self.run_record.index_select(0, idx)
        return maths.run_noise(run)

    def snapshot(self) -> torch.Tensor | None:
        """The sampled rows' values that a report's collapse statistics read, copied at the report's step
        (the report may run on the worker while the optimizer moves the rows). O(SAMPLE_ROWS x width)."""
        return self.weight.detach().index_select(0, self.sample) if self.dim >= 4 else None
