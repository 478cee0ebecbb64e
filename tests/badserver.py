"""A misbehaving HTTP server for tests: a real socket server in a thread, not a mock of our code.

Modes: ``hang`` (accepts, reads, never answers until released), ``slow`` (answers after ``delay``),
``garbage`` (200 with a body that is not JSON), ``error`` (500), ``busy`` (429/503 with Retry-After),
``reset`` (closes the connection without an answer), ``ok`` (a well-formed empty ingest reply).
A closed port is the ``refuse`` case: use ``closed_port()``.
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
