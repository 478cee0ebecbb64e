"""A run's own configuration (``probes.attach(config=...)``) made into what the wire accepts: dotted keys, bounded values.

The server refuses a batch whole when one field is out of bounds (schemas.events.RunConfig), and a
refused run_start would cost the run its start. So nothing here raises on a value: whatever a job passes
(nested dicts, dataclasses, enums, paths, dtypes, tuples, a NaN) comes out as a value the wire takes, and
only what cannot be told apart from a mistake (``config`` that is not a mapping at all) is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import re
from typing import Any, Mapping

from schemas.events import INT64_MAX, MAX_CONFIG_KEYS, MAX_CONFIG_LIST, MAX_CONFIG_TEXT

MAX_DEPTH = 8  # deeper than this, a value is kept as its text: no configuration nests that far on purpose
_LIST_ITEM_TEXT = 256
_CONTROL = re.compile(r"[\x00-\x1f]")


def as_mapping(value: Any) -> Mapping[str, Any] | None:
    """The mapping a value stands for: a dict, a dataclass instance, an argparse namespace; else None."""
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, argparse.Namespace):
        return vars(value)
    return None


def _text(value: Any, limit: int = MAX_CONFIG_TEXT) -> str:
    text = value if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _number(value: Any) -> int | float | None:
    if isinstance(value, int):
        return value if -INT64_MAX - 1 <= value <= INT64_MAX else float(value)
    value = float(value)
    return value if math.isfinite(value) else None  # the wire's null: NaN or infinite


def _scalar(value: Any) -> Any:
    """A scalar the wire takes: bool, int64, finite float, bounded text or None."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return _number(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():  # a numpy scalar, a 0-d array or tensor
        try:
            return _scalar(item())
        except Exception:  # noqa: BLE001 - a strange object: its text will do
            pass
    if isinstance(value, os.PathLike):
        return _text(os.fspath(value))
    return _text(value)


def _value(value: Any) -> Any:
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value) if not isinstance(value, (set, frozenset)) else sorted(value, key=str)
        items = [x.value if isinstance(x, enum.Enum) else x for x in items]
        if len(items) <= MAX_CONFIG_LIST:
            if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
                return [float(x) if math.isfinite(float(x)) else None for x in items]
            if all(isinstance(x, str) for x in items):
                return [_text(_CONTROL.sub(" ", x), _LIST_ITEM_TEXT) for x in items]
        return _text(value)  # long or mixed: kept as its text, cut at the bound and marked so
    return _scalar(value)


def _key(parts: list[str]) -> str:
    key = _CONTROL.sub(" ", ".".join(parts)) or "_"
    return key if len(key) <= 256 else key[:255] + "…"


def flatten(config: Any) -> tuple[dict[str, Any], int]:
    """``config`` as the wire's RunConfig, and how many keys were left out past MAX_CONFIG_KEYS.

    Nested mappings (and dataclasses, argparse namespaces) become dotted keys: ``{"optim": {"lr": 3e-4}}``
    -> ``{"optim.lr": 0.0003}``. Raises TypeError when ``config`` is not a mapping (or one of those)."""
    top = as_mapping(config)
    if top is None:
        raise TypeError(f"config must be a mapping of names to values (a dict, a dataclass, an argparse "
                        f"namespace), got {type(config).__name__}")
    out: dict[str, Any] = {}
    dropped = 0

    def walk(mapping: Mapping[Any, Any], parts: list[str], depth: int) -> None:
        nonlocal dropped
        for k, v in mapping.items():
            path = [*parts, str(k)]
            inner = as_mapping(v) if depth < MAX_DEPTH else None
            if inner is not None and inner:
                walk(inner, path, depth + 1)
                continue
            key = _key(path)
            if key in out:
                continue  # two paths that read the same ("a.b" and {"a": {"b"}}): the first one stays
            if len(out) >= MAX_CONFIG_KEYS:
                dropped += 1
                continue
            out[key] = _value(v) if inner is None else None  # an empty mapping: a key set to nothing
    walk(top, [], 0)
    return out, dropped
