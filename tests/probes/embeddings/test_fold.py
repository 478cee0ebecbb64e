"""The queued path's fold: queued steps give the statistics step-by-step updates give, from reused buffers."""

from __future__ import annotations

import pytest
import torch

from probes.embeddings import EMA_ALPHA, SLOW_ALPHA, TableState


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
