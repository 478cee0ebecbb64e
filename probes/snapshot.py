"""Evidence on demand, in the job: bounded slices of named tensors, taken at a step boundary.

The server asks (a ``snapshot`` command on the ingest reply) when a critical anomaly opens. A parameter
name gives its values and its gradient now; a module name (or ``<input>``/``<output>``) arms a one-shot
forward hook, so the slice is of the next forward pass and is sent at the step boundary after it.
Nothing here runs unless the server asked.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from .stats import local

MAX_TENSORS = 8
MAX_ELEMENTS = 256


def tensor_slice(name: str, source: str, t: torch.Tensor, max_elements: int) -> dict:
    """Up to ``max_elements`` values of ``t`` (of this rank's shard, for a sharded parameter: see stats.local).
    A sparse tensor (an embedding's sparse gradient) is sliced as its dense layout, never densified whole."""
    t = local(t.detach())
    if t.is_sparse:
        return _sparse_slice(name, source, t, max_elements)
    flat = t.reshape(-1)
    bad = ~torch.isfinite(flat) if flat.is_floating_point() else torch.zeros_like(flat, dtype=torch.bool)
    first_bad = bad.nonzero()
    # Centre the slice on the first NaN/Inf: that is where the evidence is.
    offset = max(int(first_bad[0]) - max_elements // 2, 0) if first_bad.numel() else 0
    values = flat[offset:offset + max_elements].float().tolist()
    return _slice_event(name, source, t, flat.numel(), offset, values, flat)


def _sparse_slice(name: str, source: str, t: torch.Tensor, max_elements: int) -> dict:
    """tensor_slice of a sparse COO tensor: its stored entries are blocks of the flattened dense layout (a
    row of an embedding's gradient); the slice is centred on the first entry holding a NaN/Inf, else starts
    at the first stored entry (the rows of a sparse gradient are where it says anything), zeros between."""
    t = t.coalesce()
    idx, vals = t.indices(), t.values()
    block = math.prod(vals.shape[1:])  # elements of one entry (its dense dims: an embedding row)
    # Each entry's first position in the flattened dense layout: its sparse index, row-major, times a block.
    sparse_dims = idx.shape[0]
    strides = torch.tensor([math.prod(t.shape[d + 1:sparse_dims]) for d in range(sparse_dims)], device=idx.device)
    starts = (idx * strides[:, None]).sum(0) * block
    flat_vals = vals.reshape(vals.shape[0], block)
    floating = vals.is_floating_point()
    bad = ~torch.isfinite(flat_vals) if floating else torch.zeros_like(flat_vals, dtype=torch.bool)
    first_bad = bad.reshape(-1).nonzero()
    if first_bad.numel():
        e, i = divmod(int(first_bad[0]), block)
        offset = max(int(starts[e]) + i - max_elements // 2, 0)
    else:
        offset = int(starts[0]) if starts.numel() else 0
    out = torch.zeros(max_elements, dtype=torch.float32)
    hit = ((starts < offset + max_elements) & (starts + block > offset)).nonzero().reshape(-1)
    for e in hit.tolist():  # at most max_elements / block + 2 entries
        start = int(starts[e])
        lo, hi = max(start, offset), min(start + block, offset + max_elements)
        out[lo - offset:hi - offset] = flat_vals[e, lo - start:hi - start].float()
    numel = t.numel()
    values = out[:max(min(max_elements, numel - offset), 0)].tolist()
    return _slice_event(name, source, t, numel, offset, values, vals)


def _slice_event(name: str, source: str, t: torch.Tensor, numel: int, offset: int, values: list[float],
                 stored: torch.Tensor) -> dict:
    """The slice's event; its NaN and inf counts are those of ``stored``, the tensor's values."""
    floating = stored.is_floating_point()
    return {"name": name, "source": source, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
            "numel": numel, "offset": offset,
            "values": [v if v == v and abs(v) != float("inf") else None for v in values],
            "nan_count": int(torch.isnan(stored).sum()) if floating else 0,
            "inf_count": int(torch.isinf(stored).sum()) if floating else 0}


class Snapshots:
    def __init__(self, model: torch.nn.Module, params: list[tuple[str, torch.nn.Parameter]],
                 on_ready: Callable[[], None] | None = None) -> None:
        self.model = model
        self.on_ready = on_ready  # called (from the forward hook) when a request's slices are all taken
        self.params = dict(params)
        self.modules = dict(model.named_modules())
        self._waiting: list[dict] = []  # requests whose activations come with the next forward
        self.ready: list[dict] = []  # events to send at the next step boundary

    def request(self, cmd: dict, step: int) -> dict | None:
        """Answer now (parameters only), or arm hooks and answer after the next forward."""
        params = cmd.get("params") or {}
        names = [str(n) for n in (params.get("tensors") or [])][:MAX_TENSORS]
        limit = max(1, min(int(params.get("max_elements") or 64), MAX_ELEMENTS))
        ev = {"kind": "tensor_snapshot", "step": step, "time": time.time(), "request_id": str(cmd.get("fix_id")),
              "tensors": [], "missing": []}
        handles: list[Any] = []
        pending = {"event": ev, "handles": handles, "left": 0, "done": set()}
        for name in names:
            if name in self.params:
                p = self.params[name]
                try:  # a tensor that cannot be read is missing, and the rest of the answer still goes
                    ev["tensors"].append(tensor_slice(name, "parameter", p, limit))
                    if p.grad is not None:
                        ev["tensors"].append(tensor_slice(name, "gradient", p.grad, limit))
                except Exception:  # noqa: BLE001
                    ev["missing"].append(name)
            elif name in ("<input>", "<output>") or name in self.modules:
                pending["left"] += 1
                handles.append(self._arm(name, limit, pending))
            else:
                ev["missing"].append(name)
        ev["tensors"] = ev["tensors"][:16]
        if not pending["left"]:
            return ev
        self._waiting.append(pending)
        return None

    def _arm(self, name: str, limit: int, pending: dict) -> Any:
        def record(y: Any) -> None:
            try:  # runs inside the model's forward: it must never raise there
                if pending["left"] <= 0 or name in pending["done"]:
                    return
                pending["done"].add(name)
                if isinstance(y, (tuple, list)) and y:
                    y = y[0]
                if isinstance(y, torch.Tensor) and len(pending["event"]["tensors"]) < 16:
                    pending["event"]["tensors"].append(tensor_slice(name, "activation", y, limit))
                else:
                    pending["event"]["missing"].append(name)
            except Exception:  # noqa: BLE001
                pending["event"]["missing"].append(name)
            pending["left"] -= 1
            if pending["left"] <= 0 and self.on_ready is not None:
                self.on_ready()

        if name == "<input>":
            return self.model.register_forward_pre_hook(lambda m, args: record(args[0] if args else None))
        target = self.model if name == "<output>" else self.modules[name]
        return target.register_forward_hook(lambda m, args, out: record(out))

    def poll(self) -> list[dict]:
        """Requests whose forward pass has happened: remove their hooks and hand back their events."""
        done = [p for p in self._waiting if p["left"] <= 0]
        if not done:
            return []
        self._waiting = [p for p in self._waiting if p["left"] > 0]
        for p in done:
            for h in p["handles"]:
                h.remove()
        return [p["event"] for p in done]

    def close(self) -> None:
        for p in self._waiting:
            for h in p["handles"]:
                h.remove()
        self._waiting = []
