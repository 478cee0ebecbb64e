"""A store is opened at the schema version this traindx knows: older ones are migrated in place, each
migration once; one written by a newer traindx is refused with a clear error and left untouched."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from diag_server.store import SCHEMA_VERSION, SchemaError, Store
from tests.conftest import ROOT


def _columns(path, table: str) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


def _dump(path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return list(conn.iterdump())


def test_a_store_from_before_versions_is_migrated_and_keeps_its_rows(tmp_path) -> None:
    path = tmp_path / "traindx.sqlite"
    with sqlite3.connect(path) as conn:  # the first release's tables: no rank column, no version recorded
        conn.executescript("""
            CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);
            CREATE TABLE runs(run TEXT PRIMARY KEY, created_at REAL, last_seen REAL, last_step INTEGER DEFAULT 0,
                              ended INTEGER DEFAULT 0, start TEXT);
            CREATE TABLE scalars(run TEXT, step INTEGER, name TEXT, value REAL, time REAL);
            INSERT INTO runs(run, created_at, last_seen) VALUES ('old', 1.0, 2.0);
            INSERT INTO scalars VALUES ('old', 7, 'loss', 0.5, 2.0);
        """)
    store = Store(tmp_path)
    try:
        assert store.schema_version == SCHEMA_VERSION
        row = store.read().execute("SELECT step, value, rank FROM scalars WHERE run='old'").fetchone()
        assert tuple(row) == (7, 0.5, 0)  # the old row reads as rank 0
        assert "rank" in _columns(path, "stats") and "rank" in _columns(path, "messages")
    finally:
        store.close()
    again = Store(tmp_path)  # each migration ran once: opening again changes nothing
    try:
        assert again.read().execute("SELECT count(*) FROM scalars").fetchone()[0] == 1
    finally:
        again.close()


def test_a_store_from_a_newer_traindx_is_refused_untouched(tmp_path) -> None:
    Store(tmp_path).close()
    path = tmp_path / "traindx.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    before = _dump(path)
    with pytest.raises(SchemaError, match="newer traindx"):
        Store(tmp_path)
    assert _dump(path) == before
    (tmp_path / "none.jsonl").write_text("")
    out = subprocess.run([sys.executable, "-m", "diag_server.cli", "import", str(tmp_path / "none.jsonl"),
                          "--data", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1 and "newer traindx" in out.stderr and "Traceback" not in out.stderr
    assert _dump(path) == before
