"""The OpenAPI description at /openapi.json, made to say what the server really does.

FastAPI describes each route from its signature; what it cannot see is added here, in one place:
every response is offered as JSON and as XML (valid against schemas/traindx.xsd), the ``format``
parameter, the one error shape (schemas.records.Error) for every error status including 422, and the
ingest request body, which the route reads itself to bound its size.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from schemas.events import IngestBatch

XML = "application/xml"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
FORMAT_PARAM = {
    "name": "format", "in": "query", "required": False,
    "description": "Response format; overrides the Accept header (application/json or application/xml).",
    "schema": {"type": "string", "enum": ["json", "xml"]},
}
XML_NOTE = "As XML: root element named like the model, valid against schemas/traindx.xsd."
ERROR_TEXT = {
    400: "The body is not valid JSON.", 401: "A bearer token is required (TRAINDX_TOKEN).",
    403: "Host or Origin is not this server's (DNS-rebinding / cross-site protection).",
    404: "No such run, anomaly, fix or route.", 406: "Neither JSON nor XML is acceptable to the client.",
    409: "The fix cannot do that now (advice, stale, job gone, not applied).", 413: "The body is too large.",
    422: "A parameter or the body is invalid; detail lists each problem.", 500: "The server failed on this request.",
}


def _patch(doc: dict[str, Any]) -> None:
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    ingest_schema = IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in ingest_schema.pop("$defs", {}).items():
        comps.setdefault(name, sub)
    comps["IngestBatch"] = ingest_schema
    _require_discriminators(doc, comps)
    _bound_integers(doc)
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            api = path.startswith("/v1/") or path == "/health"
            stream = path.endswith("/stream")
            if api and not stream:
                params = op.setdefault("parameters", [])
                if not any(p.get("name") == "format" for p in params):
                    params.append(FORMAT_PARAM)
            for status, resp in op.get("responses", {}).items():
                code = int(status)
                if code >= 400:
                    resp["description"] = ERROR_TEXT.get(code, resp.get("description", "Error"))
                    resp["content"] = {"application/json": {"schema": ERROR_REF}, XML: {"schema": ERROR_REF}}
                elif api and not stream and "application/json" in resp.get("content", {}):
                    schema = resp["content"]["application/json"].get("schema", {})
                    resp["content"][XML] = {"schema": schema}
                    resp["description"] = f"{resp.get('description', 'OK')}. {XML_NOTE}"
            if method == "post" and path == "/v1/ingest":
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/IngestBatch"}}}}
            if path == "/metrics":  # Prometheus text (or OpenMetrics when asked), not a record
                op["responses"]["200"]["content"] = {
                    "text/plain": {"schema": {"type": "string"}},
                    "application/openmetrics-text": {"schema": {"type": "string"}}}
            if "dashboard" in op.get("tags", []):  # the pages answer in HTML and only fail with the error shape
                op.setdefault("responses", {}).setdefault("403", {
                    "description": ERROR_TEXT[403],
                    "content": {"application/json": {"schema": ERROR_REF}, XML: {"schema": ERROR_REF}}})


def _require_discriminators(node: Any, comps: dict[str, Any]) -> None:
    """An event's ``kind`` has a default in the models (a probe need not repeat it in Python), but the
    union is told apart by it, so on the wire it is required: say so, or clients build events without it."""
    if isinstance(node, dict):
        disc = node.get("discriminator")
        if isinstance(disc, dict):
            for ref in disc.get("mapping", {}).values():
                target = comps.get(ref.rsplit("/", 1)[-1], {})
                required = target.setdefault("required", [])
                if disc["propertyName"] not in required:
                    required.append(disc["propertyName"])
        for value in node.values():
            _require_discriminators(value, comps)
    elif isinstance(node, list):
        for value in node:
            _require_discriminators(value, comps)


def _bound_integers(node: Any) -> None:
    """Integers are stored as SQLite INTEGERs and read by orjson: 64-bit signed. Say so."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node.setdefault("format", "int64")
            node.setdefault("maximum", 2**63 - 1)
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -(2**63)
        for value in node.values():
            _bound_integers(value)
    elif isinstance(node, list):
        for value in node:
            _bound_integers(value)


def install(app: FastAPI) -> None:
    """Replace ``app.openapi`` with a generator that patches FastAPI's description once, then caches it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _patch(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
