"""The store's schema and its versioned migrations.

The version a store is at lives in its ``meta`` table (``schema_version``). Opening a store runs, in
order and each in its own transaction, the migrations it has not had; a store written by a newer
traindx (a version this one does not know) is refused rather than read wrongly. A store made before
versions were recorded is brought up to date by the same migrations, which is why the early ones only
create what is missing.

To change the schema: append a Migration with the next version, never edit a released one.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Callable

# Columns of the stats table beyond (run, step, collection, tensor), in StatRow's field order.
STAT_COLUMNS = ("numel", "norm", "mean", "std", "min", "max", "nan_count", "inf_count", "zero_frac",
                "dead_frac", "saturated_frac", "update_ratio")

BASELINE = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs(
    run TEXT PRIMARY KEY, created_at REAL, last_seen REAL, last_step INTEGER DEFAULT 0,
    ended INTEGER DEFAULT 0, start TEXT);
CREATE TABLE IF NOT EXISTS batches(
    batch_id TEXT PRIMARY KEY, run TEXT, seq INTEGER, received REAL, events INTEGER);
CREATE TABLE IF NOT EXISTS scalars(run TEXT, step INTEGER, name TEXT, value REAL, time REAL, rank INTEGER DEFAULT 0);
CREATE INDEX IF NOT EXISTS scalars_by_name ON scalars(run, name, step);
CREATE TABLE IF NOT EXISTS stats(
    run TEXT, step INTEGER, collection TEXT, tensor TEXT, numel INTEGER, norm REAL, mean REAL, std REAL,
    min REAL, max REAL, nan_count INTEGER, inf_count INTEGER, zero_frac REAL, dead_frac REAL,
    saturated_frac REAL, update_ratio REAL, rank INTEGER DEFAULT 0);
CREATE INDEX IF NOT EXISTS stats_by_tensor ON stats(run, collection, tensor, step);
CREATE INDEX IF NOT EXISTS stats_by_step ON stats(run, step);
CREATE TABLE IF NOT EXISTS messages(run TEXT, step INTEGER, time REAL, level TEXT, text TEXT, rank INTEGER DEFAULT 0);
CREATE INDEX IF NOT EXISTS messages_by_run ON messages(run);
CREATE TABLE IF NOT EXISTS anomalies(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, run TEXT, kind TEXT, severity TEXT, status TEXT,
    first_step INTEGER, last_step INTEGER, resolved_step INTEGER, tensors TEXT, message TEXT, evidence TEXT,
    rule TEXT, key TEXT, created_at REAL, updated_at REAL, snapshot TEXT);
CREATE INDEX IF NOT EXISTS anomalies_by_run ON anomalies(run, status, kind);
CREATE TABLE IF NOT EXISTS fixes(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, run TEXT, anomaly_id TEXT, action TEXT, params TEXT,
    rationale TEXT, expected_effect TEXT, risk TEXT, live INTEGER, rank INTEGER, status TEXT, reason TEXT,
    requested_by TEXT, created_at REAL, updated_at REAL, applied_step INTEGER, before TEXT, after TEXT,
    pending_op TEXT, verify TEXT);
CREATE INDEX IF NOT EXISTS fixes_by_run ON fixes(run, status);
CREATE TABLE IF NOT EXISTS audit(run TEXT, time REAL, actor TEXT, action TEXT, fix_id TEXT, detail TEXT);
CREATE INDEX IF NOT EXISTS audit_by_run ON audit(run, time);
CREATE TABLE IF NOT EXISTS layer_profiles(
    run TEXT, source TEXT, name TEXT, step INTEGER, data TEXT, PRIMARY KEY(run, source, name));
CREATE TABLE IF NOT EXISTS rule_state(run TEXT, rule TEXT, state TEXT, PRIMARY KEY(run, rule));
CREATE TABLE IF NOT EXISTS embedding_tables(
    run TEXT, rank INTEGER, name TEXT, step INTEGER, summary TEXT, PRIMARY KEY(run, rank, name));
CREATE TABLE IF NOT EXISTS snapshots(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, run TEXT, anomaly_id TEXT, tensors TEXT, status TEXT,
    created_at REAL, updated_at REAL, step INTEGER);
CREATE TABLE IF NOT EXISTS ranks(
    run TEXT, rank INTEGER, local_rank INTEGER DEFAULT 0, host TEXT DEFAULT '', world_size INTEGER DEFAULT 1,
    last_seen REAL, last_step INTEGER DEFAULT 0, ended INTEGER DEFAULT 0, PRIMARY KEY(run, rank));
CREATE TABLE IF NOT EXISTS spans(
    run TEXT, rank INTEGER, step INTEGER, mode TEXT, name TEXT, category TEXT, start REAL, duration REAL,
    gpu_duration REAL);
CREATE INDEX IF NOT EXISTS spans_by_step ON spans(run, step, rank);
CREATE TABLE IF NOT EXISTS fix_acks(fix_id TEXT, op TEXT, rank INTEGER, status TEXT, reason TEXT,
    PRIMARY KEY(fix_id, op, rank));
CREATE TABLE IF NOT EXISTS captures(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, run TEXT, steps INTEGER, profile INTEGER, status TEXT,
    requested_by TEXT, created_at REAL, updated_at REAL);
CREATE TABLE IF NOT EXISTS capture_results(
    capture_id TEXT, run TEXT, rank INTEGER, status TEXT, reason TEXT, first_step INTEGER, last_step INTEGER,
    profiled INTEGER, ops TEXT, shapes TEXT, trace TEXT, trace_dropped TEXT, PRIMARY KEY(capture_id, rank));
"""


class SchemaError(RuntimeError):
    """The store cannot be used by this version of traindx (written by a newer one)."""


@dataclass(frozen=True)
class Migration:
    version: int
    what: str
    apply: Callable[[sqlite3.Connection], None]


def add_column(conn: sqlite3.Connection, table: str, column: str, decl: str) -> None:
    """ALTER TABLE ... ADD COLUMN, unless the table has it already (a store from before versions)."""
    if column not in {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}:
        conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")


def _baseline(conn: sqlite3.Connection) -> None:
    for statement in BASELINE.split(";"):
        if statement.strip():
            conn.execute(statement)


def _ranks(conn: sqlite3.Connection) -> None:
    # Rows already there read as rank 0, which is what a one-process run is.
    for table in ("scalars", "stats", "messages"):
        add_column(conn, table, "rank", "INTEGER DEFAULT 0")


def _quantiles(conn: sqlite3.Connection) -> None:
    # Rows already there read as NULL: no quantiles sent, which the distribution chart draws as min-max.
    add_column(conn, "stats", "quantiles", "BLOB")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "the tables of the first release", _baseline),
    Migration(2, "a rank on every scalar, statistic and message (multi-process runs)", _ranks),
    Migration(3, "a tensor's value quantiles on its stats rows (the dashboard's distributions)", _quantiles),
)
LATEST = MIGRATIONS[-1].version


def version_of(conn: sqlite3.Connection) -> int:
    """The store's schema version: 0 for an empty file (or one from before versions were recorded)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else 0


def migrate(conn: sqlite3.Connection) -> int:
    """Bring the store at ``conn`` (autocommit mode) to LATEST; the version it is at afterwards."""
    have = version_of(conn)
    if have > LATEST:
        raise SchemaError(f"this store is at schema version {have}, written by a newer traindx; this one "
                          f"knows versions up to {LATEST}: upgrade traindx to open it")
    for m in MIGRATIONS:
        if m.version <= have:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            m.apply(conn)
            conn.execute("INSERT INTO meta(key, value) VALUES ('schema_version', ?) "
                         "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (str(m.version),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return max(have, LATEST)
