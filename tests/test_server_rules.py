"""The rules every API shares, set once by the dispatcher after translation (server/rules.py):
translators hand over the client's tools, grammar and max_tokens as sent; the rules give each
model its own copy, with its family's tool grammar, the reasoning split and max_tokens fitted."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from edgechat.engine.output.toolfamilies import GENERIC, HERMES
from edgechat.engine.output.tools import tool_grammar
from edgechat.params import SamplingParams
from edgechat.server import anthropic_api, ollama_api, openai_chat_api, openai_responses_api
from edgechat.server.rules import fit_max_tokens, for_model
from edgechat.server.settings import ServerSettings

ASK = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _translated(settings: ServerSettings) -> dict:
    """One request offering the same tool through each API that takes tools."""
    dispatcher = SimpleNamespace(settings=settings, defaults_for=lambda name: SamplingParams())
    function = {"name": "get_weather", "parameters": PARAMS}
    return {
        "chat": openai_chat_api.parse_chat({"messages": ASK, "tools": [{"type": "function", "function": function}]}),
        "responses": openai_responses_api.parse_responses({"input": ASK, "tools": [{"type": "function", **function}]}, settings).parsed,
        "anthropic": anthropic_api.parse_messages({"messages": ASK, "max_tokens": 9, "tools": [{"name": "get_weather", "input_schema": PARAMS}]},
                                                  settings),
        "ollama": ollama_api.parse_chat({"model": "m", "messages": ASK, "tools": [{"type": "function", "function": function}]}, dispatcher),
    }


@pytest.mark.parametrize("family", [GENERIC, HERMES], ids=lambda f: f.name)
def test_every_api_hands_over_its_tools_and_the_rules_set_the_familys_grammar(family):
    settings = ServerSettings()
    for api, parsed in _translated(settings).items():
        req = parsed.request
        assert req.tools is not None and req.grammar is None, api
        ruled = for_model(req, family, settings)
        assert ruled.grammar == tool_grammar(req.tools, family), api
        assert ruled.split_reasoning and ruled is not req and req.grammar is None, api


def test_the_reasoning_split_follows_the_servers_setting_on_every_api():
    settings = ServerSettings(reasoning_format="none")
    for api, parsed in _translated(settings).items():
        assert not for_model(parsed.request, GENERIC, settings).split_reasoning, api
        assert parsed.request.split_reasoning, api  # the translator's request is left as sent


def test_a_client_grammar_stays_without_tools():
    settings = ServerSettings()
    parsed = openai_chat_api.parse_chat({"messages": ASK, "response_format": {"type": "json_object"}})
    assert for_model(parsed.request, HERMES, settings).grammar == parsed.request.grammar is not None


@pytest.mark.parametrize(
    "asked, prompt, n_ctx, fitted",
    [
        (10**9, 100, 1000, 900),  # cut to the room the prompt leaves
        (50, 100, 1000, 50),  # fits as asked
        (None, 100, 1000, 900),  # none asked: the room, where it is a quarter of the context or more
        (None, 900, 1000, None),  # less room: the engine's own limit decides
        (2000, 1000, 1000, 2000),  # no room at all: the engine refuses the prompt itself
    ],
)
def test_max_tokens_is_fitted_to_the_models_room(asked, prompt, n_ctx, fitted):
    assert fit_max_tokens(asked, prompt, n_ctx) == fitted


def test_each_model_fits_its_own_copy():
    """A failover re-fits for the fallback: fitting for the primary leaves the translated request as sent."""
    settings = ServerSettings()
    parsed = openai_chat_api.parse_chat({"messages": ASK, "max_tokens": 10**9})
    primary = for_model(parsed.request, GENERIC, settings)
    primary = dataclasses.replace(primary, max_tokens=fit_max_tokens(primary.max_tokens, 100, 512))
    fallback = for_model(parsed.request, GENERIC, settings)
    assert primary.max_tokens == 412 and parsed.request.max_tokens == fallback.max_tokens == 10**9
    assert fit_max_tokens(fallback.max_tokens, 100, 2048) == 1948
