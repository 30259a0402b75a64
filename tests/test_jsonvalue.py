"""JSON values against schemas (engine/output/jsonvalue.py): the tool parser's hold-back and the closing
of a schema-held answer before max_tokens. Every prefix of real JSON texts, pretty or not, escapes
and enums included, must stay a valid prefix and close into a value that fits the schema; the
check is against jsonschema, an independent validator."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edgechat.engine.output.jsonvalue import JsonPrefix, fits, shortest, step_texts

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
        "score": {"type": ["number", "null"]},
    },
    "required": ["city", "days", "tags", "unit", "nested"],
}
VALUES = [
    {"city": 'Pa"ris \u00e9\\n', "days": 12, "tags": ["a", "bb"], "unit": "fahrenheit", "nested": {"ok": True}, "score": -1.5e3},
    {"unit": "celsius", "nested": {"ok": False}, "tags": ["x"], "days": 0, "city": ""},
]


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("indent", [None, 2])
def test_every_prefix_closes_into_a_value_the_schema_accepts(value, indent):
    text = json.dumps(value, indent=indent, ensure_ascii=indent is None)
    assert fits(value, SCHEMA)
    for i in range(len(text)):
        prefix = JsonPrefix(SCHEMA)
        prefix.feed(text[:i])
        assert prefix.valid and prefix.end is None, text[:i]
        closed = json.loads(text[:i] + prefix.closing())
        jsonschema.validate(closed, SCHEMA)
    whole = JsonPrefix(SCHEMA)
    whole.feed(text + "\n\nmore text")
    assert whole.end == len(text) and whole.closing() == ""


def test_text_that_cannot_become_json_is_told_at_once():
    for bad in ('{"a": x', "{'a': 1}", '{"a" 1}', "[1,,2]", '"\\q"', "tru e"):
        prefix = JsonPrefix()
        prefix.feed(bad)
        assert not prefix.valid, bad


def test_fits_and_shortest_follow_the_schema():
    assert shortest(SCHEMA) == '{"city": "", "days": 0, "tags": [""], "unit": "celsius", "nested": {"ok": false}}'
    jsonschema.validate(json.loads(shortest(SCHEMA)), SCHEMA)
    assert not fits({"city": ["Paris"], "days": 1, "tags": ["a"], "unit": "celsius", "nested": {"ok": True}}, SCHEMA)
    assert not fits({"city": "Paris"}, SCHEMA)  # required fields missing
    assert not fits({"city": "a", "days": 1, "tags": [], "unit": "celsius", "nested": {"ok": True}}, SCHEMA)  # minItems
    assert not fits({"city": "a", "days": 1.5, "tags": ["a"], "unit": "celsius", "nested": {"ok": True}}, SCHEMA)
    assert fits({"x": 1}, {"type": "object", "additionalProperties": True}) and not fits({"x": 1}, {"type": "object", "additionalProperties": False})


def test_step_texts_name_what_one_token_can_open():
    attendee = {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}}, "required": ["name", "email"]}
    schema = {"type": "object", "properties": {"topic": {"type": "string"}, "attendees": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
              "required": ["topic", "attendees"], "$defs": {"a": attendee}}
    steps = step_texts(schema)
    # a key opened brings its shortest value; an array's item its required fields, through the $ref
    assert '"topic": ""' in steps and '"attendees": []' in steps
    assert '{"name": "", "email": ""}' in steps and '"email": ""' in steps
    # the longest is the attendee object: what the closing can grow by when the model opens one
    assert max(steps, key=len) == '{"name": "", "email": ""}'
