"""traindx probes: look inside a running PyTorch training job.

    import probes
    probe = probes.attach(model, optimizer, run="exp-1")
    for x, y in loader:
        ...; loss.backward(); optimizer.step()
        probe.step(loss=loss)
    probe.close()

This package imports torch, httpx, orjson and the schemas' enums: never the server, FastAPI, SQLite or lxml.
"""

from __future__ import annotations

from .probe import DEFAULT_COLLECTIONS, DEFAULT_INTERVAL, DEFAULT_SERVER, Probe, attach
from .sampling import every
from .sinks import FileSink, HttpSink, MemorySink, Sink, SinkError

__all__ = [
    "DEFAULT_COLLECTIONS", "DEFAULT_INTERVAL", "DEFAULT_SERVER", "FileSink", "HttpSink", "MemorySink",
    "Probe", "Sink", "SinkError", "attach", "every",
]
