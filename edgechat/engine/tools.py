"""Tool calling, for every front end (the server's APIs, the chat app's MCP tools): the offered
functions in, the model's calls out.

A model whose chat template takes `tools` and whose call syntax is known (toolfamilies.py:
Qwen/Hermes, Llama 3.x, Mistral, Phi-4-mini) gets the tools, its earlier calls and their
results through its own template, and writes calls in its own syntax. Any other model gets the
documented generic format (docs/server.md) in the system prompt, the format Hermes-style and
Qwen models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with earlier calls written back the same way and results as `<tool_response>` blocks in a user
turn. Either way a grammar holds the model to its family's syntax: lazy for `auto` (free text
until the model writes the family's opener, then well-formed calls to offered tools whose
arguments follow each tool's `parameters` schema), immediate for `required` and a named
function. `ToolCallParser` takes the calls out of the text as it streams, so none of the call
syntax ever reaches `content`. The prompt builder renders a request's tools and tool messages
(`tool_messages`) once, as messages, so their spans are known to eviction.

A wrong value is an `InvalidFieldError` naming its field; the server answers it as a 400.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from edgechat.engine.request import Event, Grammar, RequestHandle, TextDelta
from edgechat.engine.schema_grammar import check_schema, schema_rules
from edgechat.engine.stream import marker_tail
from edgechat.engine.toolfamilies import GENERIC, CallSyntax, ToolFamily, call_objects, native_messages
from edgechat.errors import InvalidFieldError

log = logging.getLogger("edgechat.tools")

OPEN, CLOSE = GENERIC.syntaxes[0].opener, GENERIC.syntaxes[0].closer
#: calls in one answer when parallel_tool_calls is on (a small model may not stop by itself)
MAX_PARALLEL_CALLS = 8
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

TOOLS_PROMPT = """You can call functions (tools) to help answer. The functions, one JSON object per line:
<tools>
{tools}
</tools>
To call a function, write a block like this and nothing after it:
<tool_call>
{{"name": "function name", "arguments": {{...the arguments as JSON...}}}}
</tool_call>
{many}The results come back in <tool_response> blocks; then use them to answer."""


@dataclass
class Tools:
    """A request's tools, as checked."""

    functions: list[dict]  # {"name", "description", "parameters"}
    choice: str  # "auto" | "required" | "none" | "function" (the named one)
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    @property
    def offered(self) -> list[dict]:
        """The functions the model is told of: only the named one for a named choice."""
        return [f for f in self.functions if self.named in (None, f["name"])]


def check_function(where: str, fn: dict, functions: list[dict]) -> dict:
    """One function a request offers, `{name, description, parameters}`, checked against the
    ones before it; `where` is the field holding them (chat nests them, Responses does not)."""
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidFieldError(f"{where}.name must be 1-64 letters, digits, _ or -", param=f"{where}.name", code="invalid_value")
    if any(f["name"] == name for f in functions):
        raise InvalidFieldError(f"{where}.name: '{name}' is offered twice", param=f"{where}.name", code="invalid_value")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise InvalidFieldError(f"{where}.description must be a string", param=f"{where}.description", code="invalid_type")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    param = f"{where}.parameters"
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise InvalidFieldError(f"{param} must be a JSON Schema of type object", param=param, code="invalid_schema")
    check_schema(params, param)
    return {"name": name, "description": description, "parameters": params}


def tool_grammar(tools: Tools, family: ToolFamily = GENERIC) -> Grammar:
    """Well-formed calls to the offered functions (only the named one for a named choice), in
    any of the family's call syntaxes."""
    offered = tools.offered
    # checked per tool: each tool's $refs point into its own parameters
    rules = schema_rules([(f"args-{i}", f["parameters"]) for i, f in enumerate(offered)], "tools")
    key, many = family.args_key, tools.parallel and tools.named is None
    lines = ["tool-calls ::= " + " | ".join(f"calls-{k}" for k in range(len(family.syntaxes)))]
    for k, syntax in enumerate(family.syntaxes):
        lines.append(f"calls-{k} ::= " + _syntax_rule(syntax, many))
    if any(not s.args_marker for s in family.syntaxes):  # a JSON object with the name and the arguments
        lines.append("call ::= " + " | ".join(f"call-{i}" for i in range(len(offered))))
        for i, f in enumerate(offered):
            lines.append(
                f'call-{i} ::= "{{" " "? "\\"name\\"" " "? ":" " "? "\\"{f["name"]}\\"" " "? "," " "? "\\"{key}\\"" " "? ":" " "? args-{i} "}}"'
            )
    marker = next((s.args_marker for s in family.syntaxes if s.args_marker), "")
    if marker:  # the name, the marker, the arguments
        lines.append("named-call ::= " + " | ".join(f"named-call-{i}" for i in range(len(offered))))
        lines += [f'named-call-{i} ::= "{f["name"]}" {_literal(marker)} args-{i}' for i, f in enumerate(offered)]
    lazy = tools.choice == "auto"
    # the text from the opener on follows the grammar; what comes before it is the content
    triggers = tuple(_trigger(s) for s in family.syntaxes) if lazy else ()
    return Grammar(rules.rstrip("\n") + "\n" + "\n".join(lines) + "\n", "tool-calls", triggers)


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF string literal escapes as JSON does, for these texts


def _syntax_rule(syntax: CallSyntax, many: bool) -> str:
    """One syntax's calls: one JSON list after the opener, or one block per call."""
    repeat = f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if many else ""
    if syntax.args_marker:
        block = _literal(syntax.opener) + " named-call"
        return f"{block} ({block}){repeat}" if many else block
    if syntax.listed:
        parts = [_literal(syntax.opener), f'"[" call ("," " "? call){repeat} "]"' if many else '"[" call "]"', _literal(syntax.closer)]
        return " ".join(p for p in parts if p != '""')
    if not syntax.opener:
        return "call"  # a bare JSON call at the start of the answer: nothing could open a second
    if syntax.closer:
        block = f'{_literal(syntax.opener + chr(10))} call " "? {_literal(chr(10) + syntax.closer)}'
    else:
        block = _literal(syntax.opener) + " call"
    return f'{block} ("\\n" {block}){repeat}' if many else block


def _trigger(syntax: CallSyntax) -> str:
    if not syntax.opener:
        return r"\s*(\{)[\s\S]*"  # a call that is the whole answer: the answer starts with it
    return rf"[\s\S]*?({re.escape(syntax.opener)})[\s\S]*"


def system_prompt(tools: Tools) -> str:
    lines = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.offered)
    many = "Write one block per call when several are needed.\n" if tools.parallel and tools.named is None else ""
    return TOOLS_PROMPT.format(tools=lines, many=many)


def render_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """OpenAI messages (tool calls and results included) -> the role/content messages every
    chat template takes, in the documented format."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [
                f'{OPEN}\n{{"name": {json.dumps(c["name"])}, "arguments": {c["arguments"]}}}\n{CLOSE}' for c in m["tool_calls"]
            ]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block  # results of parallel calls go back together
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools is not None and tools.active:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_messages(messages: list[dict], tools: Tools | None, family: ToolFamily) -> tuple[list[dict], dict]:
    """Checked messages (tool calls and results included) and the active tools -> the messages
    and template variables to render: through the model's own template for a known family, else
    in the generic format."""
    if family.native:
        return native_messages(messages, tools.offered if tools is not None and tools.active else None, family)
    return render_messages(messages, tools), {}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Splits streamed answer text into content and tool calls in one family's syntaxes; the
    call syntax never comes out as content (a call cut off by max_tokens is dropped, not shown).
    A call identical to one the answer already made (name and arguments) ends the list: it and
    everything after it are dropped and `ended` is set (a small model held to calls by the
    grammar may repeat one until the limit instead of stopping).
    """

    def __init__(self, family: ToolFamily = GENERIC):
        self.family = family
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        #: a call repeated an earlier one: the answer is over, the rest of the text is ignored
        self.ended = False
        self._made: set[tuple[str, str]] = set()
        self._held = ""
        self._syntax: CallSyntax | None = None  # the syntax of the call being read
        #: a bare JSON call can only be the whole answer: once other text is out, none can come
        self._bare = any(not s.opener for s in family.syntaxes)
        self._openers = [s for s in family.syntaxes if s.opener]

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content and newly completed calls in `text`."""
        if self.ended:
            return "", []
        self._held += text
        out: list[str] = []
        new: list[ToolCall] = []
        while not self.ended:
            if self._syntax is not None:
                if not self._read_call(self._syntax, new, out, final=False):
                    break
                continue
            at, syntax = self._next_opener()
            if syntax is not None:
                if not self.calls and not new:
                    out.append(self._held[:at])
                self._held, self._syntax = self._held[at + len(syntax.opener) :], syntax
                continue
            keep = self._undecided()
            if not self.calls and not new:
                # between and after calls only the separating whitespace the grammar allows
                out.append(self._held[: len(self._held) - keep])
                if self._held[: len(self._held) - keep].strip():
                    self._bare = False
            self._held = self._held[len(self._held) - keep :]
            break
        self.calls.extend(new)
        text_out = "".join(out)
        self.content.append(text_out)
        return text_out, new

    def finish(self) -> str:
        """The end: a call whose end never came is read as far as it goes (a closer-less one
        ends with the text); held text that never became an opener is content."""
        out: list[str] = []
        if self._syntax is not None and not self.ended:
            new: list[ToolCall] = []
            self._read_call(self._syntax, new, out, final=True)
            self.calls.extend(new)
        tail = "".join(out) + ("" if self._syntax is not None or self.calls else self._held)
        self._held, self._syntax = "", None
        self.content.append(tail)
        return tail

    @property
    def text(self) -> str:
        text = "".join(self.content)
        # the blank line a model puts before its call is not content
        return text.rstrip() if self.calls else text

    def _next_opener(self) -> tuple[int, CallSyntax | None]:
        found = min(((self._held.find(s.opener), s) for s in self._openers if s.opener in self._held), default=None, key=lambda f: f[0])
        if found is not None:
            return found
        if self._bare and not self.calls:
            stripped = self._held.lstrip()
            if stripped.startswith("{"):
                return len(self._held) - len(stripped), self.family.syntaxes[0]
        return -1, None

    def _undecided(self) -> int:
        """How many characters at the end of the held text may still start a call."""
        if self._bare and not self.calls and not self._held.strip():
            return len(self._held)
        return max((marker_tail(self._held, s.opener) for s in self._openers), default=0)

    def _read_call(self, syntax: CallSyntax, new: list[ToolCall], out: list[str], final: bool) -> bool:
        """Read the call after `syntax`'s opener from the held text; False if it is not all there yet."""
        if syntax.args_marker:
            # name [id marker, id] args marker {arguments}: one call per opener
            head, found, tail = self._held.partition(syntax.args_marker)
            tail = tail.lstrip()
            try:
                arguments, used = _DECODER.raw_decode(tail) if found else (None, -1)
            except json.JSONDecodeError:
                arguments, used = None, -1
            if used < 0 and not final:
                return False  # not all there yet (or malformed: dropped at the end)
            rest = tail[used:] if used >= 0 else ""
            body = self._held[: len(self._held) - len(rest)]
            called = (head.partition(syntax.id_marker)[0] if syntax.id_marker else head).strip()
            value = {"name": called, "arguments": arguments} if NAME.fullmatch(called) else None
        elif syntax.closer:
            end = self._held.find(syntax.closer)
            if end < 0 and not final:
                return False
            body, rest = (self._held, "") if end < 0 else (self._held[:end], self._held[end + len(syntax.closer) :])
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                value = None
        else:
            body = self._held.lstrip()
            if body and body[0] not in "[{" and syntax.opener:
                # the opener's word in prose ("functools" is also a Python module): content
                self._held, self._syntax = syntax.opener + self._held, None
                self._openers = [s for s in self._openers if s is not syntax]
                return True
            try:
                value, used = _DECODER.raw_decode(body)
            except json.JSONDecodeError:
                if not final:
                    return False  # not all there yet (or malformed: dropped at the end)
                value, used = None, len(body)
            rest = body[used:]
        self._held, self._syntax = rest, None
        calls = call_objects(value)
        if calls is None and not syntax.opener and not self.calls and not new:
            # a JSON answer that is not a call (no opener promised one) is content
            out.append(body if rest == "" else body[: len(body) - len(rest)])
            self._bare = False
            return True
        if calls is None:
            # only without a grammar (the model's own syntax gone wrong): dropped, never shown
            log.warning("dropped a malformed tool call: %.200s", body)
            return True
        for name, args in calls:
            key = (name, json.dumps(args, sort_keys=True))
            if key in self._made:
                self.ended, self._held = True, ""
                break
            self._made.add(key)
            new.append(ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False)))
        return True


class RepeatStop:
    """An engine event callback in front of another: it reads the answer's calls as they come
    (on the engine thread) and stops the answer at a call that repeats an earlier one, so the
    tokens of the repeats up to the call limit are never generated. `handle` is set once the
    request is submitted; the answer ends with reason 'stop', and every parser of its text
    drops the repeat."""

    def __init__(self, family: ToolFamily, on_event: Callable[[Event], None]):
        self.parser = ToolCallParser(family)
        self.on_event = on_event
        self.handle: RequestHandle | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, TextDelta) and not event.reasoning and not self.parser.ended:
            self.parser.feed(event.text)
            if self.parser.ended and self.handle is not None:
                self.handle.stop()
        self.on_event(event)


_DECODER = json.JSONDecoder()
