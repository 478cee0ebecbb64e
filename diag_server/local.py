"""Diagnose a run without a server: load its event batches into a throwaway store and run the same rules.

Used by ``traindx report FILE --run RUN``, which ``probe.report()`` runs in a child process when the job
has no server (``server=False`` writes a local event file): a training job never loads the server.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterable

import orjson

from schemas.events import IngestBatch

from .read.diagnosis import diagnose
from .pipeline.engine import Engine
from .pipeline.ingest import ingest
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


def diagnose_files(paths: Iterable[str | Path], run: str) -> str:
    """The text report for ``run`` from event files or spools (one batch per line; a torn last line, as a
    crash leaves in a spool, is skipped)."""

    def batches() -> Iterable[dict]:
        for path in paths:
            for line in Path(path).read_bytes().splitlines():
                try:
                    yield orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue

    return diagnose_batches(batches(), run)
