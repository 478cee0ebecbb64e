"""Who may talk to the server: the bearer token, and Host/Origin checks against DNS rebinding.

The token is generated on first start and kept in ``DATA/token`` (mode 0600) unless one is given
(``--token`` / ``TRAINDX_TOKEN``). One ASGI middleware guards every route, ``/mcp`` included:

1. the Host header must name this server, port included (a loopback name, the bind address, or an
   ``--allow-host``), and an Origin header, when a browser sends one, must be this server's own origin
   (scheme, host and port) or an ``--allow-origin``: a page on another site or on another port of this
   machine, ``null``, or a DNS name rebound to 127.0.0.1, gets 403/421 before any route runs;
2. every route but ``/health`` needs the token (``Authorization: Bearer``, or the ``traindx_token``
   cookie that ``/?token=...`` sets for the dashboard; a write carried by the cookie alone must come
   with an Origin, as browsers send on every write); read routes (GET) can be opened without it only
   by the explicit ``open_reads`` setting. Writes and ``/mcp`` always need it. A person whose browser
   has no token gets a short page saying how to open the dashboard, not an error document.
"""

from __future__ import annotations

import html
import ipaddress
import logging
import os
import secrets
import socket
import time
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


def allowed_hostnames(bind_host: str) -> set[str]:
    """The names this server answers to by itself: loopback, the bind address, and the machine's own names
    when it is bound to every interface (how people on the network reach it)."""
    names = {*LOOPBACK_NAMES}
    if bind_host not in ("0.0.0.0", "::", ""):
        names.add(bind_host.strip("[]").lower())
    elif not is_loopback(bind_host):
        for name in (socket.gethostname(), socket.getfqdn()):
            names.add(name.lower())
    return names


def _authority(name: str, port: int | None) -> str:
    name = name.lower()
    host = f"[{name}]" if ":" in name else name
    return host if port is None else f"{host}:{port}"


def parse_allowed_host(entry: str) -> tuple[str, int | None]:
    """An --allow-host value, ``NAME``, ``NAME:PORT``, ``[V6]`` or ``[V6]:PORT`` -> (name, port or None)."""
    entry = entry.strip()
    split = urlsplit(f"//{entry}")
    try:
        port = split.port
    except ValueError:
        raise ValueError(f"{entry!r}: the port is not a number in 0..65535") from None
    if not split.hostname or split.path or split.query or split.fragment or split.username is not None \
            or port == 0 or any(c.isspace() for c in entry):
        raise ValueError(f"{entry!r} is not a host name with an optional :PORT")
    return split.hostname, port


def parse_origin(entry: str) -> str:
    """An --allow-origin value written as browsers write an Origin: ``scheme://host[:port]``, lower case,
    no default port, no path."""
    split = urlsplit(entry.strip())
    try:
        port = split.port
    except ValueError:
        raise ValueError(f"{entry!r}: the port is not a number in 0..65535") from None
    if split.scheme not in ("http", "https") or not split.hostname or split.path not in ("", "/") \
            or split.query or split.fragment or split.username is not None or port == 0:
        raise ValueError(f"{entry!r} is not an origin (http://HOST[:PORT] or https://HOST[:PORT])")
    if port == {"http": 80, "https": 443}[split.scheme]:
        port = None
    return f"{split.scheme}://{_authority(split.hostname, port)}"


class Authorities:
    """Who this server is, for the Host and Origin checks: exact ``host:port`` values, never a name at any port.

    A Host header must be one of this server's names at its port (a bare name only when that port is 80,
    as HTTP writes it), or an --allow-host entry: ``NAME:PORT`` exactly, or a bare ``NAME`` at this port or
    without one (what a reverse proxy in front forwards). An Origin must be ``http://`` and one of those, or
    an --allow-origin (``https://`` behind a TLS proxy, say). ``null`` (a sandboxed page, a file) names no
    one. ``*`` among the hosts switches both checks off.
    """

    def __init__(self, bind_host: str, port: int, allow_hosts: Iterable[str] = (),
                 allow_origins: Iterable[str] = ()) -> None:
        self.port = port
        extra = [h.strip() for h in allow_hosts if h.strip()]
        self.off = "*" in extra
        hosts = set()
        for name in allowed_hostnames(bind_host):
            hosts.add(_authority(name, port))
            if port == 80:
                hosts.add(_authority(name, None))
        for entry in extra:
            if entry == "*":
                continue
            name, given = parse_allowed_host(entry)
            hosts.add(_authority(name, given))
            if given is None:
                hosts.add(_authority(name, port))
        self.hosts = frozenset(hosts)
        self.origins = frozenset({f"http://{h}" for h in hosts} | {parse_origin(o) for o in allow_origins})

    def host_ok(self, host: str) -> bool:
        return self.off or host.strip().lower() in self.hosts

    def origin_ok(self, origin: str) -> bool:
        return self.off or origin.strip().lower() in self.origins


def mcp_transport_security(authorities: Authorities):  # noqa: ANN201 - the SDK's type, imported lazily
    """The same Host/Origin policy, stated explicitly for the MCP SDK's own check on /mcp (its default
    switches itself off when the server is bound to 0.0.0.0)."""
    from mcp.server.transport_security import TransportSecuritySettings

    if authorities.off:
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=sorted(authorities.hosts),
                                     allowed_origins=sorted(authorities.origins))


def _quote(value: str) -> str:
    return repr(value if len(value) <= 200 else value[:200] + "...")


class SecurityMiddleware:
    """Pure ASGI middleware: Host/Origin checks, then the token, on http and websocket scopes."""

    def __init__(self, app, *, token: str, authorities: Authorities, open_reads: bool = False) -> None:  # noqa: ANN001
        self.app = app
        self.token = token.encode()
        self.authorities = authorities
        self.open_reads = open_reads
        self.log_refusal = RefusalLog()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        repeated = set()
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            if name in headers:
                repeated.add(name)
            headers[name] = v.decode("latin-1")
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        host, origin = headers.get("host", ""), headers.get("origin")
        if "host" in repeated or not self.authorities.host_ok(host):
            return await self._refuse(scope, send, 421, "invalid_host",
                                      f"Host {_quote(host)} does not name this server; allowed: "
                                      f"{', '.join(sorted(self.authorities.hosts))} (add one with --allow-host "
                                      "NAME[:PORT])")
        if "origin" in repeated or (origin is not None and not self.authorities.origin_ok(origin)):
            return await self._refuse(scope, send, 403, "invalid_origin",
                                      f"Origin {_quote(origin or '')} may not use this server: only a page served "
                                      "by it (same scheme, host and port) or an --allow-origin may (cross-site "
                                      "request refused)")
        # Host names are case-insensitive: what runs next (the MCP SDK's own check) sees the canonical form.
        scope = {**scope, "headers": [(k, v.strip().lower() if k.lower() in (b"host", b"origin") else v)
                                      for k, v in scope.get("headers", [])]}
        if path in OPEN_PATHS and method in _READ_METHODS:
            return await self.app(scope, receive, send)
        from_query = self._query_token(scope)
        if from_query:
            return await self.app(scope, receive, _with_cookie(send, from_query))
        if bearer_ok(headers, self.token):
            return await self.app(scope, receive, send)
        if cookie_ok(headers, self.token):
            if method in _READ_METHODS or origin is not None or self.authorities.off:
                return await self.app(scope, receive, send)
            # Browsers send an Origin with every write; a cookie-borne write without one did not come
            # from the dashboard, and the cookie alone must not be enough to change a job.
            return await self._refuse(scope, send, 403, "invalid_origin",
                                      "a write authorised by the dashboard's cookie needs an Origin naming this "
                                      "server (scripts send 'Authorization: Bearer <token>' instead)")
        if self.open_reads and method in _READ_METHODS and not path.startswith("/mcp"):
            return await self.app(scope, receive, send)
        if method in ("GET", "HEAD") and _wants_html(headers.get("accept", "")) and scope["type"] == "http":
            return await _how_to_open(scope, send, host)
        return await self._refuse(scope, send, 401, "unauthorized",
                                  "this server needs its token: send 'Authorization: Bearer <token>' (the token is "
                                  "in DATA/token, 0600; probes and MCP clients read it from TRAINDX_TOKEN)")

    async def _refuse(self, scope, send, status: int, code: str, message: str) -> None:  # noqa: ANN001
        self.log_refusal(code, scope.get("method", "WS"), scope.get("path", ""), message)
        await _refuse(scope, send, status, code, message)

    def _query_token(self, scope) -> str | None:  # noqa: ANN001
        """``GET /?token=...``: the link printed at start, for a browser; it sets the cookie."""
        if scope.get("method") != "GET" or b"token=" not in scope.get("query_string", b""):
            return None
        qs = parse_qs(scope["query_string"].decode("latin-1"))
        got = (qs.get("token") or [""])[0]
        return got if got and secrets.compare_digest(got.encode(), self.token) else None


def _wants_html(accept: str) -> bool:
    """A browser opening a page (``Accept: text/html,...``), not a script asking for data."""
    for part in accept.split(","):
        media, _, params = part.partition(";")
        if media.strip().lower() == "text/html":
            q = 1.0
            for p in params.split(";"):
                k, _, v = p.strip().partition("=")
                if k.strip().lower() == "q":
                    try:
                        q = float(v)
                    except ValueError:
                        q = 0.0
            return q > 0
    return False


HOW_TO_OPEN = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>traindx: open the dashboard with its link</title>
<style>body{{font:16px/1.5 system-ui,sans-serif;max-width:42em;margin:3em auto;padding:0 1em}}
code{{background:#f2f2f2;padding:.1em .3em}}</style></head>
<body><h1>This traindx dashboard needs its token</h1>
<p>The server only answers the browsers it gave its token to. Open the dashboard with the link
<code>traindx serve</code> printed when it started (<code>http://{host}/?token=...</code>), or run</p>
<pre><code>traindx open</code></pre>
<p>in the directory the server was started from (or <code>traindx open --data DATA</code>, with the server's
data directory): it opens that link for you. The token is kept in <code>DATA/token</code>.</p>
</body></html>
"""


async def _how_to_open(scope, send, host: str) -> None:  # noqa: ANN001
    body = HOW_TO_OPEN.format(host=html.escape(host)).encode()
    await send({"type": "http.response.start", "status": 401, "headers": [
        (b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b'Bearer realm="traindx"'), (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": body if scope.get("method") != "HEAD" else b""})


def authorized(headers, token: bytes) -> bool:  # noqa: ANN001 - any mapping of lower-case header names
    """The bearer token, or the dashboard's cookie, matches ``token`` (compared in constant time)."""
    return bearer_ok(headers, token) or cookie_ok(headers, token)


def bearer_ok(headers, token: bytes) -> bool:  # noqa: ANN001
    auth = headers.get("authorization") or ""
    return auth[:7].lower() == "bearer " and secrets.compare_digest(auth[7:].strip().encode(), token)


def cookie_ok(headers, token: bytes) -> bool:  # noqa: ANN001
    cookie = headers.get("cookie")
    if not cookie:
        return False
    try:
        morsel = SimpleCookie(cookie).get(COOKIE)
    except Exception:  # noqa: BLE001 - a malformed cookie header authorizes nothing
        return False
    return morsel is not None and secrets.compare_digest(morsel.value.encode(), token)


def _with_cookie(send, token: str):  # noqa: ANN001, ANN202
    value = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()

    async def wrapped(message) -> None:  # noqa: ANN001
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", value)]}
        await send(message)

    return wrapped


class RefusalLog:
    """One warning per kind of refusal a minute, with the count of those left out since: a client retrying
    with a stale token, or a page probing the server, must not flood the log (nor block a server whose
    stderr nobody reads once the pipe is full)."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._left_out: dict[str, int] = {}

    def __call__(self, code: str, method: str, path: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(code, -self.every_s) < self.every_s:
            self._left_out[code] = self._left_out.get(code, 0) + 1
            return
        self._last[code] = now
        more = self._left_out.pop(code, 0)
        log.warning("traindx: refused %s %s: %s%s", method, path[:200], message,
                    f" ({more} more '{code}' refusals in the last minute were not logged)" if more else "")


async def _refuse(scope, send, status: int, code: str, message: str) -> None:  # noqa: ANN001
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    # The one error shape, in the format the client asked for (as every route answers; see render.negotiate).
    from starlette.requests import Request

    from ..errors import ApiError
    from .render import error_response

    response = error_response(Request(scope), ApiError(status, code, message))
    body = response.body
    headers = [(b"content-type", response.media_type.encode()), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="traindx"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
