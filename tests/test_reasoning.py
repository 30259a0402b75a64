"""Reasoning models (issue 25): thoughts kept apart from the answer, budgeted, switched off.

No embedded model thinks, so SmolLM2 is given a Qwen3-style template (written here) whose
generation prompt opens `<think>\\n`: what SmolLM2 writes there is its thoughts by construction.
That proves the engine's side (the split, the budget, the switch, history, the server's fields);
it cannot prove that a real reasoning model's thoughts read well.

gpt-oss's harmony channels are told by token id, so they are tested on a copy of SmolLM2 whose
vocabulary gives seven of its special tokens harmony's names (see `harmony_path`)."""

from __future__ import annotations

import json
from itertools import pairwise

import gguf
import httpx
import openai
import pytest
from conftest import GREEDY
from serving import serving

from bench.bench_reasoning import TEMPLATE as THINK_TEMPLATE  # the template the benchmark measures
from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.kv.prefix import common_prefix
from edgechat.engine.output.reasoning import ChannelFormat, ReasoningSplitter, reasoning_format
from edgechat.engine.output.stream import OutputProcessor
from edgechat.engine.output.tools import ToolCallParser
from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.types.request import TextDelta
from edgechat.server import ServerSettings, create_app
from tests.test_cli import assert_one_line_error, edgechat

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "Explain in detail how photosynthesis works."}]


@pytest.fixture(scope="module")
def thinker(models_root):
    with Engine(EngineConfig(model=MODEL, n_ctx=4096, n_parallel=2, paths=models_root,
                             chat_template=THINK_TEMPLATE)) as engine:
        yield engine


def split(text: str, cuts: list[int], opened: bool, stop: list[str] | None = None) -> tuple[str, str]:
    proc = OutputProcessor(stop, splitter=ReasoningSplitter(reasoning_format(THINK_TEMPLATE), opened))
    data, content, thoughts = text.encode(), "", ""
    for a, b in pairwise([0, *cuts, len(text.encode())]):
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
    assert fmt.strip_thoughts("<think>long musing</think>\n\nThe answer.") == "The answer."
    assert fmt.strip_thoughts("musing the prompt opened</think>The answer.") == "The answer."
    assert fmt.strip_thoughts("No thoughts here.") == "No thoughts here."
    assert reasoning_format("{{ messages }}") is None
    harmony = reasoning_format(HARMONY_TEMPLATE)
    assert isinstance(harmony, ChannelFormat)
    # what a raw client (--reasoning-format none) keeps of a turn: the final message alone
    raw = "<|channel|>analysis<|message|>musing<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|end|>"
    assert harmony.strip_thoughts(raw) == "The answer."
    assert harmony.strip_thoughts("<|channel|>analysis<|message|>cut off while musing") == ""
    assert harmony.strip_thoughts("No thoughts here.") == "No thoughts here."


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


@pytest.mark.parametrize("engine_name", ["thinker", "harmony"])
def test_every_sampled_token_log_probability_is_delivered_once_across_a_budget(engine_name, request):
    """The budget's closing tokens have none: the deltas after them still carry every sampled one."""
    engine = request.getfixturevalue(engine_name)
    handle = engine.submit(ChatRequest(messages=ASK, sampling=GREEDY, max_tokens=30, reasoning_budget=8, logprobs=1))
    streamed = [lp for e in handle if isinstance(e, TextDelta) for lp in e.logprobs or []]
    done = handle.finished
    assert done.text and done.reasoning
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs]
    assert len(streamed) == len(done.token_ids) - len(engine.scheduler.thinking.closing)


def test_ten_turns_send_no_old_thoughts_and_reuse_the_cache(thinker):
    history, cached, answers, prompts = [], [], [], []
    for turn in range(10):
        history.append({"role": "user", "content": f"Question {turn}: name a fruit and its colour."})
        # ignore_eos: SmolLM2 under this template may end a turn before thinking, and every turn
        # here must have thoughts that the next prompt leaves out
        request = ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=24, reasoning_budget=8,
                              session="ten", ignore_eos=True)
        prompts.append(thinker.prompt_tokens(request))
        done = thinker.submit(request).result()
        assert done.reasoning
        # the cache holds the prompt and then exactly what was written, the budget's closing
        # tokens included (a budget spent inside a draft's verification once put a token in twice)
        held = next(s for s in thinker.slots if s.session == "ten").tokens
        assert held[: len(prompts[-1])] == prompts[-1]
        assert held[len(prompts[-1]) :] == done.token_ids[: len(held) - len(prompts[-1])]
        assert len(held) - len(prompts[-1]) >= len(done.token_ids) - 1
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


# ---------------------------------------------------------------- gpt-oss's harmony channels
#: SmolLM2's special tokens renamed: its turn start and end become harmony's <|start|> and
#: <|return|> (the end of an answer), its end of text <|end|>, and code-data tokens the others
#: (these give SmolLM2's continuations text, where most of the others make it end at once)
HARMONY_NAMES = {0: "<|end|>", 1: "<|start|>", 2: "<|return|>", 3: "<|channel|>", 4: "<|call|>", 5: "<|constrain|>",
                 6: "<|message|>"}
#: harmony's turns (written here from the format, simplified): earlier answers as final messages,
#: their thoughts never rendered (gpt-oss's rule); the generation prompt opens the thoughts' message,
#: so SmolLM2, which never writes a channel, writes thoughts by construction (`open_thoughts`
#: false: gpt-oss's own prompt, where the model picks its channel)
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}<|channel|>final{% endif %}"
    "<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant"
    "{% if open_thoughts is not defined or open_thoughts %}<|channel|>analysis<|message|>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def harmony_path(smollm2_path, tmp_path_factory):
    """SmolLM2 whose vocabulary has harmony's markers as special tokens, with the harmony template.

    llama.cpp treats them as it treats gpt-oss's (by name): it renders <|start|>, <|channel|>,
    <|message|>, <|constrain|> and <|end|> as their text, ends generation at <|return|> and
    <|call|> and not at <|end|>. So this proves the engine's side on real token ids as llama.cpp
    gives them (the split, the budget's closing in the sequence, the switch, history, reuse); it
    cannot prove that gpt-oss's own channels read well, and SmolLM2 never writes a header itself."""
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    reader = gguf.GGUFReader(str(smollm2_path))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    for i, name in HARMONY_NAMES.items():
        tokens[i] = name
    path = tmp_path_factory.mktemp("harmony") / "smollm2-harmony.gguf"
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    copy_with_new_metadata(reader, writer, {
        "tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, tokens, sub_type=gguf.GGUFValueType.STRING),
        "tokenizer.chat_template": MetadataDetails(gguf.GGUFValueType.STRING, HARMONY_TEMPLATE),
    }, [])
    return path


@pytest.fixture(scope="module")
def harmony(harmony_path, models_root):
    with Engine(EngineConfig(model=str(harmony_path), n_ctx=4096, n_parallel=2, paths=models_root)) as engine:
        yield engine


def channel_split(backend: LlamaBackend, tokens: list[int], fmt: ChannelFormat, prompt: list[int],
                  stop: list[str] | None = None) -> tuple[str, str]:
    """What the output processor makes of generated tokens, fed as the scheduler feeds them."""
    proc = OutputProcessor(stop, splitter=fmt.splitters(backend.tokenize)(False, prompt))
    content = "".join(proc.feed(backend.piece(t), t) for t in tokens) + proc.finish()
    return proc.reasoning, content


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
#: (what the model writes after `<|start|>assistant`, the thoughts, the answer)
HARMONY_STREAMS = [
    ("<|channel|>analysis<|message|>光合作用 🌿 is how plants eat. STOP<|end|>"
     "<|start|>assistant<|channel|>final<|message|>答案: sunlight 🌞. STOP tail",
     "光合作用 🌿 is how plants eat. STOP", "答案: sunlight 🌞. "),
    # a call written in the thoughts is not one; a preamble (commentary, no recipient) is shown; a
    # call to a function reaches the answer in its own markup
    (f"<|channel|>analysis<|message|>maybe {CALL}<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
     '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
     f"maybe {CALL}", 'Checking.<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}'),
    # the recipient in the role part, as harmony also allows
    ('<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{}',
     "hm", "<|channel|>commentary to=functions.get_weather<|message|>{}"),
]


@pytest.mark.parametrize("written, thoughts, answer", HARMONY_STREAMS)
def test_harmony_channels_are_split_by_token_id(harmony, written, thoughts, answer):
    """On the renamed vocabulary, where llama.cpp renders most markers as their text."""
    be, fmt = harmony.backend, harmony.format.reasoning
    prompt = be.tokenize("<|start|>user<|message|>hi<|end|><|start|>assistant")
    tokens = be.tokenize(written)
    assert sum(be.piece(t) == fmt.channel.encode() for t in tokens) == written.count(fmt.channel)  # rendered as text
    assert channel_split(be, tokens, fmt, prompt, ["STOP"]) == (thoughts, answer)
    # the markers spelled in ordinary tokens are text, not markup: a marker is its token
    spelled = [t for piece in ("<|", "channel", "|>", "final") for t in be.tokenize(piece)]
    assert channel_split(be, tokens[:-1] + spelled, fmt, prompt)[1].endswith("<|channel|>final")


def test_harmony_channels_split_the_same_where_markers_render_as_nothing(thinker):
    """SmolLM2's own control tokens stand in for harmony's markers (llama.cpp renders them as
    nothing, as a control-token build of gpt-oss's vocabulary would): the split is the same."""
    fmt = ChannelFormat(start="<|im_start|>", channel="<jupyter_code>", message="<jupyter_output>", end="<jupyter_text>",
                        constrain="<jupyter_script>")
    be = thinker.backend
    assert be.piece(be.tokenize(fmt.channel)[0]) == b""
    prompt = be.tokenize("<|im_start|>user<jupyter_output>hi<jupyter_text><|im_start|>assistant")
    for written, thoughts, answer in HARMONY_STREAMS:
        for name in ("start", "channel", "message", "end", "constrain"):
            written = written.replace(getattr(ChannelFormat(), name), getattr(fmt, name))
        answer = answer.replace(ChannelFormat().channel, fmt.channel).replace(ChannelFormat().message, fmt.message)
        assert channel_split(be, be.tokenize(written), fmt, prompt, ["STOP"]) == (thoughts, answer)


def test_harmony_budget_switch_and_raw_text(harmony):
    be = harmony.backend
    assert be.is_eog(be.tokenize("<|return|>")[0]) and be.is_eog(be.tokenize("<|call|>")[0])
    assert not be.is_eog(be.tokenize("<|end|>")[0])
    free = answer(harmony)
    assert free.reasoning and not free.text
    budgeted = answer(harmony, budget=12)
    assert budgeted.reasoning and budgeted.text.strip() and "<|" not in budgeted.reasoning + budgeted.text
    assert free.reasoning.startswith(budgeted.reasoning)
    # the budget, then the <|end|> that closes the thoughts (the answer's header is neither)
    assert budgeted.metrics.reasoning_tokens == 13
    assert be.detokenize(budgeted.token_ids, special=True).count("<|end|><|start|>assistant<|channel|>final<|message|>") == 1
    off = answer(harmony, budget=0)
    assert off.reasoning == "" and off.text.strip() and off.metrics.reasoning_tokens == 0
    raw = answer(harmony, split_reasoning=False)
    assert raw.reasoning == "" and raw.text.startswith(free.reasoning)  # the text as it is, markup as llama.cpp renders it


def test_harmony_prompt_where_the_model_picks_its_channel(harmony):
    """gpt-oss's own generation prompt ends at `<|start|>assistant`: off picks `final` for the
    model; a model that writes no header (SmolLM2) has its text kept as the answer."""
    be, fmt = harmony.backend, harmony.format.reasoning
    picks = {"open_thoughts": False}
    tokens = harmony.prompt_tokens(ChatRequest(messages=ASK, reasoning_budget=0, template_kwargs=picks))
    assert be.detokenize(tokens, special=True).endswith("<|start|>assistant<|channel|>final<|message|>")
    assert answer(harmony, budget=0, template_kwargs=picks).text.strip()
    own = answer(harmony, template_kwargs=picks)
    assert own.reasoning == "" and own.text.strip()
    assert fmt.channel not in harmony.detokenize(own.token_ids)


def test_harmony_turns_send_no_old_thoughts_and_reuse_the_cache(harmony):
    history, cached, prompts = [], [], []
    for turn in range(4):
        history.append({"role": "user", "content": f"Question {turn}: name a fruit and its colour."})
        request = ChatRequest(messages=list(history), sampling=GREEDY, max_tokens=24, reasoning_budget=8, session="harmony")
        prompts.append(harmony.prompt_tokens(request))
        done = harmony.submit(request).result()
        assert done.reasoning and done.text
        cached.append(done.metrics.cached_tokens)
        # a raw client's copy of the turn, markup and thoughts included
        history.append({"role": "assistant", "content": harmony.backend.detokenize(done.token_ids, special=True)})
        prompt = harmony.backend.detokenize(prompts[-1], special=True)
        assert prompt.count("<|channel|>analysis") == 1  # only the new turn's opener
    # each turn keeps the previous prompt but the thoughts' opener (`analysis<|message|>`)
    for i in range(1, 4):
        assert common_prefix(prompts[i - 1], prompts[i]) >= len(prompts[i - 1]) - 2, i
        assert cached[i] >= len(prompts[i - 1]) - 2, (i, cached)
    assert harmony.kv_problems() == []


# ---------------------------------------------------------------- the ONNX engine
@pytest.mark.slow
def test_the_onnx_engine_splits_budgets_and_switches_off_the_same(tmp_path_factory):
    """SmolLM2 exported to ONNX, given the same thinking template: the same splitter and budget
    as the llama.cpp engine's (engine/output/reasoning.py's Thinking), through the same Engine on the ONNX runner."""
    from edgechat.engine import open_engine
    from quantize.onnx_export import export
    from tests.hf_fixtures import hf_checkpoint

    folder = export(hf_checkpoint(MODEL), tmp_path_factory.mktemp("onnx") / "smollm2", bits=4).path
    with open_engine(EngineConfig(model=str(folder), n_ctx=1024, chat_template=THINK_TEMPLATE)) as engine:
        free = answer(engine)
        assert free.reasoning and not free.text
        budgeted = answer(engine, budget=12)
        # (not compared with the free thoughts: int8 activations make a reused prefix's last
        # token's logits differ from a whole prefill's, and greedy SmolLM2 flips at a near-tie)
        assert budgeted.reasoning and budgeted.text.strip() and "think>" not in budgeted.reasoning + budgeted.text
        closing = len(engine.backend.tokenize("</think>\n\n", special=True))
        assert 12 < budgeted.metrics.reasoning_tokens < 12 + closing
        assert engine.detokenize(budgeted.token_ids).count("</think>") == 1
        off = answer(engine, budget=0)
        assert off.reasoning == "" and off.text.strip() and off.metrics.reasoning_tokens == 0
