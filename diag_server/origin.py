"""Host and Origin checks for browser-facing routes (DNS-rebinding and cross-site request protection).

A page on another site can make a browser send requests to 127.0.0.1, and a rebound DNS name can make
it read the answers. Both show in the request: the ``Host`` header names the attacker's domain, or an
``Origin`` header names another site. This is one small function so that the dashboard, the REST API
and ``/mcp`` can share it (and so that the token work can extend it in one place).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .errors import ApiError

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
ANY_INTERFACE = frozenset({"0.0.0.0", "::", ""})


def _hostname(value: str) -> str | None:
    try:
        return urlsplit(value if "//" in value else f"//{value}").hostname
    except ValueError:
        return None


def allowed_hosts(bind_host: str) -> frozenset[str] | None:
    """Host names a request may address; None when the server listens on every interface (any name can
    reach it, so the bearer token is the guard there)."""
    if bind_host in ANY_INTERFACE:
        return None
    return LOOPBACK | {bind_host.strip("[]").lower()}


def check_browser_request(headers: dict[str, str] | object, bind_host: str) -> None:
    """Raise ApiError(403) when ``Host`` names a host this server was not bound to, or when ``Origin``
    (sent by browsers on cross-site and on non-GET requests) is another site."""
    get = headers.get  # type: ignore[attr-defined]
    allowed = allowed_hosts(bind_host)
    host = get("host")
    host_name = _hostname(host) if host else None
    if allowed is not None and host is not None and (host_name or "").lower() not in allowed:
        raise ApiError(403, "forbidden_host", f"Host {host!r} is not this server's address; use "
                       f"http://{bind_host}:<port> (DNS-rebinding protection)")
    origin = get("origin")
    if origin is None:
        return
    origin_name = _hostname(origin) if origin != "null" else None
    same_site = origin_name is not None and host_name is not None and origin_name.lower() == host_name.lower()
    if not same_site and (allowed is None or (origin_name or "").lower() not in allowed):
        raise ApiError(403, "forbidden_origin", f"requests from Origin {origin!r} are not allowed; open the "
                       "dashboard from this server's own address")
