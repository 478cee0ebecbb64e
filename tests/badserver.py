"""A misbehaving HTTP server for tests: a real socket server in a thread, not a mock of our code.

Modes: ``hang`` (accepts, reads, never answers until released), ``slow`` (answers after ``delay``),
``garbage`` (200 with a body that is not JSON), ``error`` (500), ``busy`` (429/503 with Retry-After),
``reset`` (closes the connection without an answer), ``ok`` (a well-formed empty ingest reply).
A closed port is the ``refuse`` case: use ``closed_port()``. ``SlowProxy`` sits in front of a real
server and holds its answers to ingest: a slow server, for tests and benchmarks/slow_server.py.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from dataclasses import dataclass, field


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@dataclass
class BadServer:
    mode: str
    delay: float = 0.0
    status: int = 503
    retry_after: str | None = "3600"
    requests: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                self.request.settimeout(30)
                try:
                    outer._handle(self.request)
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> BadServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def _read_request(self, sock: socket.socket) -> bool:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v.strip())
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                return False
            body += chunk
        with self._lock:
            self.requests += 1
        return True

    def _answer(self, sock: socket.socket, status: int, body: bytes, extra: str = "") -> None:
        sock.sendall(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                     f"{extra}\r\n".encode() + body)

    def _handle(self, sock: socket.socket) -> None:
        while self._read_request(sock):
            if self.mode == "hang":
                self.release.wait()
                return
            if self.mode == "reset":
                return
            if self.mode == "slow":
                if self.release.wait(self.delay):
                    return
                self._answer(sock, 200, b'{"accepted": 0, "commands": []}')
            elif self.mode == "garbage":
                self._answer(sock, 200, b"\x00<html>not json \xff{{{")
            elif self.mode == "error":
                self._answer(sock, 500, b'{"error": "boom"}')
            elif self.mode == "busy":
                extra = f"retry-after: {self.retry_after}\r\n" if self.retry_after is not None else ""
                self._answer(sock, self.status, b'{"error": "overloaded"}', extra)
            elif self.mode == "weird_commands":
                self._answer(sock, 200, b'{"accepted": 1, "commands": ["rm -rf", 7, {"fix_id": null}, '
                                        b'{"op": "apply", "action": "set_lr", "params": {"lr": 1e9}}]}')
            else:
                self._answer(sock, 200, b'{"accepted": 0, "commands": []}')


class SlowProxy:
    """A TCP proxy in front of a real server that holds the server's answers to ``POST /v1/ingest``.

    The request goes on to the server at once (so the server stores the batch), and its answer reaches the
    client ``delay`` seconds after the request came: a server slow to answer, as one under load is. A
    ``(low, high)`` delay draws each from that range. Only while ``slow`` is set, and for at most ``limit``
    answers when given; other requests and answers pass untouched. Use as a context manager; ``url`` is the
    proxy's address.
    """

    def __init__(self, upstream_port: int, delay: float | tuple[float, float] = 6.0, *, limit: int | None = None,
                 seed: int = 0) -> None:
        import random

        self.upstream_port = upstream_port
        self.delay = delay
        self.limit = limit
        self.slow = threading.Event()
        self.slow.set()
        self.held = 0  # answers held so far
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = threading.Event()

    def __enter__(self) -> SlowProxy:
        threading.Thread(target=self._accept, daemon=True, name="slow-proxy").start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        self._listener.close()

    def _hold(self) -> float | None:
        """Seconds to hold the answer to the request just seen, or None."""
        with self._lock:
            if not self.slow.is_set() or (self.limit is not None and self.held >= self.limit):
                return None
            self.held += 1
            low, high = self.delay if isinstance(self.delay, tuple) else (self.delay, self.delay)
            return self._random.uniform(low, high)

    def _accept(self) -> None:
        import time

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            except OSError:
                client.close()  # the server is down: the client sees its connection dropped
                continue
            upstream.settimeout(None)
            state = {"until": None}
            own_host, upstream_host = b"Host: 127.0.0.1:%d" % self.port, b"Host: 127.0.0.1:%d" % self.upstream_port

            def up(client: socket.socket = client, upstream: socket.socket = upstream, state: dict = state,
                   own_host: bytes = own_host, upstream_host: bytes = upstream_host) -> None:
                try:
                    while data := client.recv(65536):
                        # As a reverse proxy does, name the server it forwards to in Host: the server checks
                        # Host against its own address (DNS-rebinding protection).
                        data = data.replace(own_host, upstream_host, 1) if data[:1].isalpha() else data
                        if state["until"] is None and data.startswith(b"POST /v1/ingest"):
                            hold = self._hold()
                            state["until"] = time.monotonic() + hold if hold is not None else 0.0
                        upstream.sendall(data)
                except OSError:
                    pass
                finally:
                    for s in (client, upstream):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

            def down(client: socket.socket = client, upstream: socket.socket = upstream, state: dict = state) -> None:
                try:
                    while data := upstream.recv(65536):
                        until, state["until"] = state["until"], None
                        if until:
                            time.sleep(max(until - time.monotonic(), 0.0))
                        client.sendall(data)
                except OSError:
                    pass
                finally:
                    for s in (client, upstream):
                        try:
                            s.close()
                        except OSError:
                            pass

            threading.Thread(target=up, daemon=True).start()
            threading.Thread(target=down, daemon=True).start()
