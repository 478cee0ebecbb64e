"""Where a probe's batches go: one method, ``send(batch) -> reply``, as httpx transports have one.

``HttpSink`` posts to a server, ``FileSink`` appends to a JSON-lines file that ``traindx import`` loads,
``MemorySink`` keeps batches in a list for tests. A sink raises ``SinkError`` when a batch did not
arrive (the sender then spools it); any reply it returns means the batch is stored.
"""

from __future__ import annotations

import os
import select
import threading
import time
from functools import partial
from http.client import HTTPConnection, HTTPException, HTTPSConnection, RemoteDisconnected
from pathlib import Path
from typing import Callable, Protocol
from urllib.parse import urlsplit

import orjson


class SinkError(Exception):
    """The batch did not reach its destination; retry it later (not before ``retry_after`` seconds).

    ``kind`` says what kind of trouble, which decides how long a flush waits for it (probes/sender.py):
    ``away`` (nobody answers: refused, unreachable), ``slow`` (sent, no answer in time: the batch may be
    stored, and its id makes sending it again harmless), ``busy`` (the server asked for a pause),
    ``auth`` (the server refused the token or the Host), ``error`` (a 5xx, a broken or garbled answer).
    """

    def __init__(self, message: str, retry_after: float | None = None, *, kind: str = "away") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.kind = kind


MAX_RETRY_AFTER = 300.0  # a server asking for a longer pause than this is obeyed for this long
# How long a post waits for the server's answer. A slow server is waited on, not taken for an absent one:
# 8 jobs at interval 1 under 4 readers on this 2-core machine had ingest answers take over 5 s (issue 36,
# the old timeout, after which every batch counted as undelivered). Waiting costs the job nothing: the
# sender thread waits, and keeps the queue within its bound meanwhile (``while_waiting``).
READ_TIMEOUT = 60.0
WAIT_TICK = 0.25  # seconds between two calls of ``while_waiting`` during a long wait


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

    ``timeout`` bounds connecting and sending; ``read_timeout`` how long the answer is waited for, during
    which ``while_waiting`` (when set) is called every ``WAIT_TICK`` seconds. Without a token given, the
    token is found as ``default_token`` finds it, and found anew when the server answers 401: a job
    started before its server gets the token the server writes when it starts.
    """

    def __init__(self, server: str, *, token: str | None = None, timeout: float = 5.0,
                 read_timeout: float = READ_TIMEOUT) -> None:
        url = urlsplit(server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"traindx: the server must be an http(s) URL, not {server!r}")
        self.server = server.rstrip("/")
        self._path = url.path.rstrip("/") + "/v1/ingest"
        self._connect = partial(HTTPSConnection if url.scheme == "https" else HTTPConnection, url.hostname,
                                url.port, timeout=timeout)
        self.read_timeout = read_timeout
        self.while_waiting: Callable[[], None] | None = None
        self.headers = {"content-type": "application/json"}
        self._token_given = token is not None
        self.token: str | None = None
        self._use_token(token if token is not None else default_token())
        self._conn: HTTPConnection | None = None

    def _use_token(self, token: str | None) -> None:
        self.token = token or None
        if self.token:
            self.headers["authorization"] = f"Bearer {self.token}"
        else:
            self.headers.pop("authorization", None)

    def _post(self, body: bytes) -> tuple[int, str | None, bytes]:
        try:
            return self._exchange(body)
        except (RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            return self._exchange(body)  # a kept-alive connection the server had closed: once more, anew

    def _exchange(self, body: bytes) -> tuple[int, str | None, bytes]:
        conn = self._conn = self._conn or self._connect()
        try:
            if conn.sock is None:
                try:
                    conn.connect()
                except OSError as e:  # refused, unreachable, no such host, no answer to the handshake
                    raise SinkError(f"{self.server}: cannot connect: {e.__class__.__name__}: {e}", kind="away") from None
            conn.request("POST", self._path, body=body, headers=self.headers)
            self._await_answer(conn)
            r = conn.getresponse()
            return r.status, r.getheader("retry-after"), r.read()
        except BaseException:
            self.close()
            raise

    def _await_answer(self, conn: HTTPConnection) -> None:
        """Wait until the answer starts to arrive, at most ``read_timeout`` seconds, calling ``while_waiting``."""
        sock = conn.sock
        deadline = time.monotonic() + self.read_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {self.read_timeout:g} s")
            try:
                pending = getattr(sock, "pending", None)  # TLS: bytes already read and decrypted wait there
                if pending is not None and pending():
                    return
                readable, _, _ = select.select([sock], [], [], min(WAIT_TICK, left))
            except (ValueError, OSError) as e:  # the connection was closed under us (close() from another thread)
                raise ConnectionAbortedError(f"the connection was closed while waiting: {e}") from None
            if readable:
                return
            if self.while_waiting is not None:
                self.while_waiting()

    def send(self, batch: dict) -> dict:
        body = dumps(batch)
        status, retry_after, content = self._send(body)
        if status == 401 and not self._token_given:
            # The server may have started after us and written its token since (or been given a new one).
            fresh = default_token()
            if fresh and fresh != self.token:
                self._use_token(fresh)
                status, retry_after, content = self._send(body)
        if status >= 500 or status in (408, 429):
            # 503/429/507 are the server's back-pressure: keep the batch, retry after the delay it asks for.
            after = _retry_after(retry_after)
            raise SinkError(f"{self.server} answered {status}", after,
                            kind="busy" if after is not None or status in (408, 429, 503, 507) else "error")
        text = content[:500].decode("utf-8", "replace")
        if status == 401:
            raise SinkError(self._refused_token(), kind="auth")
        if status in (403, 421):
            # Not the batch's fault: a Host or Origin the server does not accept. The batch is kept (spooled)
            # until someone fixes the configuration.
            raise SinkError(f"{self.server} refused us ({status}): {text[:300]}", kind="auth")
        if status >= 400:
            # A 4xx will not get better on retry: the batch is malformed. Report, do not spool forever.
            raise RejectedBatch(f"{self.server} refused the batch ({status}): {text}")
        try:
            reply = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise SinkError(f"{self.server} answered {status} with a body that is not JSON", kind="error") from None
        if not isinstance(reply, dict):
            raise SinkError(f"{self.server} answered {status} with JSON that is not an ingest reply", kind="error")
        return reply

    def _refused_token(self) -> str:
        if self._token_given:
            return f"{self.server} refused the token given to attach (401)"
        from schemas.auth import token_places

        if self.token:
            return f"{self.server} refused the token found in {token_places()} (401); waiting for the right one there"
        return f"{self.server} needs a token (401); waiting for one in {token_places()}"

    def _send(self, body: bytes) -> tuple[int, str | None, bytes]:
        try:
            return self._post(body)
        except SinkError:
            raise
        except TimeoutError as e:  # connected, and no answer in time: a slow server, not an absent one
            raise SinkError(f"{self.server}: {e} (the batch may have been stored: it is sent again, and its id "
                            "makes that harmless)", kind="slow") from None
        except (OSError, HTTPException) as e:
            raise SinkError(f"{self.server}: {e.__class__.__name__}: {e}", kind="error") from None

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
