"""Pruning and casting a layer from curvature: saliencies, the Optimal Brain Surgeon update, profiles.

Saliency of a weight is the loss increase predicted for removing it. With only a diagonal Fisher F it is
OBD's 0.5 * F * w^2 (LeCun et al. 1990). With a Linear layer's K-FAC factors (A over inputs, diag G over
output gradients) the Fisher of row i is G_i * A, and removing weight j of that row while the row's
other kept weights move to compensate costs 0.5 * G_i * w_ij^2 / [A_KK^-1]_jj, K the row's kept inputs:
Optimal Brain Surgeon (Hassibi & Stork 1993) in its WoodFisher form (Singh & Alistarh 2020) with a
Kronecker-factored Fisher, solved exactly per row as OBC does (Frantar & Alistarh 2022). After the
mask is chosen the kept weights of each row take the OBS update w_K += A_KK^-1 A_KP w_P, so the layer's
outputs on the inputs it saw in training change as little as the mask allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Damping added to A, as a fraction of its mean diagonal: keeps A_KK invertible when inputs are
# correlated or dead (1% as in OBC / SparseGPT, Frantar & Alistarh 2022-2023).
DAMPING = 0.01
# Sparsities at which a layer profile predicts the loss increase.
SPARSITY_GRID = tuple(round(i / 100, 2) for i in range(100))
# A batched solve holds rows * in^2 numbers; chunk rows to keep it under this many.
SOLVE_ELEMENTS = 1 << 24
# Unit roundoff of the casts, and int8's levels per side (symmetric, one scale per output row).
ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
INT8_LEVELS = 127


@dataclass
class Curvature:
    diag: torch.Tensor  # diagonal empirical Fisher, the weight's shape
    A: torch.Tensor | None = None  # K-FAC input factor (in, in), Linear only
    G: torch.Tensor | None = None  # K-FAC output factor's diagonal (out,)

    @property
    def kfac(self) -> bool:
        return self.A is not None and self.G is not None


def _damped(A: torch.Tensor) -> torch.Tensor:
    mean = A.diagonal().mean().clamp_min(1e-12)
    return A + DAMPING * mean * torch.eye(A.shape[0], device=A.device, dtype=A.dtype)


def _row_systems(A: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """M_r = D_r A D_r + (I - D_r) for each row's kept set D_r: A_KK on K, the identity elsewhere."""
    k = keep.float()
    eye = torch.eye(A.shape[0], device=A.device, dtype=A.dtype)
    return A.unsqueeze(0) * k.unsqueeze(2) * k.unsqueeze(1) + eye * (1 - k).unsqueeze(2)


def _chunks(rows: int, width: int) -> list[slice]:
    step = max(1, SOLVE_ELEMENTS // max(width * width, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def saliency(w: torch.Tensor, curv: Curvature | None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Predicted loss increase for removing each weight alone (pruned ones get -1)."""
    w = w.detach().float()
    if curv is None:
        s = 0.5 * w * w  # no curvature: magnitude, as a Fisher of ones
    elif curv.kfac and w.dim() == 2:
        A = _damped(curv.A.float())
        if keep is None or bool(keep.all()):
            inv_diag = torch.linalg.inv(A).diagonal().unsqueeze(0).expand_as(w)  # one inverse serves every row
        else:
            k = keep.bool()
            inv_diag = torch.empty_like(w)
            for sl in _chunks(w.shape[0], w.shape[1]):
                inv_diag[sl] = torch.linalg.inv(_row_systems(A, k[sl])).diagonal(dim1=1, dim2=2)
        s = 0.5 * w * w * curv.G.float().clamp_min(0).unsqueeze(1) / inv_diag.clamp_min(1e-30)
    else:
        s = 0.5 * curv.diag.float().reshape(w.shape) * w * w
    if keep is not None:
        s = torch.where(keep.bool(), s, torch.full_like(s, -1.0))
    return s


def obs_update(w: torch.Tensor, curv: Curvature, keep: torch.Tensor) -> torch.Tensor:
    """Kept weights of each row move to w_K + A_KK^-1 A_KP w_P; pruned ones become 0."""
    w = w.detach().float()
    A = _damped(curv.A.float())
    k = keep.bool()
    out = torch.empty_like(w)
    for sl in _chunks(w.shape[0], w.shape[1]):
        kk = k[sl].float()
        rhs = (w[sl] * (1 - kk)) @ A * kk  # D A (w on the pruned set)
        u = torch.linalg.solve(_row_systems(A, k[sl]), rhs.unsqueeze(-1)).squeeze(-1)
        out[sl] = (w[sl] + u) * kk
    return out


def channel_saliency(w: torch.Tensor, curv: Curvature | None) -> torch.Tensor:
    """Predicted loss increase for removing each output channel (row) whole, without compensation."""
    w2 = w.detach().float().reshape(w.shape[0], -1)
    if curv is not None and curv.kfac and w.dim() == 2:
        return 0.5 * curv.G.float() * ((w2 @ curv.A.float()) * w2).sum(1)
    f = curv.diag.float().reshape(w2.shape) if curv is not None else torch.ones_like(w2)
    return 0.5 * (f * w2 * w2).sum(1)


def _fisher_diag(w: torch.Tensor, curv: Curvature | None) -> torch.Tensor:
    if curv is None:
        return torch.ones_like(w, dtype=torch.float32)
    if curv.kfac and w.dim() == 2:
        return curv.G.float().unsqueeze(1) * curv.A.float().diagonal().unsqueeze(0)
    return curv.diag.float().reshape(w.shape)


def cast(w: torch.Tensor, precision: str) -> torch.Tensor:
    """``w`` as it reads back after storing it in ``precision`` (int8: symmetric, one scale per row)."""
    if precision == "fp16":
        return w.to(torch.float16).to(w.dtype)
    if precision == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    if precision == "int8":
        q, scale = quantize_int8(w)
        return (q.float() * scale.reshape(-1, *([1] * (w.dim() - 1)))).to(w.dtype)
    return w


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = w.detach().float().reshape(w.shape[0], -1)
    scale = (rows.abs().amax(1) / INT8_LEVELS).clamp_min(1e-12)
    q = torch.round(rows / scale.unsqueeze(1)).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return q.reshape(w.shape), scale


def cast_loss(w: torch.Tensor, curv: Curvature | None, precision: str) -> float:
    """Predicted loss increase of a cast: 0.5 * sum F * E[err^2] over the weights."""
    f = _fisher_diag(w, curv)
    err = cast(w.detach().float(), precision) - w.detach().float()
    return float(0.5 * (f * err * err).sum())


def _curve(scores: torch.Tensor, grid: tuple[float, ...]) -> list[float]:
    flat = torch.sort(scores.flatten().clamp_min(0)).values
    cum = torch.cat([torch.zeros(1, device=flat.device), torch.cumsum(flat.double(), 0)])
    idx = torch.tensor([int(round(s * flat.numel())) for s in grid], device=flat.device)
    return [float(v) for v in cum[idx].tolist()]


def layer_profile(name: str, w: torch.Tensor, curv: Curvature | None, grid: tuple[float, ...] = SPARSITY_GRID) -> dict:
    """The wire form of one weight's predicted loss increase per sparsity, per channel sparsity, per cast."""
    s = saliency(w, curv)
    f = _fisher_diag(w, curv)
    method = "magnitude" if curv is None else ("obs-kfac" if curv.kfac else "obd-diagonal")
    return {
        "name": name, "numel": w.numel(), "shape": list(w.shape), "method": method,
        "fisher_mean": float(f.mean()), "saliency_mean": float(s.mean()),
        "sparsities": list(grid), "unstructured": _curve(s, grid), "channels": _curve(channel_saliency(w, curv), grid),
        "precision": {p: cast_loss(w, curv, p) for p in ("fp16", "bf16", "int8")},
    }


def prune_weight(w: torch.Tensor, curv: Curvature | None, sparsity: float, *, structure: str = "unstructured",
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """New values and keep-mask of ``w`` at ``sparsity`` (already pruned weights stay pruned)."""
    w = w.detach()
    keep = torch.ones_like(w, dtype=torch.bool) if keep is None else keep.bool()
    if structure == "channels":
        rows = channel_saliency(w * keep, curv)
        k = int(round(sparsity * w.shape[0]))
        new_keep = keep.clone()
        if k:
            new_keep[torch.argsort(rows)[:k]] = False
        return (w * new_keep).to(w.dtype), new_keep
    k = int(round(sparsity * w.numel()))
    if k <= int((~keep).sum()):
        return (w * keep).to(w.dtype), keep
    s = saliency(w, curv, keep).flatten()
    new_keep = torch.ones(w.numel(), dtype=torch.bool, device=w.device)
    new_keep[torch.argsort(s)[:k]] = False
    new_keep = new_keep.reshape(w.shape) & keep
    if curv is not None and curv.kfac and w.dim() == 2:
        return obs_update(w, curv, new_keep).to(w.dtype), new_keep
    return (w * new_keep).to(w.dtype), new_keep


def cubic_schedule(final: float, round_: int, rounds: int) -> float:
    """Sparsity after ``round_`` of ``rounds``: Zhu & Gupta (2017)'s cubic ramp, fast early, gentle late."""
    return final * (1 - (1 - round_ / rounds) ** 3)
