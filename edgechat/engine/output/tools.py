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

from edgechat.engine.output.jsonvalue import JsonPrefix, fits
from edgechat.engine.output.markers import marker_tail
from edgechat.engine.output.schema_grammar import schema_rules, tool_schema
from edgechat.engine.output.toolfamilies import GENERIC, CallSyntax, ToolFamily, call_objects, native_messages
from edgechat.engine.types.request import ToolCall, Tools
from edgechat.errors import InvalidFieldError
from edgechat.params import Grammar

log = logging.getLogger("edgechat.tools")

OPEN, CLOSE = GENERIC.syntaxes[0].opener, GENERIC.syntaxes[0].closer
#: calls in one answer when parallel_tool_calls is on (a small model may not stop by itself)
MAX_PARALLEL_CALLS = 8
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

#: the JSON calls a model may write without its family's syntax (Qwen2.5-Coder and other small
#: models: a bare object, a list of them, or one in a ```json fence), recognized only when the
#: request declared tools, each call naming one with arguments that fit its schema, and only at
#: a line's start within this many characters of the answer's start (a short preamble)
FALLBACK_PREAMBLE = 400
FENCE_CALL = CallSyntax("```")  # a fenced JSON call (the opener is the fence)
BARE_CALL = CallSyntax("")  # a bare JSON call at a line's start
_FENCE_TAGS = ("json", "JSON", "tool_call", "tool_code")
_FENCE_HEAD = re.compile(rf"[ \t]*(?:{'|'.join(_FENCE_TAGS)})?[ \t]*\n?\s*")

TOOLS_PROMPT = """You can call functions (tools) to help answer. The functions, one JSON object per line:
<tools>
{tools}
</tools>
To call a function, write a block like this and nothing after it:
<tool_call>
{{"name": "function name", "arguments": {{...the arguments as JSON...}}}}
</tool_call>
{many}The results come back in <tool_response> blocks; then use them to answer."""


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
    tool_schema(params, param)
    return {"name": name, "description": description, "parameters": params}


def tool_grammar(tools: Tools, family: ToolFamily = GENERIC) -> Grammar | None:
    """Well-formed calls to the offered functions (only the named one for a named choice), in
    any of the family's call syntaxes; None for a family no grammar can hold (its calls are
    parsed only)."""
    if not family.grammar:
        return None
    offered = tools.offered
    # checked per tool: each tool's $refs point into its own parameters
    rules = schema_rules([(f"args-{i}", tool_schema(f["parameters"], "tools")) for i, f in enumerate(offered)], "tools")
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
    if lazy:
        # the JSON calls small models write outside their family's syntax (ToolCallParser's
        # fallback): once one starts, it is held to the offered tools too
        lines[0] += " | json-calls"
        lines += _fallback_rules(offered, many)
        triggers += fallback_triggers([f["name"] for f in offered])
    return Grammar(rules.rstrip("\n") + "\n" + "\n".join(lines) + "\n", "tool-calls", triggers)


def fallback_triggers(names: list[str]) -> tuple[str, ...]:
    """Where a fallback call starts: at a line's start within the preamble, bare or after a
    ```json fence, one object or a list, naming an offered function (the grammar takes over at
    its first bracket). A JSON call to a function nobody offered stays free text, and so content.
    Anchored (^...$), so llama.cpp matches each from the answer's start at one position; an
    unanchored pattern is searched for at every position, at every token (see _trigger)."""
    at = rf"^(?:[\s\S]{{0,{FALLBACK_PREAMBLE}}}\n)?(?:```(?:json)?\s*)?"
    named = r'\s*"name"\s*:\s*"(?:' + "|".join(re.escape(n) for n in names) + r')"[\s\S]*$'
    return (at + r"(\{)" + named, at + r"(\[)\s*\{" + named)


def _fallback_rules(offered: list[dict], many: bool) -> list[str]:
    """json-calls: one call object, or a list of them, with the whitespace a model writes in
    pretty JSON, then an optional closing fence (and, with parallel calls on, more calls each in
    a fence of its own). No second bare object: a small model that writes one after its call is
    imagining the call's result (`{"result": 1813}`), which held to the tools would become a call
    it never meant; the parser still reads two bare calls where no grammar holds the answer."""
    repeat = f"{{0,{MAX_PARALLEL_CALLS - 1}}}" if many else ""
    # after a fenced call, more calls each in a fence of its own (as small models write them)
    more = f' (call-ws "```" "json"? call-ws json-call call-ws "```"){repeat}' if many else ""
    lines = [
        r"call-ws ::= [ \t\n]{0,24}",
        f'json-calls ::= (json-call | "[" call-ws json-call (call-ws "," call-ws json-call){repeat} call-ws "]")'
        f' (call-ws "```"{more})?',
        "json-call ::= " + " | ".join(f"json-call-{i}" for i in range(len(offered))),
    ]
    for i, f in enumerate(offered):
        lines.append(
            f'json-call-{i} ::= "{{" call-ws "\\"name\\"" call-ws ":" call-ws "\\"{f["name"]}\\"" call-ws "," call-ws'
            f' ("\\"arguments\\"" | "\\"parameters\\"") call-ws ":" call-ws args-{i} call-ws "}}"'
        )
    return lines


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
    """llama.cpp matches a trigger in ^...$ against the whole answer, and searches for any other
    at every position, after every token: the opener alone, found wherever it is, costs a scan;
    wrapped in [\\s\\S]* it cost milliseconds a token (a third of SmolLM2's step) in std::regex."""
    if not syntax.opener:
        return r"^\s*(\{)[\s\S]*$"  # a call that is the whole answer: the answer starts with it
    return f"({re.escape(syntax.opener)})"


def answered_calls(messages: list[dict] | None) -> frozenset[tuple[str, str]]:
    """(name, arguments as sorted JSON) of the last assistant turn's calls whose results end the
    conversation: what a model that is only echoing them would write again."""
    msgs = messages or []
    i = len(msgs)
    while i and msgs[i - 1].get("role") == "tool":
        i -= 1
    if i == len(msgs) or not i or msgs[i - 1].get("role") != "assistant":
        return frozenset()
    found = set()
    for call in msgs[i - 1].get("tool_calls") or []:
        try:
            args = json.loads(call["arguments"]) if isinstance(call.get("arguments"), str) else call.get("arguments")
        except ValueError:
            continue
        found.add((call.get("name"), json.dumps(args, sort_keys=True)))
    return frozenset(found)


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


class ToolCallParser:
    """Splits streamed answer text into content and tool calls in one family's syntaxes; the
    call syntax never comes out as content (a call cut off by max_tokens is dropped, not shown).
    Given the declared `functions`, a call must name one of them with arguments that fit its
    `parameters` schema, or its text stays content; and the JSON calls small models write
    outside their family's syntax (bare, listed or fenced) are calls too. Text is held back only
    while it can still become a call. A call identical to one the answer already made (name and
    arguments) ends the list: it and everything after it are dropped and `ended` is set (a small
    model held to calls by the grammar may repeat one until the limit instead of stopping).
    """

    def __init__(self, family: ToolFamily = GENERIC, functions: list[dict] | None = None,
                 answered: frozenset[tuple[str, str]] = frozenset()):
        self.family = family
        #: (name, arguments) of the calls whose results the prompt ends with (`answered_calls`)
        self._answered = answered
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        #: a call repeated an earlier one: the answer is over, the rest of the text is ignored
        self.ended = False
        self._made: set[tuple[str, str]] = set()
        self._held = ""
        self._skip = 0  # leading characters of _held known to be content, not a call's start
        self._released = 0  # characters of content released so far
        self._prev = "\n"  # the last character released (the answer's start is a line's start)
        self._syntax: CallSyntax | None = None  # the syntax of the call being read
        self._json: JsonPrefix | None = None  # a fallback call's JSON as it is read
        self._fed = 0  # how much of _held the fallback's JsonPrefix has read
        # what the grammar holds a call to (a keyword it cannot enforce is the tool's to check)
        self._schemas = None if functions is None else {f["name"]: tool_schema(f.get("parameters") or {}, "tools") for f in functions}
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
            at, syntax = self._next_opener(new)
            if syntax is not None:
                self._release(self._held[:at], out, new)
                self._held, self._syntax = self._held[at + len(syntax.opener) :], syntax
                self._skip = self._fed = 0
                continue
            keep = self._undecided(new)
            done = len(self._held) - keep
            self._release(self._held[:done], out, new)
            self._held, self._skip = self._held[done:], max(0, self._skip - done)
            break
        self.calls.extend(new)
        text_out = "".join(out)
        self.content.append(text_out)
        return text_out, new

    def finish(self) -> str:
        """The end: a call whose end never came is read as far as it goes (a closer-less one
        ends with the text); held text that never became an opener is content."""
        out: list[str] = []
        new: list[ToolCall] = []
        if self._syntax is not None and not self.ended:
            self._read_call(self._syntax, new, out, final=True)
        self.calls.extend(new)
        if self._syntax is None:
            self._release(self._held, out, new)
        tail = "".join(out)
        self._held, self._syntax = "", None
        self.content.append(tail)
        return tail

    @property
    def text(self) -> str:
        text = "".join(self.content)
        # the blank line a model puts before its call is not content
        return text.rstrip() if self.calls else text

    def _release(self, text: str, out: list[str], new: list[ToolCall]) -> None:
        """Text that is no call: content before the first call; between and after calls only the
        separating text the grammar allows, dropped."""
        if not text or self.calls or new:
            return
        out.append(text)
        self._released += len(text)
        self._prev = text[-1]
        if text.strip():
            self._bare = False

    def _next_opener(self, new: list[ToolCall]) -> tuple[int, CallSyntax | None]:
        held, skip = self._held, self._skip
        found = [(held.find(s.opener, skip), s) for s in self._openers if s.opener in held[skip:]]
        if self._bare and not self.calls and not new:
            stripped = held.lstrip()
            if stripped.startswith("{"):
                found.append((len(held) - len(stripped), self.family.syntaxes[0]))
        if self._schemas:
            found += self._fallback_starts(new)
        return min(found, default=(-1, None), key=lambda f: f[0])

    def _fallback_starts(self, new: list[ToolCall]) -> list[tuple[int, CallSyntax]]:
        """Where a fallback call may start in the held text: the first character of a line within
        the preamble (after a call: the first one past whitespace and commas)."""
        held, out = self._held, []
        if self.calls or new:
            i = len(held) - len(held[self._skip :].lstrip(" \t\r\n,"))
            starts = [i] if i < len(held) else []
        else:
            room = FALLBACK_PREAMBLE - self._released
            starts = [i for i in range(self._skip, min(len(held), room))
                      if held[i] in "{[`" and (held[i - 1] if i else self._prev) == "\n"]
        for i in starts:
            if held.startswith("```", i):
                out.append((i, FENCE_CALL))
            elif held[i] in "{[":
                out.append((i, BARE_CALL))
            if out:
                break
        return out

    def _undecided(self, new: list[ToolCall]) -> int:
        """How many characters at the end of the held text may still start a call."""
        held = self._held
        if self._bare and not self.calls and not new and not held.strip():
            return len(held)
        keep = max((marker_tail(held, s.opener) for s in self._openers), default=0)
        if not self._schemas:
            return keep
        if self.calls or new:
            # between calls: the separators, and a fence's first backticks
            return len(held) if held.strip(" \t\r\n,") in ("", "`", "``") else keep
        if self._released + len(held) <= FALLBACK_PREAMBLE + 2:
            before, newline, line = held.rpartition("\n")
            if line in ("`", "``") and (newline or self._prev == "\n"):
                keep = max(keep, len(line))  # a line that may become a fence
        return keep

    def _reject(self, raw: str, used: int) -> None:
        """The text read as a call is content after all: its first `used` characters are."""
        self._held, self._syntax, self._skip, self._json = raw, None, max(1, used), None
        self._bare = False  # it is content: a bare call can no longer be the whole answer

    def _read_fallback(self, syntax: CallSyntax, new: list[ToolCall], final: bool) -> bool:
        """A bare or fenced JSON call; False if it is not all there yet."""
        raw = syntax.opener + self._held
        body = self._held
        head = 0
        if syntax is FENCE_CALL:
            m = _FENCE_HEAD.match(body)
            head = m.end() if m else 0
            tag = body.strip()
            if not final and (head == len(body) or "\n" not in body and any(t.startswith(tag) for t in _FENCE_TAGS)):
                return False  # the fence's language or the first character has not come
            if head == len(body) or body[head] not in "{[":
                self._reject(raw, len(syntax.opener))
                return True
        if self._json is None:
            self._json, self._fed = JsonPrefix(), head
        self._json.feed(body[self._fed :])
        self._fed = len(body)
        if self._json.valid and self._json.end is None and not final:
            return False
        end = self._json.end
        if not self._json.valid or end is None:
            self._reject(raw, len(syntax.opener) + max(1, head))
            return True
        value = json.loads(body[head : head + end])
        rest = body[head + end :]
        if syntax is FENCE_CALL:
            stripped = rest.lstrip()
            if stripped.startswith("```"):
                rest = stripped[3:]
            elif "```".startswith(stripped) and not final:
                return False  # the closing fence may follow
        calls = self._checked(value)
        if calls is None:
            self._reject(raw, len(raw) - len(rest))
            return True
        self._json, self._held, self._syntax = None, rest, None
        self._add(calls, new)
        return True

    def _checked(self, value: object) -> list[tuple[str, dict]] | None:
        """The calls in a decoded value, if each names a declared function (any, where none were
        given) with arguments that fit its schema."""
        calls = call_objects(value)
        if calls is None or self._schemas is None:
            return calls
        ok = all(name in self._schemas and fits(args, self._schemas[name]) for name, args in calls)
        if ok and all((name, json.dumps(args, sort_keys=True)) in self._answered for name, args in calls):
            # the calls just answered, written again right after their results: an echo (small
            # models repeat the call and its result), whose words are the answer, not a loop
            return None
        return calls if ok else None

    def _add(self, calls: list[tuple[str, dict]], new: list[ToolCall]) -> None:
        for name, args in calls:
            key = (name, json.dumps(args, sort_keys=True))
            if key in self._made:
                self.ended, self._held = True, ""
                break
            self._made.add(key)
            new.append(ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False)))

    def _read_call(self, syntax: CallSyntax, new: list[ToolCall], out: list[str], final: bool) -> bool:
        """Read the call after `syntax`'s opener from the held text; False if it is not all there yet."""
        if syntax is FENCE_CALL or syntax is BARE_CALL:
            return self._read_fallback(syntax, new, final)
        raw = syntax.opener + self._held
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
            self._release(body if rest == "" else body[: len(body) - len(rest)], out, new)
            self._bare = False
            return True
        if calls is None:
            # only without a grammar (the model's own syntax gone wrong): dropped, never shown
            log.warning("dropped a malformed tool call: %.200s", body)
            return True
        if self._checked(value) is None:
            # a call to a function the request did not declare, or arguments its schema refuses
            self._reject(raw, len(raw) - len(rest))
            return True
        self._add(calls, new)
        return True


_DECODER = json.JSONDecoder()
