"""Load event files (FileSink output, spool files, exports) into the store, batch by batch, idempotently."""

from __future__ import annotations

from pathlib import Path

from ..errors import ApiError
from .ingest import MAX_BODY_BYTES, ingest, parse_batch
from .services import Services


def _lines(fh):  # noqa: ANN001, ANN202
    """(line number, line or None when longer than an ingest body may be), without reading more than that."""
    lineno = 0
    while True:
        line = fh.readline(MAX_BODY_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_BODY_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of the oversized line in bounded chunks
                rest = fh.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield lineno, None
            continue
        yield lineno, line


def import_file(services: Services, path: Path) -> tuple[int, int, int]:
    """Return (stored, duplicates, refused) batch counts. A refused line is reported, never half-stored."""
    stored = dup = bad = 0
    with open(path, "rb") as fh:
        for lineno, line in _lines(fh):
            if line is None:
                bad += 1
                print(f"{path}:{lineno}: the line is longer than {MAX_BODY_BYTES} bytes; skipped")
                continue
            if not line.strip():
                continue
            if line.lstrip().startswith(b'{"record"'):
                continue  # derived records of an export: the rules derive them again from the events
            try:
                batch = parse_batch(line)
            except ApiError as e:
                bad += 1
                print(f"{path}:{lineno}: {e}"[:2000])
                continue
            reply = ingest(services.store, services.engine, batch)
            if reply.duplicate:
                dup += 1
            else:
                stored += 1
    return stored, dup, bad
