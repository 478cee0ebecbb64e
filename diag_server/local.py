"""Diagnose a run without a server: load its event batches into a throwaway store and run the same rules.

Used by ``probe.report()`` when the job has no server (``server=False`` writes a local event file). The
probe imports this module only when asked for a report, so a training job never loads the server.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

import orjson

from schemas.events import IngestBatch

from .diagnosis import diagnose
from .engine import Engine
from .ingest import ingest
from .store import Store


def diagnose_batches(batches: Iterable[dict], run: str) -> str:
    """The text report for ``run`` from its batches (dicts in the IngestBatch shape)."""
    with tempfile.TemporaryDirectory(prefix="traindx-report-") as tmp:
        store = Store(tmp)
        try:
            engine = Engine()
            for b in batches:
                if b.get("run") == run:
                    ingest(store, engine, IngestBatch.model_validate(b))
            if store.read().execute("SELECT 1 FROM runs WHERE run=?", (run,)).fetchone() is None:
                return f"Diagnosis of run {run}\nNo events from this run were found."
            return diagnose(store, run).report
        finally:
            store.close()


def diagnose_file(path: str | Path, run: str) -> str:
    lines = Path(path).read_bytes().splitlines()
    return diagnose_batches((orjson.loads(line) for line in lines if line.strip()), run)
