"""A pydantic model's JSON Schema as a Markdown reference page: one table per section, in the order a file reads.

The page is written from the schema, so the docs cannot drift from the code (the topology file
reference, ``topology/reference.py``; the hardware profile reference, ``model/hardware_reference.py``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["schema_markdown"]


def schema_markdown(schema: dict[str, Any], header: str) -> str:
    """``header``, then a table of fields for the top level and for every section it leads to."""
    defs = schema.get("$defs", {})
    # Breadth first, so that a section used in two places (intra_node) is listed at its shorter path.
    sections: list[tuple[str, dict[str, Any]]] = []
    queue, seen = [("", schema)], set()
    while queue:
        path, obj = queue.pop(0)
        sections.append((path, obj))
        for name, prop in obj.get("properties", {}).items():
            for ref, suffix in _refs(prop):
                if ref in seen or "properties" not in defs[ref]:  # enums are spelled out in the type column
                    continue
                seen.add(ref)
                queue.append((f"{path}.{name}{suffix}" if path else f"{name}{suffix}", defs[ref]))
    parts = [header]
    for path, obj in sections:
        parts.append(_section(path, obj, defs))
    return "\n".join(parts)


def _refs(prop: dict[str, Any]) -> list[tuple[str, str]]:
    """The object definitions a property leads to, with the path suffix that reaches them (``[]``, ``.<key>``)."""
    found: list[tuple[str, str]] = []
    if "$ref" in prop:
        found.append((prop["$ref"].rsplit("/", 1)[-1], ""))
    for alt in prop.get("anyOf", []) + prop.get("allOf", []):
        found += _refs(alt)
    if isinstance(prop.get("items"), dict):
        found += [(r, "[]" + s) for r, s in _refs(prop["items"])]
    if isinstance(prop.get("additionalProperties"), dict):
        found += [(r, ".<key>" + s) for r, s in _refs(prop["additionalProperties"])]
    return found


def _section(path: str, obj: dict[str, Any], defs: dict[str, Any]) -> str:
    title = f"`{path}`" if path else "Top level"
    lines = [f"## {title}", ""]
    if obj.get("description") and path:
        lines += [" ".join(obj["description"].split()), ""]
    required = set(obj.get("required", []))
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    for name, prop in obj.get("properties", {}).items():
        default = "required" if name in required else _default(prop, defs)
        desc = " ".join(prop.get("description", "").split())
        lines.append(f"| `{name}` | {_cell(_type(prop, defs))} | {default} | {_cell(desc)} |")
    lines.append("")
    return "\n".join(lines)


def _default(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    if "default" not in prop:
        return ""
    value = prop["default"]
    if isinstance(value, dict) and value and any("properties" in defs[r] for r, _ in _refs(prop)):
        return "its fields' defaults"
    if value is None:
        return "—"
    return f"`{json.dumps(value)}`"


def _type(prop: dict[str, Any], defs: dict[str, Any]) -> str:
    """A short human type: ``integer 1-1024``, ``one of nvlink, pcie``, ``list of integer``."""
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        target = defs.get(name, {})
        if "enum" in target:
            return "one of " + ", ".join(f"`{v}`" for v in target["enum"])
        return "section (below)"
    if "anyOf" in prop:
        kinds = [_type(alt, defs) for alt in prop["anyOf"] if alt.get("type") != "null"]
        return " or ".join(dict.fromkeys(kinds))
    if "enum" in prop:
        return "one of " + ", ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    kind = prop.get("type", "any")
    if kind == "array":
        return "list of " + _type(prop.get("items", {}), defs)
    if kind == "object":
        extra = prop.get("additionalProperties")
        return "map to " + _type(extra, defs) if isinstance(extra, dict) else "map"
    bounds = []
    for key, word in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"), ("exclusiveMaximum", "<")):
        if key in prop:
            bounds.append(f"{word} {prop[key]:g}" if isinstance(prop[key], (int, float)) else f"{word} {prop[key]}")
    if "pattern" in prop and kind == "string" and len(prop["pattern"]) < 40:
        bounds.append(f"matching `{prop['pattern']}`")
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
