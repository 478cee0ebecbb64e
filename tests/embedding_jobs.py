"""Small embedding models and training loops that the embedding tests (and the dashboard's) drive.

A probe attached with the ``embeddings`` collection alone sends to an in-memory sink; ``summaries`` reads
its reports back, validated against the ingest contract.
"""

from __future__ import annotations

from typing import Callable

import torch

import probes
from probes.embeddings import Embeddings, TableState
from schemas import IngestBatch


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


def collection_of(probe: probes.Probe) -> Embeddings:
    return next(c for c in probe.collections if isinstance(c, Embeddings))


def table_state(probe: probes.Probe) -> TableState:
    return collection_of(probe).tables[0]


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
