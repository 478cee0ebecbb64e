"""Who may talk to the server: the bearer token, and Host/Origin checks against DNS rebinding.

The token is generated on first start and kept in ``DATA/token`` (mode 0600) unless one is given
(``--token`` / ``TRAINDX_TOKEN``). One ASGI middleware guards every route, ``/mcp`` included:

1. the Host header must name this server (a loopback name, the bind address, or an ``--allow-host``),
   and an Origin header, when a browser sends one, must name it too: a page on another site, or a
   DNS name rebound to 127.0.0.1, gets 421/403 before any route runs;
2. every route but ``/health`` needs the token (``Authorization: Bearer``, or the ``traindx_token``
   cookie that ``/?token=...`` sets for the dashboard); read routes (GET) can be opened without it
   only by the explicit ``open_reads`` setting. Writes and ``/mcp`` always need it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Iterable
from urllib.parse import parse_qs, urlsplit



log = logging.getLogger("traindx.server")

TOKEN_FILE = "token"
COOKIE = "traindx_token"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# Reachable without the token: a liveness probe must not need a secret, and it reveals nothing.
OPEN_PATHS = frozenset({"/health"})
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_or_create_token(data_dir: Path) -> str:
    """The token in ``data_dir/token``; created (0600, 256 random bits) when there is none."""
    path = Path(data_dir) / TOKEN_FILE
    try:
        token = path.read_text().strip()
        if token:
            if path.stat().st_mode & 0o077:
                log.warning("traindx: %s is readable by other users; chmod 600 it", path)
            return token
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL: two servers starting at once on one data dir must not overwrite each other's token.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def read_token_file(data_dir: str | os.PathLike) -> str | None:
    try:
        return (Path(data_dir) / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def allowed_hostnames(bind_host: str, extra: Iterable[str] = ()) -> set[str]:
    """Host names a request may address this server by. ``*`` in ``extra`` switches the check off."""
    names = {*LOOPBACK_NAMES}
    if bind_host not in ("0.0.0.0", "::", ""):
        names.add(bind_host.strip("[]").lower())
    elif not is_loopback(bind_host):
        # Bound to every interface: the machine's own names are how people on the network reach it.
        for name in (socket.gethostname(), socket.getfqdn()):
            names.add(name.lower())
    names.update(h.strip().strip("[]").lower() for h in extra if h.strip())
    return names


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8765
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def mcp_transport_security(names: set[str]):  # noqa: ANN201 - the SDK's type, imported lazily
    """The same Host/Origin policy, stated explicitly for the MCP SDK's own check on /mcp."""
    from mcp.server.transport_security import TransportSecuritySettings

    if "*" in names:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts = [f"[{n}]:*" if ":" in n else f"{n}:*" for n in sorted(names)]
    hosts += [h[:-2] for h in hosts]  # a Host header without a port (port 80 behind a proxy)
    origins = [f"{scheme}://{h}" for scheme in ("http", "https") for h in hosts]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=origins)


class SecurityMiddleware:
    """Pure ASGI middleware: Host/Origin checks, then the token, on http and websocket scopes."""

    def __init__(self, app, *, token: str, hostnames: set[str], open_reads: bool = False) -> None:  # noqa: ANN001
        self.app = app
        self.token = token.encode()
        self.hostnames = hostnames
        self.open_reads = open_reads

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        if "*" not in self.hostnames:
            host = headers.get("host", "")
            if not host or _hostname(host) not in self.hostnames:
                return await _refuse(scope, send, 421, "invalid_host",
                                     f"Host {host!r} does not name this server; allowed: "
                                     f"{', '.join(sorted(self.hostnames))} (add one with --allow-host)")
            origin = headers.get("origin")
            if origin is not None and origin != "null" and _hostname(urlsplit(origin).netloc) not in self.hostnames:
                return await _refuse(scope, send, 403, "invalid_origin",
                                     f"Origin {origin!r} may not use this server (cross-site request refused)")
        if path in OPEN_PATHS and method in _READ_METHODS:
            return await self.app(scope, receive, send)
        from_query = self._query_token(scope)
        if self._authorized(headers) or from_query:
            if from_query:
                send = _with_cookie(send, from_query)
            return await self.app(scope, receive, send)
        if self.open_reads and method in _READ_METHODS and not path.startswith("/mcp"):
            return await self.app(scope, receive, send)
        return await _refuse(scope, send, 401, "unauthorized",
                             "this server needs its token: send 'Authorization: Bearer <token>' (the token is in "
                             "DATA/token, 0600; probes and MCP clients read it from TRAINDX_TOKEN)")

    def _authorized(self, headers: dict[str, str]) -> bool:
        return authorized(headers, self.token)

    def _query_token(self, scope) -> str | None:  # noqa: ANN001
        """``GET /?token=...``: the link printed at start, for a browser; it sets the cookie."""
        if scope.get("method") != "GET" or b"token=" not in scope.get("query_string", b""):
            return None
        qs = parse_qs(scope["query_string"].decode("latin-1"))
        got = (qs.get("token") or [""])[0]
        return got if got and secrets.compare_digest(got.encode(), self.token) else None


def authorized(headers, token: bytes) -> bool:  # noqa: ANN001 - any mapping of lower-case header names
    """The bearer token, or the dashboard's cookie, matches ``token`` (compared in constant time)."""
    auth = headers.get("authorization") or ""
    if auth[:7].lower() == "bearer " and secrets.compare_digest(auth[7:].strip().encode(), token):
        return True
    cookie = headers.get("cookie")
    if cookie:
        try:
            morsel = SimpleCookie(cookie).get(COOKIE)
        except Exception:  # noqa: BLE001 - a malformed cookie header authorizes nothing
            return False
        return morsel is not None and secrets.compare_digest(morsel.value.encode(), token)
    return False


def _with_cookie(send, token: str):  # noqa: ANN001, ANN202
    value = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()

    async def wrapped(message) -> None:  # noqa: ANN001
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value)]}
        await send(message)

    return wrapped


async def _refuse(scope, send, status: int, code: str, message: str) -> None:  # noqa: ANN001
    log.warning("traindx: refused %s %s: %s", scope.get("method", "WS"), scope.get("path"), message)
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    # The one error shape, in the format the client asked for (as every route answers; see http.negotiate).
    from starlette.requests import Request

    from .errors import ApiError
    from .http import error_response

    response = error_response(Request(scope), ApiError(status, code, message))
    body = response.body
    headers = [(b"content-type", response.media_type.encode()), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="traindx"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
