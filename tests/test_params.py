"""One table of sampling limits (edgechat/params.py): the engine, the server's schemas, the chat
app's settings and the CLI's options give every value the same verdict."""

from __future__ import annotations

import math

import click
import pytest

from edgechat.cli.run import run_cmd
from edgechat.errors import InvalidFieldError, UsageError
from edgechat.params import SAMPLING_LIMITS, SamplingParams, check_sampling
from edgechat.server.errors import ApiError
from edgechat.server.openai_chat_api import parse_chat, parse_completion
from edgechat.tui.config import CHAT_DEFAULTS, SAMPLING_SETTINGS, validate_settings

USER = [{"role": "user", "content": "hi"}]
#: the server's names where llama-server's differ from SamplingParams'
WIRE = {"penalty_last_n": "repeat_last_n"}


def _probes(limit) -> list:
    """Values at, inside and just outside each end, and the ones no range takes."""
    step = 1 if limit.kind is int else 0.01
    values = [limit.lo - step, limit.lo, limit.lo + step, math.nan, math.inf]
    if limit.hi is None:
        values.append(10**6)
    else:
        values += [(limit.lo + limit.hi) / 2, limit.hi - step, limit.hi, limit.hi + step]
    if limit.kind is int:
        values.append(limit.lo + 1.5)  # not an integer
    return values


def engine_verdict(name, value) -> bool:
    try:
        check_sampling(SamplingParams(**{name: value}))
    except UsageError:
        return False
    return True


def server_verdict(name, value, parse=parse_chat) -> bool:
    field = WIRE.get(name, name)
    body = {"messages": USER} if parse is parse_chat else {"prompt": "hi"}
    try:
        parse({**body, field: value})
    except ApiError as exc:
        assert exc.status == 400 and exc.param == field, exc.body()
        return False
    return True


def app_verdict(name, value) -> bool:
    try:
        validate_settings({**CHAT_DEFAULTS, name: value})
    except UsageError:
        return False
    return True


def cli_verdict(name, value) -> bool:
    """What `edgechat run --NAME VALUE` makes of the value as typed."""
    option = next(p for p in run_cmd.params if p.name == name)
    try:
        option.type.convert(repr(value) if isinstance(value, float) else str(value), option, None)
    except click.BadParameter:
        return False
    return True


CASES = [(name, value) for name, limit in SAMPLING_LIMITS.items() for value in _probes(limit)]


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v}" for n, v in CASES])
def test_a_sampling_value_gets_one_verdict_from_the_engine_the_server_the_app_and_the_cli(name, value):
    limit = SAMPLING_LIMITS[name]
    expected = limit.accepts(value)
    inside = math.isfinite(value) and (value > limit.lo if limit.lo_open else value >= limit.lo) \
        and (limit.hi is None or value <= limit.hi) and (limit.kind is float or float(value).is_integer())
    assert expected is inside  # the table says what its columns say
    verdicts = {"engine": engine_verdict(name, value), "chat": server_verdict(name, value),
                "completion": server_verdict(name, value, parse_completion)}
    if name in SAMPLING_SETTINGS:
        verdicts["app"] = app_verdict(name, value)
        # the settings dialog's text goes through the same check
        verdicts["app (typed)"] = app_verdict(name, repr(value) if isinstance(value, float) else str(value))
    if any(p.name == name for p in run_cmd.params):
        verdicts["cli"] = cli_verdict(name, value)
    assert verdicts == dict.fromkeys(verdicts, expected)


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        # where the three used to disagree
        ("top_p", 0.0, True),  # OpenAI takes 0 (only the most likely token); the app refused it
        ("repeat_penalty", 0.0, False),  # the CLI and the server took it, the engine then refused every request
        ("temperature", 2.5, False),  # past OpenAI's 2: the CLI, the app and the engine took it
        ("presence_penalty", 3.0, False),  # the engine took any
        ("penalty_last_n", -1, False),  # the engine took it and penalised all but the first prompt token
    ],
)
def test_the_rules_where_the_front_ends_used_to_disagree(name, value, accepted):
    assert engine_verdict(name, value) is server_verdict(name, value) is accepted
    if name in SAMPLING_SETTINGS:
        assert app_verdict(name, value) is accepted


def test_the_errors_name_the_field_and_its_range_in_each_front_ends_words():
    with pytest.raises(InvalidFieldError) as engine:
        check_sampling(SamplingParams(top_p=1.5))
    assert (str(engine.value), engine.value.param) == ("top_p must be between 0 and 1 (got 1.5); 1 = off", "top_p")
    with pytest.raises(ApiError) as server:
        parse_chat({"messages": USER, "repeat_last_n": -2})
    body = server.value.body()["error"]
    assert body == {"message": "'repeat_last_n' must be an integer 0 or more (got -2); 0 = none", "type": "invalid_request_error",
                    "param": "repeat_last_n", "code": "invalid_value"}
    with pytest.raises(ApiError) as typed:
        parse_chat({"messages": USER, "top_k": "40"})
    assert typed.value.body()["error"]["code"] == "invalid_type" and typed.value.param == "top_k"
    with pytest.raises(UsageError, match=r"^repeat-penalty must be above 0 and at most 10 \(got 0\); 1 = off$"):
        validate_settings({**CHAT_DEFAULTS, "repeat_penalty": "0"})
    # a TOML true is not the number 1
    with pytest.raises(UsageError, match=r"^temperature must be a number, not bool$"):
        validate_settings({**CHAT_DEFAULTS, "temperature": True})


def test_each_string_setting_is_one_enum_from_the_cli_and_the_server_to_the_engine():
    from edgechat.cli.serve import serve_cmd
    from edgechat.engine import ChatRequest, EngineConfig
    from edgechat.params import CHOICES, ContextPolicy, KVType, SpeculativeMode, values

    for command in (run_cmd, serve_cmd):
        options = {p.name: p for p in command.params}
        for name, setting in CHOICES.items():
            if name in options:  # serve has no --context-policy: a request's conversation sets it
                assert list(options[name].type.choices) == values(setting), (command.name, name)
    # the word and the member are one value, which prints as the word
    config = EngineConfig(kv_type="q8_0", speculative=SpeculativeMode.LOOKUP)
    assert config.kv_type is KVType.Q8_0 and config.speculative is SpeculativeMode.LOOKUP
    assert f"{config.kv_type}" == "q8_0" and config.kv_type == "q8_0"
    for name in ("kv_type", "flash_attn", "swa_cache", "speculative"):
        words = values(CHOICES[name])
        with pytest.raises(UsageError) as err:
            EngineConfig(**{name: "nope"})
        assert str(err.value) == f"{name} must be {', '.join(words[:-1])} or {words[-1]} (got 'nope')"
    with pytest.raises(UsageError, match=r"^context_policy must be shift, truncate or summarize \(got 'drop'\)$"):
        ChatRequest(messages=USER, context_policy="drop")
    assert ChatRequest(messages=USER, speculative="off").speculative is SpeculativeMode.OFF
    assert ChatRequest(messages=USER).context_policy is ContextPolicy.SHIFT
    with pytest.raises(ApiError) as server:
        parse_chat({"messages": USER, "speculative": "fast"})
    assert server.value.param == "speculative" and "auto, off, lookup or draft" in server.value.message
    assert parse_chat({"messages": USER, "speculative": "lookup"}).request.speculative is SpeculativeMode.LOOKUP
    with pytest.raises(UsageError, match=r"^speculative decoding must be auto, off, lookup or draft \(got 'fast'\)$"):
        validate_settings({**CHAT_DEFAULTS, "speculative": "fast"})
