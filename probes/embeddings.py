"""Embedding dynamics: per-row statistics of every nn.Embedding / nn.EmbeddingBag table of the model.

Dense-model statistics (one norm per tensor) say nothing about a table of a million rows of which a
batch touches a thousand. This collection keeps, for each row, a handful of scalars on the table's
device and updates them only for the rows a step touched:

- ``touches``      steps in which the row was looked up and got a non-zero gradient (update frequency)
- ``velocity``     EMA of ||row after - row before|| across the optimizer step (update velocity)
- ``consistency``  EMA of the cosine between the row's successive updates (direction consistency)
- ``snr``          ||mean g||^2 / mean ||g - mean g||^2 of the row's gradient across the steps that
                   touched it (temporal SNR: across steps, not across the row's elements)

Memory is O(rows): five scalars and two ``SKETCH_DIM``-vectors per row, never a copy of the table.
The mean gradient and the previous update direction are kept as random projections to
``SKETCH_DIM`` dimensions (Johnson-Lindenstrauss: inner products and norms are preserved in
expectation; exact when the table is at most ``SKETCH_DIM`` wide, e.g. bias tables).

When it runs. Temporal statistics need consecutive touches of a row, which a sample every 50th step
cannot give (a row touched once per epoch would be seen once per 50 epochs). So the collection
*tracks* every ``track_every``-th step (1 by default) with one-shot hooks armed like any other
collection's, and *reports* (one host copy, one event) only every ``interval`` steps. A tracked step
costs O(rows touched x dim): the looked-up indices come from a forward hook, the gradient rows are
gathered at those indices (or read from the sparse gradient), and the rows' values are gathered
before and after the optimizer step. There is no host sync on a tracked step; on CPU the cost is a
few dozen small kernels. A report costs O(rows) scalar operations (top-k and counts).

A row counts as touched when the model looked it up *and* its gradient row is non-zero: a whole-table
L2 penalty in the loss gives every row a gradient, but only rows the model looked up are touched, so
rows nobody looks up stay dead under weight decay. Rows holding NaN/Inf are reported as non-finite,
never as dead.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .collect import Collection, HostCopy
from .fixes import Applied, FixRejected, Target, _number

# Width of the random projections that stand in for a row's mean gradient. 8 keeps the state at
# 57 bytes a row (vs 128-256 for a 32-64 wide float32 row); JL error ~ 1/sqrt(8) per estimate.
SKETCH_DIM = 8
# EMA weight of a new gradient in the row's mean (a 10-touch window, GradTracer's default window).
EMA_ALPHA = 0.1
# EMA weight for the slower averages (consistency, squared norms): a 50-touch window, so that the
# per-row noise of a cosine (+-1 for a bias row) averages down to ~0.14.
SLOW_ALPHA = 0.01
# The snr that independent zero-mean gradients give with these EMAs: E||m||^2 / E||g||^2 for an EMA
# of white noise is alpha / (2 - alpha). Below it, successive gradients cancel (variance-ratio test,
# Lo & MacKinlay 1988); above it, they drift together.
NOISE_SNR = EMA_ALPHA / (2 - EMA_ALPHA)
# A row's direction statistics count once it was touched this many times (10 observations past the
# fast window).
MIN_TOUCHES = 20
# Rows listed per table and kind in a report (the worst ones).
TOP_ROWS = 256
# Rows sampled for effective rank and mean pairwise cosine.
COLLAPSE_SAMPLE = 512


def find_tables(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, list[torch.nn.Module]]]:
    """Every trainable Embedding / EmbeddingBag weight, once even when modules share it."""
    seen: dict[int, tuple[str, torch.nn.Parameter, list[torch.nn.Module]]] = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.weight.requires_grad:
            key = id(m.weight)
            if key not in seen:
                seen[key] = (f"{name}.weight" if name else "weight", m.weight, [])
            seen[key][2].append(m)
    return list(seen.values())


class TableState:
    """Per-row statistics of one table, on its device. O(rows) memory."""

    def __init__(self, name: str, weight: torch.nn.Parameter, modules: list[torch.nn.Module],
                 sketch_dim: int = SKETCH_DIM, seed: int = 0) -> None:
        self.name, self.weight, self.modules = name, weight, modules
        rows, dim = weight.shape
        dev = weight.device
        self.rows, self.dim = rows, dim
        self.k = min(sketch_dim, dim)
        if dim <= sketch_dim:
            self.proj = None  # narrow table: keep the vectors themselves, exactly
        else:
            g = torch.Generator().manual_seed(seed)
            self.proj = (torch.randn(dim, self.k, generator=g) / math.sqrt(self.k)).to(dev)
        self.touches = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.last = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        self.velocity = torch.zeros(rows, device=dev)
        self.cons_num = torch.zeros(rows, device=dev)
        self.cons_den = torch.zeros(rows, device=dev)
        self.grad_sq = torch.zeros(rows, device=dev)
        self.grad_mean = torch.zeros(rows, self.k, device=dev)
        self.mean_sq = torch.zeros(rows, device=dev)
        self.occ_sq = torch.zeros(rows, device=dev)
        # The previous innovation: bfloat16 keeps float32's range (gradients of 1e-8 survive) at 2 bytes.
        self.prev = torch.zeros(rows, self.k, dtype=torch.bfloat16, device=dev)
        self.nonfinite = torch.zeros(rows, dtype=torch.bool, device=dev)
        pad = {m.padding_idx for m in modules if getattr(m, "padding_idx", None) is not None}
        self.padding = torch.tensor(sorted(p % rows for p in pad), dtype=torch.long, device=dev)
        self.sparse = any(getattr(m, "sparse", False) for m in modules)
        self.tracked_steps = 0
        self.last_report = -1
        # One tracked step's scratch: looked-up indices, then the touched rows and their values.
        self.lookups: list[torch.Tensor] = []
        self.idx: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None
        self.count: torch.Tensor | None = None
        self.before: torch.Tensor | None = None

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.touches, self.last, self.velocity, self.cons_num, self.cons_den, self.grad_sq,
            self.grad_mean, self.mean_sq, self.occ_sq, self.prev, self.nonfinite))

    def _sketch(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.proj is None else x @ self.proj

    # -- one tracked step ------------------------------------------------------------------------------
    def gather(self) -> None:
        """Before the optimizer step: which rows were touched, their gradients and their values."""
        self.idx = self.grad = self.before = None
        w = self.weight
        grad = w.grad
        if grad is None:
            self.lookups = []
            return
        lookups, self.lookups = self.lookups, []
        if grad.is_sparse:
            grad = grad.coalesce()
            gi, gv = grad.indices()[0], grad.values()
            if lookups:
                idx, count = torch.unique(torch.cat(lookups), return_counts=True)
                pos = torch.searchsorted(gi, idx).clamp_max(max(gi.numel() - 1, 0))
                hit = gi.numel() > 0 and gi[pos] == idx
                g = torch.where(hit[:, None], gv[pos], torch.zeros((), dtype=gv.dtype, device=gv.device)) \
                    if gi.numel() else torch.zeros(idx.numel(), w.shape[1], device=w.device)
            else:  # looked up outside the modules' forward (functional call): one lookup per row
                idx, g = gi, gv
                count = torch.ones_like(idx)
        else:
            if not lookups:
                return
            idx, count = torch.unique(torch.cat(lookups), return_counts=True)
            g = grad.index_select(0, idx)
        if self.padding.numel():
            keep = ~torch.isin(idx, self.padding)
            idx, g, count = idx[keep], g[keep], count[keep]
        g = g.detach().float()
        # A looked-up row with an exactly zero gradient did not learn; a NaN gradient is a touch (gone bad).
        touched = (g.abs().amax(dim=1) > 0) | ~torch.isfinite(g).all(dim=1)
        self.idx, self.grad, self.count = idx[touched], g[touched], count[touched]
        self.before = w.detach().index_select(0, self.idx).float()

    def update(self, step: int, with_delta: bool) -> None:
        """After the optimizer step (or at probe.step without an optimizer): fold this step into the rows."""
        idx, g = self.idx, self.grad
        self.tracked_steps += 1
        if idx is None or idx.numel() == 0:
            self.idx = self.grad = self.before = None
            return
        dev = g.device
        zero = torch.zeros((), device=dev)
        after = self.weight.detach().index_select(0, idx).float()
        finite = torch.isfinite(after).all(dim=1) & torch.isfinite(g).all(dim=1)
        self.nonfinite[idx] = ~finite  # a row that went NaN is non-finite, whatever else it is
        t = self.touches.index_select(0, idx) + finite.to(torch.int32)
        self.touches.index_copy_(0, idx, t)
        self.last.index_fill_(0, idx, step)
        tf = t.float().clamp_min(1.0)
        # Running means until a row has 1/alpha observations, EMAs after, so that a rarely touched row is
        # not dominated by its first values; a row that is not finite this step keeps its statistics.
        a_fast = torch.where(finite, (1.0 / tf).clamp_min(EMA_ALPHA), zero)
        a_slow = torch.where(finite, (1.0 / tf).clamp_min(SLOW_ALPHA), zero)
        g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
        gs = self._sketch(g)
        m = self.grad_mean.index_select(0, idx)
        # Direction consistency: the correlation of the row's successive gradient steps around their recent
        # mean (lag-1 autocorrelation of the innovations g_t - mean_{t-1}, as an EMA of inner products over
        # an EMA of norm products: a magnitude-weighted mean cosine in [-1, 1]). Centred, so that a trend
        # common to successive steps (a row still drifting towards its optimum) does not hide the reversals;
        # on gradients, not the optimizer's deltas, since momentum (Adam's beta1 = 0.9) averages successive
        # gradients and its deltas agree even when every gradient reverses the last one.
        inno = gs - m
        prev = self.prev.index_select(0, idx).float()
        gn = gs.norm(dim=1)
        pair = finite & (t >= 3)  # the first innovation is against a mean of one gradient: skip it
        a_pair = torch.where(pair, (1.0 / (tf - 2).clamp_min(1.0)).clamp_min(SLOW_ALPHA), zero)
        cn = self.cons_num.index_select(0, idx)
        cd = self.cons_den.index_select(0, idx)
        self.cons_num.index_copy_(0, idx, cn + a_pair * ((inno * prev).sum(dim=1) - cn))
        self.cons_den.index_copy_(0, idx, cd + a_pair * (inno.norm(dim=1) * prev.norm(dim=1) - cd))
        self.prev.index_copy_(0, idx, torch.where(finite[:, None], inno, prev).to(self.prev.dtype))
        m = m + a_fast[:, None] * (gs - m)
        self.grad_mean.index_copy_(0, idx, m)
        sq = self.grad_sq.index_select(0, idx)
        self.grad_sq.index_copy_(0, idx, sq + a_slow * (gn.pow(2) - sq))
        # Energy per lookup: a step's gradient sums one term per lookup, so ||g||^2 / lookups is what a
        # row's data says each time, comparable between popular and rare rows.
        oc = self.occ_sq.index_select(0, idx)
        self.occ_sq.index_copy_(0, idx, oc + a_slow * (gn.pow(2) / self.count.float() - oc))
        # ||mean||^2 over the fast window, averaged over the slow one once the fast window is full.
        warm = t.float() - 1.0 / EMA_ALPHA
        a_mean = torch.where(finite & (warm >= 1), (1.0 / warm.clamp_min(1.0)).clamp_min(SLOW_ALPHA), zero)
        ms = self.mean_sq.index_select(0, idx)
        self.mean_sq.index_copy_(0, idx, ms + a_mean * (m.pow(2).sum(dim=1) - ms))
        if with_delta:
            delta = torch.nan_to_num(after - self.before, nan=0.0, posinf=0.0, neginf=0.0)
            v = self.velocity.index_select(0, idx)
            self.velocity.index_copy_(0, idx, v + a_fast * (delta.norm(dim=1) - v))
        self.idx = self.grad = self.before = None

    # -- derived per-row values ------------------------------------------------------------------------
    def snr(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """||mean g||^2 / variance of g across the steps that touched the row (over the EMA window)."""
        ms = self.mean_sq if idx is None else self.mean_sq.index_select(0, idx)
        sq = self.grad_sq if idx is None else self.grad_sq.index_select(0, idx)
        return ms / (sq - ms).clamp_min(1e-30)

    def drift_ratio(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """snr over its value for independent zero-mean gradients: < 1 when successive gradients cancel."""
        s = self.snr(idx)
        return s / NOISE_SNR

    @property
    def consistency(self) -> torch.Tensor:
        return self.cons_num / self.cons_den.clamp_min(1e-30)

    def eligible(self) -> torch.Tensor:
        return (self.touches >= MIN_TOUCHES) & ~self.nonfinite

    def noise_excess(self) -> torch.Tensor:
        """The row's gradient energy per lookup over the median of eligible rows: > 1 is a row whose data
        keeps pulling it harder than its peers' data pulls them (conflicting or unfittable targets)."""
        el = self.eligible()
        if not bool(el.any()):
            return torch.ones(self.rows, device=self.weight.device)
        med = self.occ_sq[el].median().clamp_min(1e-30)
        return torch.where(el, self.occ_sq / med, torch.ones_like(self.occ_sq))

    def often(self) -> torch.Tensor:
        """Rows updated at least as often as the table's median touched row."""
        touched = self.touches > 0
        if not bool(touched.any()):
            return touched
        return self.touches.float() >= self.touches[touched].float().median()

    def zombie_score(self) -> torch.Tensor:
        """Higher is more zombie-like: a row whose data pulls it harder than its peers' (log noise
        excess) and whose successive gradients reverse (negative consistency). Rows not eligible score
        -inf."""
        score = torch.log(self.noise_excess().clamp_min(1e-6)) - self.consistency
        return torch.where(self.eligible(), score, torch.full_like(score, float("-inf")))

    # -- a report --------------------------------------------------------------------------------------
    def report(self, step: int) -> tuple[torch.Tensor, dict]:
        """Pack the table's summary into one float64 tensor (one host copy) and a decoding plan."""
        R = self.rows
        dev = self.weight.device
        w = self.weight.detach()
        touched = self.touches > 0
        finite_rows = ~self.nonfinite
        never = ~touched & finite_rows
        if self.padding.numel():
            never[self.padding] = False
        eligible = self.eligible()
        k = min(TOP_ROWS, R)
        ar = torch.arange(R, 0, -1, device=dev, dtype=torch.float64)  # lower id, higher key
        dead_key = torch.where(never, ar, torch.zeros((), dtype=torch.float64, device=dev))
        dead_val, dead_idx = torch.topk(dead_key, k)
        nf_key = torch.where(self.nonfinite, ar, torch.zeros((), dtype=torch.float64, device=dev))
        nf_val, nf_idx = torch.topk(nf_key, k)
        zkey = torch.where(self.often(), self.zombie_score(), torch.full((R,), float("-inf"), device=dev))
        noise = self.noise_excess()
        z_val, z_idx = torch.topk(zkey, k)
        rkey = torch.where(touched & finite_rows, -self.touches.float(), torch.full((R,), float("-inf"), device=dev))
        r_val, r_idx = torch.topk(rkey, k)
        tt = self.touches[touched]
        median = tt.float().median() if tt.numel() else torch.tensor(float("nan"), device=dev)
        nan_count = torch.isnan(w).sum() if w.is_floating_point() else torch.zeros((), device=dev)
        inf_count = torch.isinf(w).sum() if w.is_floating_point() else torch.zeros((), device=dev)
        rank, cosine, sampled = self._collapse(touched & finite_rows)

        def rows_of(i: torch.Tensor) -> list[torch.Tensor]:
            return [i.double(), self.touches[i].double(), self.velocity[i].double(),
                    self.consistency[i].double(), self.snr(i).double(), noise[i].double()]

        scalars = torch.stack([torch.tensor(float(R), device=dev, dtype=torch.float64),
                               touched.sum().double(), (self.last > self.last_report).sum().double(),
                               never.sum().double(), self.nonfinite.sum().double(), median.double(),
                               eligible.sum().double(), (eligible & (self.consistency < 0)).sum().double(),
                               rank.double(), cosine.double(), sampled.double(),
                               nan_count.double(), inf_count.double()])
        parts = [scalars, dead_val, dead_idx.double(), nf_val, nf_idx.double(), z_val.double(),
                 *rows_of(z_idx), r_val.double(), *rows_of(r_idx)]
        self.last_report = step
        return torch.cat(parts), {"k": k}

    def _collapse(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dev = self.weight.device
        nan = torch.tensor(float("nan"), device=dev)
        if self.dim < 4:
            return nan, nan, torch.zeros((), device=dev)
        # A fixed pseudo-random sample of the pool: the rows with the smallest hash of their id.
        R = self.rows
        h = (torch.arange(R, device=dev, dtype=torch.int64) * 2654435761) % 4294967296
        key = torch.where(pool, h.double(), torch.full((R,), float("inf"), dtype=torch.float64, device=dev))
        n = min(COLLAPSE_SAMPLE, R)
        val, idx = torch.topk(key, n, largest=False)
        idx = idx[torch.isfinite(val)]
        if idx.numel() < 2:
            return nan, nan, torch.tensor(float(idx.numel()), device=dev)
        x = self.weight.detach().index_select(0, idx).float()
        x = x[torch.isfinite(x).all(dim=1)]  # a row can go NaN without a touch (dense optimizer state)
        if x.shape[0] < 2:
            return nan, nan, torch.tensor(float(x.shape[0]), device=dev)
        s = torch.linalg.svdvals(x)
        p = s / s.sum().clamp_min(1e-30)
        rank = torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())  # Roy & Vetterli (2007)
        xn = x / x.norm(dim=1, keepdim=True).clamp_min(1e-30)
        m = x.shape[0]
        cos = ((xn.sum(dim=0).pow(2).sum() - m) / (m * (m - 1)))
        return rank, cos, torch.tensor(float(m), device=dev)


def _decode(name: str, table: TableState, raw: list[float], k: int) -> dict:
    def num(x: float) -> float | None:
        return x if math.isfinite(x) else None

    it = iter(raw)
    take = lambda n: [next(it) for _ in range(n)]  # noqa: E731
    (rows, touched, window, never, nonfinite, median, eligible, negative, rank, cosine, sampled,
     nan_count, inf_count) = take(13)
    dead_val, dead_idx = take(k), take(k)
    nf_val, nf_idx = take(k), take(k)
    z_val = take(k)
    z = [take(k) for _ in range(6)]
    r_val = take(k)
    r = [take(k) for _ in range(6)]

    def rowlist(vals: list[float], cols: list[list[float]]) -> list[dict]:
        out = []
        for j, v in enumerate(vals):
            if not math.isfinite(v):
                break
            out.append({"row": int(cols[0][j]), "touches": int(cols[1][j]), "velocity": num(cols[2][j]),
                        "consistency": num(cols[3][j]), "snr": num(cols[4][j]), "noise": num(cols[5][j])})
        return out

    summary = {
        "rows": int(rows), "dim": table.dim, "sparse": table.sparse, "tracked_steps": table.tracked_steps,
        "touched_rows": int(touched), "window_touched_rows": int(window), "never_updated": int(never),
        "nonfinite_rows": int(nonfinite), "median_touches": num(median), "eligible_rows": int(eligible),
        "negative_consistency_rows": int(negative), "effective_rank": num(rank), "mean_cosine": num(cosine),
        "sampled_rows": int(sampled),
        "zombies": rowlist(z_val, z),
        "rarest": rowlist(r_val, r),
        "dead_ids": [int(i) for v, i in zip(dead_val, dead_idx) if v > 0],
        "nonfinite_ids": [int(i) for v, i in zip(nf_val, nf_idx) if v > 0],
    }
    return {"name": name, "numel": table.rows * table.dim, "nan_count": int(nan_count),
            "inf_count": int(inf_count), "embedding": summary}


class Embeddings(Collection):
    """Per-row dynamics of every embedding table; tracked every ``track_every`` steps, reported every
    ``interval`` steps. See the module docstring for what is measured and what it costs."""

    name = "embeddings"
    track_every = 1

    def __init__(self, probe: Any, interval: int) -> None:
        super().__init__(probe, interval)
        self.tables = [TableState(n, w, mods, seed=i) for i, (n, w, mods) in enumerate(find_tables(probe.model))]
        self._handles: list[Any] = []
        self._step = 0
        self._stepped = False

    def due(self, step: int) -> bool:
        return bool(self.tables) and (step % self.track_every == 0 or step % self.interval == 0)

    def reports(self, step: int) -> bool:
        return step % self.interval == 0

    def table(self, name: str) -> TableState | None:
        for t in self.tables:
            if t.name == name or t.name == f"{name}.weight":
                return t
        return None

    def arm(self, step: int) -> None:
        self._step, self._stepped = step, False
        for t in self.tables:
            t.lookups = []
            for m in t.modules:
                self._handles.append(m.register_forward_hook(self._on_lookup(t)))
        opt = self.probe.optimizer
        if opt is not None:
            self._handles += [opt.register_step_pre_hook(self._pre), opt.register_step_post_hook(self._post)]

    @staticmethod
    def _on_lookup(t: TableState) -> Any:
        def hook(module: torch.nn.Module, args: tuple, out: Any) -> None:
            # Lookups made without autograd (evaluation) teach the table nothing.
            if args and isinstance(args[0], torch.Tensor) and torch.is_grad_enabled():
                t.lookups.append(args[0].detach().reshape(-1))
        return hook

    def _pre(self, *_: Any) -> None:
        for t in self.tables:
            t.gather()

    def _post(self, *_: Any) -> None:
        # Hooks are removed in collect(), not here: torch iterates the hook dict while calling us.
        if self._stepped:
            return
        self._stepped = True
        for t in self.tables:
            t.update(self._step, with_delta=True)

    def collect(self, step: int) -> list[HostCopy]:
        for h in self._handles:
            h.remove()
        self._handles = []
        if not self._stepped:  # no optimizer (or it did not step): gradients only, no deltas
            for t in self.tables:
                t.gather()
                t.update(step, with_delta=False)
        if not self.reports(step):
            return []
        names, parts, plans = [], [], []
        for t in self.tables:
            packed, plan = t.report(step)
            names.append(t.name)
            parts.append(packed)
            plans.append((t, packed.numel(), plan["k"]))

        def to_rows(names: list[str], raw: list[float]) -> list[dict]:
            rows, at = [], 0
            for name, (t, n, k) in zip(names, plans):
                rows.append(_decode(name, t, raw[at:at + n], k))
                at += n
            return rows

        return [HostCopy(self.name, step, names, torch.cat(parts), to_rows)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# -- the live fix ----------------------------------------------------------------------------------------
def _collection(t: Target) -> Embeddings:
    for c in getattr(t.probe, "collections", []):
        if isinstance(c, Embeddings):
            return c
    raise FixRejected("embedding_grad_scale needs the embeddings collection: attach the probe with "
                      "collections=[..., 'embeddings']")


def row_factors(table: TableState, *, min_factor: float, max_factor: float, snr_ref: float | None = None,
                rows: torch.Tensor | None = None, starved_below: float = 0.0) -> torch.Tensor:
    """Per-row scale, O(rows). Noisy rows (``rows`` when given, else every eligible row) get
    clamp(snr / snr_ref, min_factor, 1), with ``snr_ref`` the median snr of the table's eligible rows
    unless given: a row whose gradient is half as much signal as the typical row's takes half a step.
    Optionally, rows updated less often than ``starved_below`` x the median get up to ``max_factor``
    (sqrt(median / touches)). 1 elsewhere."""
    f = torch.ones(table.rows, device=table.weight.device)
    snr = table.snr()
    el = table.eligible()
    if snr_ref is None:
        snr_ref = float(snr[el].median()) if bool(el.any()) else 1.0
    snr_ref = max(snr_ref, 1e-12)
    noisy = el & (snr < snr_ref)
    if rows is not None:
        chosen = torch.zeros_like(noisy)
        chosen[rows] = True
        noisy &= chosen
    f = torch.where(noisy, (snr / snr_ref).clamp(min_factor, 1.0), f)
    if starved_below > 0 and max_factor > 1:
        touched = table.touches > 0
        if touched.any():
            med = table.touches[touched].float().median()
            starved = touched & (table.touches.float() < starved_below * med) & ~noisy
            up = (med / table.touches.float().clamp_min(1.0)).sqrt().clamp(1.0, max_factor)
            f = torch.where(starved, up, f)
    return f


def embedding_grad_scale(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    """Scale the learning of each affected row by a factor from its measured SNR.

    ``mode='update'`` (default) scales the row's step (w_before + f * (w_after - w_before)): for SGD this
    is the same as scaling its gradient, and for Adam-family optimizers it is the only way a constant
    per-row scale has an effect (a gradient scale cancels in m / sqrt(v)). ``mode='grad'`` scales the
    gradient rows before the optimizer step. Factors are computed once, when the fix is applied, from
    the rows' statistics at that moment; revert removes the hooks.
    """
    coll = _collection(t)
    name = params.get("table")
    table = coll.table(name) if isinstance(name, str) else None
    if table is None:
        raise FixRejected(f"no embedding table {name!r}; tables: {[x.name for x in coll.tables]}")
    opt = t.optimizer
    if opt is None:
        raise FixRejected("this action needs the optimizer; pass it to probes.attach(model, optimizer)")
    lo = bounds.get("min_factor", 0.01)
    hi = bounds.get("max_factor", 10.0)
    min_factor = _number(params, "min_factor", lo, 1.0, default=max(0.1, lo))
    max_factor = _number(params, "max_factor", 1.0, hi, default=1.0)
    snr_ref = _number(params, "snr_ref", 1e-9, 1e6) if params.get("snr_ref") is not None else None
    starved_below = _number(params, "starved_below", 0.0, 1.0, default=0.0)
    mode = params.get("mode", "update")
    if mode not in ("update", "grad"):
        raise FixRejected(f"parameter 'mode' must be 'update' or 'grad', got {mode!r}")
    ids = params.get("rows")
    rows = None
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, (int, float)) and not isinstance(i, bool)
                                                 and i == int(i) and 0 <= i < table.rows for i in ids):
            raise FixRejected(f"parameter 'rows' must be a list of row ids in [0, {table.rows})")
        rows = torch.tensor([int(i) for i in ids], dtype=torch.long, device=table.weight.device)
    factors = row_factors(table, snr_ref=snr_ref, min_factor=min_factor, max_factor=max_factor, rows=rows,
                          starved_below=starved_below)
    affected = torch.nonzero(factors != 1.0).reshape(-1)
    f = factors.index_select(0, affected)
    w = table.weight
    state: dict[str, torch.Tensor | None] = {"before": None}

    def pre(*_: Any) -> None:
        if mode == "grad":
            g = w.grad
            if g is None:
                return
            if g.is_sparse:
                g = g.coalesce()
                g.values().mul_(factors.index_select(0, g.indices()[0])[:, None].to(g.dtype))
                w.grad = g
            else:
                g.index_copy_(0, affected, g.index_select(0, affected) * f[:, None].to(g.dtype))
        else:
            state["before"] = w.detach().index_select(0, affected)

    def post(*_: Any) -> None:
        before = state["before"]
        if before is None:
            return
        state["before"] = None
        with torch.no_grad():
            after = w.detach().index_select(0, affected)
            w.index_copy_(0, affected, before + f[:, None].to(w.dtype) * (after - before))

    handles = [opt.register_step_pre_hook(pre)]
    if mode == "update":
        handles.append(opt.register_step_post_hook(post))

    class _Handles:
        def remove(self) -> None:
            for h in handles:
                h.remove()

    t.hooks[fix_id] = _Handles()

    def undo() -> dict:
        t.hooks.pop(fix_id, None)
        for h in handles:
            h.remove()
        return {"embedding_grad_scale": 1.0, "table": table.name, "rows": 0}

    n = int(affected.numel())
    after = {"embedding_grad_scale": round(float(f.mean()), 6) if n else 1.0, "table": table.name, "rows": n,
             "min_factor": round(float(f.min()), 6) if n else 1.0,
             "max_factor": round(float(f.max()), 6) if n else 1.0, "mode": mode,
             "row_ids": [str(int(i)) for i in affected[:64].tolist()]}
    return Applied({"embedding_grad_scale": 1.0, "table": table.name, "rows": 0}, after, undo)
