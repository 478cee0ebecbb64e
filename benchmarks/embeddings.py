"""Embedding dynamics on MovieLens-100k: detection of planted zombie / dead rows, the live fix, overhead.

    pip install --no-deps recbole          # ships ML-100k as a text file; nothing is downloaded at run time
    PYTHONPATH=. python benchmarks/embeddings.py --quick          # a few minutes
    PYTHONPATH=. python benchmarks/embeddings.py                  # the full protocol (5 seeds, 30 epochs)
    PYTHONPATH=. python benchmarks/embeddings.py detect|fix|overhead|ddp|ddp-fix [--quick]
    PYTHONPATH=. python benchmarks/embeddings.py agent            # the agent's loop through a real server
    PYTHONPATH=. python benchmarks/embeddings.py longtail         # the zombie rule on a 1M-row long-tailed table
    PYTHONPATH=. python benchmarks/embeddings.py overhead --baseline DIR   # and the probes of checkout DIR

Model: matrix factorisation (global mean + user/item biases + dot of 32-dim user/item tables), MSE on
ratings, a fixed 80/20 split (seed 0), batch 256. Every seed gives both arms the same initialisation and
the same batch order. Rules run in-process on the probe's own events (the same pure rule objects the
server runs), and the fix travels to the job the way a server's command does (on a sink reply). The
data, the model and such a run are in embedding_runs.py; the overhead arms in embeddings_overhead.py.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import probes
from agent_examples.jobs import toggle_labels
from benchmarks.embedding_runs import (BATCH, DIM, REGIMES, REPORT, TABLES, Data, MF, Watch, auc, flagged, load,
                                       past_floor, pr, server, table_of, tail_rows, train, zipf)
from benchmarks.embeddings_overhead import ddp_overhead, overhead
from diag_server.rules.embeddings import ZombieEmbedding
from schemas.enums import AnomalyKind


def detect(d: Data, seeds: list[int], epochs: int, regime: str = "adam1e-2", cases: str = "abch") -> None:
    """The planted cases on ML-100k, a run each per seed: (a) toggling targets, (h) no fault, (b) a group
    conflict, (c) dead rows. Each seed draws its planted items in that order from one generator."""
    counts = d.counts()
    print(f"\n== detection (regime {regime}, {epochs} epochs, seeds {seeds}) ==")
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        # (a) 50 of the 100 most popular items: their target toggles between r and 6-r at each appearance.
        top = torch.argsort(counts, descending=True)[:100]
        zombies = top[torch.randperm(100, generator=gen)[:50]]
        zset = set(zombies.tolist())
        if "a" in cases:
            _detect_toggling(d, regime, seed, epochs, zset)
        if "h" in cases:  # the same run without a fault: what the zombie rule says of healthy tables
            _detect_healthy(d, regime, seed, epochs)
        # (b) 50 items (>= 20 training ratings, not the top 100) whose ratings flip for half of the users.
        pool = torch.nonzero(counts >= 20).reshape(-1)
        pool = pool[~torch.isin(pool, top)]
        conflict = pool[torch.randperm(len(pool), generator=gen)[:50]]
        group = torch.rand(d.n_users, generator=gen) < 0.5
        if "b" in cases:
            controls = _matched(counts, conflict, exclude=set(conflict.tolist()) | zset)
            _detect_conflict(d, regime, seed, epochs, conflict, group, controls)
        # (c) 50 items with every training rating removed: dead rows, plain / L2 in the loss / after NaN.
        alive = torch.nonzero(counts > 0).reshape(-1)
        dead = alive[torch.randperm(len(alive), generator=gen)[:50]]
        if "c" in cases:
            _detect_dead(d, regime, seed, epochs, dead)


def _detect_toggling(d: Data, regime: str, seed: int, epochs: int, zset: set[int]) -> None:
    """(a): the items of ``zset`` toggle; the rows the zombie rule's last warning named, and those named in
    the run."""
    seen: dict[int, int] = {}

    def toggling(epoch: int, order: torch.Tensor) -> torch.Tensor:
        r = d.ratings[order].clone()
        toggle_labels(d.items[order].tolist(), r, zset, seen)
        return r

    run = train(d, regime, seed, epochs, probe_on=True, targets=toggling)
    for in_run in (False, True):
        zombie = AnomalyKind.zombie_embedding
        found, fb = (flagged(run["watch"], zombie, t, in_run) for t in ("item.weight", "item_bias.weight"))
        fu = flagged(run["watch"], zombie, "user.weight", in_run) | flagged(run["watch"], zombie, "user_bias.weight", in_run)
        cells = [f"{label} precision {pr(f, zset)[0]:.2f} recall {pr(f, zset)[1]:.2f} ({len(f)} flagged)"
                 for label, f in (("item.weight", found), ("item_bias.weight", fb), ("either item table", found | fb))]
        print(f"seed {seed} (a) toggling zombies, {'rows named in the run' if in_run else 'the last warning'}: "
              + "; ".join(cells) + f"; user rows flagged: {len(fu)}")


def _detect_healthy(d: Data, regime: str, seed: int, epochs: int) -> None:
    """(h): no fault; the rows the zombie rule names anyway, as warnings or as the tables' tail, and the
    rows listed as conflicted past the list's floor."""
    run = train(d, regime, seed, epochs, probe_on=True)
    w = run["watch"]
    print(f"seed {seed} (h) unplanted: zombie rows named by the last warning (in the run) "
          + ", ".join(f"{t} {len(flagged(w, AnomalyKind.zombie_embedding, t))} "
                      f"({len(flagged(w, AnomalyKind.zombie_embedding, t, True))})" for t in TABLES)
          + "; as the table's tail (info) " + ", ".join(f"{t} {tail_rows(w, t)}" for t in TABLES)
          + "; listed conflicted with a run_score of at least 2 (the report's floor) "
          + ", ".join(f"{t} {len(past_floor(table_of(run, t)))}" for t in TABLES))


def _detect_conflict(d: Data, regime: str, seed: int, epochs: int, conflict: torch.Tensor, group: torch.Tensor,
                     controls: torch.Tensor) -> None:
    """(b): the ratings of ``conflict`` flip for the users of ``group``; the AUC of each score against the
    popularity-matched ``controls``, at the end and after each epoch, and how far the model fitted them."""
    cset = set(conflict.tolist())
    flip = torch.isin(d.items, conflict) & group[d.users]
    flipped = torch.where(flip, 6 - d.ratings, d.ratings)
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

    run = train(d, regime, seed, epochs, probe_on=True, targets=lambda e, o: flipped[o], each_epoch=read)
    for tname in ("item.weight", "item_bias.weight"):
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
    print(f"seed {seed} (b) the conflict items' training MSE over the controls' at the end of each epoch "
          f"(1.00: fitted as well): {' '.join(f'{r:.2f}' for r in by_epoch['fit'])}")


def _detect_dead(d: Data, regime: str, seed: int, epochs: int, dead: torch.Tensor) -> None:
    """(c): every training rating of ``dead`` removed; the dead rows named, plain, under L2, after NaN."""
    keep = ~torch.isin(d.items, dead)
    dc = Data(d.users[keep], d.items[keep], d.ratings[keep], d.vu, d.vi, d.vr, d.n_users, d.n_items)
    truth = set(torch.nonzero(dc.counts() == 0).reshape(-1).tolist())
    for label, kw in (("plain", {}), ("L2 1e-4 in the loss", {"l2": 1e-4}),
                      ("NaN divergence", {"nan_at": (epochs - 1) * (len(dc.ratings) // BATCH)})):
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
    popularity = zipf(rows)
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

    with server("traindx-bench-agent-") as url:
        gains: dict[str, list[float]] = {"table": [], "rows": []}
        for seed in seeds:
            results = {}
            for label, rank in (("none", 0), ("table", 1), ("rows", 2)):
                out: dict = {}
                run = f"bench-agent-{label}-{seed}"
                job = threading.Thread(target=lambda out=out, run=run, seed=seed: out.update(r=recommender_job(
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
    ap.add_argument("--baseline", metavar="DIR", help="overhead: a checkout of the code to compare with (its probes "
                    "package, native kernel built): a fifth arm, the collection on with those probes, taking turns "
                    "with the others")
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
                 sink=args.sink, cases=args.overhead_cases, big_dim=args.big_dim, baseline=args.baseline)
    if args.what == "all":
        agent_bench(seeds, 1500 if args.quick else 3000)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
