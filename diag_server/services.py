"""The parts a server is made of, wired once and handed to the HTTP routes, the MCP tools and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .engine import Engine, EngineSettings
from .store import Store


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8765
    data_dir: Path = Path(".traindx")
    token: str | None = None  # when set, ingest and every write route need 'Authorization: Bearer <token>'
    engine: EngineSettings = field(default_factory=EngineSettings)


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.data_dir)
        self.engine = Engine(settings.engine)

    def close(self) -> None:
        self.store.close()
