"""The shortest valid end of a JSON answer cut short under a schema (jsonvalue.JsonPrefix.closing),
on the texts Qwen2.5-Coder-0.5B wrote in bench/bench_tools.py's json_schema cases at max_tokens 24."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgechat.engine.jsonvalue import JsonPrefix

S = {"type": "string"}
PERSON = {"type": "object", "properties": {"name": S, "age": {"type": "integer"}, "city": S},
          "required": ["name", "age", "city"], "additionalProperties": False}
RECIPE = {"type": "object", "properties": {"title": S, "ingredients": {"type": "array", "items": S, "minItems": 1},
                                           "minutes": {"type": "integer"}},
          "required": ["title", "ingredients", "minutes"], "additionalProperties": False}


@pytest.mark.parametrize("schema, text", [
    # a key just opened: it must become one of the schema's keys, not the empty one
    (PERSON, '{"name": "Maria Lopez", "age": 34, "'),
    (PERSON, '{"name": "Maria Lopez", "age": 34, "ci'),
    (RECIPE, '{"title": "Simple Pancake Recipe", "'),
    (RECIPE, '{"title": "Simple Pancake Recipe", "ingredients": ["flour", "eggs"], "min'),
    (PERSON, '{"name": "Maria Lopez", "age": 34,'),
    (PERSON, '{"name": "Maria Lo'),
])
def test_a_cut_answer_closes_valid_under_its_schema(schema, text):
    prefix = JsonPrefix(schema)
    prefix.feed(text)
    assert prefix.valid
    whole = text + prefix.closing()
    jsonschema.validate(json.loads(whole), schema)
