"""The live fix ``embedding_grad_scale``: scale each affected row's learning by a factor from its SNR.

It lives with the statistics it reads; probes/fixes.py registers it among the job's actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..fixes import Applied, FixRejected, Target, number
from .collection import Embeddings
from .constants import NOISE_SNR
from .state import TableState


def row_factors(table: TableState, *, min_factor: float, max_factor: float, snr_ref: float | None = None,
                rows: torch.Tensor | None = None, starved_below: float = 0.0) -> torch.Tensor:
    """Per-row scale, O(rows). Noisy rows (``rows`` when given, else every eligible row) get
    clamp(snr / snr_ref, min_factor, 1). Unless given, ``snr_ref`` is the lower of the table's median
    snr and the snr of white noise (NOISE_SNR): a row is damped only when its gradient carries less
    signal than both the typical row's and noise's, and a row with half that signal takes half a step.
    (While a table still learns, its median is above NOISE_SNR and few rows qualify.)
    Optionally, rows updated less often than ``starved_below`` x the median get up to ``max_factor``
    (sqrt(median / touches)). 1 elsewhere."""
    f = torch.ones(table.rows, device=table.weight.device)
    snr = table.snr()
    el = table.eligible()
    if snr_ref is None:
        snr_ref = min(float(snr[el].median()), NOISE_SNR) if bool(el.any()) else NOISE_SNR
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


@dataclass
class ScaleParams:
    """The fix's parameters, validated against the job's bounds (docs/embeddings.md lists them)."""

    table: TableState
    optimizer: torch.optim.Optimizer  # the one that steps the table, which need not be the probe's
    min_factor: float
    max_factor: float
    snr_ref: float | None
    starved_below: float
    mode: str
    rows: torch.Tensor | None
    refresh: int


def scale_params(t: Target, params: Mapping, bounds: Mapping) -> ScaleParams:
    """``params`` checked against ``bounds``; FixRejected, saying why, when a parameter is out of them, the
    table is unknown or no optimizer that steps it has been seen."""
    coll = next((c for c in getattr(t.probe, "collections", []) if isinstance(c, Embeddings)), None)
    if coll is None:
        raise FixRejected("embedding_grad_scale needs the embeddings collection: attach the probe with "
                          "collections=[..., 'embeddings']")
    name = params.get("table")
    table = coll.table(name) if isinstance(name, str) else None
    if table is None:
        raise FixRejected(f"no embedding table {name!r}; tables: {[x.name for x in coll.tables]}")
    opt = coll.owner(table)
    if opt is None:
        raise FixRejected(f"no optimizer that steps {table.name!r} yet: pass it to probes.attach(model, optimizer), "
                          "or apply the fix once a step has run")
    lo = bounds.get("min_factor", 0.01)
    hi = bounds.get("max_factor", 10.0)
    min_factor = number(params, "min_factor", lo, 1.0, default=max(0.1, lo))
    max_factor = number(params, "max_factor", 1.0, hi, default=1.0)
    snr_ref = number(params, "snr_ref", 1e-9, 1e6) if params.get("snr_ref") is not None else None
    starved_below = number(params, "starved_below", 0.0, 1.0, default=0.0)
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
    refresh = int(number(params, "refresh", 0, 1e9, default=0))
    if refresh != params.get("refresh", 0):
        raise FixRejected(f"parameter 'refresh' must be a whole number of steps, got {params.get('refresh')!r}")
    return ScaleParams(table, opt, min_factor, max_factor, snr_ref, starved_below, mode, rows, refresh)


class RowScaling:
    """The fix in place: hooks on the optimizer that steps the table. ``mode='update'`` scales each
    affected row's step (w_before + f * (w_after - w_before)) in the optimizer's post hook, ``'grad'`` its
    gradient rows in the pre hook. Factors are computed when applied, and every ``refresh`` optimizer steps
    again; remove() takes the hooks off."""

    def __init__(self, p: ScaleParams, probe: Any) -> None:
        self.p, self.probe = p, probe
        self.steps = 0
        self.before: tuple | None = None  # the affected rows, their factors and values before the step
        self.compute()
        self.handles = [p.optimizer.register_step_pre_hook(self.pre)]
        if p.mode == "update":
            self.handles.append(p.optimizer.register_step_post_hook(self.post))

    def compute(self) -> None:
        p = self.p
        self.factors = row_factors(p.table, snr_ref=p.snr_ref, min_factor=p.min_factor, max_factor=p.max_factor,
                                   rows=p.rows, starved_below=p.starved_below)
        self.affected = torch.nonzero(self.factors != 1.0).reshape(-1)
        self.f = self.factors.index_select(0, self.affected)

    def pre(self, *_: Any) -> None:
        self.steps += 1
        if self.p.refresh and self.steps % self.p.refresh == 0:
            try:  # from the rows' statistics now: a row that has turned noisy since is damped too
                self.compute()
            except Exception as e:  # noqa: BLE001 - inside the job's optimizer step: keep the factors, report
                self.probe.hook_failed("embedding_grad_scale refresh", e)
        factors, affected, f = self.factors, self.affected, self.f
        w = self.p.table.weight
        g = w.grad
        if self.p.mode == "grad":
            if g is None:
                return
            if g.is_sparse:
                g = g.coalesce()
                g.values().mul_(factors.index_select(0, g.indices()[0])[:, None].to(g.dtype))
                w.grad = g
            else:
                g.index_copy_(0, affected, g.index_select(0, affected) * f[:, None].to(g.dtype))
            return
        if g is not None and g.is_sparse:
            # Only the rows with a gradient move (sparse optimizers): the cost follows the batch, not the
            # number of damped rows in the table.
            touched = torch.unique(g._indices()[0])
            rf = factors.index_select(0, touched)
            keep = rf != 1.0
            affected, f = touched[keep], rf[keep]
        self.before = (affected, f, w.detach().index_select(0, affected))

    def post(self, *_: Any) -> None:
        if self.before is None:
            return
        (affected, f, before), self.before = self.before, None
        w = self.p.table.weight
        with torch.no_grad():
            after = w.detach().index_select(0, affected)
            w.index_copy_(0, affected, before + f[:, None].to(w.dtype) * (after - before))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def embedding_grad_scale(t: Target, params: Mapping, bounds: Mapping, fix_id: str) -> Applied:
    """Scale the learning of each affected row by a factor from its measured SNR.

    ``mode='update'`` (default) scales the row's step (w_before + f * (w_after - w_before)): for SGD this
    is the same as scaling its gradient, and for Adam-family optimizers it is the only way a constant
    per-row scale has an effect (a gradient scale cancels in m / sqrt(v)). ``mode='grad'`` scales the
    gradient rows before the optimizer step. Factors are computed when the fix is applied, from the rows'
    statistics at that moment, and with ``refresh=N`` again every N optimizer steps (a row that turns
    noisy later is damped from then on; one that regains a signal gets its step back); revert removes
    the hooks.
    """
    p = scale_params(t, params, bounds)
    scaling = RowScaling(p, t.probe)
    t.hooks[fix_id] = scaling
    name = p.table.name

    def undo() -> dict:
        t.hooks.pop(fix_id, None)
        scaling.remove()
        return {"embedding_grad_scale": 1.0, "table": name, "rows": 0}

    affected, f = scaling.affected, scaling.f
    n = int(affected.numel())
    after = {"embedding_grad_scale": round(float(f.mean()), 6) if n else 1.0, "table": name, "rows": n,
             "min_factor": round(float(f.min()), 6) if n else 1.0,
             "max_factor": round(float(f.max()), 6) if n else 1.0, "mode": p.mode, "refresh": p.refresh,
             "row_ids": [str(int(i)) for i in affected[:64].tolist()]}
    return Applied({"embedding_grad_scale": 1.0, "table": name, "rows": 0}, after, undo)
