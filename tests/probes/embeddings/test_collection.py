"""The embeddings collection: which tables, in which optimizer's step, on which steps, and what it leaves out."""

from __future__ import annotations

import pytest
import torch

import probes
import probes.embeddings
import probes.embeddings.collection
from probes.embeddings import TableState
from tests.conftest import sharded_job
from tests.ddp_job import train_steps
from tests.embedding_jobs import Toy, attach, collection_of, summaries, table_state, train


def test_sparse_adam_and_untracked_steps(path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=50, dim=16, sparse=True)
    opt = torch.optim.SparseAdam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=5)
    train(model, probe, 12, ids=torch.arange(10), opt=opt)
    probe.close()
    steps = [s for s, _ in summaries(sink)]
    assert steps == [0, 5, 10]  # tracked every step, reported every interval
    scalar_events = [e for b in sink.batches for e in b["events"] if e["kind"] == "scalars"]
    assert scalar_events  # losses still reach the server
    e = summaries(sink)[-1][1]["embedding"]
    assert e["touched_rows"] == 10 and e["never_updated"] == 40 and e["sparse"] is True


def test_hooks_stay_on_while_every_step_is_tracked_and_come_off_otherwise() -> None:
    """Tracked every step, the hooks are registered once, not every step; the optimizer hooks are torch's
    global ones, which run after an optimizer's own post hooks (a fix's act before the rows are read); they
    come off when the next step is not tracked and at close."""
    from torch.optim import optimizer as optim
    model = Toy(rows=12, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)
    probe, _ = attach(model, opt)
    coll = collection_of(probe)

    def hooks() -> tuple[int, int, int]:
        return (int(type(model.table) is not torch.nn.Embedding), len(optim._global_optimizer_pre_hooks) - before[0],
                len(optim._global_optimizer_post_hooks) - before[1])

    ids = torch.arange(8)
    train(model, probe, 3, ids=ids, opt=opt)
    handles = list(coll._handles)
    train(model, probe, 3, ids=ids, opt=opt)
    assert coll._handles == handles and hooks() == (1, 1, 1)
    moved = []  # what a fix's post hook sees: the step's rows before ours have read them
    fix = opt.register_step_post_hook(lambda *_: moved.append(int(table_state(probe).touches[0])))
    train(model, probe, 1, ids=ids, opt=opt)
    fix.remove()
    assert moved == [6] and int(table_state(probe).touches[0]) == 7  # every step counted once
    coll.track_every = 3  # step 8 is not tracked (nor reported): the hooks come off after step 7
    train(model, probe, 1, ids=ids, opt=opt)
    assert hooks() == (0, 0, 0)
    train(model, probe, 1, ids=ids, opt=opt)
    assert hooks() == (1, 1, 1)
    probe.close()
    assert hooks() == (0, 0, 0)


def test_a_probe_dropped_without_close_is_collected_and_its_global_hooks_come_off() -> None:
    """torch's global optimizer hooks are the process's: they must not keep a dropped probe, and its model,
    alive (nor run for every optimizer after it)."""
    import gc
    import weakref
    from torch.optim import optimizer as optim
    hooks = len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)

    def dropped() -> tuple[weakref.ref, weakref.ref]:
        model = Toy(rows=12, dim=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        probe, _ = attach(model, opt)
        train(model, probe, 3, ids=torch.arange(8), opt=opt)
        assert len(optim._global_optimizer_pre_hooks) == hooks[0] + 1
        return weakref.ref(model), weakref.ref(probe)

    model, probe = dropped()
    gc.collect()
    assert model() is None and probe() is None
    assert (len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)) == hooks


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_loop_calling_probe_step_before_optimizer_step_is_tracked_too(order: str, path: str) -> None:
    """The README asks for probe.step() after optimizer.step(); called before it, the step's lookups are kept
    for the optimizer step that follows, and every step but the first is tracked (velocity included)."""
    torch.manual_seed(0)
    model = Toy(rows=6, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt)
    ids = torch.arange(6)
    for _ in range(10):
        loss = ((model(ids) - 1.0) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        if order == "before":
            probe.step(loss=loss)
        opt.step()
        if order == "after":
            probe.step(loss=loss)
    probe.close()
    t = table_state(probe)
    assert t.touches.tolist() == [10.0 if order == "after" else 9.0] * 6 and float(t.velocity.min()) > 0


class SparseAndDense(torch.nn.Module):
    """A recommender's usual make-up: a sparse table (SparseAdam) under a dense layer (Adam)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(30, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(1)


def two_optimizers(given: str, steps: int, fix_at: int | None = None,
                   apply: bool = True) -> tuple[TableState, torch.Tensor, list]:
    """Trains SparseAndDense with its two optimizers, the probe given one of them (or none); returns the
    table's statistics, how far the table moved after ``fix_at`` (where a fix damping every row is applied,
    unless not ``apply``) and the fix's acks."""
    torch.manual_seed(0)
    model = SparseAndDense()
    sparse = torch.optim.SparseAdam(list(model.table.parameters()), lr=0.05)
    dense = torch.optim.Adam(model.head.parameters(), lr=0.05)
    probe, sink = attach(model, {"sparse": sparse, "dense": dense, "none": None}[given], interval=20,
                         allow=["embedding_grad_scale"])
    gen = torch.Generator().manual_seed(0)
    targets = torch.randn(30, generator=gen)
    moved = torch.zeros(())
    for step in range(steps):
        if step == fix_at and apply:
            sink.commands.append({"fix_id": "f-1", "op": "apply", "action": "embedding_grad_scale",
                                  "params": {"table": "table.weight", "snr_ref": 1e6, "min_factor": 0.1}})
            probe.flush()  # the reply carries the command: applied at the next step
        ids = torch.randint(0, 30, (16,), generator=gen)
        loss = ((model(ids) - targets[ids] - 0.3 * torch.randn(16, generator=gen)) ** 2).mean()
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        before = model.table.weight.detach().clone()
        sparse.step()
        dense.step()
        if fix_at is not None and step > fix_at:
            moved = moved + (model.table.weight.detach() - before).norm()
        probe.step(loss=loss)
    probe.close()
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    return table_state(probe), moved, acks


@pytest.mark.parametrize("given", ["dense", "none"])
def test_a_table_is_tracked_and_fixed_in_the_step_of_the_optimizer_that_holds_it(given: str, path: str) -> None:
    """Given the dense layers' optimizer, or none, the probe still tracks the sparse table in SparseAdam's
    step (its rows' velocity included), as when given SparseAdam; and a fix damps the table's step there."""
    held, _, _ = two_optimizers("sparse", 60)
    other, _, _ = two_optimizers(given, 60)
    assert float(held.velocity.max()) > 0
    assert torch.allclose(other.state, held.state, rtol=1e-5, atol=1e-7)
    _, free, _ = two_optimizers(given, 70, fix_at=60, apply=False)
    state, damped, acks = two_optimizers(given, 70, fix_at=60)
    assert [a["status"] for a in acks] == ["applied"]
    assert 0.05 < float(damped / free) < 0.2  # every eligible row takes a tenth of its step


class Undo(torch.optim.Optimizer):
    """An optimizer wrapping another (as Lookahead does) whose step undoes the inner one's: rows do not move."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})
        self.inner = inner

    @torch.no_grad()
    def step(self, closure=None) -> None:
        before = [p.detach().clone() for g in self.param_groups for p in g["params"]]
        self.inner.step()
        for p, b in zip((p for g in self.param_groups for p in g["params"]), before):
            p.copy_(b)


def test_a_step_is_read_after_the_outermost_optimizer_that_holds_the_table(path: str) -> None:
    """The inner optimizer's step ends first, inside the wrapper's: the rows are read after the wrapper's."""
    model = Toy(rows=12, dim=2)
    opt = Undo(torch.optim.SGD(model.parameters(), lr=0.05))
    probe, _ = attach(model, opt)
    train(model, probe, 5, ids=torch.arange(8), opt=opt)
    probe.close()
    t = table_state(probe)
    assert int(t.touches[0]) == 5 and float(t.velocity.abs().max()) == 0.0  # each step counted once; no move


@pytest.mark.parametrize("skip", ["loop", "skip_nonfinite"])
def test_a_step_the_optimizer_skips_is_not_a_touch_and_leaves_finite_rows_finite(skip: str, path: str) -> None:
    """A step with infinite gradients that the optimizer skips (the loop's own check, as AMP's GradScaler
    does on an overflow, or the skip_nonfinite fix) leaves the rows finite: the report says none is
    non-finite, and no row counts the step as an update."""
    torch.manual_seed(0)
    model = Toy(rows=6, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=5, allow=["skip_nonfinite"])
    if skip == "skip_nonfinite":
        sink.commands.append({"fix_id": "f-1", "action": "skip_nonfinite", "params": {}})
        probe.flush()
    ids = torch.arange(6)
    for step in range(11):
        loss = ((model(ids) - 1.0) ** 2).sum() * (float("inf") if step == 5 else 1.0)
        opt.zero_grad()
        loss.backward()
        if skip == "skip_nonfinite" or step != 5:
            opt.step()
        probe.step(loss=loss)
    probe.close()
    assert bool(torch.isfinite(model.table.weight).all())
    assert [(step, r["embedding"]["nonfinite_rows"]) for step, r in summaries(sink)] == [(0, 0), (5, 0), (10, 0)]
    assert table_state(probe).touches.tolist() == [10.0] * 6


def test_steps_that_only_track_send_nothing_and_reports_and_other_collections_keep_their_steps() -> None:
    """Between two reports every step is tracked and nothing else happens (the probe's quiet steps): the
    reports, another collection's samples and the losses still come at their steps, each step counts once,
    and a capture asked for in the middle records its steps."""
    model = Toy(rows=12, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sink = probes.MemorySink()
    probe = probes.attach(model, opt, sink=sink, run="quiet", collections={"embeddings": 5, "weights": 7})
    ids = torch.arange(8)
    train(model, probe, 12, ids=ids, opt=opt)
    assert probe._quiet_until > probe.step_count  # steps 12 and 13 are quiet: neither reports nor samples
    probe._inbox.append({"op": "capture", "capture_id": "cap-1", "steps": 2})  # as the sender hands it over
    train(model, probe, 9, ids=ids, opt=opt)
    probe.close()
    events = sink.events
    steps = {c: sorted({e["step"] for e in events if e["kind"] == "tensor_stats" and e["collection"] == c})
             for c in ("embeddings", "weights")}
    assert steps["embeddings"] == [0, 5, 10, 15, 20]
    assert steps["weights"] == [0, 7, 13, 14]  # and 13, 14: the capture, asked for at step 12
    assert sorted(s for e in events if e["kind"] == "scalars" for s in [e["step"]] if "loss" in e["values"]) == list(range(21))
    assert int(table_state(probe).touches[0]) == 21  # every step tracked once


def test_a_table_sharded_with_fsdp2_is_left_out_and_the_run_says_why():
    """Under fully_shard a table's gradient lands in shards: its rows' statistics would need the other
    ranks'. The collection tracks the tables it can and says which it left out."""
    out = sharded_job("""
        class Rec(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.user = torch.nn.Embedding(50, 8)
                self.item = torch.nn.Embedding(40, 8)

            def forward(self, u, i):
                return (self.user(u) * self.item(i)).sum(1)

        torch.manual_seed(0)
        model = Rec()
        fully_shard(model.item)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        sink = probes.MemorySink()
        probe = probes.attach(model, opt, run="sharded-tables", sink=sink, collections={"embeddings": 5},
                              spool_dir=tempfile.mkdtemp())
        for step in range(10):
            u, i = torch.randint(0, 50, (32,)), torch.randint(0, 40, (32,))
            loss = ((model(u, i) - 1.0) ** 2).mean()
            opt.zero_grad(); loss.backward(); opt.step(); probe.step(loss=loss)
        probe.close()
        out["messages"] = [e["text"] for e in sink.events if e["kind"] == "message"]
        out["tables"] = sorted({r["name"] for e in sink.events if e["kind"] == "tensor_stats"
                                and e["collection"] == "embeddings" for r in e["rows"]})
    """)
    assert out["tables"] == ["user.weight"]
    assert any("embeddings: item.weight is sharded across ranks (FSDP2)" in m for m in out["messages"]), out
    assert not [m for m in out["messages"] if "probe error" in m]


def test_a_table_whose_statistics_would_not_fit_is_left_out_and_the_run_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-row statistics take ~121 bytes a row (a 40M-row table: ~4.8 GB). Attaching the probe must not run the
    job out of memory: a table past MAX_STATE_SHARE of its device's free memory is left out, as is one whose
    statistics fail to allocate; the others are tracked, the job trains on, and the run says which and why."""
    class Rec(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user, self.item, self.tag = (torch.nn.Embedding(n, 8) for n in (20, 400, 30))

        def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            return (self.user(u) * (self.item(i) + self.tag(u % 30))).sum(1)

    assert probes.embeddings.state_bytes_of(400, 8) == 400 * (4 * 24 + 25)
    assert probes.embeddings.free_bytes(torch.device("cpu")) > 0  # the host's, from /proc/meminfo
    # 400 rows need 48,400 bytes: past a quarter of 100,000 free; 20 and 30 rows are not
    monkeypatch.setattr(probes.embeddings.collection, "free_bytes", lambda device: 100_000)
    real = TableState.__init__

    def failing(self, name, *args, **kwargs) -> None:
        if name == "tag.weight":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")
        real(self, name, *args, **kwargs)

    monkeypatch.setattr(TableState, "__init__", failing)
    torch.manual_seed(0)
    model = Rec()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    probe, sink = attach(model, opt, interval=5)
    train_steps(opt, probe, 11, lambda: ((model(torch.randint(0, 20, (16,)), torch.randint(0, 400, (16,))) - 1.0) ** 2).mean())
    assert sorted({row["name"] for _, row in summaries(sink)}) == ["user.weight"]
    assert summaries(sink)[-1][1]["embedding"]["tracked_steps"] == 11
    [message] = [e["text"] for b in sink.batches for e in b["events"] if e["kind"] == "message"]
    assert message == ("embeddings: item.weight is not tracked: its per-row statistics would take 0.0462 MB, more "
                       "than 25% of the 0.0954 MB free on cpu; embeddings: tag.weight is not tracked: its per-row "
                       "statistics (0.00346 MB) did not fit on cpu")


def test_a_table_on_the_meta_device_at_attach_is_left_out_and_the_run_says_why() -> None:
    """Deferred initialisation (a model built on the meta device, materialised with to_empty() later): its
    statistics would stay on meta and every report would fail. Left out with a message that says what to do;
    the job trains on, and nothing else degrades."""
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"deferred": torch.nn.Embedding(100, 8)})
    model["real"] = torch.nn.Embedding(50, 8)
    probe, sink = attach(model, None, interval=5)
    model.to_empty(device="cpu")
    torch.nn.init.normal_(model["deferred"].weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe.optimizer = opt
    train_steps(opt, probe, 11, lambda: (model["deferred"](torch.randint(0, 100, (16,))).pow(2).mean()
                                   + model["real"](torch.randint(0, 50, (16,))).pow(2).mean()))
    assert sorted({row["name"] for _, row in summaries(sink)}) == ["real.weight"]
    [message] = [e["text"] for b in sink.batches for e in b["events"] if e["kind"] == "message"]
    assert message.startswith("embeddings: deferred.weight is not tracked: it is on the meta device")
