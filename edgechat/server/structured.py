"""JSON Schema -> llama.cpp grammar, refusing what the converter cannot enforce.

The conversion is llama-cpp-python's `SchemaConverter` (the Python port of llama.cpp's own
json-schema-to-grammar), kept up with llama.cpp. It skips keywords it does not know without a
word, so every schema is walked first and a keyword it would skip is a 400 naming the keyword
and where it is: a client that asks for `minimum` expects it to hold.
"""

from __future__ import annotations

import json
import re

from llama_cpp.llama_grammar import SchemaConverter

from edgechat.engine.request import Grammar
from edgechat.server.errors import ApiError, bad_request

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


def _unsupported(param: str, where: str, what: str) -> ApiError:
    return bad_request(
        f"{param}: {what} at {where} cannot be enforced by this server's grammar; leave it out",
        param=param,
        code="unsupported_schema",
    )


def check_schema(schema: object, param: str) -> None:
    """Raise a 400 naming the first keyword (and its JSON pointer) that would not be enforced."""
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON Schema object", param=param, code="invalid_schema")

    def walk(node: object, where: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise bad_request(f"{param} is nested more than {_MAX_DEPTH} levels deep", param=param, code="invalid_schema")
        if isinstance(node, bool):
            # true (anything) and false (nothing) are valid schemas the converter does not take
            raise _unsupported(param, where, f"the boolean schema {str(node).lower()}")
        if not isinstance(node, dict):
            raise bad_request(f"{param}: the schema at {where} must be an object", param=param, code="invalid_schema")
        for key in node:
            if key not in _ENFORCED and key not in _HARMLESS:
                raise _unsupported(param, where, f"the keyword '{key}'")
        kind = node.get("type")
        for t in kind if isinstance(kind, list) else [kind]:
            if t is not None and t not in _TYPES:
                raise bad_request(f"{param}: unknown type {t!r} at {where}", param=param, code="invalid_schema")
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
                    raise bad_request(f"{param}: '{key}' at {where} must be an object", param=param, code="invalid_schema")
                for name, child in sub.items():
                    walk(child, f"{where}/{key}/{name}", depth + 1)
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = node.get(key)
            if sub is not None:
                if not isinstance(sub, list) or not sub:
                    raise bad_request(f"{param}: '{key}' at {where} must be a non-empty list", param=param, code="invalid_schema")
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
                        raise bad_request(f"{param}: the $ref {ref!r} points at nothing", param=param, code="invalid_schema")
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
        raise bad_request(f"{param}: this schema cannot be turned into a grammar ({exc})", param=param, code="invalid_schema") from None
    return converter.format_grammar()


def response_format_grammar(value: object) -> Grammar | None:
    """The grammar for `response_format` (None for plain text), or a 400 naming what is wrong."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'response_format' must be an object", param=param, code="invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(schema_rules([("", {"type": "object"})], param))
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be one of text, json_object, json_schema", param="response_format.type", code="invalid_value"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param="response_format.json_schema", code="invalid_type")
    return json_schema_grammar(spec, "response_format.json_schema")


def json_schema_grammar(spec: dict, where: str) -> Grammar:
    """The grammar for a `{name, schema, strict}` object at `where` (chat nests it in
    response_format.json_schema, Responses has it flat in text.format)."""
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad_request(f"{where}.name must be 1-64 letters, digits, _ or -", param=f"{where}.name", code="invalid_value")
    if not isinstance(spec.get("strict", False), bool):
        raise bad_request(f"{where}.strict must be a boolean", param=f"{where}.strict", code="invalid_type")
    # an absent schema means any JSON object; strict or not, the grammar holds it to the schema
    schema = spec.get("schema", {"type": "object"})
    check_schema(schema, f"{where}.schema")
    return Grammar(schema_rules([("", schema)], f"{where}.schema"))


#: `{m,n}` after an element of a GBNF grammar; literals, classes and comments are skipped first
_GBNF_SKIP = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*')
_GBNF_BOUNDS = re.compile(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}")


def check_gbnf(gbnf: str, param: str) -> None:
    """What llama.cpp's grammar parser would not refuse but hang on: a repetition `{m,n}` with m
    greater than n (it loops for good). The rest is left to its parser."""
    for low, high in _GBNF_BOUNDS.findall(_GBNF_SKIP.sub(" ", gbnf)):
        if int(low) > int(high):
            raise bad_request(f"'{param}' repeats an element {{{low},{high}}} times: the minimum is above the maximum",
                              param=param, code="invalid_grammar")
