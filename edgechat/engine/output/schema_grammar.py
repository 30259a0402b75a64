"""JSON Schema -> llama.cpp grammar, refusing what the converter cannot enforce.

The conversion is llama-cpp-python's `SchemaConverter` (the Python port of llama.cpp's own
json-schema-to-grammar), kept up with llama.cpp. It skips keywords it does not know without a
word, so every schema is walked first and a keyword it would skip is an `InvalidFieldError`
naming the keyword and where it is (the server answers it as a 400): a client that asks for
`minimum` expects it to hold. Used by tool calling (tools.py) and by the server's structured
outputs.
"""

from __future__ import annotations

import json
import re

from llama_cpp.llama_grammar import SchemaConverter

from edgechat.errors import InvalidFieldError

#: keywords the converter turns into grammar
_ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "format",
    "minLength", "maxLength",
}  # fmt: skip
#: keywords that describe and constrain nothing, or hold definitions reached through $ref
_HARMLESS = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "$defs", "definitions", "strict",
}  # fmt: skip
#: string formats the converter has a rule for (others would be any string)
_FORMATS = {"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"}
_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
#: a bound on schema nesting: the converter recurses once per level
_MAX_DEPTH = 64


def _unsupported(param: str, where: str, what: str) -> InvalidFieldError:
    return InvalidFieldError(
        f"{param}: {what} at {where} cannot be enforced by this server's grammar; leave it out",
        param=param,
        code="unsupported_schema",
    )


def check_schema(schema: object, param: str) -> None:
    """Raise a 400 naming the first keyword (and its JSON pointer) that would not be enforced."""
    if not isinstance(schema, dict):
        raise InvalidFieldError(f"{param} must be a JSON Schema object", param=param, code="invalid_schema")

    def walk(node: object, where: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise InvalidFieldError(f"{param} is nested more than {_MAX_DEPTH} levels deep", param=param, code="invalid_schema")
        if isinstance(node, bool):
            # true (anything) and false (nothing) are valid schemas the converter does not take
            raise _unsupported(param, where, f"the boolean schema {str(node).lower()}")
        if not isinstance(node, dict):
            raise InvalidFieldError(f"{param}: the schema at {where} must be an object", param=param, code="invalid_schema")
        for key in node:
            if key not in _ENFORCED and key not in _HARMLESS:
                raise _unsupported(param, where, f"the keyword '{key}'")
        kind = node.get("type")
        for t in kind if isinstance(kind, list) else [kind]:
            if t is not None and t not in _TYPES:
                raise InvalidFieldError(f"{param}: unknown type {t!r} at {where}", param=param, code="invalid_schema")
        if "format" in node and node["format"] not in _FORMATS:
            raise _unsupported(param, where, f"the format {node['format']!r}")
        if "items" in node and "prefixItems" in node:
            raise _unsupported(param, where, "'prefixItems' together with 'items'")
        if "pattern" in node:
            p = node["pattern"]
            if not isinstance(p, str) or not (p.startswith("^") and p.endswith("$")) or "(?" in p:
                raise _unsupported(param, where, "a 'pattern' that is not anchored with ^...$ or uses (?...) groups")
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
            raise _unsupported(param, where, f"the $ref {ref!r} (only references inside the schema, #...)")
        if "allOf" in node:
            for i, part in enumerate(node["allOf"]):
                # the converter merges only the properties of each part
                if not isinstance(part, dict) or set(part) - {"properties", "required", "type", "$ref", "anyOf", *_HARMLESS}:
                    raise _unsupported(param, f"{where}/allOf/{i}", "an allOf part with more than properties")
        for key in ("properties", "$defs", "definitions"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    raise InvalidFieldError(f"{param}: '{key}' at {where} must be an object", param=param, code="invalid_schema")
                for name, child in sub.items():
                    walk(child, f"{where}/{key}/{name}", depth + 1)
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list) or not sub:
                    raise InvalidFieldError(f"{param}: '{key}' at {where} must be a non-empty list", param=param, code="invalid_schema")
                for i, child in enumerate(sub):
                    walk(child, f"{where}/{key}/{i}", depth + 1)
        if "items" in node:
            walk(node["items"], f"{where}/items", depth + 1)
        extra = node.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            walk(extra, f"{where}/additionalProperties", depth + 1)

    walk(schema, "#", 0)


def _local_refs(schema: dict, name: str, param: str) -> tuple[dict, dict[str, object]]:
    """A copy of the schema whose $refs are keys of the returned map, each key's last part
    unique to this schema (the converter names a referenced rule after it, and several tool
    schemas share one grammar). The converter's own resolver misses refs next to a $ref
    (a root $ref with its $defs, as generated schemas have), hence this one."""
    copy = json.loads(json.dumps(schema))
    refs: dict[str, object] = {}

    def walk(node: object) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                target: object = copy
                parts = [p.replace("~1", "/").replace("~0", "~") for p in ref[2:].split("/")] if ref != "#" else []
                for part in parts:
                    if isinstance(target, dict) and part in target:
                        target = target[part]
                    elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                        target = target[int(part)]
                    else:
                        raise InvalidFieldError(f"{param}: the $ref {ref!r} points at nothing", param=param, code="invalid_schema")
                # only characters a rule name may hold: the converter uses the name raw in a cycle
                key = "ref/" + re.sub(r"[^A-Za-z0-9-]+", "-", f"{name or 'root'}-{'-'.join(parts) or 'self'}")
                node["$ref"] = key
                refs[key] = target
            for key, value in node.items():
                if key != "$ref":
                    walk(value)

    walk(copy)
    return copy, refs


def schema_rules(schemas: list[tuple[str, dict]], param: str, prop_order: tuple[str, ...] = ()) -> str:
    """GBNF rules for checked schemas, one top rule per (name, schema); an empty name is 'root'."""
    converter = SchemaConverter(prop_order={p: i for i, p in enumerate(prop_order)}, allow_fetch=False, dotall=False, raw_pattern=False)
    try:
        for name, schema in schemas:
            local, refs = _local_refs(schema, name, param)
            converter._refs.update(refs)  # what its resolve_refs would fill, for every ref
            converter.visit(local, name)
    except (AssertionError, KeyError, ValueError, TypeError, RecursionError) as exc:
        raise InvalidFieldError(f"{param}: this schema cannot be turned into a grammar ({exc})", param=param, code="invalid_schema") from None
    return converter.format_grammar()
