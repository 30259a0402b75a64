"""Tool calls in each family's own format: the model's template renders the tools, its earlier
calls and their results; the family's parser reads its real call text (streamed or whole) with
nothing of the syntax left in content; the grammar writes that syntax. The templates below are
short excerpts written for these tests in the shape of each family's published template (what
they read and where they put tools, calls and results), not copies of them."""

from __future__ import annotations

import json
import re

import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.engine.output.toolfamilies import (
    GENERIC,
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    MISTRAL_V11,
    PHI4,
    family_for,
    native_messages,
)
from edgechat.engine.output.tools import (
    ToolCallParser,
    _trigger,
    answered_calls,
    fallback_triggers,
    render_messages,
    tool_grammar,
)
from edgechat.engine.prompt.templates import CHATML_TEMPLATE, GEMMA_TEMPLATE, choose_format
from edgechat.engine.types.request import Evicted
from edgechat.params import SamplingParams
from edgechat.server import ServerSettings, create_app
from edgechat.server.openai_chat_api import parse_chat
from edgechat.server.tools import parse_tools

MODEL = "smollm2-135m-instruct"

# Qwen 2.5 / Hermes: tools as JSON lines in a system turn, calls in <tool_call> blocks, results
# as <tool_response> blocks in a user turn
QWEN = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
Function signatures in <tools></tools>:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}
{% endif %}{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}{% if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ m.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1: tools in the first user turn, a call is the JSON answer itself ("parameters"),
# results come back in an ipython turn
LLAMA = """{{ bos_token }}{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ sys }}<|eot_id|>
{%- for m in messages %}
{%- if m.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>

Reply with a JSON object {"name": function name, "parameters": its arguments} to call one of:

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ m.content }}<|eot_id|>
{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral (v3 tokenizer): tools before the last user turn, calls as a [TOOL_CALLS] list whose ids
# must be 9 letters or digits, results in [TOOL_RESULTS] naming the call
MISTRAL_T = """{% set ns = namespace(last=-1, sys='') %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% elif m.role == 'system' %}{% set ns.sys = m.content %}{% endif %}{% endfor %}
{{- bos_token }}{% for m in messages %}
{%- if m.role == 'user' %}{% if loop.index0 == ns.last and tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {% if loop.index0 == ns.last and ns.sys %}{{ ns.sys }}\n\n{% endif %}{{ m.content }}[/INST]
{%- elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}{% if c.id | length != 9 %}{{ raise_exception('tool call ids must be 9 alphanumerics') }}{% endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}
{%- endif %}{% endfor %}"""

# Mistral with a v11+ tokenizer (Small 3.1+, Devstral): the system prompt in its own block, each
# call as [TOOL_CALLS]name[ARGS]arguments, results in [TOOL_RESULTS] blocks without ids
MISTRAL_V11_T = """{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}
{{- bos_token }}{% for m in messages %}
{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]
{%- elif m.role == 'user' %}{% if loop.index0 == ns.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.tool_calls %}{{ m.content or '' }}{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]
{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}
{%- endif %}{% endfor %}"""

# Phi-4-mini: the tools are a JSON string in the system message's `tools` field
PHI = """{% for m in messages %}{% if m.role == 'system' and 'tools' in m and m.tools is not none %}<|system|>{{ m.content }}<|tool|>{{ m.tools }}<|/tool|><|end|>{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token }}{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> & later in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False},
    },
}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_abc", "name": "get_weather", "arguments": '{"city": "Oslo"}'}]},
    {"role": "tool", "content": "cold", "tool_call_id": "call_abc"},
]

FAMILIES = {
    "qwen": (QWEN, HERMES),
    "llama3": (LLAMA, LLAMA3),
    "mistral": (MISTRAL_T, MISTRAL),
    "mistral-v11": (MISTRAL_V11_T, MISTRAL_V11),
    "phi4": (PHI, PHI4),
}
#: what each family's models write when they call (their published examples' shape)
REAL_CALLS = {
    "qwen": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, {"name": "get_weather", "arguments": {"city": "Rome"}, "id": "f5g6h7i8j"}]',
    # the second call with v11's optional call id
    "mistral-v11": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}',
    "phi4": 'functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
}


def _format(template: str):
    return choose_format(template, "llama", "<s>", "</s>", lambda t: False)


def test_the_family_is_read_from_the_template():
    assert {name: family_for(t) for name, (t, _) in FAMILIES.items()} == {name: f for name, (_, f) in FAMILIES.items()}
    # templates that take no tools (SmolLM2's ChatML, Gemma 3's) get the generic format
    for template in (CHATML_TEMPLATE, GEMMA_TEMPLATE, None):
        assert family_for(template) is GENERIC


@pytest.mark.parametrize("name", FAMILIES)
def test_tools_calls_and_results_render_through_the_familys_template(name):
    template, family = FAMILIES[name]
    tools = parse_tools({"tools": [WEATHER]})
    messages, variables = native_messages(HISTORY, tools.offered, family)
    prompt = _format(template).render(messages, True, **variables)
    # the tool's schema as the template writes it, not HTML-escaped
    assert "Weather <now> & later in a city." in prompt and '"maxLength": 20' in prompt
    assert "cold" in prompt and "Be brief." in prompt
    if name == "qwen":
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
        assert "<|im_start|>user\n<tool_response>\ncold\n</tool_response>\n<|im_end|>" in prompt
    elif name == "llama3":
        assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>' in prompt
        assert "<|start_header_id|>ipython<|end_header_id|>\n\ncold<|eot_id|>" in prompt
    elif name == "mistral":
        [call_id] = re.findall(r'"id": "(\w+)"', prompt)
        assert len(call_id) == 9 and f'"call_id": "{call_id}"' in prompt  # the call and its result agree
    elif name == "mistral-v11":
        assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}</s>[TOOL_RESULTS]cold[/TOOL_RESULTS]' in prompt
    else:
        assert '<|tool|>[{"name": "get_weather"' in prompt and prompt.startswith("<|system|>Be brief.")


def test_a_template_without_tools_gets_the_generic_format_gemma():
    """Gemma 3's template takes no tools: the generic format's system prompt goes into its first
    user turn, earlier calls as <tool_call> blocks in a model turn."""
    out = render_messages(HISTORY, parse_tools({"tools": [WEATHER]}))
    prompt = _format(GEMMA_TEMPLATE).render(out)
    assert prompt.startswith("<s><start_of_turn>user\nBe brief.\n\nYou can call functions")
    assert '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><end_of_turn>' in prompt


@pytest.mark.parametrize("name", REAL_CALLS)
def test_each_familys_real_call_text_parses_at_any_chunking(name):
    text, family = REAL_CALLS[name], FAMILIES[name][1]
    cities = ["Oslo"] if name == "llama3" else ["Oslo", "Rome"]
    for step in (1, 2, 5, len(text)):
        parser, content = ToolCallParser(family), []
        for i in range(0, len(text), step):
            content.append(parser.feed(text[i : i + step])[0])
        content.append(parser.finish())
        assert parser.text == ("Let me check." if name == "qwen" else "")
        assert "".join(content).strip() == parser.text
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": c}) for c in cities]


def test_text_that_only_looks_like_a_call_stays_content():
    cases = [
        (LLAMA3, 'Use {"a": 1} here.'),  # JSON that is not a call
        (LLAMA3, 'The answer is {"name": "x"}'),  # a call is the whole answer, not a quote in one
        (PHI4, "Python's functools module caches."),  # the opener's word in prose
        (MISTRAL, "No [TOOL_CALL] here"),
        (MISTRAL_V11, "No [TOOL_CALL] or [ARGS] here"),
    ]
    for family, text in cases:
        for step in (1, len(text)):
            parser = ToolCallParser(family)
            out = [parser.feed(text[i : i + step])[0] for i in range(0, len(text), step)] + [parser.finish()]
            assert "".join(out) == text and not parser.calls, (family.name, step)
    # Llama's python_tag form, and a cut-off call that is dropped, never shown
    parser = ToolCallParser(LLAMA3)
    parser.feed('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}')
    assert parser.finish() == "" and parser.calls[0].name == "get_weather"
    parser = ToolCallParser(MISTRAL)
    assert parser.feed('Sure [TOOL_CALLS] [{"name": "get_weather", "argu')[0] == "Sure " and parser.finish() == "" and not parser.calls
    for cut in ("[TOOL_CALLS]get_wea", '[TOOL_CALLS]get_weather[ARGS]{"ci', "[TOOL_CALLS]no name here[ARGS]{}"):
        parser = ToolCallParser(MISTRAL_V11)
        assert parser.feed("Sure " + cut)[0] == "Sure " and parser.finish() == "" and not parser.calls, cut


def _fires(trigger: str, text: str) -> bool:
    """A trigger read as llama.cpp reads it: one in ^...$ matches the whole text; any other is
    searched for anywhere in it."""
    whole = trigger.startswith("^") and trigger.endswith("$")
    return (re.fullmatch if whole else re.search)(trigger, text) is not None


def test_lazy_triggers_are_each_familys_opener():
    for family, fires, quiet in (
        (HERMES, "Sure.\n<tool_call>\n{", "Sure, <tool"),
        (LLAMA3, '\n {"name', 'Hi {"name'),
        (MISTRAL, "ok [TOOL_CALLS] [", "ok [TOOL"),
        (MISTRAL_V11, "ok [TOOL_CALLS]get", "ok [TOOL"),
        (PHI4, "functools[{", "functool"),
    ):
        triggers = tool_grammar(parse_tools({"tools": [WEATHER]}), family).triggers
        assert triggers == tuple(_trigger(s) for s in family.syntaxes) + fallback_triggers(["get_weather"])
        assert any(_fires(t, fires) for t in triggers), family.name
        assert not any(_fires(t, quiet) for t in triggers), family.name


def test_the_json_calls_small_models_write_trigger_the_grammar_at_a_line_start_in_the_preamble():
    """Any family: a bare or fenced call object (or a list) naming an offered function, at the
    start of a line within the preamble, starts the tools' grammar; JSON mid-sentence, after a
    long answer, or naming a function nobody offered does not."""
    triggers = fallback_triggers(["get_weather", "get_time"])
    call = '"name": "get_time"'
    for fires in ("{" + call, '```json\n{\n  "name" : "get_weather"', "Sure, here it is:\n```json\n{" + call, "[{" + call, "Hi.\n{ " + call):
        assert any(_fires(t, fires) for t in triggers), fires
    for quiet in ("Hi {" + call, '{"city":', "x" * 500 + "\n{" + call, '{"name": "hello"', '{"name": "get_'):
        assert not any(_fires(t, quiet) for t in triggers), quiet


@pytest.fixture(scope="module")
def qwen_engine(models_root):
    """SmolLM2 with a Qwen-style template that takes tools, as if its GGUF carried one."""
    eng = Engine(EngineConfig(model=MODEL, n_ctx=2048, n_parallel=2, max_queue=8, paths=models_root, chat_template=QWEN))
    yield eng
    eng.close()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_familys_grammar_makes_a_call_the_familys_parser_reads(qwen_engine, name):
    template, family = FAMILIES[name]
    # one call: offered more, this small model keeps calling until max_tokens
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    messages, variables = native_messages([{"role": "user", "content": "Weather in Paris?"}], tools.offered, family)
    prompt = _format(template).render(messages, True, **variables)
    request = ChatRequest(prompt=prompt, grammar=tool_grammar(tools, family), max_tokens=60, sampling=SamplingParams(temperature=0), speculative="off")
    finished = qwen_engine.submit(request).result()
    assert finished.reason == "stop", finished.text
    parser = ToolCallParser(family)
    parser.feed(finished.text)
    parser.finish()
    assert parser.text == "" and [c.name for c in parser.calls] == ["get_weather"], finished.text
    assert set(json.loads(parser.calls[0].arguments)) == {"city"}


def test_agent_loop_through_a_qwen_template_with_the_official_client(qwen_engine):
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), qwen_engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        args = dict(model=MODEL, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0)
        first = client.chat.completions.create(messages=messages, **args)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **args))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert all(not d.content for d in deltas)
        streamed = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or ())
        assert json.loads(streamed) == json.loads(call.function.arguments)

        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        parsed = parse_chat({"messages": messages, "tools": [WEATHER]})
        rendered, variables = native_messages(parsed.messages, parsed.tools.offered, HERMES)
        prompt = qwen_engine.format.render(rendered, True, **variables)
        # the history went through the template: the call as a <tool_call> block, the result in a user turn
        assert '<tool_call>\n{"name": "get_weather"' in prompt and "<|im_start|>user\n<tool_response>\nsunny, 21 C" in prompt
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=20, temperature=0)
        answer = second.choices[0].message
        assert "<tool_call>" not in (answer.content or "") and (answer.content or answer.tool_calls)
    stats = qwen_engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and qwen_engine.kv_problems() == []



def _agent_history(rounds: int) -> list[dict]:
    """An agent's conversation: a question, then `rounds` calls each with its (long) result."""
    out = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Plan a week of travel: the weather in each city."}]
    for i in range(rounds):
        call = {"id": f"call_{i}", "name": "get_weather", "arguments": json.dumps({"city": f"City{i}"})}
        report = " ".join(f"hour {h}: {10 + (h + i) % 9} C, wind {h % 5} m/s" for h in range(4))
        out += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": report, "tool_call_id": f"call_{i}"}]
    return out


def test_a_tool_conversation_reaches_the_engine_as_messages_and_evicts_whole_ones(models_root):
    """Through the server, a history with calls and results is rendered once, by the engine's
    prompt builder through the model's template, with a span per message: when the answer fills
    the context, whole messages leave it (a pre-rendered prompt had no boundaries to keep to)."""
    with Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=1, paths=models_root, chat_template=QWEN)) as engine:
        dispatcher = create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), engine).state.dispatcher
        history = _agent_history(3)
        # the calls as OpenAI's clients send them
        wire = [{**m, "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history]
        parsed = parse_chat({"messages": wire, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 200, "ignore_eos": True,
                             "temperature": 0})
        req = dispatcher.request_for(dispatcher.primary, parsed)
        assert req.prompt is None and req.messages == parsed.messages
        prep = engine.prepare(req)
        rendered, variables = native_messages(parsed.messages, None, HERMES)
        assert prep.tokens == engine.prompt_text_tokens(engine.format.render(rendered, True, **variables))
        assert len(prep.spans) == len(history) - 2  # every message but the pinned system prompt and the newest
        events: list = []
        finished = engine.submit(req, events.append, prep).result()
        assert finished.reason == "length", finished.error
        evicted = [e for e in events if isinstance(e, Evicted)]
        assert evicted and all(e.messages >= 1 for e in evicted), [e.note for e in evicted]
        assert engine.kv_problems() == []


def test_a_tool_conversation_in_a_session_evicts_a_call_with_its_results(models_root):
    """A conversation (the chat app's) that outgrows the context leaves out whole messages, and
    never keeps a tool's result without the call it answers."""
    with Engine(EngineConfig(model=MODEL, n_ctx=512, n_parallel=1, paths=models_root, chat_template=QWEN)) as engine:
        tools = parse_tools({"tools": [WEATHER]})
        history = _agent_history(6)
        prep = engine.prepare(ChatRequest(messages=history, tools=tools, session="agent", max_tokens=64))
        assert prep.evicted_total > 0 and history[1 + prep.evicted_total]["role"] != "tool"
        kept = [history[0]] + history[1 + prep.evicted_total :]
        rendered, variables = native_messages(kept, tools.offered, HERMES)
        assert prep.tokens == engine.prompt_text_tokens(engine.format.render(rendered, True, **variables))
        assert len(prep.spans) == len(kept) - 2


def _parse(family, text, step, functions):
    parser = ToolCallParser(family, functions)
    out = [parser.feed(text[i : i + step])[0] for i in range(0, len(text), step)] + [parser.finish()]
    return "".join(out), [(c.name, json.loads(c.arguments)) for c in parser.calls], parser


DECLARED = [WEATHER["function"], {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}]
#: what Qwen2.5-Coder-0.5B/1.5B-Instruct write instead of <tool_call> blocks (seen on the real
#: models), and the other shapes small models use for one or several calls
JSON_CALLS = {
    "bare": ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    "fenced, pretty": ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```', "",
                       [("get_weather", {"city": "Paris"})]),
    "after a preamble": ("Sure! Here is the call:\n```json\n" + '{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
                         "Sure! Here is the call:", [("get_weather", {"city": "Paris"})]),
    "two on two lines": ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n{"name": "get_time", "arguments": {"tz": "UTC"}}', "",
                         [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    "two fences": ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n\n```json\n'
                   '{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n```', "",
                   [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]),
    "a list": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]', "",
               [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    "llama 3's typed object": ('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}', "",
                               [("get_weather", {"city": "Paris"})]),
}
NOT_CALLS = [
    '{"name": "send_email", "arguments": {"to": "bob"}}',  # a function nobody declared
    '{"name": "get_weather", "arguments": {"city": ["Paris", "Tokyo"]}}',  # an array where the schema wants a string
    '{"name": "get_weather", "arguments": {}}',  # a required argument missing
    "Here is some code:\n```python\nx = {'a': 1}\n```\nDone.",
    '```json\n{"city": "Paris"}\n```',  # JSON that is no call
    'The call would be {"name": "get_weather", "arguments": {"city": "Paris"}} in JSON.',  # mid-sentence
    "x" * 500 + '\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # past the preamble
    '{"name": "get_weather", "arguments": {"city": "Par',  # cut off: shown as it came
]


@pytest.mark.parametrize("family", [HERMES, LLAMA3, MISTRAL, MISTRAL_V11, PHI4, HARMONY, GENERIC], ids=lambda f: f.name)
def test_the_json_calls_small_models_write_are_calls_in_every_family_when_tools_are_declared(family):
    for name, (text, content, calls) in JSON_CALLS.items():
        if family is LLAMA3 and name != "llama 3's typed object" and not content:
            continue  # Llama's own bare form is read by its syntax: covered above
        for step in (1, 3, len(text)):
            out, got, parser = _parse(family, text, step, DECLARED)
            assert (got, parser.text) == (calls, content), (family.name, name, step)
            assert out.strip() == content, (family.name, name, step)
    for text in NOT_CALLS:
        for step in (1, 4, len(text)):
            out, got, _ = _parse(family, text, step, DECLARED)
            assert (out, got) == (text, []), (family.name, text[:40], step)


def test_a_family_call_to_an_undeclared_function_stays_text():
    text = 'Ok.\n<tool_call>\n{"name": "send_email", "arguments": {"to": "bob"}}\n</tool_call>'
    for step in (1, len(text)):
        out, got, _ = _parse(HERMES, text, step, DECLARED)
        assert (out, got) == (text, [])
    out, got, _ = _parse(HERMES, text, 1, None)  # no declared list: any name is a call
    assert got == [("send_email", {"to": "bob"})] and out == "Ok.\n"


def test_harmony_calls_are_read_from_the_message_the_reasoning_splitter_hands_on():
    """gpt-oss writes a call as a message to functions.NAME; its channel splitter passes it on as
    its own markup (tests/test_reasoning.py covers that split), which this parser reads."""
    text = ('Let me look that up.<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}'
            '<|channel|>commentary to=functions.get_time<|message|>{"tz": "CET"}')
    for step in (1, 2, 7, len(text)):
        out, got, parser = _parse(HARMONY, text, step, DECLARED)
        assert got == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})] and parser.text == "Let me look that up."
    template = '{% for t in tools %}{{ t }}{% endfor %}{{ "<|start|>assistant<|channel|>commentary to=functions." }}'
    assert family_for(template) is HARMONY
    assert tool_grammar(parse_tools({"tools": [WEATHER]}), HARMONY) is None  # special tokens: parsed, not held


def test_the_call_just_answered_written_again_is_text_and_another_call_is_a_call():
    messages = [{"role": "user", "content": "Weather in Paris and Tokyo?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
                {"role": "tool", "tool_call_id": "1", "content": "18 C"}]
    answered = answered_calls(messages)
    assert answered == {("get_weather", '{"city": "Paris"}')}
    assert answered_calls(messages[:2]) == frozenset()  # no result yet: nothing answered
    assert answered_calls([*messages, {"role": "assistant", "content": "It is 18 C."}]) == frozenset()
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    echo = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser = ToolCallParser(functions=functions, answered=answered)
    content, calls = parser.feed(echo)
    assert calls == [] and content + parser.finish() == echo and parser.calls == []
    tokyo = ToolCallParser(functions=functions, answered=answered)
    _, calls = tokyo.feed('{"name": "get_weather", "arguments": {"city": "Tokyo"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Tokyo"})]
