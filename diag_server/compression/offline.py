"""Offline compression: apply a recipe to a checkpoint and write a file that is really smaller.

A pruned ``state_dict`` saved as-is is as big as the dense one (zeros take four bytes too). Here each
weight in the recipe is stored as a 1-bit mask of its kept positions (packed, 8 per byte) plus the kept
values only, in the precision the recipe chose: fp32, fp16, bf16, or int8 with one fp32 scale per
output row (symmetric). Everything else is kept as it was. ``load_compressed`` rebuilds the dense
``state_dict`` (and loads it into a model when given one).

A weight that the live ``prune`` fix already pruned keeps its mask (its zeros); a weight the recipe
asks to prune further is pruned here by magnitude within the layer (the checkpoint carries no Fisher:
the OBS-chosen masks come from pruning live).

    from diag_server.compress import compress, load_compressed
    report = compress("model.pt", "recipe.json", "small.pt")
    model.load_state_dict(load_compressed("small.pt"))
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping

import torch

FORMAT = "traindx-compressed/1"
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class CompressError(Exception):
    """The checkpoint or the recipe cannot be used; the message says why."""


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, torch.zeros(pad, dtype=torch.uint8)])
    return (flat.reshape(-1, 8) * _BITS).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    bits = (packed.unsqueeze(1) & _BITS) > 0
    return bits.reshape(-1)[:numel]


def _prune_to(w: torch.Tensor, sparsity: float, structure: str) -> torch.Tensor:
    """Keep-mask of ``w`` with at least ``sparsity`` zeros; existing zeros stay zeros."""
    keep = w != 0
    if structure == "channels":
        rows = w.reshape(w.shape[0], -1).norm(dim=1)
        k = int(round(sparsity * w.shape[0]))
        if k:
            keep[torch.argsort(rows)[:k]] = False
        return keep
    k = int(round(sparsity * w.numel()))
    if k > int((~keep).sum()):
        scores = torch.where(keep, w.abs().float(), torch.full_like(w, -1.0, dtype=torch.float32)).reshape(-1)
        flat = torch.ones(w.numel(), dtype=torch.bool)
        flat[torch.argsort(scores)[:k]] = False
        keep = flat.reshape(w.shape) & keep
    return keep


def _encode(w: torch.Tensor, sparsity: float, precision: str, structure: str) -> dict:
    w = w.detach().cpu()
    keep = _prune_to(w, sparsity, structure)
    entry: dict[str, Any] = {"shape": list(w.shape), "dtype": str(w.dtype).replace("torch.", ""),
                             "precision": precision, "mask": pack_bits(keep)}
    kept = (w.float() * keep)
    if precision == "int8":
        rows = kept.reshape(w.shape[0], -1)
        scale = (rows.abs().amax(1) / 127).clamp_min(1e-12)
        q = torch.round(rows / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8).reshape(w.shape)
        entry["values"], entry["scale"] = q[keep].clone(), scale
    elif precision in _DTYPES:
        entry["values"] = kept[keep].to(_DTYPES[precision]).clone()
    else:
        raise CompressError(f"unknown precision {precision!r}; use fp32, fp16, bf16 or int8")
    return entry


def _decode(entry: Mapping[str, Any]) -> torch.Tensor:
    shape = entry["shape"]
    numel = 1
    for d in shape:
        numel *= d
    keep = unpack_bits(entry["mask"], numel).reshape(shape)
    values = entry["values"].float()
    if entry["precision"] == "int8":
        rows = torch.arange(shape[0]).reshape(-1, *([1] * (len(shape) - 1))).expand(shape)
        values = values * entry["scale"][rows[keep]]
    out = torch.zeros(shape, dtype=torch.float32)
    out[keep] = values
    return out.to(getattr(torch, entry["dtype"]))


def _as_recipe(recipe: Any) -> dict:
    if isinstance(recipe, (str, os.PathLike)):
        try:
            recipe = json.loads(Path(recipe).read_text())
        except (OSError, ValueError) as e:
            raise CompressError(f"cannot read the recipe {recipe}: {e}") from None
    if hasattr(recipe, "model_dump"):
        recipe = recipe.model_dump(mode="json")
    if not isinstance(recipe, dict) or not isinstance(recipe.get("layers"), list):
        raise CompressError("the recipe must be a CompressionRecipe (JSON with a 'layers' list)")
    return recipe


def pack(state_dict: Mapping[str, torch.Tensor], recipe: Any) -> dict:
    """The compressed form of ``state_dict`` under ``recipe`` (a CompressionRecipe, its JSON, or a path)."""
    r = _as_recipe(recipe)
    layers = {l["name"]: l for l in r["layers"]}
    missing = [n for n in layers if n not in state_dict]
    if missing:
        raise CompressError(f"the recipe names tensors the checkpoint does not have: {missing[:5]}")
    tensors: dict[str, Any] = {}
    for name, t in state_dict.items():
        l = layers.get(name)
        if l is None or not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() < 1:
            tensors[name] = {"raw": t.detach().cpu() if isinstance(t, torch.Tensor) else t}
        else:
            tensors[name] = _encode(t, float(l.get("sparsity", 0.0)), l.get("precision", "fp32"),
                                    l.get("structure", "unstructured"))
    return {"format": FORMAT, "tensors": tensors, "recipe": {k: r.get(k) for k in ("run", "method", "target_sparsity")}}


def unpack(packed: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if packed.get("format") != FORMAT:
        raise CompressError(f"not a {FORMAT} file (format={packed.get('format')!r})")
    return {n: (e["raw"] if "raw" in e else _decode(e)) for n, e in packed["tensors"].items()}


def serialized_size(obj: Any) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer().nbytes


def load_compressed(path: str | os.PathLike, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The dense state_dict stored in a compressed file; loaded into ``model`` too when given."""
    state = unpack(torch.load(path, map_location="cpu", weights_only=True))
    if model is not None:
        model.load_state_dict(state)
    return state


def _load_checkpoint(path: str | os.PathLike, trust: bool) -> tuple[dict[str, torch.Tensor], torch.nn.Module | None]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a file it cannot read
        hint = "" if trust else " (a pickled nn.Module needs --trust-checkpoint)"
        raise CompressError(f"cannot load {path}: {type(e).__name__}: {str(e)[:300]}{hint}") from None
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict(), obj
    if isinstance(obj, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(obj.get(key), dict):
                return obj[key], None
        if all(isinstance(v, torch.Tensor) for v in obj.values()):
            return obj, None
    raise CompressError(f"{path} holds neither a state_dict nor an nn.Module")


def latency_ms(model: torch.nn.Module, x: torch.Tensor, repeats: int = 50) -> float:
    """Median forward time in milliseconds (after a warm-up)."""
    model.eval()
    times = []
    with torch.no_grad():
        for _ in range(5):
            model(x)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]


def compress(checkpoint: str | os.PathLike, recipe: Any, out: str | os.PathLike, *, trust: bool = False,
             batch: int = 256) -> dict:
    """Write ``out``; return the measured sizes (and latencies when the checkpoint is a whole model)."""
    state, model = _load_checkpoint(checkpoint, trust)
    packed = pack(state, recipe)
    torch.save(packed, out)
    t0 = time.perf_counter()
    rebuilt = load_compressed(out)
    load_ms = 1000 * (time.perf_counter() - t0)
    layers = []
    for name, e in packed["tensors"].items():
        if "mask" in e:
            numel = int(torch.tensor(e["shape"]).prod())
            layers.append({"name": name, "sparsity": round(1 - e["values"].numel() / max(numel, 1), 4),
                           "precision": e["precision"]})
    report = {"checkpoint": str(checkpoint), "out": str(out), "dense_bytes": os.path.getsize(checkpoint),
              "dense_state_dict_bytes": serialized_size({k: v for k, v in state.items()}),
              "compressed_bytes": os.path.getsize(out), "load_ms": round(load_ms, 3), "layers": layers}
    report["ratio"] = round(report["compressed_bytes"] / report["dense_state_dict_bytes"], 4)
    if model is not None:
        first = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
        if first is not None:
            x = torch.randn(batch, first.in_features)
            import copy
            small = copy.deepcopy(model)
            small.load_state_dict(rebuilt)
            # Alternate the two, five rounds, and take medians: a shared CPU drifts between measurements.
            dense_ms, small_ms = [], []
            for _ in range(5):
                dense_ms.append(latency_ms(model, x, repeats=20))
                small_ms.append(latency_ms(small, x, repeats=20))
            report["latency_ms"] = {"dense": round(sorted(dense_ms)[2], 4), "compressed": round(sorted(small_ms)[2], 4),
                                    "batch": batch}
    return report
