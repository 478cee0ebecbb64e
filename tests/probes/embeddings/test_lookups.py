"""How a tracked module's lookups are kept: by position or keyword, under a subclass or a forward hook."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests.embedding_jobs import Toy, attach, summaries, table_state, train


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
