"""The server's pure pieces: request parsing and validation, the degrade switch; the load generator's statistics."""

from __future__ import annotations

import math
import random
import time

import pytest

from edgechat.engine.types.request import Infill
from edgechat.errors import EngineBusyError, EngineStoppedError, InvalidFieldError, PromptTooLongError
from edgechat.loadgen import RequestResult, Run, make_prompt, prompt_token_targets, summarize
from edgechat.server.degrade import DegradeSwitch
from edgechat.server.errors import ApiError, from_engine_error
from edgechat.server.fields import decode_body
from edgechat.server.openai_chat_api import parse_chat, parse_completion

USER = [{"role": "user", "content": "hi"}]


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    assert info.value.status == 400
    body = info.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return info.value


def test_chat_fields_map_onto_the_engine_request():
    parsed = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            "max_completion_tokens": 7,
            "max_tokens": 99,
            "temperature": 0,
            "top_p": 0.5,
            "seed": -1,
            "stop": "END",
            "stream": True,
            "stream_options": {"include_usage": True},
            "presence_penalty": 1.5,
            "ignore_eos": True,
            "repeat_last_n": 128,
            "some_future_field": {"ignored": True},
        }
    )
    req = parsed.request
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    assert req.max_tokens == 7  # the newer name wins
    assert req.sampling.temperature == 0.0 and req.sampling.top_p == 0.5
    assert req.sampling.seed == 0xFFFFFFFF  # folded into llama.cpp's 32-bit seed
    assert req.sampling.presence_penalty == 1.5
    assert req.sampling.penalty_last_n == 128  # llama-server's name for the penalty window
    assert req.stop == ["END"] and req.ignore_eos
    assert parsed.stream and parsed.include_usage and parsed.model == "m"


def test_completion_defaults_to_sixteen_tokens_like_openai():
    parsed = parse_completion({"prompt": ["Once upon a time"]})
    assert parsed.request.prompt == "Once upon a time"
    assert parsed.request.max_tokens == 16
    assert parsed.request.messages is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].image_url"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ({"messages": USER, "max_tokens": "10"}, "max_tokens"),
        ({"messages": USER, "max_tokens": True}, "max_tokens"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "temperature": 3}, "temperature"),
        ({"messages": USER, "temperature": float("nan")}, "temperature"),
        ({"messages": USER, "top_p": -0.1}, "top_p"),
        ({"messages": USER, "stop": 3}, "stop"),
        ({"messages": USER, "stop": [""]}, "stop"),
        ({"messages": USER, "stream": "yes"}, "stream"),
        ({"messages": USER, "stream_options": []}, "stream_options"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": 17}, "n"),
        ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": USER, "model": 7}, "model"),
        ({"messages": USER, "logprobs": "yes"}, "logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": USER, "response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param):
    assert _error(parse_chat, body).param == param


def test_json_object_takes_llama_servers_schema():
    fmt = {"type": "json_object", "schema": {"type": "array", "items": {"type": "integer"}}}
    grammar = parse_chat({"messages": USER, "response_format": fmt}).request.grammar
    assert grammar is not None and grammar.json_schema == fmt["schema"]
    assert parse_chat({"messages": USER, "response_format": {"type": "json_object"}}).request.grammar.json_schema == {"type": "object"}
    with pytest.raises(InvalidFieldError) as bad:  # a 400 naming the field, as for json_schema's
        parse_chat({"messages": USER, "response_format": {"type": "json_object", "schema": 123}})
    assert bad.value.param == "response_format.schema"


@pytest.mark.parametrize(
    "body, param",
    [({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 2, 3]}, "prompt"), ({"prompt": "x", "echo": True}, "echo")],
)
def test_bad_completion_bodies_name_the_field(body, param):
    assert _error(parse_completion, body).param == param


@pytest.mark.parametrize(
    "field, value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("modalities", ["text", "audio"]),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("verbosity", "low"),
        ("web_search_options", {}),
        # llama-server and vLLM extensions the engine's sampler chain does not have
        ("typical_p", 0.5),
        ("mirostat", 2),
        ("guided_json", {"type": "object"}),
        ("repetition_penalty", 1.3),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_not_ignored(field, value):
    error = _error(parse_chat, {"messages": USER, field: value})
    assert error.param == field and f"'{field}'" in error.message


@pytest.mark.parametrize(
    "field, value",
    [("logprobs", 6), ("best_of", 3), ("echo", True), ("tools", [])],
)
def test_completion_fields_that_would_change_the_answer_are_refused(field, value):
    assert _error(parse_completion, {"prompt": "x", field: value}).param == field


def test_logit_bias_in_openais_and_llama_servers_shapes():
    assert parse_chat({"messages": USER, "logit_bias": {"15": 5, "7": -100}}).request.sampling.logit_bias == ((15, 5.0), (7, -100.0))
    assert parse_completion({"prompt": "x", "logit_bias": [[15, -1.5], [16, False]]}).request.sampling.logit_bias == (
        (15, -1.5), (16, -math.inf))
    for bad in ({"15": 101}, {"15": "x"}, {"hello": 1}, [[15]], "15", [["hello", 1]]):
        error = _error(parse_chat, {"messages": USER, "logit_bias": bad})
        assert error.param == "logit_bias" and error.status == 400, bad


def test_a_completion_with_a_suffix_is_a_fill_in_the_middle():
    request = parse_completion({"prompt": "def f():\n    ", "suffix": "\n    return x\n"}).request
    assert request.prompt is None and request.infill == Infill("def f():\n    ", "\n    return x\n")
    # at the start of a file the prompt is empty
    assert parse_completion({"prompt": "", "suffix": "x = 1\n"}).request.infill == Infill("", "x = 1\n")
    assert _error(parse_completion, {"prompt": "x", "suffix": 3}).param == "suffix"
    assert _error(parse_chat, {"messages": USER, "suffix": "x"}).param == "suffix"


def test_fields_that_change_nothing_here_are_accepted():
    harmless = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": False,
        "prediction": {"type": "content", "content": "hi"},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        # the "off" values of refused features
        "logit_bias": {},
        "logprobs": False,
        "top_logprobs": 0,
        "n": 1,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "typical_p": 1.0,
        "mirostat": 0,
        "repetition_penalty": 1,
        "audio": None,
    }
    assert parse_chat({"messages": USER, **harmless}).request.messages == USER


def test_error_messages_do_not_echo_huge_or_deep_values():
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    for body in (
        {"messages": [{"role": deep, "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": deep}]}]},
        {"messages": [{"role": "x" * 100_000, "content": "x"}]},
    ):
        assert len(_error(parse_chat, body).message) < 300


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
        b'{"a": ' * 3_000 + b"1" + b"}" * 3_000,
    ],
    ids=["unclosed-arrays", "nested-messages", "nested-objects"],
)
def test_deeply_nested_json_is_a_fast_400(raw):
    start = time.perf_counter()
    error = _error(decode_body, raw)
    assert "nested too deeply" in error.message
    # a hang guard, not a benchmark: a parser that recursed or retried would take far longer
    assert time.perf_counter() - start < 5


class _Unread(list):
    """A message list that fails the test if any message in it is looked at."""

    def __iter__(self):
        raise AssertionError("a message was read")

    def __getitem__(self, index):
        raise AssertionError("a message was read")


def test_too_many_messages_are_refused_before_any_is_read():
    # the count is checked first, so a flood costs no per-message work
    error = _error(parse_chat, {"messages": _Unread(["x"] * 200_000)}, 2048)
    assert (error.param, error.code) == ("messages", "too_many_messages")
    assert "200000" in error.message and "2048" in error.message
    assert len(parse_chat({"messages": USER * 3}, 3).request.messages) == 3


def test_a_huge_max_tokens_parses_and_is_left_to_the_server_to_clamp():
    assert parse_chat({"messages": USER, "max_tokens": 10**9}).request.max_tokens == 10**9


@pytest.mark.parametrize(
    "raw, words",
    [(b"\xff\xfe{}", "not valid UTF-8"), (b"{bad", "not valid JSON"), (b"[1, 2]", "JSON object"), (b"", "not valid JSON")],
)
def test_undecodable_bodies_are_400(raw, words):
    assert words in _error(decode_body, raw).message


def test_degrade_switch_caps_under_sustained_queueing_and_releases_when_load_falls():
    changes = []
    switch = DegradeSwitch(threshold_s=2.0, max_tokens_cap=64, on_switch=changes.append)
    switch.observe(10.0)  # one slow request moves the average (3.0) over the threshold
    assert switch.active and changes == [True]
    assert switch.cap(None) == 64 and switch.cap(1000) == 64 and switch.cap(10) == 10
    switch.observe(1.5)  # average 2.55: still above half the threshold, stays on
    assert switch.active
    switch.on_admit(waiting=3, oldest_wait=0.5)
    assert switch.active
    switch.on_admit(waiting=0, oldest_wait=0.0)
    assert not switch.active and changes == [True, False]
    assert switch.cap(1000) == 1000


def test_degrade_switch_reacts_to_the_live_queue_before_anything_finishes():
    switch = DegradeSwitch(threshold_s=2.0, max_tokens_cap=64)
    switch.on_admit(waiting=5, oldest_wait=1.0)
    assert not switch.active
    switch.on_admit(waiting=5, oldest_wait=2.5)
    assert switch.active
    switch.on_admit(waiting=1, oldest_wait=1.5)  # above half the threshold: hysteresis keeps it on
    assert switch.active
    switch.on_admit(waiting=1, oldest_wait=0.2)
    assert not switch.active


def test_degrade_switch_can_be_disabled():
    switch = DegradeSwitch(threshold_s=None, max_tokens_cap=64)
    for _ in range(10):
        switch.observe(100.0)
        switch.on_admit(waiting=9, oldest_wait=100.0)
    assert not switch.active and switch.cap(500) == 500


def test_prompt_mix_is_long_tailed_and_reproducible():
    targets = prompt_token_targets(2000, random.Random(1))
    assert targets == prompt_token_targets(2000, random.Random(1))
    assert min(targets) >= 20 and max(targets) <= 400
    short = sum(t <= 100 for t in targets) / len(targets)
    long = sum(t >= 200 for t in targets) / len(targets)
    assert short > 0.6 and 0.01 < long < 0.15
    assert len(make_prompt(400, random.Random(0)).split()) > 4 * len(make_prompt(20, random.Random(0)).split())


def test_summaries_pool_requests_and_time_across_runs():
    def run(duration, *tokens):
        results = [RequestResult(50, status=200, ttft=0.1 * t, e2e=1.0 * t, output_tokens=t) for t in tokens]
        return Run("u", "m", 2, results, duration)

    failed = RequestResult(50, status=429, error="HTTP 429")
    second = run(3.0, 2, 4)
    second.results.append(failed)
    report = summarize([run(1.0, 10, 10), second])
    assert (report.requests, report.ok, report.failed) == (5, 4, 1)
    assert report.output_tokens == 26 and report.output_tok_s == pytest.approx(26 / 4.0)
    # nearest rank (the engine's percentile): the 2nd of 0.2, 0.4, 1.0, 1.0
    assert report.ttft["p50"] == pytest.approx(0.4)
    # TPOT: (e2e - ttft) / (tokens - 1) = 0.9 t / (t - 1): 1.0, 1.0, 1.8, 1.2
    assert report.tpot["p50"] == pytest.approx(1.0) and report.tpot["p99"] == pytest.approx(1.8)
    assert report.errors == ["HTTP 429"]


def test_engine_errors_map_to_http():
    too_long = from_engine_error(PromptTooLongError("x", prompt_tokens=900, limit=384), retry_after=2)
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded") and "900" in too_long.message and "384" in too_long.message
    busy = from_engine_error(EngineBusyError("busy"), retry_after=2)
    assert busy.status == 429 and busy.headers["Retry-After"] == "2"
    stopped = from_engine_error(EngineStoppedError("the engine stopped"), retry_after=2)
    assert (stopped.status, stopped.code) == (503, "engine_stopped")


def test_degrade_switch_takes_memory_under_the_floor_as_a_signal_beside_the_queue():
    changes = []
    switch = DegradeSwitch(threshold_s=2.0, max_tokens_cap=64, on_switch=changes.append)
    switch.memory(True, "100 MiB free, under the floor of 300 MiB")
    assert switch.active and switch.cap(1000) == 64 and changes == [True]
    switch.on_admit(waiting=0, oldest_wait=0.0)  # an empty queue does not undo a memory signal
    assert switch.active
    switch.on_admit(waiting=5, oldest_wait=3.0)  # the queue's signal too: still one switch, on
    switch.memory(False, "400 MiB free, above the floor again")
    assert switch.active and changes == [True]
    switch.on_admit(waiting=0, oldest_wait=0.0)
    assert not switch.active and changes == [True, False]
