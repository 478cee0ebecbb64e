"""The parts a server is made of, wired once and handed to the HTTP routes, the MCP tools and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import logging

from .engine import Engine, EngineSettings
from .retention import AgeSweeper, SizeGuard
from ..store import Store

log = logging.getLogger("traindx.server")


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8765
    data_dir: Path = Path(".traindx")
    # The bearer token every route but /health needs. None: the server loads DATA/token, or creates it
    # (0600) on first start; see diag_server/security.py and docs/security.md.
    token: str | None = None
    open_reads: bool = False  # GET routes without the token: only when asked for explicitly
    allowed_hosts: tuple[str, ...] = ()  # extra NAME or NAME:PORT Hosts (DNS rebinding check); '*' switches it off
    allowed_origins: tuple[str, ...] = ()  # extra browser Origins (scheme://host[:port]) beside the server's own
    # Size cap of the data directory in bytes (None: no cap). A warning from 80% of it; ingest is
    # refused with 507 at the cap, so probes spool instead of filling the disk.
    max_data_bytes: int | None = None
    # Runs last heard from longer ago than this (seconds) are deleted (None: kept until deleted by hand).
    max_age_s: float | None = None
    # Ingest requests waiting for the writer at once; beyond it, 503 + Retry-After (probes back off).
    max_pending_ingest: int = 16
    engine: EngineSettings = field(default_factory=EngineSettings)


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.data_dir)
        self.engine = Engine(settings.engine)
        # Checked once at start, reported in /health and the log: a store damaged by a crash says so.
        self.store_status = self.store.integrity()
        if self.store_status != "ok":
            log.error("traindx: the store %s failed its integrity check: %s", self.store.path, self.store_status)
        self.size_guard = SizeGuard(settings.data_dir, settings.max_data_bytes)
        self.pending_ingest = 0  # ingest requests waiting for the writer (changed on the event loop only)
        self.sweeper = (AgeSweeper(self.store, settings.max_age_s, engine=self.engine).start()
                        if settings.max_age_s is not None else None)

    def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
        self.store.close()
