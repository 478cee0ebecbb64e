"""TableState: the per-row statistics a tracked step reaches, on both paths (native kernel, torch fold)."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

import probes
import probes.embeddings
import probes.embeddings.collection
from probes.embeddings import EMA_ALPHA, SKETCH_DIM, SLOW_ALPHA, TableState
from tests.embedding_jobs import Toy, attach, summaries, table_state, train


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
    for _ in range(12):
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
