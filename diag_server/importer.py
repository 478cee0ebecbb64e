"""Load event files (FileSink output, spool files) into the store, batch by batch, idempotently."""

from __future__ import annotations

from pathlib import Path

from .errors import ApiError
from .ingest import ingest, parse_batch
from .services import Services


def import_file(services: Services, path: Path) -> tuple[int, int, int]:
    """Return (stored, duplicates, refused) batch counts. A refused line is reported, never half-stored."""
    stored = dup = bad = 0
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                batch = parse_batch(line)
            except ApiError as e:
                bad += 1
                print(f"{path}:{lineno}: {e}")
                continue
            reply = ingest(services.store, services.engine, batch)
            if reply.duplicate:
                dup += 1
            else:
                stored += 1
    return stored, dup, bad
