"""Compression recipes from a run's training dynamics: per-layer sparsity and precision at a target.

The job's ``fisher`` collection sends, per weight, the loss increase its curvature predicts at each
sparsity of a grid (unstructured and whole output channels: OBS saliencies from K-FAC factors, or OBD's
0.5 * F * w^2 from the diagonal) and for each cast (fp16, bf16, int8). The ``sensitivity`` action adds
the same, measured on a held batch (HAWQ's per-layer sensitivity, Dong et al. 2019); when both exist the
prediction is rescaled to the measurement, layer by layer.

The recipe then solves the allocation. For a sparsity target: every layer's curve is convex (it is a
sum of sorted saliencies), so taking the cheapest next slice of sparsity, per weight removed, across all
layers until the target is met is optimal for the additive model, the equal-marginal-cost rule that a
global OBD threshold also satisfies (LeCun et al. 1990; WoodFisher, Singh & Alistarh 2020). Each layer
then takes the smallest precision whose cast costs at most ``cast_tolerance`` of the run's loss. For a
size target in bytes: each layer picks the (sparsity, precision) that minimises loss + lambda * bytes,
and lambda is bisected until the model fits (a Lagrangian knapsack, as HAWQ-V3 solves its bit
allocation with an ILP).
"""

from __future__ import annotations

import heapq
import math
import sqlite3
import time
from typing import Any, Literal

import orjson

from schemas.enums import FixAction
from schemas.events import LayerProfiles
from schemas.records import CompressionRecipe, Fix, LayerRecipe

from . import summary as compression_summary
from .. import fixes
from ..errors import ApiError
from ..read.queries import get_fix, require_run
from ..store import Store

BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
# A cast is free enough when it costs at most this fraction of the run's recent loss (0.5%: well inside
# the run-to-run spread of a converged model; measured here on California Housing, docs/compression.md).
DEFAULT_CAST_TOLERANCE = 0.005
Structure = Literal["unstructured", "channels"]


def store_profiles(conn: sqlite3.Connection, run: str, ev: LayerProfiles) -> None:
    """Keep the latest profile of each layer per source (called by ingest inside its transaction)."""
    extra = {"samples": ev.samples, "base_loss": ev.base_loss}
    conn.executemany("INSERT OR REPLACE INTO layer_profiles(run, source, name, step, data) VALUES (?,?,?,?,?)",
                     [(run, ev.source, layer.name, ev.step, orjson.dumps({**layer.model_dump(), **extra}).decode())
                      for layer in ev.layers])


def _profiles(conn: sqlite3.Connection, run: str, source: str) -> dict[str, dict]:
    rows = conn.execute("SELECT name, step, data FROM layer_profiles WHERE run=? AND source=? ORDER BY rowid",
                        (run, source)).fetchall()
    return {r["name"]: {**orjson.loads(r["data"]), "step": r["step"]} for r in rows}


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1]) if xs[i] > xs[i - 1] else 1.0
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


class _Layer:
    def __init__(self, p: dict, measured: dict | None, structure: Structure) -> None:
        self.name, self.numel, self.shape = p["name"], int(p["numel"]), p.get("shape") or [p["numel"]]
        self.rows = int(self.shape[0]) if self.shape else 1
        self.method, self.saliency = p.get("method", ""), p.get("saliency_mean")
        curve = p.get("channels") if structure == "channels" and p.get("channels") else p["unstructured"]
        self.structure: Structure = "channels" if curve is p.get("channels") else "unstructured"
        self.xs = [float(x) for x in p["sparsities"]]
        if len(curve) != len(self.xs) or not self.xs or self.xs != sorted(self.xs):
            raise ApiError(409, "bad_profile", f"the profile of {self.name!r} has {len(curve)} values for "
                           f"{len(self.xs)} sparsities (must match, sorted)")
        self.ys = [max(float(v), 0.0) if v is not None else math.inf for v in curve]
        if self.xs[0] > 0:
            self.xs.insert(0, 0.0)
            self.ys.insert(0, 0.0)
        self.ys[0] = 0.0
        self.casts = {k: (max(v, 0.0) if v is not None else math.inf) for k, v in (p.get("precision") or {}).items()}
        self.casts["fp32"] = 0.0
        self.scale, self.measured = 1.0, False
        if measured:
            self._calibrate(measured)

    def _calibrate(self, m: dict) -> None:
        """Rescale the predicted curve to the held-batch measurement (median ratio over its points)."""
        ratios = []
        for s, v in zip(m.get("sparsities", []), m.get("unstructured", [])):
            pred = _interp(self.xs, self.ys, s)
            if v is not None and v > 0 and pred > 0 and math.isfinite(pred):
                ratios.append(v / pred)
        if ratios:
            ratios.sort()
            self.scale = ratios[len(ratios) // 2]
            self.ys = [y * self.scale for y in self.ys]
            self.measured = True
        for k, v in (m.get("precision") or {}).items():
            if v is not None:
                self.casts[k] = max(float(v), 0.0)
                self.measured = True

    def loss(self, s: float) -> float:
        return _interp(self.xs, self.ys, s)

    def size(self, s: float, precision: str) -> int:
        kept = int(round((1 - s) * self.numel))
        mask = (self.numel + 7) // 8 if s > 0 else 0
        scales = 4 * self.rows if precision == "int8" else 0
        return kept * BYTES[precision] + mask + scales


def _allocate_sparsity(layers: list[_Layer], goal: float) -> dict[str, float]:
    """Cheapest slices first: optimal for convex per-layer curves (the equal-marginal-cost rule)."""
    pos = {l.name: 0 for l in layers}
    out = {l.name: 0.0 for l in layers}
    heap: list[tuple[float, int, str]] = []
    by_name = {l.name: l for l in layers}

    def push(l: _Layer) -> None:
        i = pos[l.name]
        if i + 1 < len(l.xs):
            dz = (l.xs[i + 1] - l.xs[i]) * l.numel
            heapq.heappush(heap, ((l.ys[i + 1] - l.ys[i]) / dz if dz else math.inf, id(l), l.name))

    for l in layers:
        push(l)
    zeros = 0.0
    while heap and zeros < goal - 1e-9:
        _, _, name = heapq.heappop(heap)
        l = by_name[name]
        i = pos[name]
        dz = (l.xs[i + 1] - l.xs[i]) * l.numel
        if zeros + dz >= goal:
            out[name] = l.xs[i] + (goal - zeros) / l.numel
            zeros = goal
            break
        zeros += dz
        pos[name] = i + 1
        out[name] = l.xs[i + 1]
        push(l)
    if zeros < goal - 1e-9:
        raise ApiError(422, "target_unreachable", f"the profiled layers can hold at most {zeros:.0f} zeros, "
                       f"{goal:.0f} are needed; profile more modules (fisher_modules) or lower the target")
    return out


def _cheapest_cast(l: _Layer, tolerance: float, allowed: tuple[str, ...]) -> str:
    ok = [p for p in allowed if l.casts.get(p, math.inf) <= tolerance] or ["fp32"]
    return min(ok, key=lambda p: (BYTES[p], l.casts.get(p, 0.0)))


def _allocate_bytes(layers: list[_Layer], budget: int, allowed: tuple[str, ...]) -> dict[str, tuple[float, str]]:
    grid = [round(i / 100, 2) for i in range(100)]
    options = {l.name: [(l.loss(s) + l.casts[p], l.size(s, p), s, p) for s in grid for p in allowed
                        if math.isfinite(l.casts.get(p, math.inf))] for l in layers}

    def choose(lam: float) -> tuple[dict[str, tuple[float, str]], int]:
        out, total = {}, 0
        for name, opts in options.items():
            _, size, s, p = min(opts, key=lambda o: o[0] + lam * o[1])
            out[name] = (s, p)
            total += size
        return out, total

    lo, hi = 0.0, 1e-12
    while choose(hi)[1] > budget:
        hi *= 10
        if hi > 1e30:
            raise ApiError(422, "target_unreachable", f"even at 99% sparsity in int8 the profiled layers need more "
                           f"than {budget} bytes")
    for _ in range(60):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 1e6
        lo, hi = (mid, hi) if choose(mid)[1] > budget else (lo, mid)
    return choose(hi)[0]


def plan(run: str, profiles: dict[str, dict], measured: dict[str, dict], total_params: int, *,
         target_sparsity: float | None = None, target_bytes: int | None = None, loss: float | None = None,
         structure: Structure = "unstructured", precisions: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8"),
         cast_tolerance: float = DEFAULT_CAST_TOLERANCE) -> CompressionRecipe:
    """The recipe from layer profiles; pure, so a benchmark or a test can call it without a server."""
    if not profiles:
        raise ApiError(409, "no_data", f"run {run!r} has sent no layer profiles")
    layers = [_Layer(p, measured.get(n), structure) for n, p in profiles.items()]
    profiled = sum(l.numel for l in layers)
    total_params = max(total_params, profiled)
    other = total_params - profiled
    allowed = tuple(p for p in precisions if p in BYTES) or ("fp32",)
    tolerance = cast_tolerance * loss if loss is not None and loss > 0 else 0.0
    if target_bytes is not None:
        budget = target_bytes - other * 4
        if budget <= 0:
            raise ApiError(422, "target_unreachable", f"{target_bytes} bytes do not even hold the {other} parameters "
                           "outside the profiled layers")
        choice = _allocate_bytes(layers, budget, allowed)
    else:
        goal = (target_sparsity or 0.0) * total_params
        sparsity = _allocate_sparsity(layers, goal)
        choice = {l.name: (sparsity[l.name], _cheapest_cast(l, tolerance, allowed)) for l in layers}
    # The marginal loss per weight removed, relative to the median layer's, explains each allocation.
    costs = sorted((l.loss(choice[l.name][0]) / max(choice[l.name][0] * l.numel, 1)) for l in layers)
    median_cost = costs[len(costs) // 2] or 1e-30
    out, total_loss, size = [], 0.0, other * 4
    for l in layers:
        s, p = choice[l.name]
        dl = l.loss(s) + l.casts.get(p, 0.0)
        total_loss += dl
        nbytes = l.size(s, p)
        size += nbytes
        per = l.loss(s) / max(s * l.numel, 1)
        why = [f"{s:.0%} {l.structure} sparsity costs {l.loss(s):.3g} loss"
               + (f" ({per / median_cost:.2g}x the median layer's cost per weight removed)" if s > 0 else "")]
        if target_bytes is None and target_sparsity and s < 0.5 * target_sparsity:
            why.append("the loss is sensitive to this layer: kept denser than the target")
        elif target_bytes is None and target_sparsity and s > min(1.5 * target_sparsity, 0.95):
            why.append("the loss barely depends on most of its weights: pruned harder than the target")
        why.append(f"{p}: cast costs {l.casts.get(p, 0.0):.2g}"
                   + (f" (tolerance {tolerance:.2g})" if target_bytes is None else " (chosen for the size budget)"))
        source = "measured on the held batch" if l.measured else f"predicted ({l.method or 'fisher'})"
        out.append(LayerRecipe(name=l.name, numel=l.numel, sparsity=round(min(max(s, 0.0), 1.0), 4),
                               structure=l.structure, precision=p, saliency=l.saliency,  # type: ignore[arg-type]
                               reason="; ".join(why) + f"; {source}", size_bytes=nbytes,
                               loss_increase=dl if math.isfinite(dl) else None))
    achieved = sum(l.sparsity * l.numel for l in out) / total_params
    notes = ["loss increases are additive per-layer predictions from the Fisher (OBS/K-FAC where available, "
             "OBD diagonal otherwise), rescaled to held-batch measurements where the job ran 'sensitivity'",
             "size counts kept values in the chosen precision, a 1-bit mask per weight of a pruned layer, one fp32 "
             f"scale per row for int8, and {other} other parameters in fp32",
             "apply live with propose_prune + apply_fix, or offline with `traindx compress`"]
    return CompressionRecipe(
        run=run, target_sparsity=target_sparsity if target_bytes is None else None, target_size_bytes=target_bytes,
        achieved_sparsity=round(achieved, 4), method="fisher-obs-allocation", layers=out,
        dense_size_bytes=total_params * 4, predicted_size_bytes=size,
        predicted_loss_increase=total_loss if math.isfinite(total_loss) else None, notes=notes)


def _recent_loss(conn: sqlite3.Connection, run: str) -> float | None:
    vals = [r[0] for r in conn.execute("SELECT value FROM scalars WHERE run=? AND name='loss' AND value IS NOT NULL "
                                       "ORDER BY step DESC LIMIT 50", (run,))]
    return sorted(vals)[len(vals) // 2] if vals else None


def recipe(store: Store, run: str, target_sparsity: float | None = 0.8, *, target_bytes: int | None = None,
           structure: Structure = "unstructured", precisions: tuple[str, ...] | None = None,
           cast_tolerance: float = DEFAULT_CAST_TOLERANCE) -> CompressionRecipe:
    if target_bytes is None and (target_sparsity is None or not 0.0 <= target_sparsity < 1.0):
        raise ApiError(422, "invalid_parameter", f"target_sparsity must be in [0, 1), got {target_sparsity}")
    if target_bytes is not None and target_bytes <= 0:
        raise ApiError(422, "invalid_parameter", f"target_bytes must be positive, got {target_bytes}")
    if structure not in ("unstructured", "channels"):
        raise ApiError(422, "invalid_parameter", f"structure must be 'unstructured' or 'channels', got {structure!r}")
    conn = store.read()
    row = require_run(conn, run)
    profiles = _profiles(conn, run, "fisher")
    if not profiles:
        if target_bytes is not None:
            raise ApiError(409, "no_data", f"run {run!r} has sent no layer profiles: a size target needs the 'fisher' "
                           "collection (probes.attach(..., collections={..., 'fisher': 10}))")
        return compression_summary.recipe(store, run, float(target_sparsity or 0.0))
    total = int(orjson.loads(row["start"]).get("total_params", 0)) if row["start"] else 0
    return plan(run, profiles, _profiles(conn, run, "held_batch"), total, target_sparsity=target_sparsity,
                target_bytes=target_bytes, loss=_recent_loss(conn, run), structure=structure,
                precisions=precisions or tuple(BYTES), cast_tolerance=cast_tolerance)


# -- the recipe as a live fix --------------------------------------------------------------------------
def _insert_fix(store: Store, run: str, action: FixAction, params: dict[str, Any], rationale: str, effect: str,
                actor: str, risk: str) -> str:
    def write(conn: sqlite3.Connection) -> str:
        require_run(conn, run)
        now = time.time()
        cur = conn.execute(
            "INSERT INTO fixes(run, anomaly_id, action, params, rationale, expected_effect, risk, live, rank, status, "
            "requested_by, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (run, None, action.value, orjson.dumps(params, option=orjson.OPT_SORT_KEYS).decode(), rationale, effect,
             risk, 1, 1, "proposed", actor, now, now))
        fix_id = f"f-{cur.lastrowid}"
        conn.execute("UPDATE fixes SET id=? WHERE seq=?", (fix_id, cur.lastrowid))
        fixes._audit(conn, run, actor, "proposed", fix_id, {"action": action.value})
        return fix_id

    return store.write(write)


def propose_prune(store: Store, run: str, target_sparsity: float | None = 0.8, *, target_bytes: int | None = None,
                  structure: Structure = "unstructured", rounds: int = 1, every: int = 1,
                  actor: str = "server") -> Fix:
    """A ``prune`` fix carrying the recipe's per-layer sparsities; apply it with apply_fix."""
    if not 1 <= rounds <= 1000 or not 0 <= every <= 10_000_000:
        raise ApiError(422, "invalid_parameter", "rounds must be in [1, 1000] and every in [0, 1e7]")
    r = recipe(store, run, target_sparsity, target_bytes=target_bytes, structure=structure)
    layers = [l for l in r.layers if l.sparsity > 0]
    if not layers:
        raise ApiError(422, "nothing_to_prune", "the recipe prunes no layer at this target")
    params = {"layers": [l.name for l in layers], "sparsity": [l.sparsity for l in layers],
              "structure": [l.structure for l in layers], "rounds": rounds, "every": every}
    gradual = ((f" over {rounds} rounds, one every {every} steps (cubic ramp)" if every else
                f" in {rounds} back-to-back OBS rounds") if rounds > 1 else "")
    rationale = (f"Prune {len(layers)} layers to {r.achieved_sparsity:.0%} global sparsity{gradual} by "
                 f"{r.method}; predicted loss increase {r.predicted_loss_increase or 0:.3g} before fine-tuning. "
                 "Masks stay fixed for the rest of training, so the job fine-tunes under them.")
    fix_id = _insert_fix(store, run, FixAction.prune, params, rationale,
                         "The loss rises by about the predicted amount, then recovers as training continues.",
                         actor, "medium")
    return get_fix(store.read(), run, fix_id)


def request_sensitivity(store: Store, run: str, sparsities: list[float] | None = None, actor: str = "server") -> Fix:
    """Ask the job to measure per-layer sensitivity on its held batch (needs allow=[..., 'sensitivity'])."""
    grid = sparsities or [0.5, 0.8, 0.9, 0.95]
    if not 1 <= len(grid) <= 20 or not all(0.0 <= s < 1.0 for s in grid):
        raise ApiError(422, "invalid_parameter", "sparsities must be 1 to 20 numbers in [0, 1)")
    fix_id = _insert_fix(store, run, FixAction.sensitivity, {"sparsities": list(grid)},
                         "Measure each layer's loss change when pruned alone and cast to fp16/bf16/int8, on the job's "
                         "held batch, so the recipe can calibrate its predictions.",
                         "No change to the model; a layer_profiles event arrives.", actor, "low")
    return fixes.apply(store, run, fix_id, actor)
