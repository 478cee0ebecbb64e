"""The ``embeddings`` Collection: finds a model's tables, tracks them every step, reports every interval.

Temporal statistics need consecutive touches of a row, which a sample every 50th step cannot give (a row
touched once per epoch would be seen once per 50 epochs). So the collection *tracks* every
``track_every``-th step (1 by default) and *reports* (one host copy, one event) only every ``interval``
steps. A table is tracked in the step of the optimizer that holds it (torch's global optimizer hooks: a
recommender's SparseAdam beside the dense layers' Adam); a step that optimizer skips (AMP's GradScaler
on an overflow) teaches the rows nothing and is not tracked.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..collect import Collection, HostCopy
from ..stats import sharded
from .lookups import Lookups
from .report import decode, pack
from .state import TableState, state_bytes_of
from .worker import LateReport, Worker, spare_core

# The share of the memory free on a table's device (at attach) that its statistics may take: a larger table
# is left out, and the run says so. At 121 bytes a row (state_bytes_of), a 40M-row table needs ~4.8 GB:
# attaching the probe must not run the job out of memory, then or later, when its own allocations grow.
MAX_STATE_SHARE = 0.25


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


def tied_to(model: torch.nn.Module, weight: torch.nn.Parameter) -> tuple[str, ...]:
    """The parameters of other modules that are ``weight`` itself (weight tying: a language model's output
    projection is often its token table, ``lm_head.weight = wte.weight``). Through them every row of the
    table learns, looked up or not; the rules say so."""
    return tuple(f"{name}.{pname}" if name else pname for name, m in model.named_modules()
                 if not isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                 for pname, p in m.named_parameters(recurse=False) if p is weight)


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


def other_ranks() -> bool:
    """Whether this process is one of several ranks (torch.distributed initialised, world size > 1). Under
    data parallelism (DDP) every rank holds the whole table and the gradient is averaged across the ranks
    before the optimizer step: rows only other ranks looked up have a gradient here, and move. Found in the
    gradient (see TableState.gather), which without a reduction holds this rank's lookups only: right
    either way."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _gb(n: float) -> str:
    return f"{n / 2**30:.2g} GB" if n >= 2**28 else f"{n / 2**20:.3g} MB"


def _remove_hooks(handles: list) -> None:
    for h in handles:
        h.remove()


def track_tables(model: torch.nn.Module) -> tuple[list[TableState], list[str]]:
    """A TableState for each of the model's tables that can be tracked, and a note for each left out: one
    sharded across ranks (FSDP2's DTensor is looked up whole in the forward and its gradient lands in
    shards: its rows' statistics would need the other ranks' shards), one still on the meta device, one
    whose statistics would take more than MAX_STATE_SHARE of its device's free memory or fail to allocate
    (the job runs on, and the run says which)."""
    found = find_tables(model)
    left_out = [n for n, w, _ in found if sharded(w)]
    notes = [f"embeddings: {', '.join(left_out)} {'is' if len(left_out) == 1 else 'are'} sharded across "
             "ranks (FSDP2); per-row statistics need a whole table on one rank, so "
             f"{'it is' if len(left_out) == 1 else 'they are'} not tracked (leave the table out of "
             "fully_shard to track it)"] if left_out else []
    tables = []
    ranks = other_ranks()
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
            tables.append(TableState(n, w, mods, seed=i, tied=tied_to(model, w), other_ranks=ranks))
        except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError from 2.5; this name from 1.13)
            notes.append(f"embeddings: {n} is not tracked: its per-row statistics ({_gb(need)}) did not fit "
                         f"on {w.device}")
    return tables, notes


class Embeddings(Collection):
    """Per-row dynamics of every embedding table; tracked every ``track_every`` steps, reported every
    ``interval`` steps. See docs/embeddings.md for what is measured and what it costs."""

    name = "embeddings"
    track_every = 1
    # Fold and report CPU tables on the worker thread: True, False (inline, as on CUDA), or None: when
    # torch's intra-op threads leave a core of this process free (worker.spare_core).
    background: bool | None = None

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self.tables, notes = track_tables(probe.model)
        self.note = "; ".join(notes) or None
        self._handles: list[Any] = []
        self._lookups: list[Lookups] = []  # what keeps the tables' lookups (see arm), made at the first arm()
        self._queues: list[TableState] = []  # the queued path's tables (see quiet())
        self._step = 0
        self._left = 0  # tables no optimizer has stepped since arm() (see _post)
        self.armed = False  # whether the tables' lookups are kept (lookups.keep_lookup reads it)
        # The tables each optimizer seen stepping holds (see _held), and its number of parameter groups then.
        self._owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._last_held: tuple = (lambda: None, 0, [])
        self._finalizer: weakref.finalize | None = None  # takes the global optimizer hooks off (_optimizer_hooks)
        # Natively tracked tables (see TableState) update their rows in the hooks and report inline: a
        # report on another thread would read a later step's rows. The worker folds and reports the queued
        # path's CPU tables (no kernel, other dtypes); on CUDA the fold's kernels already run asynchronously.
        background = self.background if self.background is not None else spare_core()
        on_cpu = bool(self.tables) and all(t.weight.device.type == "cpu" and not t.native for t in self.tables)
        self.worker = Worker(lambda e: probe.hook_failed("embeddings worker", e)) if background and on_cpu else None
        for t in self.tables:
            t.worker = self.worker

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
        self._step, self.armed, self._left = step, True, len(self.tables)
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
        # cost ~0.1 ms of a 1.3 ms ML-100k step. The optimizer hooks are torch's global ones, called at
        # every optimizer's step: a table is tracked in the step of the optimizer that holds it, whichever
        # that is (a recommender's SparseAdam for its sparse tables beside an Adam for its dense layers,
        # whatever optimizer the probe was given), and after that optimizer's own post hooks, so that a
        # fix's (embedding_grad_scale rescaling the rows' step) acts before the rows are read.
        if self._handles:
            return
        if not self._lookups:
            self._lookups = [Lookups(m, self, t) for t in self.tables for m in t.modules]
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
        if self.armed and (opt is not self.probe.optimizer or self.probe._target.deferred is None):
            self._gather(opt)

    def before_optimizer_step(self) -> None:
        if self.armed and self.probe.optimizer is not None:
            self._gather(self.probe.optimizer)

    def _gather(self, opt: torch.optim.Optimizer) -> None:
        seen: list = []
        for t in self._held(opt):
            if t.phase == 0:  # once a step: a second optimizer step before probe.step() is not tracked
                t.phase, t.stepper = 1, opt
                t.gather(seen)

    def _post(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if self.armed:
            for t in self._held(opt):
                # after the step of the optimizer that gathered the rows: an optimizer wrapping another
                # (Lookahead) holds the same tables, and the inner one's step ends first
                if t.phase == 1 and t.stepper is opt:
                    t.phase, t.stepper = 2, None
                    self._left -= 1
                    if t.weight.grad is None:  # taken away in the step (skip_nonfinite): the rows did not learn
                        t.drop_step()
                    else:
                        t.update(self._step, with_delta=True)

    def _unstepped(self, step: int) -> None:
        """The tables no optimizer stepped this step. Where their optimizer skipped the step (AMP's
        GradScaler on an overflow, a loop skipping a non-finite loss) the rows did not learn, and their
        gradients may be inf while the rows are finite: nothing is tracked. A table no optimizer holds is
        tracked from its gradients only, with no deltas."""
        for t in self.tables:
            if t.phase == 2:
                continue
            if self.owner(t) is not None:
                t.drop_step()
            else:
                if t.phase == 0:
                    t.gather()
                t.update(step, with_delta=False)
            t.stepper = None
        self._left = 0

    def collect(self, step: int) -> list[HostCopy]:
        self.armed = False
        if self._left:
            self._unstepped(step)
        reporting = step % self.interval == 0
        if not (reporting or any(t.pending and t.flush_due() for t in self.tables)):
            return []
        worker = self.worker
        # Tables looked up with the same indices sort them once (entries); for a report on the worker, the
        # copies of the weight it reads are taken now, at its step (inline, it reads the rows themselves).
        work = [(t, *t.take(), t.snapshot() if reporting and worker is not None else None, t.tracked_steps)
                for t in self.tables]
        if worker is None:
            self._fold_all(work)  # an error raises into collect(): the probe degrades
            return [HostCopy(self.name, step, *self._pack(work))] if reporting else []
        late = LateReport(self.name, step, [t.name for t in self.tables]) if reporting else None
        job = self._job(work, late)
        if not worker.submit(job):  # the worker is behind: wait for it, then fold here (back-pressure)
            worker.wait()
            job()  # an error raises into collect(): the probe degrades
        return [late] if late is not None else []

    def _job(self, work: list, late: LateReport | None) -> Callable[[], None]:
        """The worker's job: fold the queued steps, then pack the report (``late``: None, no report); the
        report carries the job's error, if any, as its message."""
        def job() -> None:
            try:
                self._fold_all(work)
                if late is not None:
                    names, stacked, to_rows = self._pack(work)
                    late.raw, late.to_rows = stacked.tolist(), to_rows
            except BaseException as e:
                if late is not None:
                    late.error = e
                raise
            finally:
                if late is not None:
                    late.finished.set()
        return job

    @staticmethod
    def _fold_all(work: list) -> None:
        entries: dict = {}
        for t, pending, buf, _, _ in work:
            t.fold(pending, buf, entries)  # nothing queued for a natively tracked table

    @staticmethod
    def _pack(work: list) -> tuple[list[str], torch.Tensor, Callable]:
        names, parts, plans = [], [], []
        for t, _, _, sampled, tracked in work:
            packed, plan = pack(t, sampled)
            names.append(t.name)
            parts.append(packed)
            plans.append((t, packed.numel(), plan, tracked))

        def to_rows(names: list[str], raw: list[float]) -> list[dict]:
            rows, at = [], 0
            for name, (t, n, plan, tracked) in zip(names, plans):
                rows.append(decode(name, t, raw[at:at + n], plan, tracked))
                at += n
            return rows

        return names, torch.cat(parts), to_rows

    def disarm(self) -> None:
        self.armed = False
        if self._finalizer is not None:  # the hooks come off here, not when the collection is collected
            self._finalizer.detach()
            self._finalizer = None
        super().disarm()

    def close(self) -> None:
        self.disarm()
        if self.worker is not None:
            self.worker.close()  # the reports in flight are finished: the probe sends them next
