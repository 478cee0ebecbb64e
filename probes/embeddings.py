"""Embedding dynamics: per-row statistics of every nn.Embedding / nn.EmbeddingBag table of the model.

Dense-model statistics (one norm per tensor) say nothing about a table of a million rows of which a
batch touches a thousand. This collection keeps, for each row, a few scalars on the table's device
and updates them only for the rows a step touched:

- ``touches``      steps in which the row was looked up and got a non-zero gradient (update frequency)
- ``velocity``     EMA of ||row after - row before|| across the optimizer step (update velocity)
- ``consistency``  lag-1 correlation of the row's successive gradient steps around their recent mean
                   (an EMA of inner products over an EMA of norm products: a magnitude-weighted mean
                   cosine in [-1, 1]; -1: every update reverses the last one)
- ``snr``          ||mean g||^2 / variance of g across the steps that touched the row (temporal SNR:
                   across steps, not across the row's elements)
- ``noise``        gradient energy per lookup over the table's median (> 1: the row's data pulls it
                   harder than its peers' data pulls them)
- ``run_noise``    the row's noise over the run: the geometric mean of its noise at the reports that found
                   it updated. A row whose data conflicts (ratings that flip for a group of users) pulls
                   hard until the model has fitted the conflict, and then its noise falls back towards 1;
                   its run_noise keeps the record, as the area under the margin keeps that of mislabelled
                   examples a network ends up memorising (Pleiss et al. 2020).
- ``run_score``    the same readings in spreads (ln(noise) over the report's noise_spread, the table's
                   robust standard deviation of ln(noise) above its median), averaged over the run, at its
                   highest once RUN_SETTLED reports have read the row (TableState.conflict_score): it does
                   not fade as the model goes on memorising a conflict, nor does the late phase of a run
                   that overfits, when the median row is fitted and ratios to it spread wide, outweigh the
                   phase that learnt. Reports list the rows highest on it (``conflicted``).

Memory is O(rows): one float32 tensor of 8 + 2k columns per table (eight scalars, the mean gradient and
the previous innovation), 96 bytes a row whatever the table's width, and never a copy of the table
(plus 9 bytes a row: the list of the rows changed since the last report, and a flag saying which, and 16
for the run's record: run_noise's and run_score's sums, their count, and run_score's peak).
Vectors are kept as random projections to k = min(``SKETCH_DIM``, width) dimensions
(Johnson-Lindenstrauss: inner products and norms are preserved in expectation; exact when the table is
at most ``SKETCH_DIM`` wide, e.g. bias tables).

When it runs. Temporal statistics need consecutive touches of a row, which a sample every 50th step
cannot give (a row touched once per epoch would be seen once per 50 epochs). So the collection
*tracks* every ``track_every``-th step (1 by default) with one-shot hooks armed like any other
collection's, and *reports* (one host copy, one event) only every ``interval`` steps. A tracked step
does no arithmetic: the looked-up indices come from the table's module (_Lookups), and three copies are
queued (the gradient rows at those indices, or the sparse gradient's entries; the rows before and after the
optimizer step): O(lookups x width), no host sync, never a pass over the table. The queue is folded
into the statistics at each report, or after ``FLUSH_STEPS`` steps or ``FLUSH_VALUES`` queued values:
one sort of the queued (row, step) pairs, then a fixed number of vectorised operations that apply the
steps in order (TableState.flush). A report costs O(rows touched since the last report + TOP_ROWS +
SAMPLE_ROWS): counters are kept as rows change, the worst-row lists are re-ranked over the rows that
changed plus the previous lists, and medians and the collapse statistics come from a fixed random
sample of rows. For CPU tables, where torch's intra-op threads leave a core free, folds and reports run
on a background thread (_Worker; ATen releases the GIL, so they overlap the training thread while that
core is free); a report then reaches the sender at the first step after it is finished, like a CUDA
copy still in flight. On CUDA they stay inline: their kernels are asynchronous already.

On the CPU, a float32 table is tracked by the native kernel (``probes/_fastats.c``, built by setup.py)
instead: no queue and no fold, each tracked step applies the same recurrences to its rows in the
optimizer step's hooks (track_pre reduces the looked-up gradient rows to their sketch and copies the
rows; track_post updates their statistics once the optimizer moved them): O(lookups x width) a step, in
two calls per table, with O(lookups) scratch; reports run inline, made by the kernel too (report_rows:
the same lists and counts as TableState.report's torch operations). The queue-and-fold path remains for
CUDA tables (where its kernels run asynchronously), other dtypes and installs without the kernel; tests
hold both paths to the same step-by-step reference and the same reports.

A row counts as touched when the model looked it up *and* its gradient row is non-zero: a whole-table
L2 penalty in the loss gives every row a gradient, but only rows the model looked up are touched, so
rows nobody looks up stay dead under weight decay. Rows holding NaN/Inf are reported as non-finite,
never as dead. A table is tracked in the step of the optimizer that holds it (torch's global optimizer
hooks: a recommender's SparseAdam beside the dense layers' Adam); a step that optimizer skips (AMP's
GradScaler on an overflow) teaches the rows nothing and is not tracked.
"""

from __future__ import annotations

import copyreg
import math
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .collect import Collection, HostCopy
from .fixes import Applied, FixRejected, Target, _number
from . import stats
from .stats import sharded

# Width of the random projections that stand in for a row's vectors. 8 keeps the state at 96 bytes a
# row (vs 128-256 for a 32-64 wide float32 row); JL error ~ 1/sqrt(8) per estimate.
SKETCH_DIM = 8
# EMA weight of a new gradient in the row's mean (a 10-touch window, GradTracer's default window).
EMA_ALPHA = 0.1
# EMA weight for the slower averages (consistency, squared norms): a 50-touch window, so that the
# per-row noise of a cosine (+-1 for a bias row) averages down to ~0.14.
SLOW_ALPHA = 0.01
# The snr that independent zero-mean gradients give with these EMAs: E||m||^2 / E||g||^2 for an EMA
# of white noise is alpha / (2 - alpha). Below it, successive gradients cancel (variance-ratio test,
# Lo & MacKinlay 1988); above it, they drift together.
NOISE_SNR = EMA_ALPHA / (2 - EMA_ALPHA)
# A row's direction statistics count once it was touched this many times (10 observations past the
# fast window).
MIN_TOUCHES = 20
# A median absolute deviation times this is the standard deviation of a normal distribution: the
# reports' ``noise_spread`` is the median ln(energy / median) of a table's sampled rows above the median
# times it.
MAD_SIGMA = 1.4826
# Rows listed per table and kind (zombies, rarest) in a report: the worst LISTED_ROWS, and further ones, up to
# TOP_ROWS, while they are past the floor of their kind: a zombie score (ln(noise) - consistency) of at least
# ZOMBIE_FLOOR, touches below RARE_FLOOR x the median. Those floors sit below the rules' defaults
# (zombie_embedding's min_noise 2.5 with consistency <= 0: a score of at least ln 2.5; dead_embedding's
# rare_ratio 0.01), so every row those could name is listed; a healthy table's filler rows are not. Listing
# TOP_ROWS of each kind for every table cost ~3 ms a report on ML-100k's four tables (dicts made, sent, parsed).
TOP_ROWS = 256
LISTED_ROWS = 32
ZOMBIE_FLOOR = math.log(2.0)
RARE_FLOOR = 0.02
# A row's run_score is its running mean's peak once this many reports have read it (before: the mean).
# A mean alone fades once the model has memorised a conflict: on ML-100k's planted group conflict
# (benchmarks/embeddings.py, case b) run_noise's AUC falls from 0.81-0.82 at 5 epochs to 0.66-0.78 at 30
# under Adam 1e-2, where run_score holds 0.80-0.82 (docs/embeddings.md). Before ten readings the mean's
# standard error is over a third of one reading's, and a peak over so few would be mostly noise; from 20,
# the peak comes too late in a run that fits fast (0.03 lower under Adam 1e-2, 0.02 higher under 1e-3).
RUN_SETTLED = 10
# The conflicted list's floor: a run_score of at least this many spreads (LISTED_ROWS are listed whatever
# their score).
CONFLICT_FLOOR = 2.0
# Rows sampled for effective rank and mean pairwise cosine.
COLLAPSE_SAMPLE = 512
# A fixed random sample of each table's rows, for medians (touches, energy per lookup) and collapse.
SAMPLE_ROWS = 4096
# Tracked steps are queued and folded into the statistics together (see TableState.flush) at a report,
# or once this many steps or this many looked-up values (lookups x width: 8 MB of float32 per copy of
# the rows, three copies) are queued, whichever comes first.
FLUSH_STEPS = 64
FLUSH_VALUES = 1 << 21
# CPU tables are folded and reported on a background thread (_Worker). At most this many folds are queued
# or running; past that the training thread waits for them and folds inline (back-pressure: the queued
# copies stay within (MAX_JOBS + 2) x the FLUSH_VALUES bound above, counting the queue being filled and
# the spare buffer a fold hands back).
MAX_JOBS = 2
# The worker thread ends after this many idle seconds (a probe never closed leaves no thread behind for
# long); the next fold starts another.
WORKER_IDLE_S = 30.0
# |cos| between a row's gradient and the row at or above which the gradient pulls the row along itself (a
# penalty on its norm, as an L2 term in the loss), not towards anything it learns (_look_outside).
PARALLEL_COS = 0.99
# The share of the memory free on a table's device (at attach) that its statistics may take: a larger table
# is left out, and the run says so. At 113 bytes a row (below), a 40M-row table needs ~4.5 GB: attaching the
# probe must not run the job out of memory, then or later, when its own allocations grow.
MAX_STATE_SHARE = 0.25
# Tracked steps a table is checked for learning outside its lookups (_look_outside), at most: an output
# matrix gives every row a gradient at every step, so the first check tells; each costs ~0.15 ms of torch
# operations a table (on ML-100k's four, every report, ~1% of the step time).
OUTSIDE_CHECKS = 4


def find_tables(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, list[torch.nn.Module]]]:
    """Every trainable Embedding / EmbeddingBag weight, once even when modules share it."""
    seen: dict[int, tuple[str, torch.nn.Parameter, list[torch.nn.Module]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.weight.requires_grad:
            key = id(m.weight)
            if key not in seen:
                seen[key] = (f"{name}.weight" if name else "weight", m.weight, [])
            seen[key][2].append(m)
    return list(seen.values())


def state_bytes_of(rows: int, dim: int, sketch_dim: int = SKETCH_DIM) -> int:
    """What TableState keeps for a table: 8 + 2k float32 a row, 9 bytes a row for the window and 16 for the
    run's record (run_noise, run_score)."""
    return rows * (4 * (8 + 2 * min(sketch_dim, dim)) + 25)


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device``: a CUDA device's, or the host's available memory (Linux); None where it
    cannot be read."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def _other_ranks() -> bool:
    """Whether this process is one of several ranks (torch.distributed initialised, world size > 1). Under
    data parallelism (DDP) every rank holds the whole table and the gradient is averaged across the ranks
    before the optimizer step: rows only other ranks looked up have a gradient here, and move. Found in the
    gradient (see TableState.gather), which without a reduction holds this rank's lookups only: right
    either way."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _joined_lookups(lookups: list[torch.Tensor]) -> torch.Tensor:
    """A step's lookups of a table as one tensor of ids (the one lookup as it came, else flattened)."""
    return lookups[0] if len(lookups) == 1 else torch.cat([x.reshape(-1) for x in lookups])


def _gb(n: float) -> str:
    return f"{n / 2**30:.2g} GB" if n >= 2**28 else f"{n / 2**20:.3g} MB"


def tied_to(model: torch.nn.Module, weight: torch.nn.Parameter) -> tuple[str, ...]:
    """The parameters of other modules that are ``weight`` itself (weight tying: a language model's output
    projection is often its token table, ``lm_head.weight = wte.weight``). Through them every row of the
    table learns, looked up or not; the rules say so."""
    return tuple(f"{name}.{pname}" if name else pname for name, m in model.named_modules()
                 if not isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                 for pname, p in m.named_parameters(recurse=False) if p is weight)


def _kernel_reads(weight: torch.Tensor) -> bool:
    """Whether the native kernel can track this table: it reads float32 rows in place, on the CPU."""
    return (stats._fastats is not None and weight.is_cpu and weight.dtype is torch.float32
            and weight.is_contiguous())


class _Scratch:
    """One tracked step's scratch for the native kernel (see TableState._native_pre), for up to ``cap``
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


class TableState:
    """Per-row statistics of one table, on its device. O(rows) memory."""

    def __init__(self, name: str, weight: torch.nn.Parameter, modules: list[torch.nn.Module],
                 sketch_dim: int = SKETCH_DIM, seed: int = 0, tied: tuple[str, ...] = (),
                 other_ranks: bool = False) -> None:
        self.name, self.weight, self.modules = name, weight, modules
        # One of several ranks (see _other_ranks): the gradient may hold other ranks' lookups (see gather).
        self.other_ranks = other_ranks
        self._nonzero: torch.Tensor | None = None  # _rows_with_grad's buffer (the kernel's)
        self.tied = tied  # other modules' parameters that are this weight (see tied_to)
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
        # Every per-row statistic lives in one (rows, 8 + 2k) float32 tensor, so that a tracked step reads
        # and writes a touched row's state with one gather and one scatter. Columns: touches, velocity, consistency numerator
        # and denominator, mean ||g||^2, mean ||mean g||^2, energy per lookup, non-finite flag, then the
        # mean gradient (k) and the previous innovation (k); the properties below name them.
        self._state = torch.zeros(rows, 8 + 2 * self.k, device=dev)
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
        # The rows whose statistics changed since the last report (what it re-ranks), each once, unsorted,
        # in the first _win_n entries: a row is appended when its flag in _inwin is set (by the fold, or the
        # native kernel), and a report clears the flags of the rows it read. 9 bytes a row.
        self._win = torch.empty(rows, dtype=torch.long, device=dev)
        self._win_n = 0
        self._inwin = torch.zeros(rows, dtype=torch.uint8, device=dev)
        # The report's lists (zombies, rarest, non-finite, dead, conflicted: TOP_ROWS each), kept in place: the
        # native report reads them and rewrites them (see _native_report), the torch one replaces them.
        self._lists = torch.empty(5, min(TOP_ROWS, rows), dtype=torch.long, device=dev).unbind()
        self.zombie_ids, self.rare_ids, self.nonfinite_ids, self.dead_ids, self.conflicted_ids = (
            ids[:0] for ids in self._lists)
        self._collapse_rows: torch.Tensor | None = None  # the native report's, allocated at its first
        self.dead_scan = 0
        # The run's record of each row's pull: the sum of ln(noise) over the reports that found the row updated
        # since the one before (eligible, its energy measured, the table's spread known), how many, the sum of
        # the same readings in spreads, and that sum's mean at its highest once RUN_SETTLED are in (run_score,
        # conflict_score). The rows a report lists highest on it are the fifth list (conflicted_ids).
        self._run = torch.zeros(rows, 4, device=dev)
        self._run[:, 3] = -math.inf
        # Whether the weight learns outside the table's lookups (an output matrix, as in a full softmax over
        # its ids, or a functional call): rows not looked up in a step then have a gradient, and a row never
        # looked up is not one that never learns. Checked at the first tracked step after a report that
        # listed never or rarely updated rows (_look_outside; OUTSIDE_CHECKS times at most), said by the report
        # after it; once seen, kept.
        self.outside = False
        self._check_outside = False
        self._checks_left = OUTSIDE_CHECKS
        self._outside_seen: torch.Tensor | None = None  # the check's verdict, on the table's device
        self.occ_median = torch.tensor(float("nan"), device=dev)
        self.touch_median = torch.tensor(float("nan"), device=dev)
        # One tracked step's scratch (looked-up indices, then their gradient rows and values), and the
        # tracked steps queued for flush(): (ids, gradient rows or sparse entries, rows before, rows after,
        # how many of the ids are lookups: None, all; the rest are rows only other ranks looked up).
        self.lookups: list[torch.Tensor] = []
        self._cur: tuple | int | None = None
        self.pending: list[tuple] = []
        self.pending_rows = 0
        # On the CPU the copies go into a reused (3, capacity, width) buffer (gradient rows, rows before,
        # rows after) instead of three fresh tensors a step: the allocations and the memory they churned
        # cost ~0.25 ms of a 1.3 ms ML-100k step. A queue takes its buffer to fold(), which hands it back
        # as the spare; a step that does not fit gets fresh tensors.
        self.reuse_buffers = dev.type == "cpu"
        self._buf: torch.Tensor | None = None
        self._buf_at = 0
        self._spare: torch.Tensor | None = None
        # Rows updated at least once, non-finite, and eligible (>= MIN_TOUCHES updates, finite), kept as
        # rows change so that a report does not count them over the whole table.
        self.counts = torch.zeros(3, dtype=torch.long, device=dev)
        # The collection's background worker (CPU tables), which folds queued steps into _state: every
        # reader outside it waits for the folds in flight (see state).
        self.worker: _Worker | None = None
        # A float32 CPU table with the native kernel (probes/_fastats.c) skips the queue: each tracked step
        # updates its rows' statistics in the optimizer step's hooks (track_pre / track_post), the same
        # recurrences as _fold, one step at a time, with O(lookups) scratch.
        self.native = _kernel_reads(weight)
        self.shape = weight.shape
        self._scratch: _Scratch | None = None
        # The kernel's pointers: the weight's (checked every step), the window's, and those of the scratch
        # as track_pre and track_post take them (set at the first tracked step and when the scratch grows).
        self._wp = weight.data_ptr() if self.native else 0
        self._win_p = self._win.data_ptr()
        self._tail: tuple | None = None
        self._post_head: tuple = ()
        # The kernel's arguments that never change (the state, counters, projection and padding rows are
        # allocated once), so that a tracked step only looks up the rest.
        self._fixed_pre = (self.rows, self.dim, self.k, self.proj.data_ptr() if self.proj is not None else 0,
                           self.padding.data_ptr(), self.padding.numel())
        self._fixed_post = (self.dim, self.k, self._state.data_ptr(), self.counts.data_ptr(), self._inwin.data_ptr(),
                            EMA_ALPHA, SLOW_ALPHA, MIN_TOUCHES)

    def state_bytes(self) -> int:
        return (self._state.numel() * self._state.element_size() + self._run.numel() * self._run.element_size()
                + self._win.numel() * self._win.element_size() + self._inwin.numel())

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
        return self._state

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

    def _sketch(self, x: torch.Tensor) -> torch.Tensor:
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
            self._look_outside(grad, lookups)
        if self.native and w.data_ptr() != self._wp:  # the table was replaced or moved (model.to(), .data = ...)
            self.native = _kernel_reads(w)  # else another dtype, device or layout: the queued path from now
            self._wp, self._tail = w.data_ptr(), None
        sparse = grad.is_sparse
        # the usual step, in as few torch calls as can be
        if self.native and len(lookups) == 1 and not sparse and not self.other_ranks:
            ids, src = lookups[0], None
            if seen is not None:
                for x, t in seen:
                    if x is ids and t.same_rows == self.same_rows:
                        src = t
                        break
                seen.append((ids, self))
            self._native_pre(ids, grad, None, src)
            return
        if sparse and grad.sparse_dim() != 1:  # not an embedding's (row, width) layout: read it dense
            grad, sparse = grad.to_dense(), False
        # A sparse gradient: its uncoalesced (row, values) entries, where duplicates add up and the entries
        # of rows no forward hook saw drop (a row gets a gradient only where it was looked up); or, looked
        # up outside the modules' forward (a functional call), its coalesced rows: one lookup per row.
        # With other ranks (data parallel), the gradient is reduced across them: rows only they looked up have
        # one here too, and the optimizer moves them. They are rows of the step with no lookup here (``extra``,
        # count 0): their statistics are updated, and a row no rank looks up is the only dead one. Found in the
        # gradient: for a dense one, its rows with a nonzero element (_rows_with_grad: O(rows x width) a step,
        # what its all-reduce already moves); for a sparse one, its entries' rows.
        entries = extra = None
        if lookups:
            ids = _joined_lookups(lookups)
        if sparse and lookups:
            entries = (grad._indices()[0], grad._values().detach())
            if self.other_ranks:
                extra = entries[0]
        elif sparse:
            grad = grad.coalesce()
            ids = grad.indices()[0]
            entries = (ids, grad.values().detach())
        elif self.other_ranks:
            extra = self._rows_with_grad(grad)
            if not lookups:
                ids = extra[:0]
        elif not lookups:
            return
        if self.native:
            self._native_pre(ids, grad, entries, extra=extra)
            return
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        n_local = None  # every id a lookup
        if extra is not None:
            n_local = ids.numel()
            ids = torch.cat([ids.long(), extra.long()])
        if entries is None:
            g = None
        elif lookups:  # copied: the optimizer may not leave them be
            g = (entries[0].clone(), entries[1].clone())
        else:
            g = entries[1].clone()  # one row per id, in their order
        at = self._reserve(ids.numel()) if self.reuse_buffers else None
        if g is None:
            g = self._copy_rows(grad, ids, 0, at)
        self._cur = (ids, g, self._copy_rows(w.detach(), ids, 1, at), at, n_local)

    def _rows_with_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The rows of a dense gradient with a nonzero element (NaN counts), in order: by the kernel into a
        reused buffer of the table's rows (8 bytes a row, allocated at the first call), else two row
        reductions (on CUDA, reading how many is a host synchronisation)."""
        if self.native:
            if grad.dtype is not torch.float32 or not grad.is_contiguous():
                grad = grad.float().contiguous()
            if self._nonzero is None:
                self._nonzero = torch.empty(self.rows, dtype=torch.long)
            n = stats._fastats.nonzero_rows(grad.data_ptr(), self.rows, self.dim, self._nonzero.data_ptr())
            return self._nonzero[:n]
        return torch.nonzero((grad.amax(dim=1) != 0) | (grad.amin(dim=1) != 0)).reshape(-1)  # NaN != 0

    def _look_outside(self, grad: torch.Tensor, lookups: list[torch.Tensor]) -> None:
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
                learns &= ~torch.isin(cand, _joined_lookups(lookups).reshape(-1).to(cand.device))
            seen = learns.any()
            self._outside_seen = seen if self._outside_seen is None else self._outside_seen | seen

    def _outside_flag(self) -> torch.Tensor | None:
        """The check's verdict since the last report (a bool tensor; None: not checked), and whether the next
        tracked step checks: while the weight is not known to learn outside its lookups, the report lists
        rows never or rarely updated, and fewer than OUTSIDE_CHECKS checks have run."""
        seen, self._outside_seen = self._outside_seen, None
        self._check_outside = (not self.outside and not self.other_ranks and self._checks_left > 0
                               and bool(self.dead_ids.numel() or self.rare_ids.numel()))
        return seen

    def _native_pre(self, ids: torch.Tensor, grad: torch.Tensor, entries: tuple | None,
                    src: TableState | None = None, extra: torch.Tensor | None = None) -> None:
        """track_pre over this step's lookups (``entries``: a sparse gradient's, see gather()); ``src``: a
        table tracked just before from the same lookups, whose distinct rows and counts are taken; ``extra``:
        rows of the step with no lookup here (other ranks', see gather()), counted 0. The
        kernel's pointers that last from step to step are kept (_tail), and checked again when the weight
        moved."""
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
        sc, tail = self._scratch, self._tail
        if sc is None or sc.cap < n + n_extra or (sparse and sc.acc is None):
            sc = self._scratch = _Scratch(max(n + n_extra, 2 * sc.cap if sc is not None else 0), self.k, self.dim, sparse)
            tail = None
        if tail is None:
            tail = self._tail = (self._wp, *self._fixed_pre, *sc.pre)
            self._post_head = (*sc.post, self._wp)
        shared = (0, 0, 0) if src is None else (src._scratch.uniq.data_ptr(), src._scratch.cnt.data_ptr(), src._cur)
        self._cur = stats._fastats.track_pre(ids.data_ptr(), n, *gpart, *shared, *tail,  # the step's distinct rows
                                             0 if extra is None else extra.data_ptr(), n_extra)

    def _native_post(self, nu: int, with_delta: bool) -> None:
        """track_post: the rows' statistics, once the optimizer moved them; the rows go to the window."""
        n = self._win_n
        self._win_n = n + stats._fastats.track_post(nu, *self._post_head, with_delta, self._win_p + n * 8,
                                                    self.rows - n, *self._fixed_post)

    def _reserve(self, n: int) -> int | None:
        """Where this step's rows go in the queue's buffer; None: fresh tensors."""
        buf = self._buf
        if buf is None:
            buf, self._spare = self._spare, None
            # Room for the queue's bound (FLUSH_STEPS steps of this size, at most FLUSH_VALUES values).
            cap = max(n, min(n * FLUSH_STEPS, FLUSH_VALUES // self.dim + n))
            if buf is None or buf.shape[1] < cap or buf.dtype != self.weight.dtype:
                buf = torch.empty(3, cap, self.dim, dtype=self.weight.dtype, device=self.weight.device)
            self._buf, self._buf_at = buf, 0
        at = self._buf_at
        if at + n > buf.shape[1]:
            return None
        self._buf_at = at + n
        return at

    def _copy_rows(self, src: torch.Tensor, ids: torch.Tensor, slot: int, at: int | None) -> torch.Tensor:
        if at is None or src.dtype != self._buf.dtype:
            return src.index_select(0, ids)
        return torch.index_select(src, 0, ids, out=self._buf[slot, at:at + ids.numel()])

    def update(self, step: int, with_delta: bool) -> None:
        """After the optimizer step (or at probe.step without an optimizer): the rows' values after it.
        The step is queued; flush() folds the queue into the statistics."""
        self.tracked_steps += 1
        cur, self._cur = self._cur, None
        if cur is None:
            return
        if cur.__class__ is int:  # natively tracked: the step's distinct rows (see _native_pre)
            self._native_post(cur, with_delta)
            return
        ids, g, before, at, n_local = cur
        after = self._copy_rows(self.weight.detach(), ids, 2, at)
        self.pending.append((ids, g, before if with_delta else None, after, n_local))
        self.pending_rows += ids.numel()

    def flush_due(self) -> bool:
        return len(self.pending) >= FLUSH_STEPS or self.pending_rows * self.dim >= FLUSH_VALUES

    def take(self) -> tuple[list[tuple], torch.Tensor | None]:
        """The queued steps and the buffer holding their copies, handed to fold() (here or on the worker);
        the queue starts empty again, in another buffer."""
        pending, self.pending, self.pending_rows = self.pending, [], 0
        buf, self._buf = self._buf, None
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

    def fold(self, pending: list[tuple], buf: torch.Tensor | None = None, entries: dict | None = None) -> None:
        """Fold queued steps into the rows' statistics, in step order, with a fixed number of vectorised
        operations whatever the number of steps: each statistic is a recurrence x_j = (1 - a_j) x_{j-1} +
        a_j y_j over a row's successive touches, which is solved for all rows and steps at once by a
        segmented parallel scan (log2(steps) rounds). O(lookups queued x width)."""
        try:
            if pending:
                with torch.no_grad():
                    self._fold(pending, entries, buf)
        finally:
            if buf is not None:
                self._spare = buf  # read again only once the fold is done with it

    def _fold(self, pending: list, entries: dict | None = None, buf: torch.Tensor | None = None) -> None:
        dev, k, n_steps = self.weight.device, self.k, len(pending)
        # One entry per (row, step), sorted by row, then step: a row's touches are consecutive, in order.
        # Tables looked up with the same index tensors (a user table and its bias table) share the sort.
        # The forward hooks keep a view of each lookup's input, so two tables' views of one input have the
        # same memory, length and stride (while queued, every view holds its memory: no address reuse).
        ident = tuple((p[0].data_ptr(), p[0].numel(), p[0].stride(0)) for p in pending)
        ids = torch.cat([p[0] for p in pending])
        if entries is not None and ident in entries:
            entry, inv, count = entries[ident]
        else:
            sizes = [p[0].numel() for p in pending]
            steps = torch.repeat_interleave(torch.arange(n_steps, device=dev), torch.tensor(sizes, device=dev))
            key = ids * n_steps + steps
            entry, inv, count = torch.unique(key, return_inverse=True, return_counts=True)
            if entries is not None:
                entries[ident] = (entry, inv, count)
        E = entry.numel()
        if any(p[4] is not None for p in pending):  # rows of a step with no lookup here (gather's extra) count 0
            looked = torch.cat([(torch.arange(p[0].numel(), device=dev) < p[4]) if p[4] is not None
                                else torch.ones(p[0].numel(), dtype=torch.bool, device=dev) for p in pending])
            count = torch.zeros(E, dtype=torch.long, device=dev).index_add_(0, inv, looked.long())
        # Each lookup's full-width rows are reduced at once to what the statistics read: the row's largest
        # |element| after the step (finiteness), the norm of its step, the gradient's largest |element|
        # (zero: no gradient; NaN or inf: a non-finite gradient) and its sketch. Then one copy per (row,
        # step). (abs().amax: linalg.vector_norm with ord 1 or inf is ~10x slower on CPU.)
        after = _joined([p[3] for p in pending], buf, 2).float()
        if all(p[2] is not None for p in pending):
            step_norm = (after - _joined([p[2] for p in pending], buf, 1).float()).pow(2).sum(dim=1).sqrt()
            has_delta = torch.ones((), device=dev)
        else:
            step_norm = torch.cat([torch.linalg.vector_norm(p[3].float() - p[2].float(), dim=1) if p[2] is not None
                                   else torch.zeros(p[0].numel(), device=dev) for p in pending])
            has_delta = torch.cat([torch.full((p[0].numel(),), float(p[2] is not None), device=dev) for p in pending])
        per_lookup = [_max_abs(after), step_norm, has_delta.expand(after.shape[0])]
        if all(isinstance(p[1], torch.Tensor) for p in pending):
            # A dense gradient's row is the same at every lookup of it: reduce per lookup, keep one.
            g = _joined([p[1] for p in pending], buf, 0).float()
            e = torch.cat([torch.stack([*per_lookup, _max_abs(g)], dim=1), self._sketch(g)], dim=1)
            e = torch.zeros(E, e.shape[1], device=dev).index_copy_(0, inv, e)
        else:
            # Sparse entries of one row and step add up (one per lookup): sum them at full width first.
            g = torch.zeros(E, self.dim, device=dev)
            sparse = [(i, p[1]) for i, p in enumerate(pending) if not isinstance(p[1], torch.Tensor)]
            gi = torch.cat([x[0] for _, x in sparse])
            gv = torch.cat([x[1] for _, x in sparse]).float()
            if len(sparse) == n_steps and gi.numel() == inv.numel() and torch.equal(gi, ids):
                g.index_add_(0, inv, gv)  # the usual case: one gradient entry per lookup, in lookup order
            else:
                at = 0
                for i, p in enumerate(pending):
                    if isinstance(p[1], torch.Tensor):
                        g.index_copy_(0, inv[at:at + p[0].numel()], p[1].float())
                    at += p[0].numel()
                gstep = torch.repeat_interleave(torch.tensor([i for i, _ in sparse], device=dev),
                                                torch.tensor([x[0].numel() for _, x in sparse], device=dev))
                gkey = gi * n_steps + gstep
                pos = torch.searchsorted(entry, gkey).clamp_max(E - 1)
                hit = entry[pos] == gkey  # a sparse gradient row no forward hook saw is not a lookup
                g.index_add_(0, pos, torch.where(hit[:, None], gv, torch.zeros((), device=dev)))
            e = torch.zeros(E, 3, device=dev).index_copy_(0, inv, torch.stack(per_lookup, dim=1))
            e = torch.cat([e, _max_abs(g)[:, None], self._sketch(g)], dim=1)
        row = entry // n_steps
        # A looked-up row with an exactly zero gradient did not learn; a NaN gradient (NaN != 0) is a touch.
        touched = e[:, 3] != 0
        if self.padding.numel():
            touched &= ~torch.isin(row, self.padding)
        row, e, count = row[touched], e[touched], count[touched].float()
        E = row.numel()
        if E == 0:
            return
        # From here on, one row per quantity and one column per entry: element-wise operations between a
        # quantity and a per-entry scalar then broadcast along the contiguous dimension (5x faster on CPU).
        e = e.t().contiguous()
        rows, seg, per_row = torch.unique_consecutive(row, return_inverse=True, return_counts=True)
        end = per_row.cumsum(0) - 1
        start = (end - per_row + 1).index_select(0, seg)  # per entry: where its row's run starts
        at = torch.arange(E, device=dev)
        first = (at == start).float()
        old = self._state.index_select(0, rows)
        old_e = old.index_select(0, seg).t()

        finite = torch.isfinite(e[0]) & torch.isfinite(e[3])
        fin = finite.float()
        cum = fin.cumsum(0)
        t = old_e[0] + cum - (cum - fin).index_select(0, start)  # a non-finite step keeps the row's statistics
        inv_t = 1.0 / t.clamp_min(1.0)
        # Running means until a row has 1/alpha observations, EMAs after, so that a rarely touched row is
        # not dominated by its first values.
        a_fast = inv_t.clamp_min(EMA_ALPHA) * fin
        a_slow = inv_t.clamp_min(SLOW_ALPHA) * fin
        # The first innovation is against a mean of one gradient: pairs count from the third touch.
        a_pair = (1.0 / (t - 2).clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (t >= 3))
        warm = t - 1.0 / EMA_ALPHA  # ||mean||^2 over the fast window, averaged once the window is full
        a_mean = (1.0 / warm.clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (warm >= 1))
        gs = torch.nan_to_num(e[4:] * fin, nan=0.0, posinf=0.0, neginf=0.0)
        # Direction consistency: the correlation of the row's successive gradient steps around their recent
        # mean (lag-1 autocorrelation of the innovations g_t - mean_{t-1}, as an EMA of inner products over
        # an EMA of norm products: a magnitude-weighted mean cosine in [-1, 1]). Centred, so that a trend
        # common to successive steps (a row still drifting towards its optimum) does not hide the reversals;
        # on gradients, not the optimizer's deltas, since momentum (Adam's beta1 = 0.9) averages successive
        # gradients and its deltas agree even when every gradient reverses the last one.
        old_m, old_prev = old_e[8:8 + k], old_e[8 + k:]
        m = _ema_scan(a_fast[None], gs, old_m, first, n_steps)
        m_before = torch.roll(m, 1, dims=1) * (1.0 - first) + old_m * first
        inno = gs - m_before
        # The previous innovation: that of the row's last finite touch before this one, else the stored one.
        last_fin = torch.cummax(torch.where(finite, at, torch.full_like(at, -1)), dim=0).values
        last_before = torch.roll(last_fin, 1, dims=0)
        has_prev = ((last_before >= start) & (first == 0)).float()
        prev = inno.index_select(1, last_before.clamp_min(0)) * has_prev + old_prev * (1.0 - has_prev)
        gn2 = gs.pow(2).sum(dim=0)
        targets = torch.stack([
            torch.nan_to_num(e[1], nan=0.0, posinf=0.0, neginf=0.0),
            (inno * prev).sum(dim=0),
            (inno.pow(2).sum(dim=0) * prev.pow(2).sum(dim=0)).sqrt(),
            gn2,
            m.pow(2).sum(dim=0),
            # Energy per lookup: a step's gradient sums one term per lookup, so ||g||^2 / lookups is what a
            # row's data says each time, comparable between popular and rare rows. (Only from the steps that
            # looked the row up here: one only other ranks looked up has no count to divide by.)
            gn2 / count.clamp_min(1.0),
        ])
        rates = torch.stack([a_fast * e[2], a_pair, a_pair, a_slow, a_mean, a_slow * (count > 0)])
        stats = _ema_scan(rates, targets, old_e[1:7], first, n_steps)
        last_fin_row = last_fin.index_select(0, end)
        has_last = (last_fin_row >= start.index_select(0, end))[:, None]
        prev_row = torch.where(has_last, inno.index_select(1, last_fin_row.clamp_min(0)).t(), old[:, 8 + k:])
        new = torch.cat([t.index_select(0, end)[:, None], stats.index_select(1, end).t(),
                         1.0 - fin.index_select(0, end)[:, None], m.index_select(1, end).t(), prev_row], dim=1)
        self.counts += _counts(new) - _counts(old)
        self._state.index_copy_(0, rows, new)
        rows = rows[self._inwin.index_select(0, rows) == 0]  # not in the window yet
        self._inwin.index_fill_(0, rows, 1)
        self._win[self._win_n:self._win_n + rows.numel()] = rows
        self._win_n += rows.numel()

    # -- derived per-row values ------------------------------------------------------------------------
    def snr(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """||mean g||^2 / variance of g across the steps that touched the row (over the EMA window)."""
        ms = self.mean_sq if idx is None else self.mean_sq.index_select(0, idx)
        sq = self.grad_sq if idx is None else self.grad_sq.index_select(0, idx)
        return _snr(sq, ms)

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
        return _ratio(num, den)

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
        el = (t >= MIN_TOUCHES) & ~(ss[7] > 0) & _measured(ss[6])
        self.occ_median = torch.where(el, ss[6], nan).nanmedian()
        return ss

    def noise_excess(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The row's gradient energy per lookup over the median of the table's eligible rows: > 1 is a row
        whose data keeps pulling it harder than its peers' data pulls them (conflicting targets)."""
        occ = self.occ_sq if idx is None else self.occ_sq.index_select(0, idx)
        return _ratio(occ, self._occ_ref())

    def _occ_ref(self) -> torch.Tensor:
        """What noise_excess divides by: the median per-lookup energy (inf while there is none)."""
        return torch.nan_to_num(self.occ_median, nan=float("inf"))

    def zombie_score(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """Higher is more zombie-like: a row whose data pulls it harder than its peers' (log noise
        excess) and whose successive gradients reverse (negative consistency). Rows not eligible score
        -inf. Call refresh_medians() first."""
        occ = self.occ_sq if idx is None else self.occ_sq.index_select(0, idx)
        return _zombie_score(self.eligible(idx) & _measured(occ), self.noise_excess(idx), self.consistency_of(idx))

    def conflict_score(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """run_score: the row's ln(noise) in spreads, averaged over the reports that read it, at its highest
        since RUN_SETTLED of them had; -inf for a row no report has read. Higher is a row whose data has
        pulled it harder than its peers' over the run, whether or not the model has since fitted it."""
        _ = self.state  # the folds and reports in flight first (see state)
        return _conflict_score(self._run if idx is None else self._run.index_select(0, idx))

    def run_noise(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """The geometric mean of the row's noise over the reports that read it; NaN for a row none has."""
        _ = self.state
        run = self._run if idx is None else self._run.index_select(0, idx)
        return _run_noise(run)

    def _conflicts(self, win: torch.Tensor, k: int, spread: torch.Tensor) -> tuple[torch.Tensor, int]:
        """At a report, after the medians: add each row of the window (updated since the last report) that is
        eligible, with its energy measured, its ln(noise) to the run's record, and the same over the report's
        ``spread`` (noise_spread; none when it is not finite and positive), raising run_score's peak once
        RUN_SETTLED readings are in; then rank the window and the previous list by conflict_score, as the
        zombies are: of the finite rows updated at least as often as the median row (a rarer row's energy is
        averaged over fewer lookups, and the model has fitted it less), the worst LISTED_ROWS, and further
        ones up to ``k`` while at least CONFLICT_FLOOR. Returns the packed ids and five columns (touches,
        noise, run_noise, run_score, reports), and how many rows. ~20 operations over the window and the
        list, on the table's device; reading the list's length is a host sync on CUDA, as the other lists'
        are."""
        st = self._state
        c = st.index_select(0, win)
        ref = self._occ_ref()
        ok = ((c[:, 0] >= MIN_TOUCHES) & ~(c[:, 7] > 0) & _measured(c[:, 6]) & torch.isfinite(ref)
              & (spread > 0) & torch.isfinite(spread))
        ln = torch.log(_ratio(c[:, 6], ref).clamp_min(1e-6))
        zero = torch.zeros_like(ln)
        add = torch.stack([torch.where(ok, ln, zero), ok.to(ln.dtype), torch.where(ok, ln / spread, zero)], dim=1)
        run = self._run.index_select(0, win)
        run[:, :3] += add  # the window holds each row once
        mean = run[:, 2] / run[:, 1].clamp_min(1.0)
        run[:, 3] = torch.where(ok & (run[:, 1] >= RUN_SETTLED), torch.maximum(run[:, 3], mean), run[:, 3])
        self._run.index_copy_(0, win, run)
        cand = torch.unique(torch.cat([win, self.conflicted_ids]))
        score = _conflict_score(self._run.index_select(0, cand))
        cs = st.index_select(0, cand)
        often = (cs[:, 0] >= torch.nan_to_num(self.touch_median, nan=math.inf)) & ~(cs[:, 7] > 0)
        pos = _ranked(torch.where(often, score, torch.full_like(score, -math.inf)), k, True, CONFLICT_FLOOR)
        ids = self.conflicted_ids = cand.index_select(0, pos)
        rows, run = st.index_select(0, ids), self._run.index_select(0, ids)
        cols = torch.stack([rows[:, 0], _ratio(rows[:, 6], ref), _run_noise(run), _conflict_score(run), run[:, 1]])
        return torch.cat([ids.to(torch.float64), cols.to(torch.float64).reshape(-1)]), ids.numel()

    # -- a report --------------------------------------------------------------------------------------
    def snapshot(self) -> torch.Tensor | None:
        """The sampled rows' values that a report's collapse statistics read, copied at the report's step
        (the report may run on the worker while the optimizer moves the rows). O(SAMPLE_ROWS x width)."""
        return self.weight.detach().index_select(0, self.sample) if self.dim >= 4 else None

    def report(self, step: int, sampled: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Pack the table's summary into one float64 tensor (one host copy) and a decoding plan.
        ``sampled``: snapshot() taken at the report's step (else the rows are read now).

        O(rows touched since the last report + TOP_ROWS + SAMPLE_ROWS): the lists are re-ranked over
        the rows that changed plus the previous lists (a row nobody touched kept its statistics). Ties
        go to the lower row id. A natively tracked table is summarised by the kernel (report_rows, the
        same lists and counts); here each set of rows is gathered once: ~60 operations a table.

        Layout (see _decode): 12 scalars, the non-finite ids, the zombies' ids and five columns, the
        rarest's, the collapse statistics (3), the dead ids, whether rows not looked up had a gradient (1, 0;
        NaN: not checked, see _look_outside), the conflicted rows' ids and five columns (_conflicts)."""
        if self.native and _kernel_reads(self.weight):
            return self._native_report(sampled)
        dev, w, f64 = self.weight.device, self.weight.detach(), torch.float64
        window = self._win_n
        win = self._win[:window]  # read before the next tracked step writes the window again
        self._inwin.index_fill_(0, win, 0)
        self._win_n = 0
        k = min(TOP_ROWS, self.rows)
        inf = float("inf")
        ss = self.refresh_medians()
        occ_ref = self._occ_ref()

        # Every candidate's statistics in one gather: the rows that changed, and the previous lists.
        cand = torch.unique(torch.cat([win, self.zombie_ids, self.rare_ids, self.nonfinite_ids]))
        c = self.state[:, :8].index_select(0, cand).t()
        t, bad = c[0], c[7] > 0
        cols = torch.stack([t, c[1], _ratio(c[2], c[3]), _snr(c[4], c[5]), _ratio(c[6], occ_ref)])

        often = (t > 0) & (t >= torch.nan_to_num(self.touch_median, nan=inf))  # as the table's median row
        zkey = _zombie_score(often & (t >= MIN_TOUCHES) & ~bad & _measured(c[6]), cols[4], cols[2])
        zpos = _ranked(zkey, k, True, torch.tensor(ZOMBIE_FLOOR, dtype=zkey.dtype, device=dev))
        rpos = _ranked(torch.where((t > 0) & ~bad, t, inf), k, False, (RARE_FLOOR * self.touch_median).to(t.dtype))
        self.zombie_ids, self.rare_ids = cand.index_select(0, zpos), cand.index_select(0, rpos)
        self.nonfinite_ids = cand[bad][:k]
        self._refill_dead(k)

        # The fixed sample: the share of eligible rows with negative consistency, the spread of their
        # energy per lookup, and the collapse.
        el = (ss[0] >= MIN_TOUCHES) & ~(ss[7] > 0)
        neg = torch.stack([(el & (ss[2] < 0)).sum(), el.sum()])  # consistency < 0: its numerator < 0
        el_measured = el & _measured(ss[6])
        spread = _log_spread(ss[6], el_measured, self.occ_median)
        scores = _score_spread(ss[6], ss[2], ss[3], el_measured, self.occ_median)
        rank, cosine, sampled = self._collapse(sampled, (ss[0] > 0) & ~(ss[7] > 0))
        nf = self.nonfinite_ids.numel()
        if nf:  # on the worker, read a step or two after the report's step: a row gone NaN or inf stays so
            vals = w.index_select(0, self.nonfinite_ids)
            bad_stats = torch.stack([(t[bad][:k] == 0).sum(), torch.isnan(vals).sum(), torch.isinf(vals).sum()])
        else:
            bad_stats = torch.zeros(3, dtype=torch.long, device=dev)
        parts = [torch.cat([self.counts, neg]).to(f64), self.touch_median.to(f64)[None], bad_stats.to(f64),
                 spread.to(f64)[None], scores.to(f64), self.nonfinite_ids.to(f64),
                 self.zombie_ids.to(f64), cols.index_select(1, zpos).to(f64).reshape(-1),
                 self.rare_ids.to(f64), cols.index_select(1, rpos).to(f64).reshape(-1),
                 torch.stack([rank, cosine, sampled]).to(f64), self.dead_ids.to(f64)]
        seen = self._outside_flag()
        parts.append(torch.full((1,), math.nan, dtype=f64, device=dev) if seen is None else seen.to(f64)[None])
        conflicts, nc = self._conflicts(win, k, spread)
        parts.append(conflicts)
        plan = {"window": window, "dead": self.dead_ids.numel(), "nonfinite": nf,
                "zombies": zpos.numel(), "rarest": rpos.numel(), "conflicted": nc}
        return torch.cat(parts), plan

    def _native_report(self, sampled: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """report() by the kernel: its lists, counts and collapse statistics in one call (report_rows, the
        same ranking), but for the effective rank's eigenvalues. O(SAMPLE_ROWS + candidates x log TOP_ROWS),
        a few operations."""
        k = min(TOP_ROWS, self.rows)
        z, r, nf, dead, cl = self._lists  # the five lists view these (the torch report never ran here)
        window, self._win_n = self._win_n, 0  # the kernel clears the window's flags: it starts again empty
        out = torch.empty(16 + 20 * k, dtype=torch.float64)
        # The collapse statistics' rows, as float64 (the kernel copies them in and sums their unit vectors).
        x = self._collapse_rows
        if x is None and self.dim >= 4:
            x = self._collapse_rows = torch.empty(min(COLLAPSE_SAMPLE, self.sample.numel()), self.dim,
                                                  dtype=torch.float64)
        nz, nr, nnf, nd, self.dead_scan, touch_median, occ_median, m, nc = stats._fastats.report_rows(
            self._state.data_ptr(), self._state.shape[1], self.rows, self.dim, self.weight.data_ptr(),
            self._inwin.data_ptr(), self.counts.data_ptr(), self._win.data_ptr(), window,
            z.data_ptr(), self.zombie_ids.numel(), r.data_ptr(), self.rare_ids.numel(),
            nf.data_ptr(), self.nonfinite_ids.numel(), dead.data_ptr(), self.dead_ids.numel(),
            self.sample.data_ptr(), self.sample.numel(), self.padding.data_ptr(),
            self.padding.numel(), k, self.dead_scan, MIN_TOUCHES, MAD_SIGMA, out.data_ptr(),
            0 if x is None else x.data_ptr(), 0 if x is None else x.shape[0], LISTED_ROWS, ZOMBIE_FLOOR, RARE_FLOOR,
            self._run.data_ptr(), cl.data_ptr(), self.conflicted_ids.numel(), RUN_SETTLED, CONFLICT_FLOOR)
        self.zombie_ids, self.rare_ids, self.nonfinite_ids, self.dead_ids = z[:nz], r[:nr], nf[:nnf], dead[:nd]
        self.conflicted_ids = cl[:nc]
        self.touch_median, self.occ_median = torch.tensor(touch_median), torch.tensor(occ_median)
        at = 12 + nnf + 6 * (nz + nr)
        if m >= 2:  # the kernel wrote the mean cosine and the rows; the rank, from the rows' eigenvalues
            out[at] = _rank_of(torch.linalg.eigvalsh(_gram(x[:m])).tolist())
        seen = self._outside_flag()
        out[at + 3 + nd] = math.nan if seen is None else float(seen)
        plan = {"window": window, "dead": nd, "nonfinite": nnf, "zombies": nz, "rarest": nr, "conflicted": nc}
        return out[:at + 4 + nd + 6 * nc], plan

    def _refill_dead(self, k: int, chunk: int = 1 << 16) -> None:
        """Lowest-id finite rows never updated. A row once updated never becomes dead again, so the list
        only shrinks and is refilled by one forward scan over the ids: O(rows) once, not per report."""
        dev = self.weight.device
        ids = self.dead_ids
        if ids.numel():
            d = self.state.index_select(0, ids)
            ids = ids[(d[:, 0] == 0) & ~(d[:, 7] > 0)]
        while ids.numel() < k and self.dead_scan < self.rows:
            lo, hi = self.dead_scan, min(self.dead_scan + chunk, self.rows)
            span = torch.arange(lo, hi, device=dev)
            ok = (self.touches[lo:hi] == 0) & ~(self.state[lo:hi, 7] > 0)
            if self.padding.numel():
                ok &= ~torch.isin(span, self.padding)
            found = span[ok][: k - ids.numel()]
            ids = torch.cat([ids, found])
            self.dead_scan = int(found[-1]) + 1 if ids.numel() >= k and found.numel() else hi
        self.dead_ids = ids

    def _collapse(self, sampled: torch.Tensor | None, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Effective rank and mean pairwise cosine of up to COLLAPSE_SAMPLE of the sampled rows (``ok``:
        which of them were updated and are finite), and how many rows they are over."""
        dev = self.weight.device
        nan = torch.tensor(float("nan"), device=dev)
        if self.dim < 4:
            return nan, nan, torch.zeros((), device=dev)
        x = (self.weight.detach().index_select(0, self.sample) if sampled is None else sampled)[ok][:COLLAPSE_SAMPLE]
        x = x[torch.isfinite(x).all(dim=1)].float()  # a row can go NaN without a touch (dense optimizer state)
        m = x.shape[0]
        if m < 2:
            return nan, nan, torch.tensor(float(m), device=dev)
        g = x.double()
        xn = g / g.norm(dim=1, keepdim=True).clamp_min(1e-30)
        cos = ((xn.sum(dim=0).pow(2).sum() - m) / (m * (m - 1)))
        return _effective_rank(g), cos, torch.tensor(float(m), device=dev)


def _gram(x: torch.Tensor) -> torch.Tensor:
    """The smaller Gram matrix of the rows of ``x``: its eigenvalues are their squared singular values (a
    third of svdvals' time on 512 x 32 rows in float64, the same values to ~1e-8 of the largest)."""
    return x.T @ x if x.shape[0] >= x.shape[1] else x @ x.T


def _effective_rank(x: torch.Tensor) -> torch.Tensor:
    """exp(entropy of the normalised singular values) of the rows of ``x`` (float64), Roy & Vetterli
    (2007), on x's device (no host sync)."""
    s = torch.linalg.eigvalsh(_gram(x)).clamp_min(0.0).sqrt()
    p = s / s.sum().clamp_min(1e-30)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())


def _rank_of(eigenvalues: list[float]) -> float:
    """_effective_rank from the Gram matrix's eigenvalues on the host: the native report's, where a few
    float operations cost less than eight tensor ones."""
    s = [math.sqrt(max(v, 0.0)) for v in eigenvalues]
    total = max(math.fsum(s), 1e-30)
    return math.exp(-math.fsum(v / total * math.log(max(v / total, 1e-30)) for v in s))


def _counts(state_rows: torch.Tensor) -> torch.Tensor:
    """How many of these rows were updated at least once, are non-finite, are eligible."""
    t, bad = state_rows[:, 0], state_rows[:, 7] > 0
    return torch.stack([(t > 0).sum(), bad.sum(), ((t >= MIN_TOUCHES) & ~bad).sum()])


def _measured(occ: torch.Tensor) -> torch.Tensor:
    """Whether a row's energy per lookup was measured: it has been looked up here. A row of a replicated
    table that only other ranks look up is updated (its gradient is all-reduced) with no lookup here, and
    its energy stays 0: counted in the median energy, it read as the typical row's, and the rows looked up
    here stood out by 1e28x, critical zombies (a 2-rank DDP recommender, tests/test_distributed.py)."""
    return occ > 0


def _zombie_score(eligible: torch.Tensor, noise: torch.Tensor, consistency: torch.Tensor) -> torch.Tensor:
    """log(noise excess) - consistency where ``eligible``, else -inf (TableState.zombie_score)."""
    score = torch.log(noise.clamp_min(1e-6)) - consistency
    return torch.where(eligible, score, torch.full_like(score, float("-inf")))


def _ranked(key: torch.Tensor, k: int, largest: bool, floor: torch.Tensor | float) -> torch.Tensor:
    """Positions in ``key`` (over candidates sorted by row id) of a report's list: the worst LISTED_ROWS of
    the finite keys, and further ones up to ``k`` while past ``floor`` (at least it when ``largest``, else
    below it). Ties go to the lower row id."""
    val, pos = torch.sort(key, descending=largest, stable=True)
    val, pos = val[:k], pos[:k]
    keep = torch.isfinite(val) & ((torch.arange(val.numel(), device=key.device) < LISTED_ROWS)
                                  | (val >= floor if largest else val < floor))
    return pos[keep]


def _conflict_score(run: torch.Tensor) -> torch.Tensor:
    """run_score of rows of the run's record (sum of ln(noise), count, sum in spreads, its mean's peak): the
    peak once the count is RUN_SETTLED, the mean in spreads before; -inf where the count is 0."""
    mean = torch.where(run[:, 1] > 0, run[:, 2] / run[:, 1].clamp_min(1.0), torch.full_like(run[:, 0], -math.inf))
    return torch.where(run[:, 1] >= RUN_SETTLED, run[:, 3], mean)


def _run_noise(run: torch.Tensor) -> torch.Tensor:
    """run_noise of rows of the run's record: exp of the mean ln(noise); NaN where the count is 0."""
    mean = run[:, 0] / run[:, 1].clamp_min(1.0)
    return torch.where(run[:, 1] > 0, torch.exp(mean), torch.full_like(mean, math.nan))


def _log_spread(occ: torch.Tensor, eligible: torch.Tensor, median: torch.Tensor) -> torch.Tensor:
    """The spread of the log energy per lookup of the ``eligible`` rows above their median, the side the
    zombie rule reads: MAD_SIGMA x the median of ln(occ / median) over those rows. A standard deviation that
    the few outlying rows a rule looks for barely move; for symmetric log energies, that of the whole. A
    table that fits its data spreads its rows below the median wider (rows it memorises go quiet) than above
    it: measured on both sides, that width was read as the upper tail's (docs/embeddings.md). NaN without a
    positive median or a row above it."""
    logs = torch.where(eligible, (occ / median).log(), torch.full_like(occ, float("nan")))
    return torch.where(median > 0, _upper_spread(logs, torch.zeros_like(median)), torch.full_like(median, float("nan")))


def _score_spread(occ: torch.Tensor, num: torch.Tensor, den: torch.Tensor, eligible: torch.Tensor,
                  median: torch.Tensor) -> torch.Tensor:
    """The median zombie score (as the zombies are ranked) of the ``eligible`` rows and the spread of those
    above it: what the zombie rule reads a listed row's score against. Two NaN without a positive median."""
    score = torch.where(eligible, _zombie_score(eligible, _ratio(occ, median), _ratio(num, den)),
                        torch.full_like(occ, float("nan")))
    centre = score.nanmedian()
    return torch.where(median > 0, torch.stack([centre, _upper_spread(score, centre)]),
                       torch.full((2,), float("nan"), dtype=occ.dtype, device=occ.device))


def _upper_spread(x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """MAD_SIGMA x the median excess over ``centre`` of the values of ``x`` above it (NaN: not counted), a
    robust standard deviation of that side; NaN when none is above."""
    return torch.where(x > centre, x - centre, torch.full_like(x, float("nan"))).nanmedian() * MAD_SIGMA


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return num / den.clamp_min(1e-30)


def _snr(grad_sq: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """||mean g||^2 over the variance of g (E||g||^2 - ||mean g||^2)."""
    return _ratio(mean_sq, grad_sq - mean_sq)


def _joined(parts: list[torch.Tensor], buf: torch.Tensor | None, slot: int) -> torch.Tensor:
    """torch.cat(parts), read (not copied) from the queue's buffer when the parts lie there end to end,
    as every step's copies do unless one did not fit."""
    if buf is not None:
        whole = buf[slot]
        base, row = whole.data_ptr(), whole.stride(0) * whole.element_size()
        n = 0
        for p in parts:
            if p.dtype != whole.dtype or p.data_ptr() != base + n * row:
                break
            n += p.shape[0]
        else:
            return whole[:n]
    return torch.cat(parts)


def _max_abs(x: torch.Tensor) -> torch.Tensor:
    """Per row: the largest |element|, NaN when the row holds a NaN, inf when it holds an inf."""
    return x.abs().amax(dim=1)


def _ema_scan(rate: torch.Tensor, y: torch.Tensor, x0: torch.Tensor, first: torch.Tensor, n_steps: int) -> torch.Tensor:
    """Every x_j of x_j = (1 - rate_j) x_{j-1} + rate_j y_j along each row's run of consecutive entries
    (one column per entry), starting from x0 (given per entry; read at a run's first entry, where
    ``first`` is 1); a run (one row's touches) is at most n_steps long. An inclusive Hillis-Steele scan
    over the affine maps x -> c x + b: ceil(log2(n_steps)) rounds of three element-wise operations. The
    row's stored value is folded into its first entry, whose map becomes constant (c = 0), so that a
    combination reaching into the previous row multiplies it by 0: no segment masks, given finite
    values. The same products as the step-by-step update, in another order."""
    c = (1.0 - rate) * (1.0 - first)
    b = rate * y + (1.0 - rate) * first * x0
    b = torch.nan_to_num(b, nan=0.0, posinf=1e30, neginf=-1e30)  # finite, so that 0 * b is 0
    d = 1
    while d < n_steps:
        b[:, d:] += c[:, d:] * b[:, :-d]
        if 2 * d < n_steps:
            c[:, d:] = c[:, d:] * c[:, :-d]
        d *= 2
    return b


# A listed row's fields, in the order of the report's six columns (see TableState.report).
_ROW_KEYS = ("row", "touches", "velocity", "consistency", "snr", "noise")


def _decode(name: str, table: TableState, raw: list[float], plan: dict, tracked_steps: int) -> dict:
    isfinite = math.isfinite

    def num(x: float) -> float | None:
        return x if isfinite(x) else None

    touched, nonfinite, eligible, neg_sample, eligible_sample, median, untouched_bad, nan_count, inf_count = raw[:9]
    spread, score_median, score_spread = raw[9:12]
    at = 12

    def take(n: int) -> list[float]:
        nonlocal at
        at += n
        return raw[at - n:at]

    nf_idx = take(plan["nonfinite"])
    z_at, r_at = at, at + 6 * plan["zombies"]
    at = r_at + 6 * plan["rarest"]
    rank, cosine, sampled = take(3)
    dead_idx = take(plan["dead"])
    if take(1)[0] == 1.0:  # rows not looked up had a gradient (see TableState._look_outside)
        table.outside = True
    nc = plan["conflicted"]
    conflicted_ids, touches, noise, run_noise, run_score, reports = (take(nc) for _ in range(6))

    def rowlist(start: int, n: int) -> list[dict]:
        if stats._fastats is not None:
            return stats._fastats.row_dicts(raw, start, n, _ROW_KEYS)
        cols = [raw[start + c * n:start + (c + 1) * n] for c in range(6)]
        if all(isfinite(sum(c)) for c in cols[2:]):  # as the listed rows' statistics always are: no checks per row
            return [{"row": int(i), "touches": int(t), "velocity": v, "consistency": c, "snr": s, "noise": x}
                    for i, t, v, c, s, x in zip(*cols)]
        return [{"row": int(i), "touches": int(t), "velocity": v if isfinite(v) else None,
                 "consistency": c if isfinite(c) else None, "snr": s if isfinite(s) else None,
                 "noise": x if isfinite(x) else None}
                for i, t, v, c, s, x in zip(*cols)]

    summary = {
        "rows": table.rows, "dim": table.dim, "sparse": table.sparse, "tracked_steps": tracked_steps,
        "touched_rows": int(touched), "window_touched_rows": plan["window"],
        "never_updated": table.rows - int(touched) - int(untouched_bad) - table.padding.numel(),
        "nonfinite_rows": int(nonfinite), "median_touches": num(median), "eligible_rows": int(eligible),
        # estimated from the fixed sample of rows
        "negative_consistency_rows": round(neg_sample / max(eligible_sample, 1.0) * eligible),
        "noise_spread": num(spread), "score_median": num(score_median), "score_spread": num(score_spread),
        "effective_rank": num(rank), "mean_cosine": num(cosine), "sampled_rows": int(sampled),
        "zombies": rowlist(z_at, plan["zombies"]),
        "rarest": rowlist(r_at, plan["rarest"]),
        "dead_ids": [int(i) for i in dead_idx],
        "nonfinite_ids": [int(i) for i in nf_idx],
        "conflicted": [{"row": int(i), "touches": int(t), "noise": num(x), "run_noise": num(r), "run_score": num(z),
                        "reports": int(n)}
                       for i, t, x, r, z, n in zip(conflicted_ids, touches, noise, run_noise, run_score, reports)],
    }
    if table.tied:
        summary["tied_to"] = list(table.tied)
    if table.outside:
        summary["learns_outside_lookups"] = True
    return {"name": name, "numel": table.rows * table.dim, "nan_count": int(nan_count),
            "inf_count": int(inf_count), "embedding": summary}


def _spare_core() -> bool:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return torch.get_num_threads() < cores


class _Worker:
    """One background thread that runs a collection's folds and reports in order, for CPU tables: ATen
    releases the GIL inside its operations, so their compute overlaps the training thread on another
    core. Bounded: submit() refuses a job while MAX_JOBS are queued or running (the caller then waits and
    runs it itself). A job's error goes to ``on_error`` (the probe's hook_failed: reported at its next
    step, like an error in one of its hooks); it never reaches the training loop from here."""

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self.on_error = on_error
        self._cond = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()  # the first one is running
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stop = False

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def submit(self, job: Callable[[], None]) -> bool:
        with self._cond:
            if len(self._jobs) >= MAX_JOBS or self._stop:
                return False
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="traindx-embeddings", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def wait(self) -> None:
        """Until every submitted job has finished (at once on the worker itself: its own job is running)."""
        if self.on_thread():
            return
        with self._cond:
            while self._jobs:
                self._cond.wait()

    def close(self) -> None:
        self.wait()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    def _run(self) -> None:
        self._ident = threading.get_ident()
        while True:
            with self._cond:
                while not self._jobs:
                    if self._stop or (not self._cond.wait(WORKER_IDLE_S) and not self._jobs):
                        self._thread, self._ident = None, None  # idents are reused by later threads
                        return
                job = self._jobs[0]
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - for the training thread, which degrades
                self.on_error(e)
            with self._cond:
                self._jobs.popleft()
                self._cond.notify_all()


class _LateReport(HostCopy):
    """A report that the worker packs (its rows are decoded when it is sent, on the training thread: pure
    Python on the worker would hold the GIL): done once the worker got to it. A report that failed
    becomes an error message, so that sending it never raises."""

    def __init__(self, collection: str, step: int, names: list[str]) -> None:
        self.collection, self.step, self.names = collection, step, names
        self.time = time.time()
        self.host, self.ready = None, None
        self.raw: list[float] | None = None
        self.to_rows: Callable[[list[str], list[float]], list[dict]] | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def done(self) -> bool:
        return self.finished.is_set()

    def event(self) -> dict:
        if self.finished.wait(timeout=60.0) and self.raw is not None and self.to_rows is not None:
            return {"kind": "tensor_stats", "step": self.step, "time": self.time,
                    "collection": self.collection, "rows": self.to_rows(self.names, self.raw)}
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "not finished in 60 s"
        return {"kind": "message", "step": self.step, "time": self.time, "level": "error",
                "text": f"traindx: the {self.collection} report of step {self.step} was not made ({why})"[:4000]}


class _Lookups:
    """Keeps the ids of one module's lookups, made with autograd on while the collection is armed, in its
    table's ``lookups`` (gather() takes them). The module is put under a subclass of its own class whose
    forward does so, as torch's parametrizations put a module under a subclass, for as long as this is on
    (remove() puts the module's class back). A forward hook did the same through torch's hooked module
    call, which leaves Module.__call__'s fast path: 11-18 us of a 0.9 ms ML-100k step for its four
    lookups, against 3-7 us this way (docs/embeddings.md). The subclass keeps its class's name (the model
    prints as before); a copy or a pickle of the module is of its own class again, untracked; a replica's
    lookups (nn.DataParallel) are the table's, as a hook's were. Where the module has a forward of its own
    (set on the instance, as accelerate's hooks do: the class's would not run) or its class takes no
    subclass, a forward hook does it."""

    def __init__(self, module: torch.nn.Module, coll: Embeddings, table: TableState) -> None:
        self.module, self.table, self.coll = module, table, weakref.ref(coll)
        self.base: type | None = None  # the class the module is put under a subclass of, and that subclass
        self.cls: type | None = None
        self._on = [False]  # read by the subclass's forward (each its own): off, it is the class's own
        self._hook: Any = None

    def put_on(self) -> None:
        m = self.module
        # A forward set on the instance (accelerate's hooks set one) would bypass the class's.
        if "forward" in vars(m) or not self._put_class(m):
            self.cls, self._on = None, [False]
            self._hook = m.register_forward_hook(self._on_lookup, with_kwargs=True)
        self._on[0] = True

    def remove(self) -> None:
        self._on[0] = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        elif type(self.module) is self.cls:  # else another subclass went on top since: this one stays, off
            self.module.__class__ = self.base

    def _put_class(self, m: torch.nn.Module) -> bool:
        """Put ``m`` under the subclass (made again when its class changed since); False where its class
        takes no subclass (or no other __class__)."""
        try:
            if self.cls is None or type(m) is not self.base:
                self.base, self.cls = type(m), self._subclass(type(m))
            m.__class__ = self.cls
        except TypeError:
            return False
        return True

    def _subclass(self, base: type) -> type:
        # A list of its own: a subclass left under another one's (see remove) stays off for good.
        self._on = on = [False]
        ref, table, base_forward = self.coll, self.table, base.forward

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            out = base_forward(self, *args, **kwargs)
            if on[0]:  # kept once the lookup is made: ids it refused never reach the kernel
                _keep_lookup(ref, table, args, kwargs)
            return out

        def __reduce_ex__(self: torch.nn.Module, protocol: Any) -> Any:  # copies and pickles: the class's own
            fn, args, *rest = base.__reduce_ex__(self, protocol)
            if fn is copyreg.__newobj__ and args == (cls,):  # (pickle checks that class against __class__)
                return (copyreg._reconstructor, (base, object, None), *rest)  # what protocols 0 and 1 use
            return (fn, tuple(base if a is cls else a for a in args), *rest)

        cls = type(base.__name__, (base,), {"forward": forward, "__reduce_ex__": __reduce_ex__,
                                            "__module__": base.__module__, "__qualname__": base.__qualname__})
        return cls

    def _on_lookup(self, module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        if self._on[0]:
            _keep_lookup(self.coll, self.table, args, kwargs)


def _keep_lookup(coll: Callable[[], Embeddings | None], table: TableState, args: tuple, kwargs: dict) -> None:
    """A lookup's ids into its table's ``lookups``, while the collection (``coll``, a weak reference) is
    armed. Lookups made without autograd (evaluation) teach the table nothing. The ids are the first
    argument, passed by position or as ``input=`` (both modules' forward(input, ...)): a lookup by keyword
    missed would leave its rows learning, untracked."""
    if torch.is_grad_enabled():
        c = coll()
        if c is not None and c._armed:
            ids = args[0] if args else kwargs.get("input")
            if isinstance(ids, torch.Tensor):
                table.lookups.append(ids)  # integer ids (no autograd history), flattened in gather()


class Embeddings(Collection):
    """Per-row dynamics of every embedding table; tracked every ``track_every`` steps, reported every
    ``interval`` steps. See the module docstring for what is measured and what it costs."""

    name = "embeddings"
    track_every = 1
    # Fold and report CPU tables on the worker thread: True, False (inline, as on CUDA), or None: when
    # torch's intra-op threads leave a core of this process free (the worker then competes with nobody
    # of ours; with every core busy it only adds context switches, measured in docs/embeddings.md).
    background: bool | None = None

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        found = find_tables(probe.model)
        # A table sharded across ranks (FSDP2's DTensor) is looked up whole in the forward and its gradient
        # lands in shards: its rows' statistics would need the other ranks' shards. Left out, and said so.
        left_out = [n for n, w, _ in found if sharded(w)]
        notes = [f"embeddings: {', '.join(left_out)} {'is' if len(left_out) == 1 else 'are'} sharded across "
                 "ranks (FSDP2); per-row statistics need a whole table on one rank, so "
                 f"{'it is' if len(left_out) == 1 else 'they are'} not tracked (leave the table out of "
                 "fully_shard to track it)"] if left_out else []
        # A table whose statistics would take more than MAX_STATE_SHARE of its device's free memory is left
        # out, as is one whose statistics fail to allocate: the job runs on, and the run says which.
        self.tables = []
        other_ranks = _other_ranks()
        for i, (n, w, mods) in enumerate(found):
            if n in left_out:
                continue
            if w.device.type == "meta":  # deferred initialisation: its statistics would stay on meta
                notes.append(f"embeddings: {n} is not tracked: it is on the meta device (not yet materialised) "
                             "when the probe attaches; attach the probe after to_empty() and the weights' "
                             "initialisation to track it")
                continue
            need, free = state_bytes_of(*w.shape), free_bytes(w.device)
            if free is not None and need > MAX_STATE_SHARE * free:
                notes.append(f"embeddings: {n} is not tracked: its per-row statistics would take {_gb(need)}, more "
                             f"than {MAX_STATE_SHARE:.0%} of the {_gb(free)} free on {w.device}")
                continue
            try:
                self.tables.append(TableState(n, w, mods, seed=i, tied=tied_to(probe.model, w),
                                              other_ranks=other_ranks))
            except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError from 2.5; this name from 1.13)
                notes.append(f"embeddings: {n} is not tracked: its per-row statistics ({_gb(need)}) did not fit "
                             f"on {w.device}")
        self.note = "; ".join(notes) or None
        self._handles: list[Any] = []
        self._lookups: list[_Lookups] = []  # what keeps the tables' lookups (see arm), made at the first arm()
        self._queues: list[TableState] = []  # the queued path's tables (see quiet())
        self._step = 0
        self._left = 0  # tables no optimizer has stepped since arm() (see _post)
        self._armed = False
        # The tables each optimizer seen stepping holds (see _held), and its number of parameter groups then.
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_held: tuple = (lambda: None, 0, [])
        self._finalizer: weakref.finalize | None = None  # takes the global optimizer hooks off (_optimizer_hooks)
        # Natively tracked tables (see TableState) update their rows in the hooks and report inline: a
        # report on another thread would read a later step's rows. The worker folds and reports the queued
        # path's CPU tables (no kernel, other dtypes); on CUDA the fold's kernels already run asynchronously.
        # (Until the kernel prefetched rows, a large table with a free core took the queued path on the
        # worker: on a 1M x 32 sparse table, batch 1024, both now measure ~1.16x, native at half the CPU.)
        background = self.background if self.background is not None else _spare_core()
        on_cpu = bool(self.tables) and all(t.weight.device.type == "cpu" and not t.native for t in self.tables)
        self._worker = _Worker(lambda e: probe.hook_failed("embeddings worker", e)) if background and on_cpu else None
        for t in self.tables:
            t.worker = self._worker

    def due(self, step: int) -> bool:
        return bool(self.tables) and (step % self.track_every == 0 or step % self.interval == 0)

    def next_due(self, step: int) -> int:
        if not self.tables:
            return 2**62
        return min(-(-step // self.track_every) * self.track_every, -(-step // self.interval) * self.interval)

    def reports(self, step: int) -> bool:
        return step % self.interval == 0

    def quiet(self, step: int) -> int:
        # Tracked every step, up to the next report. (A table that leaves the kernel after this, its weight
        # replaced, has its queue folded at the next report: at most one interval of steps.)
        if self.track_every != 1 or not self.tables:
            return step
        self._queues = [t for t in self.tables if not t.native]
        return -(-step // self.interval) * self.interval

    def tick(self, step: int) -> bool:
        # collect() where it has work (no optimizer step, a queue at its bound): it reports nothing here
        if self._left or any(t.pending and t.flush_due() for t in self._queues):
            self.collect(step)
        self.arm(step + 1)
        return self.track_every == 1

    def table(self, name: str) -> TableState | None:
        for t in self.tables:
            if t.name == name or t.name == f"{name}.weight":
                return t
        return None

    def arm(self, step: int) -> None:
        self._step, self._armed, self._left = step, True, len(self.tables)
        for t in self.tables:
            # Lookups no optimizer step took (gather() empties the list) are dropped: their step was skipped.
            # Those made after the table's optimizer stepped are the next step's, in a loop that calls
            # probe.step() before optimizer.step(): kept for it. (So are those of a forward with autograd
            # between optimizer.step() and probe.step(), a metric computed without no_grad: the next step
            # counts them as lookups; rows they alone looked up get no gradient there and are not touched.)
            if t.lookups and t.phase != 2:
                t.lookups = []
            t.phase = 0
        # With every step tracked the hooks stay on between steps (the probe calls disarm() only after a
        # tracked step that the next one does not follow): registering and removing six hooks every step
        # cost ~0.1 ms of a 1.3 ms ML-100k step (docs/embeddings.md). The optimizer hooks are torch's global
        # ones, called at every optimizer's step: a table is tracked in the step of the optimizer that holds
        # it, whichever that is (a recommender's SparseAdam for its sparse tables beside an Adam for its dense
        # layers, whatever optimizer the probe was given), and after that optimizer's own post hooks, so that
        # a fix's (embedding_grad_scale rescaling the rows' step) acts before the rows are read.
        if self._handles:
            return
        if not self._lookups:
            self._lookups = [_Lookups(m, self, t) for t in self.tables for m in t.modules]
        for lk in self._lookups:
            lk.put_on()
        self._handles += self._lookups
        self._handles += self._optimizer_hooks()

    def _optimizer_hooks(self) -> list:
        """torch's global optimizer step hooks, calling _pre and _post while this collection lives. The global
        registry is the process's: holding the collection there (and through it the probe and its model)
        would keep a probe the job dropped without close() alive, its hooks running at every optimizer's
        step, for good. So they hold it weakly, and come off when it is collected (or at disarm())."""
        ref = weakref.ref(self)

        def calling(name: str) -> Callable:
            def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
                coll = ref()
                if coll is not None:
                    try:
                        getattr(coll, name)(opt)
                    except Exception as e:  # noqa: BLE001 - inside the job's optimizer step (as guarded())
                        coll.probe.hook_failed("embeddings hook", e)
            return hook

        handles = [register_optimizer_step_pre_hook(calling("_pre")), register_optimizer_step_post_hook(calling("_post"))]
        self._finalizer = weakref.finalize(self, _remove_hooks, handles)
        return handles

    def _held(self, opt: torch.optim.Optimizer) -> list[TableState]:
        """The tables whose weights ``opt``'s parameter groups hold (none: another model's optimizer), found
        once per optimizer and again when its groups change."""
        last = self._last_held  # the optimizer of the last call (one per step in most jobs): no dict lookup
        if last[0]() is opt and last[1] == len(opt.param_groups):
            return last[2]
        got = self._owned.get(opt)
        if got is None or got[0] != len(opt.param_groups):
            held = {id(w) for g in opt.param_groups for w in g["params"]}
            tables = [t for t in self.tables if id(t.weight) in held]
            got = self._owned[opt] = (len(opt.param_groups), tables)
        self._last_held = (weakref.ref(opt), *got)
        return got[1]

    def owner(self, table: TableState) -> torch.optim.Optimizer | None:
        """The optimizer that steps ``table``: the probe's if it holds it, else the first whose step was seen
        holding it; None when neither (the probe has no optimizer, or another one that has not stepped yet)."""
        if self.probe.optimizer is not None:
            self._held(self.probe.optimizer)  # known from the start, stepped or not
        return next((opt for opt, (_, tables) in list(self._owned.items()) if table in tables), None)

    def _pre(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        # Deferred (Probe.defer_step_fixes: Lightning's optimizer.step(closure) runs the forward and backward
        # inside the step, after its pre hooks), the probe's optimizer's tables are gathered from
        # before_optimizer_step(), after the backward.
        if self._armed and (opt is not self.probe.optimizer or self.probe._target.deferred is None):
            self._gather(opt)

    def before_optimizer_step(self) -> None:
        if self._armed and self.probe.optimizer is not None:
            self._gather(self.probe.optimizer)

    def _gather(self, opt: torch.optim.Optimizer) -> None:
        seen: list = []
        for t in self._held(opt):
            if t.phase == 0:  # once a step: a second optimizer step before probe.step() is not tracked
                t.phase, t.stepper = 1, opt
                t.gather(seen)

    def _post(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if self._armed:
            for t in self._held(opt):
                # after the step of the optimizer that gathered the rows: an optimizer wrapping another
                # (Lookahead) holds the same tables, and the inner one's step ends first
                if t.phase == 1 and t.stepper is opt:
                    t.phase, t.stepper = 2, None
                    self._left -= 1
                    if t.weight.grad is None:  # taken away in the step (skip_nonfinite): the rows did not learn
                        t._cur = None
                    else:
                        t.update(self._step, with_delta=True)

    def collect(self, step: int) -> list[HostCopy]:
        self._armed = False
        if self._left:  # tables no optimizer stepped this step
            for t in self.tables:
                if t.phase == 2:
                    continue
                if self.owner(t) is not None:
                    # Their optimizer skipped the step (AMP's GradScaler on an overflow, a loop skipping a
                    # non-finite loss): the rows did not learn, and their gradients may be inf while the rows
                    # are finite. Nothing is tracked.
                    t._cur = None
                else:  # no optimizer holds them: the gradients only, no deltas
                    if t.phase == 0:
                        t.gather()
                    t.update(step, with_delta=False)
                t.stepper = None
            self._left = 0
        reporting = step % self.interval == 0
        if not (reporting or any(t.pending and t.flush_due() for t in self.tables)):
            return []
        worker = self._worker
        # Tables looked up with the same indices sort them once (entries); for a report on the worker, the
        # copies of the weight it reads are taken now, at its step (inline, it reads the rows themselves).
        work = [(t, *t.take(), t.snapshot() if reporting and worker is not None else None, t.tracked_steps)
                for t in self.tables]
        if worker is None:
            self._fold_all(work)  # an error raises into collect(): the probe degrades
            return [HostCopy(self.name, step, *self._pack(step, work))] if reporting else []
        late = _LateReport(self.name, step, [t.name for t in self.tables]) if reporting else None

        def job() -> None:
            try:
                self._fold_all(work)
                if late is not None:
                    names, stacked, to_rows = self._pack(step, work)
                    late.raw, late.to_rows = stacked.tolist(), to_rows
            except BaseException as e:
                if late is not None:
                    late.error = e
                raise
            finally:
                if late is not None:
                    late.finished.set()

        if not worker.submit(job):  # the worker is behind: wait for it, then fold here (back-pressure)
            worker.wait()
            job()  # an error raises into collect(): the probe degrades
        return [late] if late is not None else []

    @staticmethod
    def _fold_all(work: list) -> None:
        entries: dict = {}
        for t, pending, buf, _, _ in work:
            t.fold(pending, buf, entries)  # nothing queued for a natively tracked table

    def _pack(self, step: int, work: list) -> tuple[list[str], torch.Tensor, Callable]:
        names, parts, plans = [], [], []
        for t, _, _, sampled, tracked in work:
            packed, plan = t.report(step, sampled)
            names.append(t.name)
            parts.append(packed)
            plans.append((t, packed.numel(), plan, tracked))

        def to_rows(names: list[str], raw: list[float]) -> list[dict]:
            rows, at = [], 0
            for name, (t, n, plan, tracked) in zip(names, plans):
                rows.append(_decode(name, t, raw[at:at + n], plan, tracked))
                at += n
            return rows

        return names, torch.cat(parts), to_rows

    def disarm(self) -> None:
        self._armed = False
        if self._finalizer is not None:  # the hooks come off here, not when the collection is collected
            self._finalizer.detach()
            self._finalizer = None
        super().disarm()

    def close(self) -> None:
        self.disarm()
        if self._worker is not None:
            self._worker.close()  # the reports in flight are finished: the probe sends them next


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


# -- the live fix ----------------------------------------------------------------------------------------
def _collection(t: Target) -> Embeddings:
    for c in getattr(t.probe, "collections", []):
        if isinstance(c, Embeddings):
            return c
    raise FixRejected("embedding_grad_scale needs the embeddings collection: attach the probe with "
                      "collections=[..., 'embeddings']")


def row_factors(table: TableState, *, min_factor: float, max_factor: float, snr_ref: float | None = None,
                rows: torch.Tensor | None = None, starved_below: float = 0.0) -> torch.Tensor:
    """Per-row scale, O(rows). Noisy rows (``rows`` when given, else every eligible row) get
    clamp(snr / snr_ref, min_factor, 1). Unless given, ``snr_ref`` is the lower of the table's median
    snr and the snr of white noise (NOISE_SNR): a row is damped only when its gradient carries less
    signal than both the typical row's and noise's, and a row with half that signal takes half a step.
    (While a table still learns, its median is above NOISE_SNR and few rows qualify.)
    Optionally, rows updated less often than ``starved_below`` x the median get up to ``max_factor``
    (sqrt(median / touches)). 1 elsewhere."""
    f = torch.ones(table.rows, device=table.weight.device)
    snr = table.snr()
    el = table.eligible()
    if snr_ref is None:
        snr_ref = min(float(snr[el].median()), NOISE_SNR) if bool(el.any()) else NOISE_SNR
    snr_ref = max(snr_ref, 1e-12)
    noisy = el & (snr < snr_ref)
    if rows is not None:
        chosen = torch.zeros_like(noisy)
        chosen[rows] = True
        noisy &= chosen
    f = torch.where(noisy, (snr / snr_ref).clamp(min_factor, 1.0), f)
    if starved_below > 0 and max_factor > 1:
        touched = table.touches > 0
        if touched.any():
            med = table.touches[touched].float().median()
            starved = touched & (table.touches.float() < starved_below * med) & ~noisy
            up = (med / table.touches.float().clamp_min(1.0)).sqrt().clamp(1.0, max_factor)
            f = torch.where(starved, up, f)
    return f


def embedding_grad_scale(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    """Scale the learning of each affected row by a factor from its measured SNR.

    ``mode='update'`` (default) scales the row's step (w_before + f * (w_after - w_before)): for SGD this
    is the same as scaling its gradient, and for Adam-family optimizers it is the only way a constant
    per-row scale has an effect (a gradient scale cancels in m / sqrt(v)). ``mode='grad'`` scales the
    gradient rows before the optimizer step. Factors are computed when the fix is applied, from the rows'
    statistics at that moment, and with ``refresh=N`` again every N optimizer steps (a row that turns
    noisy later is damped from then on; one that regains a signal gets its step back); revert removes
    the hooks.
    """
    coll = _collection(t)
    name = params.get("table")
    table = coll.table(name) if isinstance(name, str) else None
    if table is None:
        raise FixRejected(f"no embedding table {name!r}; tables: {[x.name for x in coll.tables]}")
    opt = coll.owner(table)  # the one that steps the table, which need not be the probe's
    if opt is None:
        raise FixRejected(f"no optimizer that steps {table.name!r} yet: pass it to probes.attach(model, optimizer), "
                          "or apply the fix once a step has run")
    lo = bounds.get("min_factor", 0.01)
    hi = bounds.get("max_factor", 10.0)
    min_factor = _number(params, "min_factor", lo, 1.0, default=max(0.1, lo))
    max_factor = _number(params, "max_factor", 1.0, hi, default=1.0)
    snr_ref = _number(params, "snr_ref", 1e-9, 1e6) if params.get("snr_ref") is not None else None
    starved_below = _number(params, "starved_below", 0.0, 1.0, default=0.0)
    mode = params.get("mode", "update")
    if mode not in ("update", "grad"):
        raise FixRejected(f"parameter 'mode' must be 'update' or 'grad', got {mode!r}")
    ids = params.get("rows")
    rows = None
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, (int, float)) and not isinstance(i, bool)
                                                 and i == int(i) and 0 <= i < table.rows for i in ids):
            raise FixRejected(f"parameter 'rows' must be a list of row ids in [0, {table.rows})")
        rows = torch.tensor([int(i) for i in ids], dtype=torch.long, device=table.weight.device)
    refresh = int(_number(params, "refresh", 0, 1e9, default=0))
    if refresh != params.get("refresh", 0):
        raise FixRejected(f"parameter 'refresh' must be a whole number of steps, got {params.get('refresh')!r}")
    w = table.weight
    state: dict[str, Any] = {"before": None, "steps": 0}

    def compute() -> None:
        factors = row_factors(table, snr_ref=snr_ref, min_factor=min_factor, max_factor=max_factor, rows=rows,
                              starved_below=starved_below)
        affected = torch.nonzero(factors != 1.0).reshape(-1)
        state.update(factors=factors, affected=affected, f=factors.index_select(0, affected))

    compute()

    def pre(*_: Any) -> None:
        state["steps"] += 1
        if refresh and state["steps"] % refresh == 0:
            try:  # from the rows' statistics now: a row that has turned noisy since is damped too
                compute()
            except Exception as e:  # noqa: BLE001 - inside the job's optimizer step: keep the factors, report
                t.probe.hook_failed("embedding_grad_scale refresh", e)
        factors, affected, f = state["factors"], state["affected"], state["f"]
        if mode == "grad":
            g = w.grad
            if g is None:
                return
            if g.is_sparse:
                g = g.coalesce()
                g.values().mul_(factors.index_select(0, g.indices()[0])[:, None].to(g.dtype))
                w.grad = g
            else:
                g.index_copy_(0, affected, g.index_select(0, affected) * f[:, None].to(g.dtype))
        else:
            g = w.grad
            if g is not None and g.is_sparse:
                # Only the rows with a gradient move (sparse optimizers): the cost follows the batch, not
                # the number of damped rows in the table.
                touched = torch.unique(g._indices()[0])
                rf = factors.index_select(0, touched)
                keep = rf != 1.0
                affected, f = touched[keep], rf[keep]
            state["before"] = (affected, f, w.detach().index_select(0, affected))

    def post(*_: Any) -> None:
        if state["before"] is None:
            return
        (affected, f, before), state["before"] = state["before"], None
        with torch.no_grad():
            after = w.detach().index_select(0, affected)
            w.index_copy_(0, affected, before + f[:, None].to(w.dtype) * (after - before))

    handles = [opt.register_step_pre_hook(pre)]
    if mode == "update":
        handles.append(opt.register_step_post_hook(post))

    class _Handles:
        def remove(self) -> None:
            for h in handles:
                h.remove()

    t.hooks[fix_id] = _Handles()

    def undo() -> dict:
        t.hooks.pop(fix_id, None)
        for h in handles:
            h.remove()
        return {"embedding_grad_scale": 1.0, "table": table.name, "rows": 0}

    affected, f = state["affected"], state["f"]
    n = int(affected.numel())
    after = {"embedding_grad_scale": round(float(f.mean()), 6) if n else 1.0, "table": table.name, "rows": n,
             "min_factor": round(float(f.min()), 6) if n else 1.0,
             "max_factor": round(float(f.max()), 6) if n else 1.0, "mode": mode, "refresh": refresh,
             "row_ids": [str(int(i)) for i in affected[:64].tolist()]}
    return Applied({"embedding_grad_scale": 1.0, "table": table.name, "rows": 0}, after, undo)
