"""One error shape for every error the server returns (schemas.Error), over HTTP and MCP."""

from __future__ import annotations

from schemas.records import Error


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, detail: list[str] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.detail = detail or []
        self.headers = headers or {}  # e.g. Retry-After on 503

    def body(self) -> Error:
        return Error(error=self.code, message=_printable(self.message), detail=[_printable(d) for d in self.detail])

    def __str__(self) -> str:
        return self.message + ("" if not self.detail else " (" + "; ".join(self.detail) + ")")


def _printable(text: str) -> str:
    """Messages quote what the client sent, which may hold lone surrogates that no UTF-8 (JSON or XML)
    answer can carry: those become '?'."""
    return text.encode("utf-8", "replace").decode("utf-8")
