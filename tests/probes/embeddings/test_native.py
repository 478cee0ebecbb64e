"""The native kernel's tracking: tables looked up with the same ids share the distinct rows it finds."""

from __future__ import annotations

import pytest
import torch

import probes.stats
from tests.embedding_jobs import attach, collection_of


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
        coll = collection_of(probe)
        assert all(t.native for t in coll.tables)
        states[twin] = {t.name: t.state.clone() for t in coll.tables}
        # per step, in the tables' order: emb finds its rows, bias takes them, padded finds its own
        assert calls[:3] == ([False, False, False] if twin else [False, True, False]) and len(calls) == 180
        probe.close()
    for name, state in states[False].items():
        assert torch.equal(state, states[True][name]), name
    assert states[False]["padded.weight"][3, 0] == 0  # the padding row is never touched
