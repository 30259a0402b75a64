"""The shortest valid end of a JSON answer cut short under a schema (jsonvalue.JsonPrefix.closing),
on the texts Qwen2.5-Coder-0.5B writes in bench/bench_tools.py's json_schema cases, and on the
model itself."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.bench_tools import JSON_PROMPTS, PERSON, RECIPE
from edgechat.engine import Engine, EngineConfig
from edgechat.engine.output.jsonvalue import JsonPrefix
from edgechat.params import SamplingParams
from edgechat.server.openai_chat_api import parse_chat


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


@pytest.fixture(scope="module")
def qwen(qwen_coder_path, models_root):
    eng = Engine(EngineConfig(model=str(qwen_coder_path), n_ctx=1024, n_parallel=1, paths=models_root))
    yield eng
    eng.close()


CUT = [pytest.param(name, schema, prompt, n, id=f"{name}-{n}") for name, schema, prompt in JSON_PROMPTS for n in (24, 48)]


@pytest.mark.slow
@pytest.mark.parametrize("name, schema, prompt, max_tokens", CUT)
def test_a_json_answer_ends_valid_within_max_tokens_on_the_real_model(qwen, name, schema, prompt, max_tokens):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}}
    request = parse_chat(body).request
    request.sampling = SamplingParams(temperature=0)
    finished = qwen.submit(request).result()
    jsonschema.validate(json.loads(finished.text), schema)
    # the closing counts against max_tokens like any token the model writes
    assert finished.metrics.completion_tokens <= max_tokens, finished.text
