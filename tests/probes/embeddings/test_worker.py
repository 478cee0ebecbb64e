"""The background worker: folds and reports on it equal inline ones, are sent within steps, and are bounded."""

from __future__ import annotations

import pytest
import torch

import probes
import probes.embeddings.state
import probes.stats
from probes.embeddings import Embeddings, TableState
from tests.embedding_jobs import attach, collection_of, summaries


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
    coll = collection_of(probe)
    native = all(t.native for t in coll.tables)  # natively tracked tables report inline: no worker
    assert (coll.worker is not None) == (background and not native)
    assert native == (probes.stats._fastats is not None)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
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
            coll = collection_of(probe)
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
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
        probe, _ = attach(model, None)
        assert (collection_of(probe).worker is not None) == worker
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
    coll = collection_of(probe)
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
    coll = collection_of(probe)
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
