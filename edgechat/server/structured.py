"""Structured outputs on the server: `response_format`, Responses' `text.format`, and the
`grammar` extension field, each wrong value a 400 naming it. The schemas become grammars in
the engine's schema_grammar.py."""

from __future__ import annotations

import re

from edgechat.engine.output.schema_grammar import check_schema, schema_rules
from edgechat.params import Grammar
from edgechat.server.errors import bad_request


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
        # llama-server's extension: a `schema` beside the type (any JSON value under it)
        schema = value.get("schema", {"type": "object"})
        check_schema(schema, f"{param}.schema")
        return Grammar(schema_rules([("", schema)], f"{param}.schema"), json_schema=schema)
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
    return Grammar(schema_rules([("", schema)], f"{where}.schema"), json_schema=schema)


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
