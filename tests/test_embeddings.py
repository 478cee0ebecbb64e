"""The embeddings collection, its rules and its fix: small tables, real training, one real server."""

from __future__ import annotations

import copy
import io
import math
import sqlite3
import time
from types import SimpleNamespace
from typing import Callable

import httpx

from tests.conftest import AUTH, sharded_job
from tests.ddp_job import train_steps
import pytest
import torch

import probes
import probes.embeddings
import probes.embeddings.action
import probes.embeddings.collection
import probes.embeddings.state
import probes.stats
from diag_server.fixes import embedding_scale_params
from diag_server.rules import Observations
from diag_server.rules.embeddings import DeadEmbedding, EmbeddingCollapse, ZombieEmbedding
from probes.embeddings import EMA_ALPHA, NOISE_SNR, SKETCH_DIM, SLOW_ALPHA, Embeddings, TableState
from probes.embeddings.maths import log_spread
from probes.embeddings.report import ROW_KEYS, decode, pack
from schemas import IngestBatch
from schemas.enums import AnomalyKind, Severity


class Toy(torch.nn.Module):
    """A table whose rows are pulled towards per-row targets: out[row] = <w[row], c>."""

    def __init__(self, rows: int = 12, dim: int = 2, *, sparse: bool = False, bag: bool = False) -> None:
        super().__init__()
        cls = torch.nn.EmbeddingBag if bag else torch.nn.Embedding
        kw = {"mode": "sum"} if bag else {}
        self.table = cls(rows, dim, sparse=sparse, **kw)
        self.bag = bag

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.table(ids[:, None]) if self.bag else self.table(ids)
        return out.sum(dim=1)


def toggling_targets(step: int, rows: int, zombies: set[int], gen: torch.Generator) -> torch.Tensor:
    """Healthy rows: a fixed target plus noise. Zombie rows: +2 / -2 on alternate steps."""
    t = 1.0 + 0.3 * torch.randn(rows, generator=gen)
    for z in zombies:
        t[z] = 2.0 if step % 2 else -2.0
    return t


def train(model: Toy, probe: probes.Probe | None, steps: int, *, ids: torch.Tensor | Callable[[int], torch.Tensor],
          zombies: set[int] = frozenset(), lr: float = 0.05, opt: torch.optim.Optimizer | None = None, seed: int = 0,
          after_step=None) -> None:
    """``ids``: the rows each step looks up, or a function of the step giving them."""
    gen = torch.Generator().manual_seed(seed)
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr)
    rows = model.table.weight.shape[0]
    for step in range(steps):
        looked_up = ids(step) if callable(ids) else ids
        target = toggling_targets(step, rows, zombies, gen)[looked_up]
        loss = ((model(looked_up) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if probe is not None:
            probe.step(loss=loss)
        if after_step:
            after_step(step)


def attach(model: torch.nn.Module, opt: torch.optim.Optimizer | None, interval: int = 10, **kw) -> tuple[probes.Probe, probes.MemorySink]:
    sink = probes.MemorySink()
    probe = probes.attach(model, opt, sink=sink, run="emb", collections={"embeddings": interval}, **kw)
    return probe, sink


def summaries(sink: probes.MemorySink) -> list[tuple[int, dict]]:
    out = []
    for b in sink.batches:
        IngestBatch.model_validate(b)  # what the probe sends is what the contract says
        for ev in b["events"]:
            if ev["kind"] == "tensor_stats" and ev["collection"] == "embeddings":
                out += [(ev["step"], r) for r in ev["rows"]]
    return out


def table_state(probe: probes.Probe) -> TableState:
    return next(c for c in probe.collections if isinstance(c, Embeddings)).tables[0]


# -- statistics ----------------------------------------------------------------------------------------------
def reference(grads: list[list[float]]) -> dict:
    """The per-row statistics by hand, in plain floats, for a table at most SKETCH_DIM wide."""
    m = [0.0] * len(grads[0])
    prev = [0.0] * len(m)
    num = den = sq = msq = 0.0
    for t, g in enumerate(grads, 1):
        a_fast, a_slow = max(1 / t, EMA_ALPHA), max(1 / t, SLOW_ALPHA)
        inno = [x - y for x, y in zip(g, m)]
        if t >= 3:
            a = max(1 / (t - 2), SLOW_ALPHA)
            num += a * (sum(x * y for x, y in zip(inno, prev)) - num)
            den += a * (math.hypot(*inno) * math.hypot(*prev) - den)
        prev = inno
        m = [y + a_fast * (x - y) for x, y in zip(g, m)]
        sq += a_slow * (sum(x * x for x in g) - sq)
        warm = t - 1 / EMA_ALPHA
        if warm >= 1:
            msq += max(1 / warm, SLOW_ALPHA) * (sum(x * x for x in m) - msq)
    return {"touches": len(grads), "consistency": num / den, "grad_sq": sq, "snr": msq / (sq - msq)}


def test_row_statistics_match_a_hand_computation(path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=6, dim=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt)
    ids = torch.tensor([0, 1, 2, 3])  # rows 4 and 5 are never looked up
    seen: dict[int, list[list[float]]] = {i: [] for i in range(4)}

    def record(step: int) -> None:
        for i in range(4):
            seen[i].append(model.table.weight.grad[i].tolist())

    train(model, probe, 30, ids=ids, zombies={0}, opt=opt, after_step=record)
    t = table_state(probe)
    for i in range(4):
        ref = reference(seen[i])
        assert int(t.touches[i]) == ref["touches"] == 30
        assert float(t.consistency[i]) == pytest.approx(ref["consistency"], rel=2e-3, abs=1e-4)
        assert float(t.grad_sq[i]) == pytest.approx(ref["grad_sq"], rel=1e-4)
        assert float(t.snr()[i]) == pytest.approx(ref["snr"], rel=1e-3)
    assert t.touches[4:].tolist() == [0, 0]
    assert float(t.consistency[0]) < -0.9  # row 0's gradient reverses every step
    assert all(float(t.consistency[i]) > 0 for i in (1, 2, 3))  # still drifting towards their targets
    probe.close()


def _beside_other_ranks(model: Toy, opt: torch.optim.Optimizer, probe: probes.Probe, n: int,
                        ids: Callable[[torch.Generator], torch.Tensor], pulled: slice, weight: float) -> None:
    """``n`` steps on this rank's lookups ``ids(gen)``, and what the all-reduce adds of the other ranks'
    lookups, stood in for by a term of the loss pulling the rows ``pulled`` (``weight`` x a random pull a
    step); then the queue flushed."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = ids(gen)
        rows = model.table.weight[pulled]
        targets, pull = torch.randn(x.numel(), generator=gen), torch.randn(rows.shape, generator=gen)
        loss = ((model(x) - targets) ** 2).mean() + weight * (rows * pull).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    probe.flush()


def test_with_other_ranks_a_row_with_a_gradient_is_updated_whether_or_not_this_rank_looked_it_up(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under data parallelism the gradient is averaged across the ranks: rows only other ranks looked up have
    one here, and move. With other ranks, such a row counts as updated, its statistics those of its gradient;
    its energy per lookup comes from this rank's lookups alone (it has none). Stood in for by a second term
    of the loss on rows 4 and 5 (what the all-reduce adds); rows 6 and 7 get nothing: the only dead ones."""
    monkeypatch.setattr(probes.embeddings.collection, "other_ranks", lambda: True)
    torch.manual_seed(0)
    model = Toy(rows=8, dim=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt)
    _beside_other_ranks(model, opt, probe, 30, lambda gen: torch.tensor([0, 1, 2, 3, 3]), slice(4, 6), 1.0)
    t = table_state(probe)
    assert t.touches.tolist() == [30] * 6 + [0, 0]
    assert (t.occ_sq[:4] > 0).all() and t.occ_sq[4:].tolist() == [0] * 4
    assert (t.grad_sq[4:6] > 0).all()  # what the other ranks' lookups gave them
    e = summaries(sink)[-1][1]["embedding"]
    assert (e["never_updated"], e["dead_ids"], e.get("learns_outside_lookups")) == (2, [6, 7], None)
    probe.close()


def test_with_other_ranks_rows_no_lookup_here_measured_are_left_out_of_the_energy_median(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row only other ranks look up has no energy per lookup here (0: not measured). Before, half the
    sample's energies were those zeros: the median energy was 0, and every row this rank looks up pulled
    "1e28x harder than the median row": critical zombies on a healthy 2-rank recommender. The median and
    the zombie ranking read the rows looked up here; rows 20-39 stand in for the other ranks' (a term of
    the loss on them, as the all-reduce adds)."""
    monkeypatch.setattr(probes.embeddings.collection, "other_ranks", lambda: True)
    torch.manual_seed(0)
    model = Toy(rows=40, dim=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=20)
    _beside_other_ranks(model, opt, probe, 100, lambda gen: torch.randint(0, 20, (32,), generator=gen), slice(20, 40),
                        0.05)
    t = table_state(probe)
    assert (t.touches >= 60).all() and (t.occ_sq[:20] > 0).all() and (t.occ_sq[20:] == 0).all()
    here = t.occ_sq[:20].sort().values
    assert here[9] <= float(t.occ_median) <= here[10]  # the median of the rows looked up here, not 0
    e = summaries(sink)[-1][1]["embedding"]
    assert e["zombies"] and max(z["noise"] for z in e["zombies"]) < 5, e["zombies"]  # the worst listed: 1e28 before
    probe.close()


def test_the_rows_with_a_gradient_are_those_with_an_element_that_is_not_zero(path: str) -> None:
    """What a rank with other ranks reads as the rows of its step: a NaN or a subnormal element makes a row
    one, -0.0 does not (the kernel's bit test and the torch path's reductions agree)."""
    t = TableState("t", torch.nn.Parameter(torch.zeros(6, 3)), [], other_ranks=True)
    grad = torch.zeros(6, 3)
    grad[1, 2], grad[2, 0], grad[3, 1], grad[5, 0] = float("nan"), 1e-40, -0.0, -2.0
    assert t.rows_with_grad(grad).tolist() == [1, 2, 5]
    assert t.rows_with_grad(grad.double()).tolist() == [1, 2, 5]  # another dtype: read as float32 by the kernel


def test_velocity_is_the_ema_of_the_row_step(path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=3, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe, _ = attach(model, opt)
    steps = []
    gen = torch.Generator().manual_seed(1)
    for s in range(12):
        w0 = model.table.weight.detach().clone()
        loss = ((model(torch.tensor([0, 1])) - torch.randn(2, generator=gen)) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        steps.append((model.table.weight.detach() - w0)[0].norm().item())
    v = 0.0
    for t, x in enumerate(steps, 1):
        v += max(1 / t, EMA_ALPHA) * (x - v)
    assert float(table_state(probe).velocity[0]) == pytest.approx(v, rel=1e-5)
    probe.close()


def test_memory_is_o_rows_and_never_a_copy_of_the_table() -> None:
    per_row = []
    for rows, dim in ((1000, 4), (1000, 64), (50_000, 64), (50_000, 256)):
        m = torch.nn.Embedding(rows, dim)
        t = TableState("w", m.weight, [m])
        per_row.append(t.state_bytes() / rows)
        for name, x in vars(t).items():
            if isinstance(x, torch.Tensor) and x.dim() == 2 and name not in ("proj", "weight"):
                assert x.shape[1] <= 8 + 2 * SKETCH_DIM, name  # per-row state does not grow with the row's width
    assert max(per_row) == per_row[1] == per_row[2] == per_row[3]  # bytes per row: independent of rows and width
    # 24 float32 a row, the window's 9 bytes and the run's record's 16: below a 32-wide float32 row (128 bytes),
    # whatever the width; the bound a table is left out by counts all of it
    assert per_row[1] == 96 + 9 + 16 == probes.embeddings.state_bytes_of(1000, 64) / 1000


@pytest.mark.parametrize("bag", [False, True])
def test_sparse_and_dense_gradients_give_the_same_statistics(bag: bool, path: str) -> None:
    states = []
    for sparse in (False, True):
        torch.manual_seed(0)
        model = Toy(rows=10, dim=3, sparse=sparse, bag=bag)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        probe, sink = attach(model, opt)
        train(model, probe, 25, ids=torch.tensor([0, 1, 2, 2, 5]), zombies={1}, opt=opt)
        probe.close()
        t = table_state(probe)
        assert t.sparse == sparse
        states.append(t)
        e = summaries(sink)[-1][1]["embedding"]
        assert e["never_updated"] == 6 and e["dead_ids"] == [3, 4, 6, 7, 8, 9]
    dense, sparse_ = states
    assert torch.equal(dense.touches, sparse_.touches)
    assert torch.allclose(dense.consistency, sparse_.consistency, atol=1e-5)
    assert torch.allclose(dense.grad_sq, sparse_.grad_sq, rtol=1e-5)
    assert torch.allclose(dense.velocity, sparse_.velocity, rtol=1e-5)


class KeywordToy(Toy):
    """Toy, looking its table up by keyword: ``table(input=ids)``."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.table(input=ids[:, None]) if self.bag else self.table(input=ids)).sum(dim=1)


@pytest.mark.parametrize("bag", [False, True])
def test_a_table_looked_up_by_keyword_is_tracked_as_by_position(bag: bool, path: str) -> None:
    # ``table(input=ids)`` reaches a forward hook in kwargs, not args: before, such a table was never
    # tracked (every row "never updated", and the rows learning all the while).
    states = []
    for cls in (Toy, KeywordToy):
        torch.manual_seed(0)
        model = cls(rows=10, dim=3, bag=bag)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        probe, sink = attach(model, opt)
        train(model, probe, 25, ids=torch.tensor([0, 1, 2, 2, 5]), zombies={1}, opt=opt)
        probe.close()
        e = summaries(sink)[-1][1]["embedding"]
        assert e["touched_rows"] == 4 and e["dead_ids"] == [3, 4, 6, 7, 8, 9]
        states.append(table_state(probe))
    positional, keyword = states
    assert torch.equal(positional.state, keyword.state)


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


def test_a_tracked_module_reads_as_before_and_its_copies_are_untracked() -> None:
    """The lookups are kept by putting the table's module under a subclass of its class (torch's hooked
    module call costs more than the lookup): the model prints as before, a deep copy or a pickle of it (an
    EMA model, torch.save) is an nn.Embedding again whose lookups are its own, close() puts the class back,
    a module with a forward of its own is tracked by a hook, and a compiled model's lookups are kept with
    no graph break or recompile."""
    from torch._dynamo.utils import counters
    model = Toy(rows=12, dim=2)
    printed = repr(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt)
    train(model, probe, 2, ids=torch.arange(8), opt=opt)
    assert type(model.table) is not torch.nn.Embedding and isinstance(model.table, torch.nn.Embedding)
    assert repr(model) == printed
    buf = io.BytesIO()
    torch.save(model, buf)
    assert b"probes" not in buf.getvalue()  # the checkpoint loads without traindx
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert type(other.table) is torch.nn.Embedding and torch.equal(other.table.weight, model.table.weight)
        train(other, None, 1, ids=torch.arange(4))
        assert table_state(probe).lookups == []  # not the tracked table's
    train(model, probe, 1, ids=torch.arange(8), opt=opt)
    assert table_state(probe).touches[:9].tolist() == [3.0] * 8 + [0.0]
    probe.close()
    assert type(model.table) is torch.nn.Embedding

    # A forward set on the instance (as accelerate's hooks set it) would bypass the class's: a hook, then.
    model = Toy(rows=12, dim=2)
    own = model.table.forward
    model.table.forward = lambda *args, **kwargs: own(*args, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt)
    train(model, probe, 2, ids=torch.arange(8), opt=opt)
    assert type(model.table) is torch.nn.Embedding and table_state(probe).touches[:9].tolist() == [2.0] * 8 + [0.0]
    probe.close()
    assert not model.table._forward_hooks

    torch._dynamo.reset()
    compiled = torch.compile(Toy(rows=12, dim=2), backend="aot_eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.05)
    probe, _ = attach(compiled, opt)
    graphs = []
    for _ in range(4):
        train(compiled, probe, 1, ids=torch.arange(8), opt=opt)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0]] * 4 and table_state(probe).touches[:9].tolist() == [4.0] * 8 + [0.0]
    probe.close()


def test_hooks_stay_on_while_every_step_is_tracked_and_come_off_otherwise() -> None:
    """Tracked every step, the hooks are registered once, not every step; the optimizer hooks are torch's
    global ones, which run after an optimizer's own post hooks (a fix's act before the rows are read); they
    come off when the next step is not tracked and at close."""
    from torch.optim import optimizer as optim
    model = Toy(rows=12, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = len(optim._global_optimizer_pre_hooks), len(optim._global_optimizer_post_hooks)
    probe, _ = attach(model, opt)
    coll = next(c for c in probe.collections if isinstance(c, Embeddings))

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


def _two_tables() -> torch.nn.Module:
    class TwoTables(torch.nn.Module):  # a user table and its bias table, looked up with the same ids
        def __init__(self) -> None:
            super().__init__()
            self.user, self.user_bias = torch.nn.Embedding(40, 12), torch.nn.Embedding(40, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return (self.user(ids).sum(dim=1, keepdim=True) + self.user_bias(ids)).squeeze(1)
    torch.manual_seed(0)
    return TwoTables()


def _run_two_tables(background: bool, steps: int = 45) -> tuple[list, list[torch.Tensor]]:
    model = _two_tables()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    old = Embeddings.background
    Embeddings.background = background
    try:
        probe, sink = attach(model, opt, interval=10)
    finally:
        Embeddings.background = old
    coll = next(c for c in probe.collections if isinstance(c, Embeddings))
    native = all(t.native for t in coll.tables)  # natively tracked tables report inline: no worker
    assert (coll.worker is not None) == (background and not native)
    assert native == (probes.stats._fastats is not None)
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        ids = torch.randint(0, 25, (16,), generator=gen)
        loss = (model(ids) - torch.randn(16, generator=gen)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    states = [t.state.clone() for t in coll.tables]
    probe.close()
    return [(s, r["name"], r["embedding"]) for s, r in summaries(sink)], states


def test_background_folds_and_reports_equal_inline_ones(torch_fold: None) -> None:
    """Folded on the worker thread or inline, the statistics and every report are the same; the user table
    and its bias table (same ids) share one sort."""
    inline, inline_states = _run_two_tables(False)
    background, background_states = _run_two_tables(True)
    assert [s for s, _, _ in background] == [0, 0, 10, 10, 20, 20, 30, 30, 40, 40]
    assert background == inline
    for a, b in zip(background_states, inline_states):
        assert torch.equal(a, b)
    t = TableState("w", torch.nn.Embedding(5, 3).weight, [])
    shared = torch.tensor([0, 1, 1, 2])
    entries: dict = {}
    for table in (t, TableState("b", torch.nn.Embedding(5, 1).weight, [])):
        table.lookups = [shared[:]]  # each table's hook keeps its own view of the input
        table.weight.grad = torch.ones_like(table.weight)
        table.gather()
        table.update(0, with_delta=True)
        table.fold(*table.take(), entries=entries)
    assert len(entries) == 1


def test_a_gradient_in_another_sparse_layout_is_read_whole(path: str) -> None:
    """A sparse gradient whose every element is its own entry (sparse_dim 2) gives the statistics of
    the same gradient held dense; the kernel never reads it as rows."""
    states = []
    for layout in ("dense", "coo2"):
        emb = torch.nn.Embedding(9, 3)
        t = TableState("w", emb.weight, [emb])
        gen = torch.Generator().manual_seed(0)
        for step in range(6):
            ids = torch.tensor([1, 4, 4, 7])
            g = torch.zeros(9, 3)
            g[ids] = torch.randn(4, 3, generator=gen)
            emb.weight.grad = g.to_sparse(2) if layout == "coo2" else g
            t.lookups = [ids]
            t.gather()
            with torch.no_grad():
                emb.weight -= 0.1 * g
            t.update(step, with_delta=True)
        states.append(t.state.clone())
    assert torch.allclose(states[0], states[1], rtol=1e-5, atol=1e-7)
    assert states[0][[1, 4, 7], 0].tolist() == [6.0, 6.0, 6.0]


def test_a_table_that_changes_dtype_after_attach_is_tracked_on(path: str) -> None:
    """model.double() after attach: the kernel reads float32 rows in place, so the table moves to the
    queued path and keeps counting; nothing is read as the wrong type."""
    torch.manual_seed(0)
    model = Toy(rows=10, dim=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=5)
    ids = torch.tensor([0, 1, 2, 2, 5])
    train(model, probe, 6, ids=ids, opt=opt)
    model.double()
    train(model, probe, 6, ids=ids, opt=opt)
    probe.close()
    t = table_state(probe)
    assert not t.native and t.touches[[0, 1, 2, 5]].tolist() == [12.0] * 4 and t.touches[3] == 0
    assert summaries(sink)[-1][1]["embedding"]["touched_rows"] == 4


def test_the_window_of_changed_rows_holds_each_row_once(path: str) -> None:
    """However long the report interval, the rows changed since the last report are kept once each (O(rows),
    not O(steps)), and the report names each once."""
    torch.manual_seed(0)
    model = Toy(rows=10, dim=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=400)
    ids = torch.tensor([0, 1, 2, 2, 5])
    t = table_state(probe)
    train(model, probe, 399, ids=ids, opt=opt, after_step=lambda _: t.changed.n <= 4 or pytest.fail(f"{t.changed.n}"))
    train(model, probe, 2, ids=ids, opt=opt)  # step 400 reports
    assert t.changed.n <= 4 and t.changed.flags.sum() == t.changed.n  # the report cleared the flags of what it read
    probe.close()
    last = summaries(sink)[-1]
    assert last[0] == 400 and last[1]["embedding"]["window_touched_rows"] == 4


class Shared(torch.nn.Module):
    """A recommender's tables: an embedding and a bias looked up with the same ids, and an embedding of as
    many rows with a padding row (the same ids, other distinct rows)."""

    def __init__(self, rows: int = 40) -> None:
        super().__init__()
        self.emb, self.bias = torch.nn.Embedding(rows, 16), torch.nn.Embedding(rows, 1)
        self.padded = torch.nn.Embedding(rows, 4, padding_idx=3)

    def forward(self, ids: torch.Tensor, twin: bool = False) -> torch.Tensor:
        # twin: every table gets its own copy of the ids (nothing to share)
        a, b, c = (ids.clone() for _ in range(3)) if twin else (ids, ids, ids)
        return self.emb(a).sum(1) + self.bias(b)[:, 0] + self.padded(c).sum(1)


@pytest.mark.skipif(probes.stats._fastats is None, reason="the native kernel is not built (no C compiler at install)")
def test_tables_looked_up_with_the_same_ids_share_their_distinct_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias looked up with its embedding's ids takes the rows the embedding's tracking found (one hash of
    the lookups, not two) and ends with the statistics it has when tracked on its own; a table with another
    padding row finds its own."""
    kernel, calls = probes.stats._fastats, []

    class Recording:
        def __getattr__(self, name: str):
            if name != "track_pre":
                return getattr(kernel, name)
            return lambda *a: calls.append(a[6] != 0) or kernel.track_pre(*a)

    monkeypatch.setattr(probes.stats, "_fastats", Recording())
    states = {}
    for twin in (False, True):
        torch.manual_seed(0)
        model = Shared()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        probe, _ = attach(model, opt, interval=10**6)
        gen = torch.Generator().manual_seed(1)
        calls.clear()
        for _ in range(60):
            ids = torch.cat([torch.randint(0, 8, (24,), generator=gen), torch.randint(0, 40, (8,), generator=gen)])
            loss = ((model(ids, twin) - (ids % 3).float()) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            probe.step(loss=loss)
        coll = next(c for c in probe.collections if isinstance(c, Embeddings))
        assert all(t.native for t in coll.tables)
        states[twin] = {t.name: t.state.clone() for t in coll.tables}
        # per step, in the tables' order: emb finds its rows, bias takes them, padded finds its own
        assert calls[:3] == ([False, False, False] if twin else [False, True, False]) and len(calls) == 180
        probe.close()
    for name, state in states[False].items():
        assert torch.equal(state, states[True][name]), name
    assert states[False]["padded.weight"][3, 0] == 0  # the padding row is never touched


@pytest.mark.skipif(probes.stats._fastats is None, reason="the native kernel is not built (no C compiler at install)")
def test_the_kernel_builds_the_listed_rows_as_the_python_decoder_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report's listed rows become the event's dicts in the kernel (row_dicts) or in Python: the same
    dicts, row ids and touches as ints, a non-finite statistic as None; malformed arguments are refused."""
    kernel, nan, inf = probes.stats._fastats, float("nan"), float("inf")
    zombies = [[3.0, 9.0], [40.0, 21.0], [0.5, 0.25], [-0.3, nan], [0.04, 0.05], [3.5, inf]]
    rarest = [[12.0], [1.0], [0.0], [0.0], [-inf], [0.0]]
    raw = [2.0, 0.0, 2.0, 1.0, 2.0, 21.0, 0.0, 0.0, 0.0, 0.4, 0.1, 0.6] + [c for col in zombies for c in col] \
        + [c for col in rarest for c in col] + [4.0, 0.1, 2.0] + [5.0] + [nan] + [8.0, 30.0, 1.5, nan, 2.5, 4.0]
    plan = {"window": 3, "nonfinite": 0, "zombies": 2, "rarest": 1, "dead": 1, "conflicted": 1}
    t = SimpleNamespace(rows=20, dim=2, sparse=False, padding=torch.empty(0), tied=(), outside=False)
    native = decode("w", t, raw, plan, 7)
    monkeypatch.setattr(probes.stats, "_fastats", None)
    python = decode("w", t, raw, plan, 7)
    assert native == python
    assert native["embedding"]["conflicted"] == [{"row": 8, "touches": 30, "noise": 1.5, "run_noise": None,
                                                  "run_score": 2.5, "reports": 4}]
    z = native["embedding"]["zombies"]
    assert z[0] == {"row": 3, "touches": 40, "velocity": 0.5, "consistency": -0.3, "snr": 0.04, "noise": 3.5}
    assert z[1]["consistency"] is None and z[1]["noise"] is None and type(z[1]["row"]) is int
    assert native["embedding"]["rarest"] == [{"row": 12, "touches": 1, "velocity": 0.0, "consistency": 0.0,
                                              "snr": None, "noise": 0.0}]
    assert native["embedding"]["dead_ids"] == [5] and native["embedding"]["noise_spread"] == 0.4
    assert native["embedding"]["score_median"] == 0.1 and native["embedding"]["score_spread"] == 0.6
    with pytest.raises(ValueError, match="six columns"):
        kernel.row_dicts(raw, len(raw) - 5, 1, ROW_KEYS)
    with pytest.raises(TypeError):
        kernel.row_dicts(raw, 0, 1, list(ROW_KEYS))


def test_noise_spread_is_the_standard_deviation_of_the_log_energy_that_outliers_do_not_move() -> None:
    """noise_spread reads as a standard deviation of ln(energy per lookup): 0.5 for log-normal energies of
    sigma 0.5, whatever their scale, and still 0.5 with 3% of the rows (zombies) at 20x the median; that of
    the rows above the median where the rows below spread wider (a table memorising its quiet rows); NaN
    without a positive median."""
    gen = torch.Generator().manual_seed(0)
    occ = 3.0 * torch.exp(0.5 * torch.randn(4000, generator=gen))
    every = torch.ones(4000, dtype=torch.bool)

    def spread(x: torch.Tensor, eligible: torch.Tensor = every) -> float:
        median = torch.where(eligible, x, torch.full_like(x, float("nan"))).nanmedian()
        return float(log_spread(x, eligible, median))

    assert spread(occ) == pytest.approx(0.5, abs=0.03)
    zombies = occ.clone()
    zombies[:120] = 20 * occ.median()
    assert spread(zombies) == pytest.approx(0.5, abs=0.05)
    assert spread(occ, torch.arange(4000) < 2000) == pytest.approx(0.5, abs=0.04)  # eligible rows only
    quiet = torch.where(occ < occ.median(), occ.median() * (occ / occ.median()) ** 3, occ)  # sigma 1.5 below
    assert spread(quiet) == pytest.approx(0.5, abs=0.03)  # the side a zombie is looked for on
    assert math.isnan(spread(torch.zeros(10), torch.ones(10, dtype=torch.bool)))


@pytest.mark.skipif(probes.stats._fastats is None, reason="the native kernel is not built (no C compiler at install)")
@pytest.mark.parametrize("rows,dim", [(300, 16), (300, 1), (60, 3)], ids=["sketched", "bias", "small"])
def test_the_native_report_lists_what_the_torch_report_lists(rows: int, dim: int) -> None:
    """The kernel's report (report_rows) and the torch operations it replaces give the same summary from
    the same statistics: counts, medians, the zombie, rarest, conflicted, non-finite and dead lists in the same order
    (ties to the lower row id), their columns; over two reports, the second ranking the first's lists.
    A sketched table, a bias table, and one of fewer rows than a list holds (no collapse statistics)."""
    import copy

    torch.manual_seed(0)
    model = Toy(rows=rows, dim=dim)
    model.table.padding_idx = 7
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, _ = attach(model, opt, interval=10**6)
    t = table_state(probe)
    assert t.native
    gen = torch.Generator().manual_seed(1)
    zombies = set(range(0, 40, 3))
    used = torch.arange(rows)[torch.arange(rows) % 5 != 4]  # one row in five is never looked up: dead

    def run(steps: int) -> None:
        for _ in range(steps):  # a batch of popular and rare rows
            ids = torch.cat([used[torch.randint(0, min(60, len(used)), (40,), generator=gen)],
                             used[torch.randint(0, len(used), (20,), generator=gen)], torch.tensor([7])])
            train(model, probe, 1, ids=ids, zombies=zombies, opt=opt, seed=int(torch.randint(0, 10**6, (1,), generator=gen)))

    for steps, nan_row in ((120, 11), (60, 23)):
        run(steps)
        with torch.no_grad():
            model.table.weight[nan_row] = float("nan")  # goes non-finite at its next touch
        run(5)
        twin = copy.deepcopy(t)
        twin.native = False  # the torch operations, on a copy of the same statistics and lists
        want, plan_t = pack(twin)
        got, plan_n = pack(t)
        a = decode("w", twin, want.tolist(), plan_t, 0)["embedding"]
        b = decode("w", t, got.tolist(), plan_n, 0)["embedding"]
        assert plan_t == plan_n and b["window_touched_rows"] > rows // 3
        for key in ("zombies", "rarest", "conflicted"):
            assert [r["row"] for r in a[key]] == [r["row"] for r in b[key]]
            for ra, rb in zip(a[key], b[key]):
                assert ra == pytest.approx(rb, rel=1e-5, abs=1e-6)
        for key in ("dead_ids", "nonfinite_ids", "touched_rows", "never_updated", "nonfinite_rows", "eligible_rows",
                    "median_touches", "negative_consistency_rows", "sampled_rows"):
            assert a[key] == b[key], key
        for key in ("noise_spread", "score_median", "score_spread"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
        assert a["noise_spread"] > 0 and a["score_spread"] > 0
        for key in ("effective_rank", "mean_cosine"):  # None below 4 columns
            assert (a[key] is None) == (b[key] is None) == (dim < 4)
            assert a[key] is None or a[key] == pytest.approx(b[key])
        assert len(b["zombies"]) >= 5 and b["nonfinite_ids"] and 4 in b["dead_ids"] and 7 not in b["dead_ids"]
        assert b["conflicted"] and torch.allclose(twin.run_record, t.run_record, rtol=1e-5, atol=1e-6)  # the run's record
        assert t.changed.flags.sum() == 0 and t.changed.n == 0  # the window starts again
    probe.close()


def test_native_tracking_and_the_queued_path_on_the_worker_report_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 CPU tables are tracked by the native kernel and report inline, with no worker; the queued
    path (no kernel) folds and reports on the worker where a core is free, and reports the same."""
    if probes.stats._fastats is None:
        pytest.skip("the native kernel is not built")
    native, native_states = _run_two_tables(True)  # a core free, but native tables: no worker
    monkeypatch.setattr(probes.stats, "_fastats", None)
    queued, queued_states = _run_two_tables(True)
    assert [(s, n) for s, n, _ in queued] == [(s, n) for s, n, _ in native]
    for (_, _, a), (_, _, b) in zip(queued, native):
        assert a["touched_rows"] == b["touched_rows"] and a["never_updated"] == b["never_updated"]
        assert [r["row"] for r in a["rarest"]] == [r["row"] for r in b["rarest"]]
    for a, b in zip(queued_states, native_states):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_copies_reuse_one_buffer_and_survive_a_fold_mid_step(torch_fold: None) -> None:
    emb = torch.nn.Embedding(20, 4)
    t = TableState("w", emb.weight, [emb])

    def gather(ids: torch.Tensor) -> None:
        emb.zero_grad()
        (emb(ids) * torch.arange(1.0, 5.0)).sum().backward()
        t.lookups = [ids]
        t.gather()

    ids = torch.arange(5)
    gather(ids)
    t.update(0, with_delta=True)
    buf = t.buf
    assert t.pending[-1][3].data_ptr() == buf[2].data_ptr()  # copied into the buffer, not a fresh tensor
    t.flush()
    gather(ids)
    t.update(1, with_delta=True)
    assert t.buf is buf  # the fold handed it back
    gather(torch.arange(20).repeat(50))  # 1,000 lookups: more than the buffer holds (5 x FLUSH_STEPS rows)
    t.update(2, with_delta=True)
    assert t.pending[-1][1].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    gather(ids)
    t.flush()  # a reader folds the queue between the optimizer's pre and post hooks
    t._reserve(5)
    t.buf.fill_(float("nan"))  # the next queue overwrites the buffer the taken step was copied into
    t.update(3, with_delta=True)
    assert torch.equal(t.pending[-1][1], emb.weight.grad[ids]) and torch.isfinite(t.pending[-1][2]).all()
    assert t.touches[:5].tolist() == [4.0] * 5


@pytest.fixture
def torch_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue-and-fold path: tables the native kernel cannot track (CUDA, not float32, or no kernel
    built), which the worker thread folds on the CPU."""
    monkeypatch.setattr(probes.stats, "_fastats", None)


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch, torch_fold: None) -> None:
    monkeypatch.setattr(Embeddings, "background", True)


def test_a_background_report_is_sent_within_steps_not_an_interval(background: None) -> None:
    """A report made on the worker is picked up at the first step after it is finished: the rules see
    the report of step 10 long before the next report (step 20) would have carried it."""
    model = _two_tables()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=10)
    gen = torch.Generator().manual_seed(3)
    for step in range(20):
        ids = torch.randint(0, 25, (16,), generator=gen)
        loss = (model(ids) - torch.randn(16, generator=gen)).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step > 10:  # give the worker time for the report of step 10: a slow machine is still in time
            coll = next(c for c in probe.collections if isinstance(c, Embeddings))
            coll.worker.wait()
        probe.step(loss=loss)
        if step == 12:
            assert probe.sender.flush(10)
            assert {s for s, _ in summaries(sink)} == {0, 10}
    probe.close()


def test_the_worker_runs_only_where_a_core_is_free(monkeypatch: pytest.MonkeyPatch, torch_fold: None) -> None:
    """By default the folds go to the worker only when torch's own threads leave a core free."""
    model = _two_tables()
    for threads, worker in ((1, True), (4096, False)):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
        probe, _ = attach(model, None)
        assert (next(c for c in probe.collections if isinstance(c, Embeddings)).worker is not None) == worker
        probe.close()


def _train_on_ids(model: torch.nn.Module, opt: torch.optim.Optimizer, probe: probes.Probe, steps: int,
                  each=None) -> None:  # noqa: ANN001
    """Train on ids 0-7 for ``steps`` steps; ``each()``, when given, must hold after every step."""
    ids = torch.arange(8)
    for _ in range(steps):
        loss = model(ids).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        assert each is None or each()


def test_a_failing_background_fold_degrades_and_never_raises(background: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _two_tables()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=5)
    coll = next(c for c in probe.collections if isinstance(c, Embeddings))
    assert coll.worker is not None
    fold_steps = probes.embeddings.state.fold_steps

    def broken(table: TableState, *args: object, **kwargs: object) -> None:  # the first table's folds fail
        if table is coll.tables[0]:
            raise RuntimeError("fold broke")
        fold_steps(table, *args, **kwargs)

    monkeypatch.setattr(probes.embeddings.state, "fold_steps", broken)
    _train_on_ids(model, opt, probe, 12)  # never raises
    probe.close()
    texts = [e["text"] for b in sink.batches for e in b["events"] if e["kind"] == "message"]
    # Each report became an error message, and the probe logged the error where it degrades.
    assert any(x.startswith("traindx: the embeddings report of step 5 was not made") and "fold broke" in x for x in texts)
    assert any(x.startswith("probe error in embeddings worker") and "fold broke" in x for x in texts)
    assert coll.worker.thread is None or not coll.worker.thread.is_alive()


def test_the_worker_queue_is_bounded(background: None) -> None:
    """A slow worker makes the training thread wait and fold inline: never more than MAX_JOBS folds queued."""
    import threading

    from probes import embeddings as emb

    model = _two_tables()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    probe, _ = attach(model, opt, interval=1)  # a fold and a report every step
    coll = next(c for c in probe.collections if isinstance(c, Embeddings))
    gate = threading.Event()
    fold = TableState.fold
    seen: list[bool] = []
    threading.Timer(0.5, gate.set).start()  # the worker stalls for half a second

    def slow(self: TableState, pending: list, buf: torch.Tensor | None = None, entries: dict | None = None) -> None:
        inline = not coll.worker.on_thread()
        if not inline:
            gate.wait(timeout=5.0)
        seen.append(inline)
        fold(self, pending, buf, entries)

    TableState.fold = slow
    try:
        _train_on_ids(model, opt, probe, 6, each=lambda: len(coll.worker.jobs) <= emb.MAX_JOBS)
    finally:
        TableState.fold = fold
        gate.set()
    assert int(coll.tables[0].touches[0]) == 6  # every step folded once, in order
    assert any(seen) and not all(seen)  # some folds ran on the training thread, after waiting
    probe.close()


# -- rules ---------------------------------------------------------------------------------------------------
def obs_of(sink: probes.MemorySink) -> Observations:
    obs = Observations(run="emb", interval=10)
    for step, row in summaries(sink):
        obs.stats.setdefault("embeddings", {}).setdefault(step, []).append(row)
    return obs


def test_zombie_rule_names_the_rows_whose_updates_reverse(path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=20)
    train(model, probe, 81, ids=torch.arange(40), zombies={3, 17, 29}, opt=probe.optimizer)
    probe.close()
    found = ZombieEmbedding().observe({}, obs_of(sink))
    assert len(found) == 1
    f = found[0]
    assert f.kind == AnomalyKind.zombie_embedding and f.tensors == ["table.weight"]
    assert sorted(int(r) for r in f.evidence["rows"]) == [3, 17, 29]
    assert f.evidence["fraction"] == pytest.approx(3 / 40)

    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=20)
    train(model, probe, 81, ids=torch.arange(40), opt=probe.optimizer)
    probe.close()
    assert ZombieEmbedding().observe({}, obs_of(sink)) == []


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_rows_whose_data_pulled_hard_stay_listed_as_conflicted_once_it_no_longer_does(path: str, sparse: bool) -> None:
    """Rows 0-4 get conflicting targets (+2 and -2 in turn) for 400 steps, then the target the others have for 1200:
    their noise falls back to their peers', and the zombie list lets them go. Their run_noise keeps the record
    of the run, and their run_score its peak while their mean over the run falls; the reports list them first
    as conflicted, every other row below the list's floor (a data conflict the model has since fitted:
    benchmarks/embeddings.py, case b), on both paths, with dense gradients and sparse ones."""
    from probes.embeddings import CONFLICT_FLOOR

    torch.manual_seed(0)
    model = Toy(rows=40, dim=4, sparse=sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=20)
    planted, ids = set(range(5)), torch.arange(40)
    train(model, probe, 400, ids=ids, zombies=planted, opt=opt)  # then as long again as the slow averages remember
    probe.flush()
    during = [r["embedding"] for _, r in summaries(sink)][-1]
    train(model, probe, 1200, ids=ids, opt=opt, seed=1)
    probe.flush()
    last = [r["embedding"] for _, r in summaries(sink)][-1]
    assert {r["row"] for r in during["zombies"][:5]} == planted == {r["row"] for r in during["conflicted"][:5]}
    assert not planted & {r["row"] for r in last["zombies"][:8]}  # their noise now: as their peers'
    assert {r["row"] for r in last["conflicted"][:5]} == planted
    for r in last["conflicted"][:5]:
        assert r["run_noise"] > 3 * r["noise"] and r["run_noise"] > 3 and r["reports"] >= 70 and r["touches"] > 1500
        assert r["run_score"] > 2 * CONFLICT_FLOOR
    assert all(4 * r["run_score"] < last["conflicted"][4]["run_score"] and r["run_noise"] < 1.5
               for r in last["conflicted"][5:])
    then = {r["row"]: r["run_score"] for r in during["conflicted"][:5]}
    assert all(r["run_score"] >= then[r["row"]] for r in last["conflicted"][:5])  # the peak holds
    t = table_state(probe)
    mean = t.run_record[:5, 2] / t.run_record[:5, 1]
    assert (mean < t.run_record[:5, 3] - 0.3).all()  # where a mean over the run would have faded to
    by_row = sorted(last["conflicted"][:5], key=lambda r: r["row"])  # rows 0-4, as the record's
    assert torch.equal(t.conflict_score(torch.arange(5)), torch.tensor([r["run_score"] for r in by_row]))
    assert torch.allclose(t.run_noise(torch.arange(5)).double(),
                          torch.tensor([r["run_noise"] for r in by_row], dtype=torch.float64))
    probe.close()


def test_a_report_lists_the_worst_rows_and_every_row_past_the_floor(path: str) -> None:
    """A report lists, of each kind, the worst LISTED_ROWS rows and every further row past its floor (a zombie
    score ln(noise) - consistency of at least ln 2; touches under 2% of the median), up to TOP_ROWS: every row
    the rules could name, and no healthy filler. Of 600 rows, 60 toggle and 40 are looked up once in 100
    steps; without them, each list holds the worst 32."""
    from probes.embeddings import LISTED_ROWS, RARE_FLOOR, ZOMBIE_FLOOR

    def last_report(zombies: set[int], rare: torch.Tensor) -> dict:
        torch.manual_seed(0)
        model = Toy(rows=600, dim=2)
        probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.05), interval=100)
        common = torch.tensor([i for i in range(600) if i not in set(rare.tolist())])
        train(model, probe, 301, ids=lambda step: torch.cat([common, rare]) if step % 100 == 50 else common,
              zombies=zombies, opt=probe.optimizer)
        probe.close()
        return summaries(sink)[-1][1]["embedding"]

    zombies = set(range(0, 120, 2))
    e = last_report(zombies, torch.arange(500, 540))
    listed = [r["row"] for r in e["zombies"]]
    assert zombies <= set(listed) and len(zombies) <= len(listed) < 256
    assert all(math.log(r["noise"]) - r["consistency"] >= ZOMBIE_FLOOR - 1e-6 for r in e["zombies"][LISTED_ROWS:])
    assert sorted(r["row"] for r in e["rarest"]) == list(range(500, 540))
    assert all(r["touches"] < RARE_FLOOR * e["median_touches"] for r in e["rarest"])
    healthy = last_report(set(), torch.arange(0))
    assert len(healthy["zombies"]) == len(healthy["rarest"]) == LISTED_ROWS


@pytest.mark.parametrize("setting", ["plain", "l2", "nan"])
def test_dead_rule_names_never_updated_rows_under_l2_and_after_nan(setting: str, path: str) -> None:
    torch.manual_seed(0)
    model = Toy(rows=30, dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    looked_up = torch.tensor([i for i in range(30) if i not in (4, 9, 22)])
    gen = torch.Generator().manual_seed(0)
    for step in range(61):
        ids = looked_up[torch.randint(0, len(looked_up), (16,), generator=gen)]
        loss = ((model(ids) - 1.0) ** 2).mean()
        if setting == "l2":
            loss = loss + 1e-3 * (model.table.weight ** 2).sum()  # every row gets a gradient
        if setting == "nan" and step == 45:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
    probe.close()
    found = DeadEmbedding().observe({}, obs_of(sink))
    assert len(found) == 1
    assert sorted(int(r) for r in found[0].evidence["rows"]) == [4, 9, 22]
    e = summaries(sink)[-1][1]["embedding"]
    # an L2 term gives every row a gradient, along the row itself: not learning outside the lookups
    assert found[0].severity == Severity.warning and not found[0].evidence["learns_outside_lookups"]
    assert "learns_outside_lookups" not in e
    if setting == "nan":
        assert e["nonfinite_rows"] > 0 and not set(e["nonfinite_ids"]) & {4, 9, 22}
        assert found[0].evidence["nonfinite_rows"] == e["nonfinite_rows"]
    else:
        assert e["nonfinite_rows"] == 0


class TinyLM(torch.nn.Module):
    """Next token from the previous one, its output projection tied to the token table or not; or, with
    ``output``, the token table itself as the output matrix (a functional call: logits = h @ wte.weight.T,
    as a recommender's full softmax over its items)."""

    def __init__(self, vocab: int, tie: bool, output: bool = False) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, 8)
        self.lm_head = torch.nn.Linear(8, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight
        self.output = output

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.wte(ids))
        return torch.nn.functional.linear(h, self.wte.weight) if self.output else self.lm_head(h)


def train_lm(model: TinyLM, probe: probes.Probe, steps: int, inputs: int) -> None:
    """Next-token training on ids 0 .. inputs - 1 (the rest of the vocabulary never appears as input)."""
    opt = probe.optimizer
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, inputs, (64,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(ids), (ids + 1) % inputs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)


@pytest.mark.parametrize("how", ["tied", "output", "untied"])
def test_rows_of_a_tied_table_never_looked_up_are_said_to_learn_through_the_tie(how: str, path: str) -> None:
    # Tokens 30-39 never appear as inputs. Tied to the output projection, or the table itself used as the
    # output matrix (a full softmax over its ids), their rows still learn (their logits are pushed down every
    # step): an info that says so, and no up-weighting proposed; untied, dead rows.
    torch.manual_seed(0)
    model = TinyLM(40, how == "tied", output=how == "output")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    before = model.wte.weight[30:].detach().clone()
    train_lm(model, probe, 61, inputs=30)
    probe.close()
    learns = how != "untied"
    assert not torch.equal(model.wte.weight[30:], before) if learns else torch.equal(model.wte.weight[30:], before)
    reports = [row["embedding"] for _, row in summaries(sink) if row["name"] == "wte.weight"]
    e = reports[-1]
    assert e["never_updated"] == 10
    assert e.get("tied_to", []) == (["lm_head.weight"] if how == "tied" else [])
    # seen at the first step after the first report, said from the next report on
    assert [r.get("learns_outside_lookups", False) for r in reports] == [False] + [learns] * (len(reports) - 1)
    [found] = DeadEmbedding().observe({}, obs_of(sink))
    assert sorted(int(r) for r in found.evidence["rows"]) == list(range(30, 40))
    assert found.evidence["learns_outside_lookups"] == learns
    if how == "tied":
        assert found.severity == Severity.info and found.evidence["tied_to"] == ["lm_head.weight"]
        assert "tied to 'lm_head.weight'" in found.message and "looked up" in found.message
    elif how == "output":
        assert found.severity == Severity.info and found.evidence["tied_to"] == []
        assert "learns outside its lookups" in found.message and "never or almost never looked up" in found.message
    else:  # the vocabulary's last ids: a table sized past the data's ids (a non-suffix is a warning: above)
        assert found.severity == Severity.info and "never or almost never updated" in found.message
        assert found.evidence["past_data_range"] and "the table's last ids (30-39)" in found.message
    assert (embedding_scale_params(found.kind, {**found.evidence, "rare_rows": 1}) is None) == learns


@pytest.mark.parametrize("unused", ["last", "middle"])
def test_rows_never_updated_that_are_the_tables_last_ids_are_a_table_sized_past_the_data(unused: str, path: str) -> None:
    # A position table of 32 rows fed sequences of 24 (or a vocabulary padded to a round size): its last 8
    # rows are never looked up, by design: an info. The same 8 rows in the middle of the ids: a warning.
    torch.manual_seed(0)
    model = Toy(rows=32, dim=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe, sink = attach(model, opt, interval=20)
    used = torch.tensor([i for i in range(32) if not (24 <= i if unused == "last" else 10 <= i < 18)])
    train(model, probe, 61, ids=used, opt=opt)
    probe.close()
    [found] = DeadEmbedding().observe({}, obs_of(sink))
    assert found.evidence["never_updated"] == 8 and found.evidence["past_data_range"] == (unused == "last")
    if unused == "last":
        assert found.severity == Severity.info and "the table's last ids (24-31)" in found.message
    else:
        assert found.severity == Severity.warning and "Cold-start ids" in found.message


def test_dead_rule_waits_for_enough_updates_and_spares_a_healthy_table() -> None:
    torch.manual_seed(0)
    model = Toy(rows=10, dim=4)
    probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=0.01), interval=5)
    train(model, probe, 6, ids=torch.arange(5), opt=probe.optimizer)  # 6 updates: too early to judge
    assert DeadEmbedding().observe({}, obs_of(sink)) == []
    train(model, probe, 30, ids=torch.arange(10), opt=probe.optimizer)
    probe.close()
    assert DeadEmbedding().observe({}, obs_of(sink)) == []  # every row is updated now


def test_rare_rows_are_a_lower_bound_only_when_the_probe_list_is_full() -> None:
    """The probe lists every row updated under 2% of the median (up to 256): 40 rare rows of a shorter list are
    all of them; 256 listed, all rare, may have been cut."""
    from diag_server.rules.embeddings import LISTED_MAX

    def judge(n: int) -> dict:
        rarest = [{"row": i, "touches": 1, "velocity": 0.0, "consistency": 0.0, "snr": 0.0, "noise": 1.0}
                  for i in range(n)]
        summary = {"rows": 10_000, "median_touches": 500.0, "tracked_steps": 600, "rarest": rarest}
        [f] = DeadEmbedding().observe({}, Observations(run="r", stats={"embeddings": {600: [
            {"name": "t.weight", "embedding": summary}]}}))
        return f.evidence

    assert judge(40)["rare_rows"] == 40 and not judge(40)["fraction_is_lower_bound"]
    assert judge(LISTED_MAX)["fraction_is_lower_bound"]


def test_collapse_rule_fires_on_collapsed_rows_only() -> None:
    for collapsed in (True, False):
        torch.manual_seed(0)
        model = Toy(rows=200, dim=16)
        if collapsed:
            with torch.no_grad():
                model.table.weight.copy_(torch.randn(16) + 0.01 * torch.randn(200, 16))
        probe, sink = attach(model, torch.optim.SGD(model.parameters(), lr=1e-4), interval=5)
        train(model, probe, 6, ids=torch.arange(200), opt=probe.optimizer)
        probe.close()
        found = EmbeddingCollapse().observe({}, obs_of(sink))
        assert bool(found) == collapsed
        if collapsed:
            assert found[0].evidence["mean_cosine"] > 0.9


def test_zombie_rule_fires_on_rows_past_its_thresholds_in_consecutive_reports_only() -> None:
    """A row whose statistics cross the thresholds for one report is noise in its EMAs; a zombie stays past
    them. The rule names rows that qualify in ``reports`` consecutive reports, remembered across batches
    (the engine's JSON state), and forgets a table that stops being judged."""
    import orjson

    def report(step: int, noisy: set[int], median: float = 100.0) -> Observations:
        rows = [{"row": r, "touches": 200, "velocity": 0.1, "consistency": -0.3 if r in noisy else 0.2,
                 "snr": 0.05, "noise": 4.0 if r in noisy else 1.0} for r in range(10)]
        summary = {"rows": 1000, "median_touches": median, "zombies": sorted(rows, key=lambda r: -r["noise"])}
        return Observations(run="r", stats={"embeddings": {step: [{"name": "t.weight", "embedding": summary}]}})

    rule, state = ZombieEmbedding(), {}

    def see(obs: Observations) -> list:
        nonlocal state
        found = rule.observe(state, obs)
        state = orjson.loads(orjson.dumps(state))  # as the engine keeps it between batches
        return found

    assert see(report(100, {1, 2, 3, 4})) == []  # once: not yet
    found = see(report(200, {2, 3, 4, 5}))  # rows 2, 3, 4 qualify twice running; 1 and 5 once
    assert len(found) == 1 and sorted(found[0].evidence["rows"]) == [2, 3, 4] and found[0].evidence["zombie_rows"] == 3
    assert see(report(300, {6, 7, 8})) == []  # new rows, each once
    assert see(report(400, {6, 7, 8}, median=10.0)) == []  # too early to judge: the table's history is dropped
    assert see(report(500, {6, 7, 8})) == []
    both = report(600, {6, 7, 8})  # two reports in one batch count as two
    both.stats["embeddings"].update(report(700, {6, 7, 8}).stats["embeddings"])
    [found] = see(both)
    assert sorted(found.evidence["rows"]) == [6, 7, 8]
    # every row a warning on the table has named in the run, lowest id first: what the fault has shown so far
    assert found.evidence["rows_named_in_run"] == [2, 3, 4, 6, 7, 8] and found.evidence["rows_named_in_run_count"] == 6
    assert ZombieEmbedding(reports=1).observe({}, report(100, {1, 2, 3}))  # reports=1: one report is enough


def test_zombie_rule_tells_rows_that_stand_out_from_the_tail_the_tables_spread_gives_by_chance() -> None:
    """Ten thousand healthy rows put dozens past 2.5x the median energy per lookup: on a table of that size
    and spread, 30 rows at 3-4x are its tail (an info finding that says so), and 5 rows at 8x stand out of
    it: zombies, named alone, a warning. On a table of 200 rows the same 30 are far more than chance gives.
    A report without the spread (an older probe) is judged on the fixed thresholds."""
    tail = [3.0 + i / 30 for i in range(30)]

    def judge(noises: list[float], eligible: int, spread: float | None):
        rows = [{"row": i, "touches": 200, "velocity": 0.1, "consistency": -0.1, "snr": 0.05, "noise": x}
                for i, x in enumerate(noises)]
        summary = {"rows": max(eligible, len(rows)), "eligible_rows": eligible, "median_touches": 100.0,
                   "noise_spread": spread, "zombies": sorted(rows, key=lambda r: -r["noise"])}
        obs = Observations(run="r", stats={"embeddings": {s: [{"name": "t.weight", "embedding": summary}]
                                                          for s in (100, 200)}})
        [f] = ZombieEmbedding().observe({}, obs)
        return f, sorted(int(r) for r in f.evidence["rows"])

    f, named = judge(tail, 10_000, 0.5)
    assert f.severity == Severity.info and named == list(range(30)) and not f.evidence["stand_out"]
    assert f.evidence["expected_by_chance"] > 30 and "they are its tail, not ids with conflicting targets" in f.message
    f, named = judge(tail + [8.0] * 5, 10_000, 0.5)
    assert f.severity == Severity.warning and named == list(range(30, 35)) and f.evidence["past_thresholds"] == 35
    assert f.evidence["least_noise"] == 8.0 and f.evidence["expected_by_chance"] < 1 and "by chance" in f.message
    for eligible, spread in ((200, 0.5), (10_000, None)):
        f, named = judge(tail, eligible, spread)
        assert f.severity != Severity.info and f.evidence["stand_out"] and named == list(range(30))


def test_zombie_rule_reads_a_rows_reversal_as_well_as_its_energy_against_the_table() -> None:
    """The chance test reads the zombie score (ln(noise) - consistency, as the probe ranks the rows) against
    the table's spread of scores: of rows pulled equally hard (3-4x the median), 30 whose successive
    gradients barely disagree (-0.05, as a healthy vector row's) are the tail of a 10,000-row table, and 5
    whose updates keep reversing (-0.8: a bias row with toggling labels) stand out of it. From the
    energy alone (a probe that sends no score spread) the two cannot be told apart."""
    def judge(spreads: dict):
        rows = [{"row": i, "touches": 200, "velocity": 0.1, "consistency": -0.8 if i >= 30 else -0.05, "snr": 0.05,
                 "noise": 3.0 + (i % 30) / 30} for i in range(35)]
        summary = {"rows": 10_000, "eligible_rows": 10_000, "median_touches": 100.0, **spreads,
                   "zombies": sorted(rows, key=lambda r: r["consistency"] - math.log(r["noise"]))}
        obs = Observations(run="r", stats={"embeddings": {s: [{"name": "t.weight", "embedding": summary}]
                                                          for s in (100, 200)}})
        [f] = ZombieEmbedding().observe({}, obs)
        return f, sorted(int(r) for r in f.evidence["rows"])

    f, named = judge({"noise_spread": 0.5, "score_median": 0.0, "score_spread": 0.5})
    assert f.severity == Severity.warning and named == list(range(30, 35)) and f.evidence["score_spread"] == 0.5
    assert f.evidence["past_thresholds"] == 35 and f.evidence["expected_by_chance"] < 2.5
    assert "zombie scores" in f.message
    f, named = judge({"noise_spread": 0.5})
    assert f.severity == Severity.info and named == list(range(35))
    f, named = judge({"score_spread": 0.5})  # a spread without its median (and no noise_spread): the thresholds
    assert f.severity == Severity.warning and named == list(range(35)) and f.evidence["expected_by_chance"] is None


def test_rules_ignore_other_collections_and_round_trip_state() -> None:
    obs = Observations(run="r", stats={"weights": {0: [{"name": "w", "norm": 1.0}]}})
    for rule in (ZombieEmbedding(), DeadEmbedding(), EmbeddingCollapse()):
        assert rule.observe(rule.initial_state(), obs) == []
        assert rule.describe()["params"]  # every threshold is documented


# -- the fix -------------------------------------------------------------------------------------------------
def test_fix_scales_the_affected_rows_updates_and_reverts() -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow={"embedding_grad_scale": {"min_factor": 0.05}})
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2, 7}, opt=opt)
    t = table_state(probe)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1}})
    probe.flush()

    def one_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        target = toggling_targets(step, 12, {2, 7}, gen)
        w0 = model.table.weight.detach().clone()
        loss = ((model(ids) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        grad = model.table.weight.grad.detach().clone()
        opt.step()
        probe.step(loss=loss)
        return model.table.weight.detach() - w0, grad

    one_step(40)  # the command is applied at this step boundary, from the statistics as they are then
    probe.flush()
    expected = torch.ones(12)
    snr = t.snr()
    ref = min(float(snr[t.eligible()].median()), NOISE_SNR)
    for r in (2, 7):
        expected[r] = float((snr[r] / ref).clamp(0.1, 1.0))
    assert expected[2] < 0.5 and expected[7] < 0.5  # zombie rows: their gradient cancels, they are damped
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert acks and acks[-1]["status"] == "applied", acks
    assert acks[-1]["after"]["rows"] == 2 and acks[-1]["after"]["row_ids"] == ["2", "7"]
    delta, grad = one_step(41)
    assert torch.allclose(delta, -lr * grad * expected[:, None], atol=1e-7)
    sink.commands.append({"fix_id": "f-1", "op": "revert", "action": "embedding_grad_scale"})
    probe.flush()
    one_step(42)
    probe.flush()
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert acks[-1]["status"] == "reverted"
    delta, grad = one_step(43)
    assert torch.allclose(delta, -lr * grad, atol=1e-7)  # every row takes its full step again
    probe.close()


def test_fix_with_refresh_damps_a_row_that_turns_noisy_after_it_was_applied() -> None:
    """refresh=N recomputes the factors every N optimizer steps from the rows' statistics then: a row that
    was healthy when the fix was applied, and whose target starts toggling later, is damped from then on."""
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1, "refresh": 10}})
    probe.flush()
    ratios = []  # row 7's step over its full step, after each optimizer step
    for step in range(40, 200):
        gen = torch.Generator().manual_seed(100 + step)
        target = toggling_targets(step, 12, {2, 7}, gen)  # from now on row 7 toggles too
        w0 = model.table.weight.detach().clone()
        loss = ((model(ids) - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        full = -lr * model.table.weight.grad[7].detach().clone()
        opt.step()
        probe.step(loss=loss)
        ratios.append(float((model.table.weight.detach()[7] - w0[7]).norm() / full.norm()))
        if step == 40:
            probe.flush()
    probe.close()
    ack = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"][-1]
    assert ack["status"] == "applied" and ack["after"]["row_ids"] == ["2"] and ack["after"]["refresh"] == 10
    assert ratios[1:10] == pytest.approx([1.0] * 9)  # healthy when applied: its full step, until the first refresh
    assert ratios[-1] < 0.5  # noisy since: damped, by the factor its measured SNR gives
    changes = [i for i in range(1, len(ratios)) if abs(ratios[i] - ratios[i - 1]) > 1e-6]
    # The fix is applied at step 40's boundary; its factors change only every 10th step after.
    assert changes and all(i % 10 == 0 for i in changes)

def test_fix_on_a_sparse_table_scales_the_rows_the_batch_touched_and_leaves_the_others() -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2, sparse=True)
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    train(model, probe, 40, ids=torch.arange(12), zombies={2, 7}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2, 7], "min_factor": 0.1}})
    probe.flush()
    train(model, probe, 1, ids=torch.arange(12), zombies={2, 7}, opt=opt, seed=40)  # applied at this boundary
    probe.flush()
    t = table_state(probe)
    snr = t.snr()
    ref = min(float(snr[t.eligible()].median()), NOISE_SNR)
    factor = float((snr[2] / ref).clamp(0.1, 1.0))
    assert factor < 0.5
    ids = torch.arange(7)  # row 2 is looked up, row 7 is not
    w0 = model.table.weight.detach().clone()
    loss = ((model(ids) - 1.0) ** 2).sum()
    opt.zero_grad()
    loss.backward()
    grad = model.table.weight.grad.detach().to_dense()
    opt.step()
    probe.step(loss=loss)
    probe.close()
    delta = model.table.weight.detach() - w0
    expected = -lr * grad
    expected[2] *= factor
    assert torch.allclose(delta, expected, atol=1e-7)  # row 2 damped; rows 0-6 full; row 7 and up unmoved
    assert torch.equal(delta[7:], torch.zeros(5, 2))

def test_a_refresh_that_fails_keeps_the_factors_and_never_reaches_the_loop(monkeypatch) -> None:
    torch.manual_seed(0)
    model = Toy(rows=12, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    ids = torch.arange(12)
    train(model, probe, 40, ids=ids, zombies={2}, opt=opt)
    sink.commands.append({"fix_id": "f-1", "action": "embedding_grad_scale",
                          "params": {"table": "table.weight", "rows": [2], "min_factor": 0.1, "refresh": 5}})
    probe.flush()
    train(model, probe, 1, ids=ids, zombies={2}, opt=opt, seed=40)  # applied at this boundary

    def broken(*_, **__):
        raise RuntimeError("statistics unavailable")

    monkeypatch.setattr(probes.embeddings.action, "row_factors", broken)
    w0 = model.table.weight.detach().clone()
    train(model, probe, 20, ids=ids, zombies={2}, opt=opt, seed=41)  # four refreshes fail inside opt.step()
    assert not torch.equal(model.table.weight.detach(), w0)  # training went on
    probe.close()
    texts = [e["text"] for b in sink.batches for e in b["events"] if e["kind"] == "message"]
    assert any("embedding_grad_scale refresh" in t and "statistics unavailable" in t for t in texts), texts

def test_fix_refuses_bad_parameters_and_a_missing_collection() -> None:
    torch.manual_seed(0)
    model = Toy(rows=5, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, allow=["embedding_grad_scale"])
    for fid, params in (("f-1", {"table": "nope"}), ("f-2", {"table": "table.weight", "min_factor": 0.0001}),
                        ("f-3", {"table": "table.weight", "rows": [99]})):
        sink.commands.append({"fix_id": fid, "action": "embedding_grad_scale", "params": params})
    probe.flush()
    train(model, probe, 2, ids=torch.arange(5), opt=opt)
    probe.flush()
    acks = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert [a["status"] for a in acks] == ["rejected"] * 3
    blind, sink = attach(Toy(rows=5, dim=2), None, allow=["embedding_grad_scale"])  # no optimizer, no step seen
    sink.commands.append({"fix_id": "f-4", "action": "embedding_grad_scale", "params": {"table": "table.weight"}})
    blind.flush()
    blind.step()
    blind.close()
    [ack] = [e for b in sink.batches for e in b["events"] if e["kind"] == "fix_ack"]
    assert ack["status"] == "rejected" and "no optimizer that steps 'table.weight' yet" in ack["reason"]
    assert "no embedding table" in acks[0]["reason"] and "bounds" in acks[1]["reason"]
    probe.close()
    bare = probes.attach(model, opt, sink=probes.MemorySink(), collections=["weights"], allow=["embedding_grad_scale"])
    bare._inbox.append({"fix_id": "f-9", "action": "embedding_grad_scale", "params": {"table": "table.weight"}})
    bare.step()
    bare.close()
    ack = [e for b in bare.sender.sink.batches for e in b["events"] if e["kind"] == "fix_ack"][0]
    assert ack["status"] == "rejected" and "embeddings collection" in ack["reason"]


# -- end to end ----------------------------------------------------------------------------------------------
def _conflicted_heading(lines: list[str]) -> int:
    """Where `traindx embeddings` heads table.weight's conflicted rows (its table follows, after two lines)."""
    return next(i for i, line in enumerate(lines) if line.startswith("table.weight (rank 0): rows whose data has pulled"))


def test_end_to_end_dead_and_zombie_rows_through_a_real_server(server) -> None:
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe = probes.attach(model, opt, server=server.url, run="emb-e2e", collections={"embeddings": 20},
                          allow=["embedding_grad_scale"])
    ids = torch.tensor([i for i in range(40) if i not in (5, 33)])  # rows 5 and 33: never looked up
    train(model, probe, 81, ids=ids, zombies={3, 17, 29}, opt=opt)
    assert probe.flush()
    base = f"{server.url}/v1/runs/emb-e2e"
    page = httpx.get(f"{base}/anomalies", headers=AUTH).json()
    by_kind = {a["kind"]: a for a in page["anomalies"]}
    assert sorted(int(r) for r in by_kind["dead_embedding"]["evidence"]["rows"]) == [5, 33]
    zombie = by_kind["zombie_embedding"]
    assert sorted(int(r) for r in zombie["evidence"]["rows"]) == [3, 17, 29]
    assert zombie["tensors"] == ["table.weight"]

    # The table as its latest report described it, over HTTP (JSON and XML) and MCP, its lists cut to ``rows``.
    tables = httpx.get(f"{base}/embeddings", params={"rows": 3}, headers=AUTH).json()
    assert tables["rows"] == 3 and [(t["name"], t["step"]) for t in tables["tables"]] == [("table.weight", 80)]
    summary = tables["tables"][0]["summary"]
    assert summary["rows"] == 40 and summary["never_updated"] == 2 and summary["dead_ids"] == [5, 33]
    assert sorted(r["row"] for r in summary["zombies"]) == [3, 17, 29] and len(summary["rarest"]) == 3
    assert sorted(r["row"] for r in summary["conflicted"]) == [3, 17, 29]  # and their data, over the run
    xml = httpx.get(f"{base}/embeddings", params={"table": "table", "format": "xml"}, headers=AUTH)
    assert xml.status_code == 200 and b"<EmbeddingTables" in xml.content and xml.content.count(b"<zombies") == 20
    missing = httpx.get(f"{base}/embeddings", params={"table": "user"}, headers=AUTH)
    assert missing.status_code == 404 and "it reported: table.weight" in missing.json()["message"]

    async def over_mcp() -> dict:
        from agent_examples.scripted_agent import connect
        async with connect(f"{server.url}/mcp") as mcp:
            return (await mcp.call_tool("get_embeddings", {"run": "emb-e2e", "rows": 3})).structured_content

    import asyncio
    assert asyncio.run(over_mcp()) == tables
    from click.testing import CliRunner  # and for people, as a table
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    out = CliRunner().invoke(main, ["embeddings", "emb-e2e", "--rows", "3"], env=env, catch_exceptions=False).output
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["TABLE", "RANK", "STEP"] and lines[2].split()[:8] == ["table.weight", "0", "80",
                                                                                         "40", "2", "38", "2", "0"]
    assert "SCORE SPREAD" in lines[0] and float(lines[2].split()[9]) > 0  # what a row's score is read against
    at = lines.index("table.weight (rank 0): rows most like zombies, worst first")
    assert sorted(int(line.split()[0]) for line in lines[at + 3:at + 6]) == [3, 17, 29]
    at = _conflicted_heading(lines)
    assert sorted(int(line.split()[0]) for line in lines[at + 3:at + 6]) == [3, 17, 29]
    assert lines[at + 1].split()[:5] == ["ROW", "UPDATES", "RUN", "SCORE", "RUN"]
    assert all(float(line.split()[2]) >= 2 for line in lines[at + 3:at + 6])  # RUN SCORE, at least the floor
    assert "table.weight: never updated: 5, 33" in lines
    fixes = httpx.post(f"{base}/anomalies/{zombie['id']}/propose", headers=AUTH).json()["fixes"]
    assert [f["action"] for f in fixes] == ["embedding_grad_scale"] * 2
    assert fixes[0]["params"]["table"] == "table.weight" and "rows" not in fixes[0]["params"]  # the whole table
    assert fixes[0]["params"]["refresh"] > 0  # its factors follow the rows as they turn noisy
    assert sorted(fixes[1]["params"]["rows"]) == [3, 17, 29]  # only the named rows
    fix_id = fixes[1]["id"]
    assert httpx.post(f"{base}/fixes/{fix_id}/apply", headers=AUTH).json()["status"] == "pending"
    status = None
    for step in range(200):
        train(model, probe, 1, ids=ids, zombies={3, 17, 29}, opt=opt, seed=1000 + step)
        probe.flush()
        status = httpx.get(f"{base}/fixes/{fix_id}", headers=AUTH).json()
        if status["status"] not in ("pending",):
            break
        time.sleep(0.05)
    assert status["status"] == "applied", status
    # Named rows whose SNR is below the reference are damped (a named row with more signal keeps factor 1).
    assert 1 <= status["after"]["rows"] <= 3 and set(status["after"]["row_ids"]) <= {"3", "17", "29"}
    assert httpx.post(f"{base}/fixes/{fix_id}/revert", headers=AUTH).status_code == 200
    for step in range(200):
        train(model, probe, 1, ids=ids, zombies={3, 17, 29}, opt=opt, seed=2000 + step)
        probe.flush()
        status = httpx.get(f"{base}/fixes/{fix_id}", headers=AUTH).json()
        if status["status"] == "reverted":
            break
        time.sleep(0.05)
    assert status["status"] == "reverted"
    probe.close()
    with server.client() as c:  # deleting the run deletes its tables' reports too
        assert c.delete("/v1/runs/emb-e2e").status_code == 204
    with sqlite3.connect(server.data_dir / "traindx.sqlite") as db:
        assert db.execute("SELECT count(*) FROM embedding_tables WHERE run='emb-e2e'").fetchone() == (0,)


def test_a_report_from_a_probe_before_run_score_still_shows_its_conflicted_rows(server) -> None:
    """A job on a probe from before run_score (2026-12-01) ranked the conflicted list by run_noise and sent no
    run_score: the server stores its reports as they came, and the table for people shows the rows whose
    run_noise is past the floor, as that probe meant, not an empty list."""
    torch.manual_seed(0)
    model = Toy(rows=40, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    probe, sink = attach(model, opt, interval=20)
    train(model, probe, 201, ids=torch.arange(40), zombies={3, 17, 29}, opt=opt)
    probe.close()
    for b in sink.batches:  # as the older probe sent them
        for ev in b["events"]:
            for r in ev.get("rows", []) if ev["kind"] == "tensor_stats" else []:
                for c in r.get("embedding", {}).get("conflicted", []):
                    del c["run_score"]
        b["run"] = "emb-old"
        r = httpx.post(f"{server.url}/v1/ingest", json=b, headers=AUTH)
        assert r.status_code == 200, r.text
    listed = summaries(sink)[-1][1]["embedding"]["conflicted"]
    past = sorted(c["row"] for c in listed if c["run_noise"] >= 2)
    assert {3, 17, 29} <= set(past)
    from click.testing import CliRunner
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    lines = CliRunner().invoke(main, ["embeddings", "emb-old"], env=env, catch_exceptions=False).output.splitlines()
    at = _conflicted_heading(lines)
    shown = [line.split() for line in lines[at + 3:at + 3 + len(past)]]
    assert sorted(int(r[0]) for r in shown) == past and all(r[2] == "-" for r in shown)  # no run_score: "-"


@pytest.mark.parametrize("how", ["tied", "output", "untied"])
def test_a_tied_table_through_a_real_server(server, how: str) -> None:
    """What a person reads of a language model whose data never holds the last tenth of the vocabulary: with
    the output projection its token table (tied, or the table used as the output matrix), an info saying the
    rows learn as outputs; untied, an info saying the table is sized past the data's ids. Advice either way:
    no fix to apply."""
    torch.manual_seed(0)
    model = TinyLM(40, tie=how == "tied", output=how == "output")
    run = f"emb-{how}"
    probe = probes.attach(model, torch.optim.Adam(model.parameters(), lr=0.01), server=server.url, run=run,
                          collections={"embeddings": 20})
    train_lm(model, probe, 61, inputs=36)
    assert probe.flush()
    probe.close()
    base = f"{server.url}/v1/runs/{run}"
    learns = how != "untied"
    [dead] = [a for a in httpx.get(f"{base}/anomalies", headers=AUTH).json()["anomalies"]
              if a["kind"] == "dead_embedding"]
    assert dead["severity"] == "info" and dead["evidence"]["learns_outside_lookups"] is learns
    assert dead["evidence"]["tied_to"] == (["lm_head.weight"] if how == "tied" else [])
    assert dead["evidence"]["past_data_range"] is True  # rows 36-39: the vocabulary's last ids
    [advice] = httpx.post(f"{base}/anomalies/{dead['id']}/propose", headers=AUTH).json()["fixes"]
    assert advice["action"] == "advice"  # nothing to up-weight
    assert {"tied": "tied to lm_head.weight", "output": "also learns outside its lookups",
            "untied": "exactly its last ids (36-39)"}[how] in advice["rationale"]
    [table] = httpx.get(f"{base}/embeddings", headers=AUTH).json()["tables"]
    assert table["summary"]["learns_outside_lookups"] is learns and table["summary"]["dead_ids"] == [36, 37, 38, 39]
    assert table["summary"]["tied_to"] == (["lm_head.weight"] if how == "tied" else [])
    from click.testing import CliRunner
    from diag_server.cli import main
    env = {"TRAINDX_SERVER": server.url, "TRAINDX_TOKEN": server.token}
    out = CliRunner().invoke(main, ["embeddings", run], env=env, catch_exceptions=False).output
    what = {"tied": "never looked up (tied to lm_head.weight, they learn through it)",
            "output": "never looked up (the weight learns outside its lookups, they learn there)",
            "untied": "never updated (the table's last ids: it is sized past the data's)"}[how]
    assert f"wte.weight: {what}: 36, 37, 38, 39" in out


def test_a_recommender_with_the_default_collections_flags_its_toggling_items_and_nothing_else(session_server) -> None:
    """The recorded agent session's job (agent_examples.jobs.recommender_job): every rule of the server runs
    on a matrix factorisation with the probe's default collections; the healthy run raises nothing, and the
    faulty one raises zombie rows on its item tables only, naming only the items whose labels toggle."""
    from agent_examples.jobs import recommender_job

    url = session_server.url
    kinds = {}
    for run, toggling in (("rec-healthy", 0), ("rec-toggling", 8)):
        result = recommender_job(run=run, toggling=toggling, pace=0, probe_kwargs={"server": url})
        assert result.error is None
        kinds[run] = httpx.get(f"{url}/v1/runs/{run}/anomalies", headers=AUTH).json()["anomalies"]
    assert kinds["rec-healthy"] == []
    flagged = kinds["rec-toggling"]
    assert flagged and {a["kind"] for a in flagged} == {"zombie_embedding"}
    assert {a["tensors"][0] for a in flagged} <= {"item.weight", "item_bias.weight"}
    assert all(a["severity"] in ("warning", "critical") for a in flagged)  # zombies that stand out, not a tail
    assert all(a["evidence"]["stand_out"] for a in flagged if a["tensors"] == ["item.weight"])
    named = {int(r) for a in flagged for r in a["evidence"]["rows"]}
    assert len(named) >= 4 and named <= set(range(8))
    # Both item tables name mostly the same items: the diagnosis calls it one problem, not two.
    ids = [{int(r) for r in a["evidence"]["rows"]} for a in flagged]
    if len(ids) == 2 and len(ids[0] & ids[1]) >= 0.5 * min(map(len, ids)):
        causes = httpx.get(f"{url}/v1/runs/rec-toggling/diagnosis", headers=AUTH).json()["causes"]
        assert len(causes) == 1 and len(causes[0]["consequences"]) == 1


@pytest.mark.parametrize("loss_after", [0.9, 1.5], ids=["not_worse", "worse"])
def test_a_damping_fix_is_judged_on_the_loss_while_its_zombies_hold(tmp_path, loss_after: float) -> None:
    """Damping zombie rows cannot clear what makes them zombies (their data): their anomaly holding after
    the fix is the expected state. The verdict is taken on the loss once the window has passed: effective
    when it is not worse, ineffective (revert suggested) when it is."""
    from diag_server import fixes as server_fixes
    from diag_server.engine import Engine
    from diag_server.store import Store
    from tests.test_rules import _feed

    store, engine, run = Store(tmp_path), Engine(), "damped"
    seq = iter(range(10**6))

    def feed(*events: dict) -> None:
        _feed(store, engine, run, list(events), next(seq))

    def step(at: int, loss: float) -> None:
        zombies = [{"row": r, "touches": 200, "velocity": 0.1, "consistency": -0.3, "snr": 0.05, "noise": 4.0}
                   for r in (3, 17, 29)]
        summary = {"rows": 1000, "dim": 8, "median_touches": 100.0, "zombies": zombies}
        feed({"kind": "scalars", "step": at, "time": 1.0 + at, "values": {"loss": loss}},
             {"kind": "tensor_stats", "step": at, "time": 1.0 + at, "collection": "embeddings",
              "rows": [{"name": "item.weight", "numel": 8000, "embedding": summary}]})

    feed({"kind": "run_start", "step": 0, "time": 1.0, "config": {"interval": 20}, "allow": ["embedding_grad_scale"]})
    for at in range(0, 101, 20):
        step(at, 1.0)
    (a,) = [x for x in store.read().execute("SELECT id, kind, status FROM anomalies WHERE run=?", (run,))]
    assert (a["kind"], a["status"]) == ("zombie_embedding", "open")
    fix = server_fixes.propose(store, run, a["id"], "test").fixes[0]
    assert fix.action.value == "embedding_grad_scale"
    server_fixes.apply(store, run, fix.id, "test")
    feed({"kind": "fix_ack", "step": 101, "time": 102.0, "fix_id": fix.id, "status": "applied",
          "before": {"embedding_grad_scale": 1.0}, "after": {"embedding_grad_scale": 0.4}})
    for at in range(120, 421, 20):
        step(at, loss_after)
    row = store.read().execute("SELECT status, reason FROM fixes WHERE id=? AND run=?", (fix.id, run)).fetchone()
    assert store.read().execute("SELECT status FROM anomalies WHERE id=? AND run=?", (a["id"], run)).fetchone()[0] == "open"
    if loss_after < 1.0:
        assert row["status"] == "effective" and "still holds, as expected" in row["reason"], row["reason"]
    else:
        assert row["status"] == "ineffective" and "revert it" in row["reason"], row["reason"]
    store.close()


# -- the batched fold against the step-by-step update ---------------------------------------------------------
def step_by_step(state: torch.Tensor, k: int, proj, idx: torch.Tensor, g: torch.Tensor, count: torch.Tensor,
                 before, after: torch.Tensor) -> None:
    """One tracked step on the touched rows, as the collection computed it before steps were queued."""
    old = state[idx]
    finite = torch.isfinite(torch.cat([g, after], dim=1)).all(dim=1)
    fin = finite.float()
    t = old[:, 0] + fin
    inv = 1.0 / t.clamp_min(1.0)
    a_fast, a_slow = inv.clamp_min(EMA_ALPHA) * fin, inv.clamp_min(SLOW_ALPHA) * fin
    g = torch.nan_to_num(g * fin[:, None], nan=0.0, posinf=0.0, neginf=0.0)
    gs = g if proj is None else g @ proj
    m, prev = old[:, 8:8 + k], old[:, 8 + k:]
    inno = gs - m
    a_pair = (1.0 / (t - 2).clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (t >= 3))
    gn2 = gs.pow(2).sum(dim=1)
    m_new = m + a_fast[:, None] * inno
    warm = t - 1.0 / EMA_ALPHA
    a_mean = (1.0 / warm.clamp_min(1.0)).clamp_min(SLOW_ALPHA) * (fin * (warm >= 1))
    delta = (after - before).norm(dim=1) if before is not None else old[:, 1]
    delta = torch.nan_to_num(delta, nan=0.0, posinf=0.0, neginf=0.0)
    targets = torch.stack([t, delta, (inno * prev).sum(dim=1), inno.norm(dim=1) * prev.norm(dim=1), gn2,
                           m_new.pow(2).sum(dim=1), gn2 / count, 1.0 - fin], dim=1)
    rates = torch.stack([torch.ones_like(t), a_fast, a_pair, a_pair, a_slow, a_mean, a_slow, torch.ones_like(t)], dim=1)
    state[idx] = torch.cat([old[:, :8] + rates * (targets - old[:, :8]), m_new,
                            torch.where(finite[:, None], inno, prev)], dim=1)


@pytest.mark.parametrize("sparse,dim", [(False, 12), (True, 12), (False, 1)])
def test_queued_steps_fold_to_the_step_by_step_statistics(sparse: bool, dim: int, path: str) -> None:
    """Random lookups with repeats, rows touched on many successive steps, a padding row, a NaN gradient
    and a step without an optimizer: folding 37 queued steps at once (the torch path), or updating the
    rows in each step's hooks (the native kernel), gives the statistics (and the counts a report reads)
    that 37 step-by-step updates give."""
    torch.manual_seed(0)
    rows = 30
    emb = torch.nn.Embedding(rows, dim, padding_idx=3, sparse=sparse)
    t = TableState("w", emb.weight, [emb])
    ref = torch.zeros_like(t.row_state)
    gen = torch.Generator().manual_seed(1)
    for step in range(37):
        ids = torch.randint(0, 12 if step % 3 else rows, (20,), generator=gen)  # rows 0-11 touched most steps
        ids[0] = 3  # the padding row is looked up and ignored
        out = emb(ids)
        w_out = torch.randn(out.shape, generator=gen)
        if step == 20:
            w_out[1] = float("nan")  # one row's gradient goes NaN for a step
        emb.zero_grad()
        (out * w_out).sum().backward()
        t.lookups = [ids]
        with_delta = step != 11
        before = emb.weight.detach().clone()
        t.gather()
        if with_delta:
            with torch.no_grad():
                emb.weight[torch.isfinite(emb.weight).all(dim=1)] -= 0.01 * torch.randn(rows, dim, generator=gen)[
                    torch.isfinite(emb.weight).all(dim=1)]
        t.update(step, with_delta=with_delta)
        # The reference: unique ids, the coalesced gradient, rows with a non-zero gradient only.
        idx, count = torch.unique(ids, return_counts=True)
        grad = emb.weight.grad.to_dense() if sparse else emb.weight.grad
        g = grad[idx].float()
        keep = (idx != 3) & g.ne(0).any(dim=1)
        idx, g, count = idx[keep], g[keep], count[keep].float()
        step_by_step(ref, t.k, t.proj, idx, g, count, before[idx] if with_delta else None, emb.weight.detach()[idx])
        if step in (9, 36):  # two folds: 10 queued steps, then 27
            t.flush()
            assert torch.allclose(t.row_state, ref, rtol=1e-4, atol=1e-6), (t.row_state - ref).abs().max()
    state = t.state
    assert not t.pending and int(state[:, 0].max()) > 20  # some rows were touched on most of the 37 steps
    assert t.counts.tolist() == [int((state[:, 0] > 0).sum()), int((state[:, 7] > 0).sum()),
                                 int(((state[:, 0] >= 20) & (state[:, 7] == 0)).sum())]


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
