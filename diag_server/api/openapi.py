"""The OpenAPI description at /openapi.json, made to say what the server really does.

FastAPI describes each route from its signature; what it cannot see is added here, in one place:
each route's answer in every format it offers (JSON and XML valid against schemas/traindx.xsd, unless
it says otherwise with ``render.offers``), the ``format`` parameter listing those, the one error shape
(schemas.records.Error) for every error status including 422, and the ingest request body, which the
route reads itself to bound its size. Integer bounds come from the models and parameters themselves.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import iter_route_contexts

from schemas.events import IngestBatch

from .render import NegotiatedRoute, formats_of

XML = "application/xml"
ERROR_REF = {"$ref": "#/components/schemas/Error"}
# The Chrome trace event format (what ?format=chrome returns): chrome://tracing and Perfetto read it.
CHROME_TRACE = {"type": "object", "required": ["traceEvents"],
                "description": "A Chrome trace / Perfetto JSON file (?format=chrome).",
                "properties": {"traceEvents": {"type": "array", "items": {"type": "object"}},
                               "displayTimeUnit": {"type": "string"}, "otherData": {"type": "object"}}}
XML_NOTE = "As XML: root element named like the model, valid against schemas/traindx.xsd."
ERROR_TEXT = {
    400: "The body is not valid JSON.", 401: "A bearer token is required (TRAINDX_TOKEN).",
    403: "The Origin is not this server's (cross-site protection: scheme, host and port).",
    421: "The Host does not name this server (DNS-rebinding protection).",
    404: "No such run, anomaly, fix or route.", 405: "The route does not take this method.",
    406: "The client accepts none of the route's formats (nothing was done).",
    409: "The fix cannot do that now (advice, stale, job gone, not applied).", 413: "The body is too large.",
    422: "A parameter or the body is invalid; detail lists each problem.", 500: "The server failed on this request.",
}


def _format_param(offer: tuple[str, ...]) -> dict[str, Any]:
    return {"name": "format", "in": "query", "required": False,
            "description": f"Response format; overrides the Accept header. Offered: {', '.join(offer)}.",
            "schema": {"type": "string", "enum": list(offer)}}


def _offers(app: FastAPI) -> dict[tuple[str, str], tuple[str, ...]]:
    """(path, method) -> the formats a negotiated route offers."""
    return {(r.path_format, m.lower()): formats_of(r.original_route.endpoint)
            for r in iter_route_contexts(app.routes) if isinstance(r.original_route, NegotiatedRoute)
            for m in r.methods or ()}


def _patch(doc: dict[str, Any], offered: dict[tuple[str, str], tuple[str, ...]]) -> None:
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    ingest_schema = IngestBatch.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in ingest_schema.pop("$defs", {}).items():
        comps.setdefault(name, sub)
    comps["IngestBatch"] = ingest_schema
    comps["ChromeTrace"] = CHROME_TRACE
    _require_discriminators(doc, comps)
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            offer = offered.get((path, method), ())
            if offer:
                op.setdefault("parameters", []).append(_format_param(offer))
                op.setdefault("responses", {}).setdefault("406", {})
            for status, resp in op.get("responses", {}).items():
                code = int(status)
                if code >= 400:
                    resp["description"] = ERROR_TEXT.get(code, resp.get("description", "Error"))
                    resp["content"] = {"application/json": {"schema": ERROR_REF}, XML: {"schema": ERROR_REF}}
                elif "xml" in offer and "application/json" in resp.get("content", {}):
                    schema = resp["content"]["application/json"].get("schema", {})
                    resp["content"][XML] = {"schema": schema}
                    resp["description"] = f"{resp.get('description', 'OK')}. {XML_NOTE}"
                if code == 200 and "chrome" in offer:  # same media type, another shape: say both
                    json_body = resp["content"]["application/json"]
                    json_body["schema"] = {"anyOf": [json_body.get("schema", {}),
                                                     {"$ref": "#/components/schemas/ChromeTrace"}]}
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


def install(app: FastAPI) -> None:
    """Replace ``app.openapi`` with a generator that patches FastAPI's description once, then caches it."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _patch(doc, _offers(app))
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
