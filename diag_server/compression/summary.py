"""The fallback compression recipe, for runs without the ``fisher`` collection.

This method works from the per-tensor summaries alone (no per-weight Fisher yet): it models the
weights of a layer as N(0, sigma_l^2) and the diagonal Fisher of the layer as its mean squared
gradient F_l, then applies one global Optimal-Brain-Damage threshold tau on the saliency F_l * w^2
(LeCun et al. 1990). Under that model layer l keeps the weights with |w| >= sqrt(tau / F_l), i.e.
prunes the fraction erf(sqrt(tau / (2 F_l sigma_l^2))), and tau is found by bisection so the global
sparsity meets the target. Layers the loss is more sensitive to keep more of their weights.
"""

from __future__ import annotations

import math

from schemas.records import CompressionRecipe, LayerRecipe

from ..errors import ApiError
from ..read.queries import require_run, stats_table
from ..store import Store

# Gradient samples averaged for each layer's Fisher estimate.
FISHER_SAMPLES = 20


def _pruned_fraction(tau: float, fisher: float, var: float) -> float:
    if fisher <= 0 or var <= 0:
        return 1.0  # a layer with no gradient signal costs nothing to prune, by this model
    return math.erf(math.sqrt(tau / (2 * fisher * var)))


def _loss_increase(p: float, fisher: float, var: float, n: int) -> float:
    """0.5 * F * sigma^2 * n * E[z^2 ; |z| < q] with q the pruning quantile: OBD's sum over pruned weights."""
    if p <= 0:
        return 0.0
    if p >= 1:
        return 0.5 * fisher * var * n
    q = _erfinv(p) * math.sqrt(2)
    tail = p - 2 * q * math.exp(-q * q / 2) / math.sqrt(2 * math.pi)
    return 0.5 * fisher * var * n * max(tail, 0.0)


def _erfinv(y: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.erf(mid) < y else (lo, mid)
    return (lo + hi) / 2


def recipe(store: Store, run: str, target_sparsity: float) -> CompressionRecipe:
    conn = store.read()
    require_run(conn, run)
    # The latest sample at which every weight was finite: a recipe for a broken model is no use.
    last = conn.execute("SELECT max(step) FROM stats WHERE run=? AND collection='weights' AND step NOT IN "
                        "(SELECT step FROM stats WHERE run=? AND collection='weights' AND "
                        "(nan_count > 0 OR inf_count > 0))", (run, run)).fetchone()[0]
    if last is None:
        raise ApiError(409, "no_data", f"run {run!r} has sent no weight statistics yet; the recipe needs the "
                       "'weights' and 'gradients' collections")
    # A model sharded across ranks (FSDP2) sends a row per shard: read the whole tensors' rows.
    weights = {r["tensor"]: r for r in conn.execute(
        f"SELECT tensor, numel, mean, std FROM {stats_table(conn, run, 'weights')} WHERE run=? AND "
        "collection='weights' AND step=?", (run, last))}
    fisher: dict[str, list[float]] = {}
    for r in conn.execute(f"SELECT tensor, norm, numel FROM {stats_table(conn, run, 'gradients')} WHERE run=? AND "
                          "collection='gradients' AND step IN "
                          "(SELECT DISTINCT step FROM stats WHERE run=? AND collection='gradients' AND step <= ? "
                          "ORDER BY step DESC LIMIT ?)", (run, run, last, FISHER_SAMPLES)):
        if r["norm"] is not None and r["numel"]:
            fisher.setdefault(r["tensor"], []).append(r["norm"] ** 2 / r["numel"])
    # Prune weight matrices and kernels; biases and norm scales are tiny and sensitive.
    layers = []
    for name, w in weights.items():
        if name.endswith("bias") or w["numel"] is None or w["numel"] < 64 or w["std"] is None:
            continue
        f = sum(fisher.get(name, [0.0])) / max(len(fisher.get(name, [])), 1)
        layers.append((name, int(w["numel"]), f, w["std"] ** 2 + (w["mean"] or 0.0) ** 2))
    if not layers:
        raise ApiError(409, "no_data", f"run {run!r} has no weight matrix large enough to prune")
    total_all = sum(int(w["numel"] or 0) for w in weights.values())
    prunable = sum(n for _, n, _, _ in layers)
    goal = target_sparsity * total_all
    if goal > prunable:
        raise ApiError(422, "target_unreachable", f"target {target_sparsity:.0%} of {total_all} weights needs "
                       f"{goal:.0f} zeros, but only {prunable} weights are in prunable layers")

    def pruned(tau: float) -> float:
        return sum(_pruned_fraction(tau, f, v) * n for _, n, f, v in layers)

    lo, hi = 0.0, 1.0
    while pruned(hi) < goal and hi < 1e300:
        hi *= 4
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pruned(mid) < goal else (lo, mid)
    tau = hi
    out, loss, kept_bytes = [], 0.0, 0
    for name, n, f, v in layers:
        p = _pruned_fraction(tau, f, v) if target_sparsity > 0 else 0.0
        loss += _loss_increase(p, f, v, n)
        kept_bytes += int(round(n * (1 - p))) * 4 + (n + 7) // 8  # fp32 values + a bitmask
        out.append(LayerRecipe(
            name=name, numel=n, sparsity=round(p, 4), precision="fp32", saliency=f * v,
            reason=(f"mean saliency F*w^2 = {f * v:.3g} "
                    + ("(below the layers' median: pruned harder)" if f * v < _median_saliency(layers) else
                       "(above the layers' median: kept denser)"))))
    other = total_all - prunable
    achieved = sum(l.sparsity * l.numel for l in out) / total_all
    return CompressionRecipe(
        run=run, target_sparsity=target_sparsity, achieved_sparsity=round(achieved, 4),
        method="obd-global-threshold-from-summaries", layers=out, dense_size_bytes=total_all * 4,
        predicted_size_bytes=kept_bytes + other * 4, predicted_loss_increase=loss,
        notes=[f"statistics of step {last}; Fisher = mean squared gradient over the last {FISHER_SAMPLES} samples",
               "weights modelled as N(0, sigma^2) per layer; one global OBD threshold (LeCun et al. 1990)",
               "predicted size counts fp32 values of kept weights plus a 1-bit mask per weight"])


def _median_saliency(layers: list[tuple[str, int, float, float]]) -> float:
    s = sorted(f * v for _, _, f, v in layers)
    return s[len(s) // 2]
