"""XML form of the exported models, valid against the checked-in ``schemas/traindx.xsd``.

``to_xml`` walks the same JSON Schema that ``schemas.export`` turns into the XSD, with the same
``shape``/``split_null``/``dict_parts``/``mixed_items``, so both follow one set of rules (listed in
``schemas.export``): elements named like the model and its fields, null as ``xsi:nil="true"``, a list
field as a repeated element, other lists as ``<item>`` children, dicts as ``<entry key="...">``.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from lxml import etree
from pydantic import BaseModel

from schemas import export

XSI = "http://www.w3.org/2001/XMLSchema-instance"
XSD_PATH = Path(export.__file__).with_name(export.XSD_FILE)


@cache
def _defs() -> dict[str, Any]:
    return export.json_schema()["$defs"]


@cache
def xsd_schema() -> etree.XMLSchema:
    """The checked-in XSD, loaded once."""
    # The XSD is a file we ship, but parse it as untrusted all the same: no entities, no network.
    parser = etree.XMLParser(resolve_entities=False, no_network=True)
    return etree.XMLSchema(etree.parse(str(XSD_PATH), parser))


def to_xml(model: BaseModel) -> bytes:
    """``model`` as a UTF-8 XML document whose root element is named like its class (``<Anomaly>``)."""
    name = type(model).__name__
    if type(model) not in export.MODELS:
        raise TypeError(f"{name} is not an exported model; see schemas.export.MODELS")
    root = etree.Element(name, nsmap={"xsi": XSI})
    # The JSON text, not model_dump(mode="json"): only the text turns NaN/Inf into null, as on the wire.
    _fill(root, {"$ref": f"#/$defs/{name}"}, json.loads(model.model_dump_json()), name)
    return etree.tostring(root, xml_declaration=True, encoding="UTF-8", pretty_print=True)


# Characters XML 1.0 cannot carry at all, even escaped (control characters, lone surrogates). They reach
# records from what clients send (an error message quoting a bad key); they are shown as U+FFFD.
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return _NOT_XML.sub("\ufffd", str(value))


def _field(parent: etree._Element, name: str, node: dict[str, Any], value: Any, where: str) -> None:
    _, inner = export.split_null(node)
    if value is not None and export.shape(inner, _defs(), where) == "array":  # a list field repeats
        for item in value:
            _fill(etree.SubElement(parent, name), inner["items"], item, where)
    else:
        _fill(etree.SubElement(parent, name), node, value, where)


def _fill(el: etree._Element, node: dict[str, Any], value: Any, where: str) -> None:
    """Render ``value`` into ``el`` (already named) as the schema ``node`` says."""
    defs = _defs()
    nullable, node = export.split_null(node)
    if value is None:
        if not nullable:  # e.g. a NaN in a plain float field: the JSON form is invalid too
            raise ValueError(f"{where}: null where the schema allows none")
        el.set(f"{{{XSI}}}nil", "true")
        return
    kind = export.shape(node, defs, where)
    if kind == "ref":
        _fill(el, export.resolve(node, defs), value, where)
    elif kind == "model":
        for field, sub in node["properties"].items():
            _field(el, field, sub, value[field], f"{where}.{field}")
    elif kind == "choice":
        ref = node["discriminator"]["mapping"][value[node["discriminator"]["propertyName"]]]
        member = ref.rsplit("/", 1)[-1]
        _fill(etree.SubElement(el, member), {"$ref": ref}, value, f"{where}.{member}")
    elif kind == "dict":
        _, value_node = export.dict_parts(node, where)
        for key, item in value.items():
            _fill(etree.SubElement(el, "entry", key=_text(key)), value_node, item, f"{where}.entry")
    elif kind == "array" or (kind == "mixed" and isinstance(value, list)):
        items = node["items"] if kind == "array" else export.mixed_items(node, defs)
        for item in value:
            _fill(etree.SubElement(el, "item"), items, item, f"{where}[]")
    else:  # enum, string, integer, number, boolean, a union of those, or the scalar side of "mixed"
        el.text = _text(value)
