"""Tool calling: OpenAI's `tools` / `tool_choice` in, the model's calls out as `tool_calls`.

The calls are written in one documented format (docs/server.md), told to the model in the
system prompt, the format Hermes-style and Qwen models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A grammar holds the model to it: lazy for `auto` (free text until the model writes
`<tool_call>`, then a well-formed call to an offered tool whose arguments follow that tool's
`parameters` schema), immediate for `required` and a named function. `ToolCallParser` takes
the calls out of the text as it streams, so no `<tool_call>` syntax ever reaches `content`.
Earlier calls and results in the history are written back in the same format (results as
`<tool_response>` blocks in a user turn).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field

from edgechat.engine.request import Grammar
from edgechat.server.errors import bad_request
from edgechat.server.structured import check_schema, schema_rules

log = logging.getLogger("edgechat.server")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: calls in one answer when parallel_tool_calls is on (a small model may not stop by itself)
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

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


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, each wrong value a 400 naming it."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls", code="invalid_type")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools", code="invalid_type")
    functions: list[dict] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function'", param=f"{where}.type", code="invalid_value")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", param=f"{where}.function", code="invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -", param=f"{where}.function.name", code="invalid_value")
        if any(f["name"] == name for f in functions):
            raise bad_request(f"{where}.function.name: '{name}' is offered twice", param=f"{where}.function.name", code="invalid_value")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description", code="invalid_type")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        param = f"{where}.function.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad_request(f"{param} must be a JSON Schema of type object", param=param, code="invalid_schema")
        check_schema(params, param)
        functions.append({"name": name, "description": description, "parameters": params})
    named = None
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if not any(f["name"] == named for f in functions):
            offered = ", ".join(f["name"] for f in functions)
            raise bad_request(
                f"tool_choice names the function {named!r}, which is not in 'tools' ({offered})",
                param="tool_choice",
                code="invalid_value",
            )
        kind = "function"
    else:
        raise bad_request(
            "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice",
            code="invalid_value",
        )
    return Tools(functions, kind, named, parallel)


def tool_grammar(tools: Tools) -> Grammar:
    """Well-formed calls to the offered functions (only the named one for a named choice)."""
    offered = [f for f in tools.functions if tools.named in (None, f["name"])]
    # checked per tool: each tool's $refs point into its own parameters
    rules = schema_rules([(f"args-{i}", f["parameters"]) for i, f in enumerate(offered)], "tools")
    calls = []
    for i, f in enumerate(offered):
        calls.append(
            f'call-{i} ::= "{{" " "? "\\"name\\"" " "? ":" " "? "\\"{f["name"]}\\"" " "? "," " "? "\\"arguments\\"" " "? ":" " "? args-{i} "}}"'
        )
    many = tools.parallel and tools.named is None
    repeat = f' ("\\n" tool-call){{0,{MAX_PARALLEL_CALLS - 1}}}' if many else ""
    lines = [
        f"tool-calls ::= tool-call{repeat}",
        f'tool-call ::= "{OPEN}\\n" call " "? "\\n{CLOSE}"',
        "call ::= " + " | ".join(f"call-{i}" for i in range(len(offered))),
        *calls,
    ]
    lazy = tools.choice == "auto"
    # the text from the opener on follows the grammar; what comes before it is the content
    triggers = (rf"[\s\S]*?({re.escape(OPEN)})[\s\S]*",) if lazy else ()
    return Grammar(rules.rstrip("\n") + "\n" + "\n".join(lines) + "\n", "tool-calls", triggers)


def system_prompt(tools: Tools) -> str:
    lines = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions if tools.named in (None, f["name"]))
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


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Splits streamed answer text into content and tool calls; the call syntax never comes out
    as content (a call cut off by max_tokens is dropped, not shown)."""

    content: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """New content and newly completed calls in `text`."""
        self._held += text
        out, new = [], []
        while True:
            if self._in_call:
                end = self._held.find(CLOSE)
                if end < 0:
                    break
                call = _parse_call(self._held[:end])
                if call is not None:
                    new.append(call)
                self._held, self._in_call = self._held[end + len(CLOSE) :], False
                continue
            start = self._held.find(OPEN)
            if start >= 0:
                out.append(self._held[:start] if not self.calls and not new else "")
                self._held, self._in_call = self._held[start + len(OPEN) :], True
                continue
            keep = _partial_opener(self._held)
            if not self.calls and not new:
                # between and after calls only the separating whitespace the grammar allows
                out.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        self.calls.extend(new)
        text_out = "".join(out)
        self.content.append(text_out)
        return text_out, new

    def finish(self) -> str:
        """The end: held text that never became an opener is content."""
        tail = "" if self._in_call or self.calls else self._held
        self._held = ""
        self.content.append(tail)
        return tail

    @property
    def text(self) -> str:
        text = "".join(self.content)
        # the blank line a model puts before its call is not content
        return text.rstrip() if self.calls else text


def _partial_opener(text: str) -> int:
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


def _parse_call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments", {}), dict):
        # only without a grammar (a template's own format gone wrong): dropped, never shown
        log.warning("dropped a malformed tool call: %.200s", text)
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))
