"""Where a probe's batches go: one method, ``send(batch) -> reply``, as httpx transports have one.

``HttpSink`` posts to a server, ``FileSink`` appends to a JSON-lines file that ``traindx import`` loads,
``MemorySink`` keeps batches in a list for tests. A sink raises ``SinkError`` when a batch did not
arrive (the sender then spools it); any reply it returns means the batch is stored.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol

import orjson


class SinkError(Exception):
    """The batch did not reach its destination; retry it later (not before ``retry_after`` seconds)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


MAX_RETRY_AFTER = 300.0  # a server asking for a longer pause than this is obeyed for this long


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER)
    except ValueError:
        pass
    try:  # the HTTP-date form
        from email.utils import parsedate_to_datetime
        import time as _time

        return min(max(parsedate_to_datetime(value).timestamp() - _time.time(), 0.0), MAX_RETRY_AFTER)
    except (TypeError, ValueError, OverflowError):
        return None


def default_token() -> str | None:
    """TRAINDX_TOKEN, else the token file the server wrote in its data directory (TRAINDX_DATA or .traindx)."""
    token = os.environ.get("TRAINDX_TOKEN")
    if token:
        return token.strip()
    try:
        return (Path(os.environ.get("TRAINDX_DATA", ".traindx")) / "token").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


class Sink(Protocol):
    def send(self, batch: dict) -> dict: ...

    def close(self) -> None: ...


def dumps(batch: dict) -> bytes:
    # Non-finite floats are already null by the time they get here (see probes.stats); orjson would
    # turn any stray one into null too, never into invalid JSON.
    return orjson.dumps(batch)


class HttpSink:
    def __init__(self, server: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        import httpx

        self.server = server.rstrip("/")
        headers = {"content-type": "application/json"}
        token = token if token is not None else default_token()
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=self.server, headers=headers, timeout=timeout)

    def send(self, batch: dict) -> dict:
        import httpx

        try:
            r = self._client.post("/v1/ingest", content=dumps(batch))
        except httpx.HTTPError as e:
            raise SinkError(f"{self.server}: {e.__class__.__name__}: {e}") from None
        if r.status_code >= 500 or r.status_code in (408, 429):
            # 503/429/507 are the server's back-pressure: keep the batch, retry after the delay it asks for.
            raise SinkError(f"{self.server} answered {r.status_code}", _retry_after(r.headers.get("retry-after")))
        if r.status_code in (401, 403, 421):
            # Not the batch's fault: a missing or wrong token, or a Host the server does not accept. The
            # batch is kept (spooled) until someone fixes the configuration.
            raise SinkError(f"{self.server} refused us ({r.status_code}): {r.text[:300]}; set TRAINDX_TOKEN "
                            "to the server's token (in its DATA/token)")
        if r.status_code >= 400:
            # A 4xx will not get better on retry: the batch is malformed. Report, do not spool forever.
            raise RejectedBatch(f"{self.server} refused the batch ({r.status_code}): {r.text[:500]}")
        try:
            reply = orjson.loads(r.content)
        except orjson.JSONDecodeError:
            raise SinkError(f"{self.server} answered {r.status_code} with a body that is not JSON") from None
        if not isinstance(reply, dict):
            raise SinkError(f"{self.server} answered {r.status_code} with JSON that is not an ingest reply")
        return reply

    def close(self) -> None:
        self._client.close()


class RejectedBatch(Exception):
    """The server refused the batch as malformed; sending it again would not help."""


class FileSink:
    """Appends each batch as one JSON line; ``traindx import FILE`` loads it into a server's store."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "ab")
        self._lock = threading.Lock()

    def send(self, batch: dict) -> dict:
        with self._lock:
            self._fh.write(dumps(batch) + b"\n")
            self._fh.flush()
        return {"accepted": len(batch["events"]), "commands": []}

    def close(self) -> None:
        self._fh.close()


class MemorySink:
    """Keeps every batch; ``commands`` are handed to the probe on the next send, for tests."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.commands: list[dict] = []
        self._lock = threading.Lock()

    def send(self, batch: dict) -> dict:
        with self._lock:
            self.batches.append(orjson.loads(dumps(batch)))
            commands, self.commands = self.commands, []
        return {"accepted": len(batch["events"]), "commands": commands}

    @property
    def events(self) -> list[dict]:
        with self._lock:
            return [e for b in self.batches for e in b["events"]]

    def close(self) -> None:
        pass
