"""Export the contract as one JSON Schema document and one XSD, both generated from the pydantic models.

``python -m schemas.export`` writes ``schemas/traindx.schema.json`` and ``schemas/traindx.xsd``;
``python -m schemas.export --check`` lists drift between them and the models and exits 1.

The XSD is built by walking the JSON Schema (one method per kind of schema node), and
``diag_server.api.xml.to_xml`` renders an instance by walking the same JSON Schema with the same ``shape``
and ``split_null``, so a rendered document and the XSD cannot follow different rules. The rules:

- One global element per top-level model, named like the model class (``<Anomaly>``), of the complex type
  of the same name. A field is a child element named like the field, in field order.
- Null (an optional left empty, a NaN/Inf number) is the element with ``xsi:nil="true"``, never an
  omitted element, so null reads the same in a field, a list item and a dict entry.
- A list field is its element repeated once per item (no element for an empty list). A list anywhere
  else (inside a list, as a dict value) is one element holding an ``<item>`` per item.
- A dict is one ``<entry key="...">`` per key, holding the value as a field would: text for a scalar,
  child elements for a model, ``<item>`` children for a list. A value that may be a scalar or a list
  (``Params``) is mixed content: the XSD checks its items but cannot type its text.
- A union of models (the ingest events) holds one child element named like the model it is.
- Enums and Literals are ``xs:enumeration`` restrictions; numbers are ``xs:double``/``xs:integer``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import schemas as contract

from .enums import SCHEMA_VERSION

# Derived from __all__ so that a model added to the contract is exported without an edit here.
MODELS: list[type[BaseModel]] = [
    obj
    for name in contract.__all__
    if isinstance(obj := getattr(contract, name), type) and issubclass(obj, BaseModel)
]

SCHEMA_ID = f"urn:traindx:schema:{SCHEMA_VERSION}"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
XS_NS = "http://www.w3.org/2001/XMLSchema"
HERE = Path(__file__).parent
JSON_FILE, XSD_FILE = "traindx.schema.json", "traindx.xsd"

# Keywords that only document a node; every other keyword must be understood or the XSD export fails.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})
SIMPLE = frozenset({"enum", "string", "integer", "number", "boolean", "union"})
NULL = {"type": "null"}
BOUNDS = {"minimum": "minInclusive", "maximum": "maxInclusive", "exclusiveMinimum": "minExclusive", "exclusiveMaximum": "maxExclusive"}
DICT_KEYWORDS = {"type", "additionalProperties", "patternProperties", "propertyNames", "minProperties", "maxProperties"}


# --- JSON Schema -------------------------------------------------------------------------------------


def _json_schema(models: list[type[BaseModel]]) -> dict[str, Any]:
    # Validation mode for every model, events and records alike. The ingest models must accept what a
    # probe sends, where a field with a default may be absent: only validation mode says so. The models
    # have no custom serializers or computed fields, so a serialization-mode schema would say the same
    # thing, and one mode keeps one $def per model (mixing modes splits a model used on both sides into
    # Foo-Input / Foo-Output). A model_dump(mode="json") holds every field, so records validate too.
    refs, top = models_json_schema([(m, "validation") for m in models])
    for model in models:
        if refs[(model, "validation")]["$ref"] != f"#/$defs/{model.__name__}":
            raise TypeError(f"two exported models are named {model.__name__}; element names would clash")
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        "$id": SCHEMA_ID,
        "title": "traindx",
        "description": "Events a probe sends and records the traindx server returns. Generated from "
        "the pydantic models in schemas/ by `python -m schemas.export`; do not edit.",
        "schema_version": SCHEMA_VERSION,
        "models": [m.__name__ for m in models],
        "$defs": top.get("$defs", {}),
    }


def json_schema() -> dict[str, Any]:
    """The one JSON Schema document of the contract: every model under shared ``$defs``."""
    return _json_schema(MODELS)


def schema_for(model_name: str) -> dict[str, Any]:
    """A standalone schema that validates one instance of ``model_name`` (e.g. ``"Anomaly"``)."""
    doc = json_schema()
    if model_name not in doc["models"]:
        raise KeyError(f"{model_name!r} is not an exported model")
    return {"$schema": JSON_SCHEMA_DIALECT, "$id": SCHEMA_ID, "$ref": f"#/$defs/{model_name}", "$defs": doc["$defs"]}


# --- How a JSON Schema node maps to XML (shared with diag_server.api.xml) --------------------------------


def split_null(node: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """(nullable, the node without its null branch): ``X | None`` is X with xsi:nil allowed."""
    key = "anyOf" if "anyOf" in node else "oneOf" if "oneOf" in node else None
    if key is None or NULL not in node[key]:
        return False, node
    rest = [m for m in node[key] if m != NULL]
    if len(rest) == 1:
        return True, rest[0]
    return True, {k: v for k, v in node.items() if k not in ANNOTATIONS} | {key: rest}


def resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node


def shape(node: dict[str, Any], defs: dict[str, Any], where: str) -> str:
    """What kind of XML a (non-null) node becomes; TypeError, naming the field, when there is none."""
    if "$ref" in node:
        return "ref"
    if "anyOf" in node or "oneOf" in node:
        kinds = {shape(resolve(m, defs), defs, where) for m in node.get("anyOf") or node["oneOf"]}
        if kinds <= SIMPLE:
            return "union"
        if kinds == {"model"} and "discriminator" in node:
            return "choice"  # the member is told by its discriminator, here and in to_xml
        if "array" in kinds and kinds - {"array"} <= SIMPLE:
            return "mixed"
        raise TypeError(f"{where}: no XML form for a union of {sorted(kinds)}")
    if "properties" in node:
        return "model"
    if "enum" in node or "const" in node:
        return "enum"
    kind = node.get("type")
    if kind in ("string", "integer", "number", "boolean", "array"):
        return kind
    if kind == "object" and ("additionalProperties" in node or "patternProperties" in node):
        return "dict"
    raise TypeError(f"{where}: no XML form for the JSON Schema {json.dumps(node, sort_keys=True)}")


def dict_parts(node: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(key schema, value schema) of a dict node. A constrained key (``dict[TensorName, X]``) comes as a
    single patternProperties entry from pydantic, an unconstrained one as additionalProperties."""
    patterns, extra = node.get("patternProperties", {}), node.get("additionalProperties")
    key = {"type": "string"} | {k: v for k, v in node.get("propertyNames", {}).items() if k not in ANNOTATIONS}
    if len(patterns) == 1 and extra is None:
        [(key["pattern"], value)] = patterns.items()
    elif not patterns and isinstance(extra, dict):
        value = extra
    else:
        raise TypeError(f"{where}: no XML form for a dict with these key rules: {json.dumps(node, sort_keys=True)}")
    return key, value


def mixed_items(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The item schema of a scalar-or-list union: the union of its list members' items."""
    members = node.get("anyOf") or node["oneOf"]
    items: list[dict[str, Any]] = []
    for m in members:
        if resolve(m, defs).get("type") != "array":
            continue
        item = resolve(m, defs)["items"]
        # Flatten nested unions (list[str] | list[float | None]) so a null item shows as one nillable union.
        for sub in item.get("anyOf", [item]):
            if sub not in items:
                items.append(sub)
    return items[0] if len(items) == 1 else {"anyOf": items}


# --- XSD -------------------------------------------------------------------------------------------


def _xsd_pattern(pattern: str, where: str) -> str:
    """A Python/ECMA regex as an XSD one: XSD patterns match the whole value and know no \\xHH escapes."""
    body = pattern[1:] if pattern.startswith("^") else ".*" + pattern
    body = body[:-1] if body.endswith("$") and not body.endswith("\\$") else body + ".*"

    def controls(m: re.Match[str]) -> str:
        # XML 1.0 cannot hold a control character but tab, LF and CR: a range of them is those it holds.
        lo, hi = int(m[1], 16), int(m[2] or m[1], 16)
        if hi >= 0x20:
            raise TypeError(f"{where}: no XSD form for the regex escape {m[0]!r}")
        return "".join(esc for code, esc in ((9, r"\t"), (10, r"\n"), (13, r"\r")) if lo <= code <= hi)

    body = re.sub(r"\\x([0-9a-fA-F]{2})(?:-\\x([0-9a-fA-F]{2}))?", controls, body)
    if re.search(r"\(\?|\\[bBAZzx]|\[\^?\]", body):
        raise TypeError(f"{where}: no XSD form for the regex {pattern!r}")
    return body


class _Xsd:
    """Turns the JSON Schema $defs into XSD types: one method per kind of node (see ``shape``)."""

    def __init__(self, defs: dict[str, Any]) -> None:
        self.defs = defs
        self.entry_types: dict[str, ET.Element] = {}  # named simple types made for dict entries

    def document(self, models: list[str]) -> ET.Element:
        root = ET.Element("xs:schema", {"xmlns:xs": XS_NS, "version": SCHEMA_VERSION})
        root.append(ET.Comment(" Generated from the models in schemas/ by `python -m schemas.export`; do not edit. "))
        for name in models:
            ET.SubElement(root, "xs:element", name=name, type=name)
        for name, node in self.defs.items():
            kind = shape(node, self.defs, name)
            if kind not in ("model", "enum"):
                raise TypeError(f"{name}: no XML form for a shared definition of kind {kind}")
            root.append(getattr(self, f"{kind}_type")(node, name, name))
        root.extend(self.entry_types.values())
        return root

    def check(self, node: dict[str, Any], allowed: set[str], where: str) -> None:
        unknown = set(node) - allowed - ANNOTATIONS
        if unknown:
            raise TypeError(f"{where}: no XML form for the JSON Schema keywords {sorted(unknown)}")

    def type_of(self, node: dict[str, Any], where: str) -> str | ET.Element:
        """A type name, or an anonymous xs:simpleType / xs:complexType element."""
        return getattr(self, f"{shape(node, self.defs, where)}_type")(node, where)

    def element(
        self, name: str, node: dict[str, Any], where: str, low: int = 1, high: int | None = 1, nillable: bool = False
    ) -> ET.Element:
        nullable, node = split_null(node)
        nullable = nullable or nillable
        kind = self.type_of(node, where)
        el = ET.Element("xs:element", name=name, **({"type": kind} if isinstance(kind, str) else {}))
        if low != 1:
            el.set("minOccurs", str(low))
        if high != 1:
            el.set("maxOccurs", "unbounded" if high is None else str(high))
        if nullable:
            el.set("nillable", "true")
        if not isinstance(kind, str):
            el.append(kind)
        return el

    def field(self, name: str, node: dict[str, Any], where: str, required: bool) -> ET.Element:
        nullable, inner = split_null(node)
        if shape(inner, self.defs, where) == "array":  # a list field repeats its element
            self.check(inner, {"type", "items", "minItems", "maxItems"}, where)
            return self.element(name, inner["items"], where, inner.get("minItems", 0), inner.get("maxItems"), nullable)
        return self.element(name, node, where, int(required))

    def model_type(self, node: dict[str, Any], where: str, name: str | None = None) -> ET.Element:
        self.check(node, {"type", "properties", "required", "additionalProperties"}, where)
        if node.get("additionalProperties", False) is not False:
            raise TypeError(f"{where}: no XML form for extra fields (additionalProperties)")
        complex_type = ET.Element("xs:complexType", **({"name": name} if name else {}))
        sequence = ET.SubElement(complex_type, "xs:sequence")
        required = set(node.get("required", ()))
        for field, sub in node["properties"].items():
            sequence.append(self.field(field, sub, f"{where}.{field}", field in required))
        return complex_type

    def ref_type(self, node: dict[str, Any], where: str) -> str:
        self.check(node, {"$ref"}, where)
        return node["$ref"].rsplit("/", 1)[-1]

    def enum_type(self, node: dict[str, Any], where: str, name: str | None = None) -> ET.Element:
        self.check(node, {"enum", "const", "type"}, where)
        values = node["enum"] if "enum" in node else [node["const"]]
        if not all(isinstance(v, str) for v in values):
            raise TypeError(f"{where}: no XML form for a non-string enum or Literal {values}")
        simple = ET.Element("xs:simpleType", **({"name": name} if name else {}))
        restriction = ET.SubElement(simple, "xs:restriction", base="xs:string")
        for value in values:
            ET.SubElement(restriction, "xs:enumeration", value=value)
        return simple

    def _restrict(self, base: str, facets: list[tuple[str, Any]]) -> str | ET.Element:
        if not facets:
            return base
        simple = ET.Element("xs:simpleType")
        restriction = ET.SubElement(simple, "xs:restriction", base=base)
        for facet, value in facets:
            ET.SubElement(restriction, f"xs:{facet}", value=str(value))
        return simple

    def string_type(self, node: dict[str, Any], where: str) -> str | ET.Element:
        self.check(node, {"type", "minLength", "maxLength", "pattern"}, where)
        facets = [(f, node[k]) for k, f in (("minLength", "minLength"), ("maxLength", "maxLength")) if k in node]
        if "pattern" in node:
            facets.append(("pattern", _xsd_pattern(node["pattern"], where)))
        return self._restrict("xs:string", facets)

    def _numeric(self, base: str, node: dict[str, Any], where: str) -> str | ET.Element:
        self.check(node, {"type", *BOUNDS}, where)
        return self._restrict(base, [(facet, json.dumps(node[k])) for k, facet in BOUNDS.items() if k in node])

    def integer_type(self, node: dict[str, Any], where: str) -> str | ET.Element:
        return self._numeric("xs:integer", node, where)

    def number_type(self, node: dict[str, Any], where: str) -> str | ET.Element:
        # Non-finite numbers are null on the wire, so xs:double's NaN/INF never appear in a document.
        return self._numeric("xs:double", node, where)

    def boolean_type(self, node: dict[str, Any], where: str) -> str:
        self.check(node, {"type"}, where)
        return "xs:boolean"

    def union_type(self, node: dict[str, Any], where: str) -> ET.Element:
        self.check(node, {"anyOf", "oneOf"}, where)
        simple = ET.Element("xs:simpleType")
        union = ET.SubElement(simple, "xs:union")
        members = [self.type_of(m, where) for m in node.get("anyOf") or node["oneOf"]]
        if names := [m for m in members if isinstance(m, str)]:
            union.set("memberTypes", " ".join(names))
        union.extend(m for m in members if not isinstance(m, str))
        return simple

    def choice_type(self, node: dict[str, Any], where: str) -> ET.Element:
        self.check(node, {"anyOf", "oneOf", "discriminator"}, where)
        complex_type = ET.Element("xs:complexType")
        choice = ET.SubElement(complex_type, "xs:choice")
        for member in node.get("anyOf") or node["oneOf"]:
            name = self.ref_type(member, where)
            ET.SubElement(choice, "xs:element", name=name, type=name)
        return complex_type

    def mixed_type(self, node: dict[str, Any], where: str) -> ET.Element:
        self.check(node, {"anyOf", "oneOf"}, where)
        complex_type = ET.Element("xs:complexType", mixed="true")
        sequence = ET.SubElement(complex_type, "xs:sequence")
        sequence.append(self.element("item", mixed_items(node, self.defs), f"{where}[]", 0, None))
        return complex_type

    def array_type(self, node: dict[str, Any], where: str) -> ET.Element:
        self.check(node, {"type", "items", "minItems", "maxItems"}, where)
        complex_type = ET.Element("xs:complexType")
        sequence = ET.SubElement(complex_type, "xs:sequence")
        item = self.element("item", node["items"], f"{where}[]", node.get("minItems", 0), node.get("maxItems"))
        sequence.append(item)
        return complex_type

    def dict_type(self, node: dict[str, Any], where: str) -> ET.Element:
        self.check(node, DICT_KEYWORDS, where)
        key, value = dict_parts(node, where)
        nullable, value = split_null(value)
        complex_type = ET.Element("xs:complexType")
        entry = ET.SubElement(ET.SubElement(complex_type, "xs:sequence"), "xs:element", name="entry")
        entry.set("minOccurs", str(node.get("minProperties", 0)))
        entry.set("maxOccurs", str(node.get("maxProperties", "unbounded")))
        if nullable:
            entry.set("nillable", "true")
        entry.append(self.entry_type(key, value, f"{where}.entry"))
        return complex_type

    def entry_type(self, key: dict[str, Any], value: dict[str, Any], where: str) -> ET.Element:
        """The value's type plus a required ``key`` attribute."""
        attribute = ET.Element("xs:attribute", name="key", use="required")
        key_type = self.string_type(key, f"{where}.key")
        if isinstance(key_type, str):
            attribute.set("type", key_type)
        else:
            attribute.append(key_type)
        value_type = self.type_of(value, where)
        if isinstance(value_type, ET.Element) and value_type.tag == "xs:complexType":
            value_type.append(attribute)
            return value_type
        if isinstance(value_type, ET.Element):  # only a named type can be extended with an attribute
            value_type.set("name", where)
            self.entry_types[where] = value_type
            value_type = where
        complex_content = "properties" in self.defs.get(value_type, {})
        complex_type = ET.Element("xs:complexType")
        content = ET.SubElement(complex_type, "xs:complexContent" if complex_content else "xs:simpleContent")
        ET.SubElement(content, "xs:extension", base=value_type).append(attribute)
        return complex_type


def xsd(models: list[type[BaseModel]] | None = None) -> str:
    """The XSD of ``models`` (default: every exported model), as a pretty, deterministic document."""
    models = MODELS if models is None else models
    doc = _json_schema(models)
    # ElementTree knows no namespaces by prefix without a process-wide registry, so the "xs:" tags are
    # written literally and the prefix is declared on the root.
    root = _Xsd(doc["$defs"]).document(doc["models"])
    ET.indent(root, "  ")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --- Checked-in files --------------------------------------------------------------------------------


def _rendered() -> dict[str, str]:
    return {JSON_FILE: json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n", XSD_FILE: xsd()}


def write(dir: Path | str = HERE) -> list[Path]:
    """Write the generated files into ``dir`` (default: this package); return their paths."""
    paths = []
    for name, text in _rendered().items():
        path = Path(dir) / name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def check(dir: Path | str = HERE) -> list[str]:
    """One message per generated file in ``dir`` that is missing or differs from the models."""
    problems = []
    for name, text in _rendered().items():
        path = Path(dir) / name
        if not path.exists():
            problems.append(f"{path}: missing; run `python -m schemas.export`")
            continue
        old = path.read_text(encoding="utf-8")
        if old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), "checked-in", "models", lineterm="", n=1))
            shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
            problems.append(f"{path}: differs from the models; run `python -m schemas.export`\n{shown}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="list drift instead of writing; exit 1 on drift")
    parser.add_argument("--dir", type=Path, default=HERE, help="where the files live (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.dir)
        print("\n".join(problems) if problems else "schemas are up to date")
        return 1 if problems else 0
    for path in write(args.dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
