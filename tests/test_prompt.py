"""Prompt preparation without a model: message segments, linear cost, eviction for every template."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest

from edgechat.engine.prompt.prompt import SUMMARY_PREFIX, PromptBuilder, SummaryNeeded
from edgechat.engine.prompt.templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE, choose_format
from edgechat.engine.types.request import ChatRequest, ContextPolicy
from edgechat.errors import PromptTooLongError

# Qwen3's shape, written for this test: the assistant turn after the last user message is rendered
# with a reasoning block, earlier ones without, so a prefix render is not a prefix of the prompt
QWEN3_LIKE = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_query %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# rewrites every content: message boundaries cannot be told, so the prompt is one segment
REWRITING = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | upper }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"


class Vocab:
    """A deterministic stand-in tokenizer: special tags, words and spaces each one token."""

    def __init__(self):
        self.ids: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.setdefault(p, len(self.ids) + 1) for p in re.findall(r"<[^<>\s]+>|\w+|\s+|[^\w\s]", text)]

    def decode(self, tokens: list[int]) -> str:
        pieces = {i: p for p, i in self.ids.items()}
        return "".join(pieces[t] for t in tokens)


def fmt(template):
    return choose_format(template, "llama", "<s>", "</s>", lambda token: True)


def builder(template, n_ctx=4096):
    return PromptBuilder(fmt(template), Vocab(), bos=None, n_ctx=n_ctx)


def quadratic_segments(f, messages):
    """The definition: segment i is what rendering messages[:i+1] adds to messages[:i]."""
    full = f.render(messages, True)
    segs, pos = [], 0
    for i in range(1, len(messages) + 1):
        prefix = f.render(messages[:i], False)
        if not full.startswith(prefix) or len(prefix) < pos:
            return [full]
        segs.append(prefix[pos:])
        pos = len(prefix)
    return segs + [full[pos:]]


def chat(n, system=True):
    msgs = [{"role": "system", "content": "You are terse."}] if system else []
    for i in range(n):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": f"  message {i} with a few words  " if i % 3 else f"message {i}"})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "last question"})
    return msgs


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_TEMPLATE, GEMMA_TEMPLATE])
@pytest.mark.parametrize("n,system", [(1, False), (1, True), (6, True), (9, False)])
def test_segments_match_the_per_prefix_definition(template, n, system):
    f = fmt(template)
    msgs = chat(n, system)
    segs = f.segments(msgs)
    assert segs == quadratic_segments(f, msgs)
    assert len(segs) == len(msgs) + 1


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, GEMMA_TEMPLATE, QWEN3_LIKE, REWRITING])
def test_the_template_is_rendered_a_constant_number_of_times(template):
    f = fmt(template)
    calls = 0
    render = f._render

    def counting(messages, add_generation_prompt):
        nonlocal calls
        calls += 1
        return render(messages, add_generation_prompt)

    f._render = counting
    counts = []
    for n in (10, 100, 1000, 10000):
        calls = 0
        segs = f.segments(chat(n))
        assert "".join(segs) == render(chat(n), True)
        counts.append(calls)
    assert max(counts) <= 6 and counts[0] == counts[-1], counts


def test_a_template_that_renders_the_last_turn_differently_still_splits_by_message():
    f = fmt(QWEN3_LIKE)
    msgs = chat(7) + [{"role": "assistant", "content": "a reply after the last question"}]
    segs = f.segments(msgs)
    assert len(segs) == len(msgs) + 1 and "".join(segs) == f.render(msgs, True)
    assert segs[-2].startswith("<|im_start|>assistant\n<think>")


@pytest.mark.parametrize("template", [QWEN3_LIKE, REWRITING])
def test_a_long_chat_evicts_old_messages_whatever_the_template(template):
    b = builder(template, n_ctx=512)
    msgs = chat(300)
    with pytest.raises(PromptTooLongError):
        b.prepare(ChatRequest(messages=msgs), ContextPolicy.SHIFT)  # without a session nothing is cut
    prep = b.prepare(ChatRequest(messages=msgs, session="long"), ContextPolicy.SHIFT)
    assert len(prep.tokens) <= b.limit(ChatRequest(messages=msgs))
    assert prep.evicted_total > 250 and prep.evicted_now == prep.evicted_total
    # the system prompt stays pinned, the oldest messages leave, the newest stays
    text = b._tokenize.decode(prep.tokens).lower()
    assert "you are terse." in text and "message 1 " not in text and text.rstrip().endswith("last question<|im_end|>\n<|im_start|>assistant\n".rstrip() if template == QWEN3_LIKE else "last question\n[assistant]")


def test_the_summarize_policy_asks_for_a_summary_and_pins_it():
    """The builder never runs the model: it says what leaves, and finishes the prompt with the
    summary it is given."""
    b = builder(CHATML_TEMPLATE, n_ctx=512)
    msgs = chat(300)
    need = b.prepare(ChatRequest(messages=msgs, session="long"), ContextPolicy.SUMMARIZE)
    assert isinstance(need, SummaryNeeded) and need.previous is None
    assert len(need.leaving) == need.evicted > 250 and need.leaving[0] == msgs[1]
    ask = need.request(b.n_ctx)
    assert ask.session is None and ask.max_tokens == 64 and need.leaving[-1]["content"] in ask.messages[0]["content"]
    prep = b.summarized(need, "They counted messages.")
    assert prep.summary == "They counted messages." and prep.evicted_total == need.evicted
    text = b._tokenize.decode(prep.tokens)
    assert text.index("You are terse.") < text.index(SUMMARY_PREFIX + "They counted messages.")
    assert len(prep.tokens) <= b.limit(ChatRequest(messages=msgs)) and prep.keep >= len(b._tokenize(SUMMARY_PREFIX))


def test_spans_cover_each_evictable_message():
    b = builder(CHATML_TEMPLATE)
    msgs = chat(6)
    prep = b.prepare(ChatRequest(messages=msgs), ContextPolicy.SHIFT)
    segs = b.format.segments(msgs)
    assert prep.keep == len(b.tokens_for(segs[:1])[0])
    assert [length for _, length in prep.spans] == [len(t) for t in b.tokens_for(segs[1:-2])]
    for (start, length), (nxt, _) in pairwise(prep.spans):
        assert start + length == nxt
