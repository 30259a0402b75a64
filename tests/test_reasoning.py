"""Reasoning models (issue 25): thoughts kept apart from the answer, budgeted, switched off.

No embedded model thinks, so SmolLM2 is given a Qwen3-style template (written here) whose
generation prompt opens `<think>\\n`: what SmolLM2 writes there is its thoughts by construction.
That proves the engine's side (the split, the budget, the switch, history, the server's fields);
it cannot prove that a real reasoning model's thoughts read well."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from bench.bench_reasoning import TEMPLATE as THINK_TEMPLATE  # the template the benchmark measures
from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.kvcache import common_prefix
from edgechat.engine.reasoning import ReasoningSplitter, reasoning_format, strip_thoughts
from edgechat.engine.request import SamplingParams, TextDelta
from edgechat.engine.stream import OutputProcessor
from edgechat.server import ServerSettings, create_app
from edgechat.engine.tools import ToolCallParser
from serving import serving
from tests.test_cli import assert_one_line_error, edgechat

MODEL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0)
ASK = [{"role": "user", "content": "Explain in detail how photosynthesis works."}]


@pytest.fixture(scope="module")
def thinker(models_root):
    with Engine(EngineConfig(model=MODEL, n_ctx=4096, n_parallel=2, paths=models_root,
                             chat_template=THINK_TEMPLATE)) as engine:
        yield engine


def split(text: str, cuts: list[int], opened: bool, stop: list[str] | None = None) -> tuple[str, str]:
    proc = OutputProcessor(stop, splitter=ReasoningSplitter(reasoning_format(THINK_TEMPLATE), opened))
    data, content, thoughts = text.encode(), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text.encode())]):
        content += proc.feed(data[a:b])
        thoughts += proc.take_reasoning()
    content += proc.finish()
    thoughts += proc.take_reasoning()
    assert thoughts == proc.reasoning and content == proc.text
    return thoughts, content


@pytest.mark.parametrize("text, opened", [
    ("<think>\n光合作用 🌿 is how plants eat.\n</think>\n\n答案: sunlight 🌞.", False),
    ("plants 🌿 use light.\n</think>\n\n答案 🌞", True),
])
def test_the_splitter_cuts_markers_at_every_byte(text, opened):
    want = ("光合作用 🌿 is how plants eat.\n", "答案: sunlight 🌞.") if not opened else ("plants 🌿 use light.\n", "答案 🌞")
    n = len(text.encode())
    for cut in range(1, n):
        assert split(text, [cut], opened) == want, cut
    assert split(text, list(range(1, n)), opened) == want  # one byte at a time


def test_no_block_is_plain_content_and_stop_strings_apply_to_the_answer_only():
    assert split("Just an answer, no thoughts.", [3, 9], False) == ("", "Just an answer, no thoughts.")
    # "STOP" written while thinking does not end the answer; in the answer it does
    assert split("<think>I must not STOP here</think>Answer. STOP tail", [5, 20], False, ["STOP"]) == ("I must not STOP here", "Answer. ")


def test_a_tool_call_inside_the_thoughts_is_not_a_call():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    thoughts, content = split(f"<think>maybe {call}</think>\n\nSure. {call}", [7, 31, 60], False)
    assert call in thoughts
    parser = ToolCallParser()
    text, _ = parser.feed(content)
    parser.finish()
    assert [c.name for c in parser.calls] == ["get_weather"] and "tool_call" not in text


def test_earlier_thoughts_are_stripped_from_history():
    fmt = reasoning_format(THINK_TEMPLATE)
    assert strip_thoughts("<think>long musing</think>\n\nThe answer.", fmt) == "The answer."
    assert strip_thoughts("musing the prompt opened</think>The answer.", fmt) == "The answer."
    assert strip_thoughts("No thoughts here.", fmt) == "No thoughts here."
    assert reasoning_format("{{ messages }}") is None


def answer(engine, budget=None, **kw):
    handle = engine.submit(ChatRequest(messages=ASK, sampling=GREEDY, max_tokens=kw.pop("max_tokens", 80), reasoning_budget=budget, **kw))
    events = list(handle)
    done = handle.finished
    assert "".join(e.text for e in events if isinstance(e, TextDelta) and e.reasoning) == done.reasoning
    assert "".join(e.text for e in events if isinstance(e, TextDelta) and not e.reasoning) == done.text
    return done


def test_the_budget_closes_the_thoughts_and_an_answer_follows(thinker):
    free = answer(thinker)
    assert free.reasoning and not free.text  # SmolLM2 never closes a block it was not trained on
    assert free.metrics.reasoning_tokens == free.metrics.completion_tokens
    budgeted = answer(thinker, budget=12)
    assert budgeted.reasoning and budgeted.text.strip()
    assert free.reasoning.startswith(budgeted.reasoning.strip())  # the same thoughts, cut at the budget
    # the budget, then the end marker's tokens (the newlines after it are the answer's)
    closing = len(thinker.backend.tokenize("</think>\n\n", special=True))
    assert 12 < budgeted.metrics.reasoning_tokens < 12 + closing
    assert "</think>" not in budgeted.text and "<think>" not in budgeted.reasoning
    # the closing marker went into the sequence: the answer's tokens come after it
    assert thinker.detokenize(budgeted.token_ids).count("</think>") == 1
    off = answer(thinker, budget=0)
    assert off.reasoning == "" and off.text.strip() and off.metrics.reasoning_tokens == 0
    raw = answer(thinker, split_reasoning=False)
    assert raw.reasoning == "" and raw.text.strip() == free.reasoning  # the raw text, as the model wrote it


def test_ten_turns_send_no_old_thoughts_and_reuse_the_cache(thinker):
    history, cached, answers, prompts = [], [], [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"Question {turn}: name a fruit and its colour."})
        request = ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=24, reasoning_budget=8, session="ten")
        prompts.append(thinker.prompt_tokens(request))
        done = thinker.submit(request).result()
        assert done.reasoning
        cached.append(done.metrics.cached_tokens)
        # what the client keeps of the turn, thoughts included, as llama-server's raw clients do
        history.append({"role": "assistant", "content": f"<think>{done.reasoning}</think>{done.text}"})
        prompt = thinker.backend.detokenize(thinker.prompt_tokens(ChatRequest(messages=history + [{"role": "user", "content": "x"}])),
                                            special=True)
        assert "</think>" not in prompt  # no turn's thoughts are rendered (the last line opens a new block)
        answers.append(done.text)
        if not any(done.reasoning.strip() in a for a in answers):  # SmolLM2 repeats itself across turns
            assert done.reasoning.strip() not in prompt
    # reuse holds: each turn keeps the whole previous prompt but the block its generation prompt
    # opened, so what is prefilled is the previous answer and the new message, never the history
    opener = len(thinker.backend.tokenize("<think>\n", special=True))
    for i in range(1, 10):
        assert common_prefix(prompts[i - 1], prompts[i]) >= len(prompts[i - 1]) - opener, i  # history renders as it did
        assert cached[i] >= len(prompts[i - 1]) - opener, (i, cached)
    assert thinker.kv_problems() == []


@pytest.fixture(scope="module")
def base_url(thinker):
    with serving(create_app(ServerSettings(model_id=MODEL), thinker)) as url:
        yield url


def test_the_server_returns_thoughts_apart_streamed_equal_to_whole(base_url):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    args = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, extra_body={"reasoning_budget": 10})
    whole = client.chat.completions.create(**args)
    message = whole.choices[0].message
    thoughts = message.model_extra["reasoning_content"]
    assert thoughts and message.content and "think>" not in message.content + thoughts
    details = whole.usage.completion_tokens_details
    assert 10 < details.reasoning_tokens < whole.usage.completion_tokens
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == thoughts
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == message.content
    off = client.chat.completions.create(**{**args, "extra_body": {"reasoning_effort": "none"}})
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    kwargs_off = client.chat.completions.create(**{**args, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert kwargs_off.choices[0].message.content == off.choices[0].message.content


@pytest.mark.parametrize("field, value", [
    ("chat_template_kwargs", {"nested": {"a": 1}}),
    ("chat_template_kwargs", ["enable_thinking"]),
    ("reasoning_effort", "extreme"),
    ("reasoning_budget", -5),
    ("reasoning_budget", 2.5),
])
def test_bad_reasoning_fields_are_a_400_naming_the_field(base_url, field, value):
    body = {"model": MODEL, "messages": ASK, field: value}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_the_cli_prints_thoughts_to_stderr_and_json_carries_them(tmp_path):
    template = tmp_path / "think.jinja"
    template.write_text(THINK_TEMPLATE)
    args = ["run", "--chat-template", str(template), "--temperature", "0", "--max-tokens", "40", "--think", "10",
            "Explain in detail how photosynthesis works."]
    shown = edgechat(*args)
    data = json.loads(edgechat(*args, "--json").stdout)
    assert shown.returncode == 0 and data["reasoning"] and data["reasoning_tokens"] > 10
    assert data["reasoning"].strip() in shown.stderr and data["reasoning"].strip() not in shown.stdout
    assert shown.stdout.strip() == data["text"].strip()
    hidden = edgechat(*args, "--hide-thinking")
    assert data["reasoning"].strip() not in hidden.stderr and hidden.stdout == shown.stdout
    off = json.loads(edgechat(*args[:-2], "off", args[-1], "--json").stdout)
    assert off["reasoning"] is None and off["reasoning_tokens"] == 0
    assert_one_line_error(edgechat(*args[:-2], "lots", args[-1]), "--think")
    assert_one_line_error(edgechat("run", "--chat-template", str(tmp_path / "missing.jinja"), "hi"), "cannot read the chat template")
