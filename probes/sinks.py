"""Where a probe's batches go: one method, ``send(batch) -> reply``, as httpx transports have one.

``HttpSink`` posts to a server, ``FileSink`` appends to a JSON-lines file that ``traindx import`` loads,
``MemorySink`` keeps batches in a list for tests. A sink raises ``SinkError`` when a batch did not
arrive (the sender then spools it); any reply it returns means the batch is stored.
"""

from __future__ import annotations

import os
import threading
from functools import partial
from http.client import HTTPConnection, HTTPException, HTTPSConnection, RemoteDisconnected
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

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
    """TRAINDX_TOKEN, else the token file the server wrote in its data directory (TRAINDX_DATA or .traindx):
    ``schemas.auth.find_token``, the rule the CLI and the Python client follow too."""
    from schemas.auth import find_token  # here, not at import: ``import probes`` loads no pydantic

    return find_token()


class Sink(Protocol):
    def send(self, batch: dict) -> dict: ...

    def close(self) -> None: ...


def dumps(batch: dict) -> bytes:
    # Non-finite floats are already null by the time they get here (see probes.stats); orjson would
    # turn any stray one into null too, never into invalid JSON.
    return orjson.dumps(batch)


class HttpSink:
    """Posts each batch to the server's ``/v1/ingest`` over one kept-alive connection.

    The standard library's http.client rather than httpx: a post runs on the probe's sender thread and
    holds the GIL for its Python, which the training thread then waits for. httpx made ~1,780 Python
    calls a post, http.client ~350; at the default interval on the MLP of benchmarks/overhead.py, where
    a step's Python waits on that, the server sink cost ~13 ms every 100 steps more than an in-memory
    one (docs/overhead.md). The ingest is idempotent (batch ids), so a post on a connection the server
    had closed is sent once more on a new one. It connects to the server directly: unlike httpx, it reads
    no HTTP proxy from the environment.
    """

    def __init__(self, server: str, *, token: str | None = None, timeout: float = 5.0) -> None:
        url = urlsplit(server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"traindx: the server must be an http(s) URL, not {server!r}")
        self.server = server.rstrip("/")
        self._path = url.path.rstrip("/") + "/v1/ingest"
        self._connect = partial(HTTPSConnection if url.scheme == "https" else HTTPConnection, url.hostname,
                                url.port, timeout=timeout)
        self.headers = {"content-type": "application/json"}
        token = token if token is not None else default_token()
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self._conn: HTTPConnection | None = None

    def _post(self, body: bytes) -> tuple[int, str | None, bytes]:
        try:
            return self._exchange(body)
        except (RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            return self._exchange(body)  # a kept-alive connection the server had closed: once more, anew

    def _exchange(self, body: bytes) -> tuple[int, str | None, bytes]:
        conn = self._conn = self._conn or self._connect()
        try:
            conn.request("POST", self._path, body=body, headers=self.headers)
            r = conn.getresponse()
            return r.status, r.getheader("retry-after"), r.read()
        except BaseException:
            self.close()
            raise

    def send(self, batch: dict) -> dict:
        try:
            status, retry_after, content = self._post(dumps(batch))
        except (OSError, HTTPException) as e:
            raise SinkError(f"{self.server}: {e.__class__.__name__}: {e}") from None
        if status >= 500 or status in (408, 429):
            # 503/429/507 are the server's back-pressure: keep the batch, retry after the delay it asks for.
            raise SinkError(f"{self.server} answered {status}", _retry_after(retry_after))
        text = content[:500].decode("utf-8", "replace")
        if status in (401, 403, 421):
            # Not the batch's fault: a missing or wrong token, or a Host the server does not accept. The
            # batch is kept (spooled) until someone fixes the configuration.
            raise SinkError(f"{self.server} refused us ({status}): {text[:300]}; set TRAINDX_TOKEN "
                            "to the server's token (in its DATA/token)")
        if status >= 400:
            # A 4xx will not get better on retry: the batch is malformed. Report, do not spool forever.
            raise RejectedBatch(f"{self.server} refused the batch ({status}): {text}")
        try:
            reply = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise SinkError(f"{self.server} answered {status} with a body that is not JSON") from None
        if not isinstance(reply, dict):
            raise SinkError(f"{self.server} answered {status} with JSON that is not an ingest reply")
        return reply

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


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
