"""JSON Schema -> llama.cpp grammar.

The conversion is llama-cpp-python's `SchemaConverter` (the Python port of llama.cpp's own
json-schema-to-grammar), kept up with llama.cpp. It skips keywords it does not know without a
word, so every schema is walked first. Structured outputs (`check_schema`) refuse a keyword it
would skip with an `InvalidFieldError` naming the keyword and where it is (a 400): a client that
asks for `minimum` in its answer's format expects it to hold. A tool's parameters (`tool_schema`)
describe the client's tool, and agents send every keyword JSON Schema has: there what cannot be
enforced is left out of the grammar and logged, as hosted APIs accept it.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable

from llama_cpp.llama_grammar import SchemaConverter

from edgechat.errors import InvalidFieldError

log = logging.getLogger("edgechat.tools")

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
_ANY = ["object", "array", "string", "number", "boolean", "null"]
#: the keywords that count characters or items, and the most the grammar holds to
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_COUNT = 512
#: a bound on schema nesting: the converter recurses once per level
_MAX_DEPTH = 64


def _unsupported(param: str, where: str, what: str) -> InvalidFieldError:
    return InvalidFieldError(
        f"{param}: {what} at {where} cannot be enforced by this server's grammar; leave it out",
        param=param,
        code="unsupported_schema",
    )


def _invalid(param: str, message: str) -> InvalidFieldError:
    return InvalidFieldError(f"{param}{message}", param=param, code="invalid_schema")


def _drop_unenforced(out: dict, where: str, skip: Callable[[str, str], None]) -> None:
    """Take out of a node's copy the values of its enforced keywords that the grammar cannot
    hold (each told to `skip`)."""
    for key in _COUNTS:
        # the converter writes a bound as that many nested optional items: a large one is a
        # grammar of megabytes, whose parsing overflows llama.cpp's stack
        if isinstance(out.get(key), int) and out[key] > MAX_COUNT:
            skip(where, f"'{key}' above {MAX_COUNT}")
            del out[key]
    if "format" in out and out["format"] not in _FORMATS:
        skip(where, f"the format {out['format']!r}")
        del out["format"]
    if "items" in out and "prefixItems" in out:
        skip(where, "'prefixItems' together with 'items'")
        del out["prefixItems"]
    if "pattern" in out:
        p = out["pattern"]
        if not isinstance(p, str) or not (p.startswith("^") and p.endswith("$")) or "(?" in p:
            skip(where, "a 'pattern' that is not anchored with ^...$ or uses (?...) groups")
            del out["pattern"]
    ref = out.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/"))):
        skip(where, f"the $ref {ref!r} (only references inside the schema, #...)")
        del out["$ref"]
    if isinstance(out.get("allOf"), list):
        for i, part in enumerate(out["allOf"]):
            # the converter merges only the properties of each part
            if not isinstance(part, dict) or set(part) - {"properties", "required", "type", "$ref", "anyOf", *_HARMLESS}:
                skip(f"{where}/allOf/{i}", "an allOf part with more than properties")


def _walk(schema: object, param: str, strict: bool) -> tuple[dict, list[str]]:
    """A checked copy of `schema` the converter can take, and what of it is not enforced.

    Malformed schemas (a node that is no object, an unknown type, a list keyword that is no
    list) are an InvalidFieldError either way. What the grammar cannot hold (a keyword such as
    `minimum`, an unknown format, an unanchored pattern) is an error when `strict`; otherwise it
    is left out of the copy and named in the list, as "keyword at #/pointer"."""
    if not isinstance(schema, dict):
        raise _invalid(param, " must be a JSON Schema object")
    skipped: list[str] = []

    def skip(where: str, what: str) -> None:
        if strict:
            raise _unsupported(param, where, what)
        skipped.append(f"{what} at {where}")

    def walk(node: object, where: str, depth: int) -> dict:
        if depth > _MAX_DEPTH:
            raise _invalid(param, f" is nested more than {_MAX_DEPTH} levels deep")
        if isinstance(node, bool):
            # true (anything) and false (nothing) are valid schemas the converter does not take:
            # both become "any value"
            skip(where, f"the boolean schema {str(node).lower()}")
            return {}
        if not isinstance(node, dict):
            raise _invalid(param, f": the schema at {where} must be an object")
        out: dict = {}
        for key, value in node.items():
            if key in _ENFORCED or key in _HARMLESS:
                out[key] = value
            else:
                skip(where, f"the keyword '{key}'")
        kind = node.get("type")
        for t in kind if isinstance(kind, list) else [kind]:
            if t is not None and t not in _TYPES:
                raise _invalid(param, f": unknown type {t!r} at {where}")
        _drop_unenforced(out, where, skip)
        for key in ("properties", "$defs", "definitions"):
            sub = out.get(key)
            if sub is not None:
                if not isinstance(sub, dict):
                    raise _invalid(param, f": '{key}' at {where} must be an object")
                out[key] = {name: walk(child, f"{where}/{key}/{name}", depth + 1) for name, child in sub.items()}
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            sub = out.get(key)
            if sub is not None:
                if not isinstance(sub, list) or not sub:
                    raise _invalid(param, f": '{key}' at {where} must be a non-empty list")
                out[key] = [walk(child, f"{where}/{key}/{i}", depth + 1) for i, child in enumerate(sub)]
        if "items" in out:
            out["items"] = walk(out["items"], f"{where}/items", depth + 1)
        extra = out.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            out["additionalProperties"] = walk(extra, f"{where}/additionalProperties", depth + 1)
        if not strict and not set(out) - _HARMLESS:
            # no constraint left: any JSON value (the converter would read {} as an object)
            out["type"] = _ANY
        return out

    return walk(schema, "#", 0), skipped


def check_schema(schema: object, param: str) -> None:
    """Raise a 400 naming the first keyword (and its JSON pointer) that would not be enforced:
    a client that asks for structured output expects every keyword of it to hold."""
    _walk(schema, param, strict=True)


def tool_schema(schema: object, param: str) -> dict:
    """A tool's parameter schema as the grammar enforces it: what the converter cannot hold is
    left out (a tool's schema describes the tool; hosted APIs take any valid keyword there, and
    the tool checks its own arguments). Malformed schemas still raise. What is left out is
    logged once per process for each set."""
    enforced, skipped = _walk(schema, param, strict=False)
    if skipped:
        _log_unenforced(tuple(sorted({s.split(" at ")[0] for s in skipped})))
    return enforced


@functools.cache
def _log_unenforced(what: tuple[str, ...]) -> None:
    log.info("tool schemas: not enforced by the grammar (accepted, left to the tool): %s", ", ".join(what))


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
