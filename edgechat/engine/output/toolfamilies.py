"""Model families' own tool-call syntaxes, and their templates' shape of tool messages.

A family is recognised from the chat template's text: a template that takes `tools` and
writes one family's call syntax is that family, and requests with tools are rendered through
it (`native_messages`); anything else gets the generic `<tool_call>` format in the system
prompt (tools.py). What each family's models write when they call:

- hermes (Qwen 2.5 / 3, Hermes, and the generic format): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
- llama3 (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`, or it follows `<|python_tag|>`
- mistral (tokenizers up to v7: Mistral 7B v0.3, Nemo, Small 2409): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; call ids are 9 letters or digits
- mistral-v11 (tokenizers v11 on: Mistral Small 3.1+, Magistral, Devstral): `[TOOL_CALLS]name[ARGS]{...}` per call, one after
  another; v11 may put `[CALL_ID]id` before `[ARGS]`
- phi4 (Phi-4-mini): `functools[{"name": ..., "arguments": {...}}, ...]`; the tools go in the system message's `tools` field
- harmony (gpt-oss): a message to `functions.NAME` whose text is the arguments; the reasoning splitter
  hands it on as `<|channel|>commentary to=functions.NAME<|message|>{...}`. Its markers are special
  tokens the grammar sampler does not see as text, so no grammar holds it: its calls are parsed only

Gemma 3's template takes no tools, so Gemma gets the generic format.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class CallSyntax:
    #: the text that starts the calls; "" for a JSON call that is the whole answer
    opener: str
    #: the text that ends them; "" where the JSON value's own end does
    closer: str = ""
    #: the calls are one JSON list, not one object per opener
    listed: bool = False
    #: set where a call is the function's name, this text, then the arguments object (not one
    #: JSON object with both)
    args_marker: str = ""
    #: the text that may follow the name with the call's id, before args_marker
    id_marker: str = ""


@dataclass(frozen=True)
class ToolFamily:
    name: str
    #: what its models write; the grammar allows each of them
    syntaxes: tuple[CallSyntax, ...]
    #: texts that, in a template that takes tools, identify the family
    markers: tuple[str, ...] = ()
    #: the key of a call's arguments the model writes ("arguments" or Llama's "parameters")
    args_key: str = "arguments"
    #: rendered through the model's own template (False: the generic system-prompt format)
    native: bool = True
    #: a grammar can hold its calls (False where its syntax is special tokens: parsed only)
    grammar: bool = True


HERMES_CALL = CallSyntax("<tool_call>", "</tool_call>")
GENERIC = ToolFamily("generic", (HERMES_CALL,), native=False)
HERMES = ToolFamily("hermes", (HERMES_CALL,), ("<tool_call>",))
LLAMA3 = ToolFamily("llama3", (CallSyntax(""), CallSyntax("<|python_tag|>")), ("<|python_tag|>", "ipython"), args_key="parameters")
MISTRAL = ToolFamily("mistral", (CallSyntax("[TOOL_CALLS]", listed=True),), ("[TOOL_CALLS]",))
MISTRAL_V11 = ToolFamily("mistral-v11", (CallSyntax("[TOOL_CALLS]", args_marker="[ARGS]", id_marker="[CALL_ID]"),), ("[ARGS]",))
PHI4 = ToolFamily("phi4", (CallSyntax("functools", listed=True), CallSyntax("<|tool_call|>", "<|/tool_call|>", listed=True)), ("functools", "<|tool|>"))
HARMONY = ToolFamily("harmony", (CallSyntax("<|channel|>commentary to=functions.", args_marker="<|message|>"),), ("to=functions.",), grammar=False)
#: checked in this order: Mistral's and Llama's templates may also mention other families' texts
#: (a v11 Mistral template writes [TOOL_CALLS] too)
FAMILIES = (HARMONY, MISTRAL_V11, MISTRAL, LLAMA3, PHI4, HERMES)


def family_for(template: str | None) -> ToolFamily:
    """The family whose syntax this chat template writes, if it takes tools; else the generic one."""
    if not template or not re.search(r"\btools\b", template):
        return GENERIC
    return next((f for f in FAMILIES if any(m in template for m in f.markers)), GENERIC)


def call_objects(value: object) -> list[tuple[str, dict]] | None:
    """(name, arguments) of each call in a decoded call value (one object or a list), or None
    if it is not one; the arguments may be under "arguments" or "parameters"."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        out.append((item["name"], args))
    return out or None


def native_messages(messages: list[dict], functions: list[dict] | None, family: ToolFamily) -> tuple[list[dict], dict]:
    """Checked OpenAI messages -> the messages and variables the family's template takes.

    Calls carry their arguments as objects (templates write them with `tojson`), results the
    id and name of the call they answer. `functions` (None: no tools offered) become the
    `tools` variable in OpenAI's shape.
    """
    names: dict[str, str] = {}
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                names[c["id"]] = c["name"]
                fn = {"name": c["name"], "arguments": json.loads(c["arguments"])}
                calls.append({"id": _call_id(c["id"], family), "type": "function", "function": fn})
            out.append({"role": "assistant", "content": m["content"], "tool_calls": calls})
        elif m["role"] == "tool":
            call_id = m["tool_call_id"]
            out.append({"role": "tool", "content": m["content"], "tool_call_id": _call_id(call_id, family), "name": names.get(call_id, "")})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if functions is None:
        return out, {}
    if family is PHI4:
        # Phi-4-mini's template reads the tools from the system message, as a JSON string
        listed = json.dumps(functions, ensure_ascii=False)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "tools": listed}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": listed})
    return out, {"tools": [{"type": "function", "function": f} for f in functions]}


def _call_id(call_id: str, family: ToolFamily) -> str:
    if family not in (MISTRAL, MISTRAL_V11):
        return call_id
    # Mistral's templates refuse any id but 9 letters or digits; the same id maps the same way
    # in the call and in its result
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]
