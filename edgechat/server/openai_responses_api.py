"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) as a
translator: its body into the one internal request (a ParsedRequest holding the engine's
ChatRequest, the same one chat completions builds), the engine's events into a Response object
or its numbered SSE events. Errors are OpenAI's own shape, as for chat completions.

Mapping: `instructions` is a system message; `input` items are chat messages (`function_call`
items an assistant's tool calls, `function_call_output` the tool messages answering them;
`reasoning` items are dropped, since earlier thoughts are never given to the model again), so
tools go through the same machinery (tools.py) as chat's; `text.format` is response_format;
`reasoning.effort` is reasoning_effort. A stored response (`store`, on by default as at OpenAI)
keeps its whole context, so `previous_response_id` continues from it. A user's `input_image`
parts are its pictures (server/images.py). Fields that would change the answer and are not built
here (background runs, conversations, prompt templates, logprobs, files) are refused;
bookkeeping fields (metadata echoed, user, service_tier, prompt_cache_key, include, truncation)
are accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat.engine.output.tools import check_function
from edgechat.engine.types.request import ChatRequest, Finished, ToolCall, Tools
from edgechat.errors import StoreError
from edgechat.server import fields, responses
from edgechat.server.bridge import Part, Started
from edgechat.server.dispatch import Api
from edgechat.server.errors import ApiError, bad_request
from edgechat.server.fields import ParsedRequest
from edgechat.server.images import DATA_URL_HINT, ImageReader
from edgechat.server.images import content as content_of
from edgechat.server.keepalive import keep_alive_seconds
from edgechat.server.settings import ServerSettings
from edgechat.server.streaming import Wire, stream, whole
from edgechat.server.structured import json_schema_grammar, response_format_grammar
from edgechat.server.tools import note_hosted_tools
from edgechat.store.responses import ResponseStore

log = logging.getLogger("edgechat.server")
#: fields that would change the answer, with the values that leave them off
_UNSUPPORTED: dict[str, tuple] = {"background": (False,), "conversation": (), "prompt": (), "top_logprobs": (0,)}
#: the content part types each role's message may hold
_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the body into the internal request ------------------------------------------------------


@dataclass
class ResponsesRequest:
    """A checked body: the internal request, the context a stored response keeps (the input
    items of this response and of every one before it) and what the Response object echoes."""

    parsed: ParsedRequest
    context: list[dict]
    echo: dict
    store: bool
    #: what a call item carries beyond a function call's fields, by tool name (_tools)
    kinds: dict[str, dict] = dataclasses.field(default_factory=dict)


def _content(where: str, content: object, part_type: str, images: ImageReader | None = None) -> str | list:
    """A message's content: a string or a list of parts of the role's type, and input_image
    parts where `images` reads them (a user's: image_url a data: or file:// URL)."""
    if isinstance(content, str):
        return fields.text(where, content)
    if not isinstance(content, list):
        raise fields.type_error(where, "a string or a list of content parts", content)
    parts: list = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise fields.type_error(at, "an object", part)
        kind = part.get("type")
        if kind == "input_image":
            if images is None:
                raise bad_request(f"{at}: input_image parts go in user messages", param=f"{at}.type", code="invalid_value")
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise bad_request(f"{at}.file_id: files are not stored here; {DATA_URL_HINT} in image_url",
                                  param=f"{at}.file_id", code="unsupported_parameter")
            parts.append(images.url(f"{at}.image_url", part.get("image_url")))
            continue
        if kind in ("input_file", "input_audio"):
            raise bad_request(f"{at}: {kind} parts are not supported here (the model reads text and images)", param=f"{at}.type", code="unsupported_parameter")
        if kind != part_type:
            raise bad_request(f"{at}.type must be '{part_type}' here, got {fields.describe(kind)}", param=f"{at}.type", code="invalid_value")
        parts.append(fields.text(f"{at}.text", part.get("text")))
    return content_of(parts)


def _function_call(where: str, item: dict) -> dict:
    """An earlier call: {id, name, arguments (JSON object text)}, as chat's tool_calls are kept."""
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id:
        raise fields.type_error(f"{where}.call_id", "a string", call_id)
    if not isinstance(name, str):
        raise fields.type_error(f"{where}.name", "a string", name)
    try:
        parsed = json.loads(fields.text(f"{where}.arguments", args))
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(f"{where}.arguments must be a JSON object in a string", param=f"{where}.arguments", code="invalid_value")
    return {"id": call_id, "name": name, "arguments": json.dumps(parsed, ensure_ascii=False)}


def _messages(items: list[dict], first: int, images: ImageReader) -> list[dict]:
    """Input items -> the checked chat messages chat completions makes too (fields.messages):
    {role, content[, tool_calls | tool_call_id]}. Items before `first` came from a stored
    response (checked when it was made); errors name the others by their place in `input`."""
    out: list[dict] = []
    calls: set[str] = set()  # the call_ids of function_call items so far
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        if not isinstance(item, dict):
            raise fields.type_error(where, "an object", item)
        # a message may leave its type out (OpenAI's EasyInputMessage)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _PARTS:
                raise bad_request(f"{where}.role must be one of {', '.join(_PARTS)}, got {fields.describe(role)}", param=f"{where}.role", code="invalid_value")
            text = _content(f"{where}.content", item.get("content"), _PARTS[role], images if role == "user" else None)
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            call = _function_call(where, item) if kind == "function_call" else _custom_call(where, item)
            if out and out[-1]["role"] == "assistant":
                # the text before a call and calls made together are one assistant turn
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(call["id"])
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise bad_request(f"{where}.call_id must be the call_id of an earlier {kind[:-7]} item, got {fields.describe(call_id)}",
                                  param=f"{where}.call_id", code="invalid_value")
            output = item.get("output")
            text = _content(f"{where}.output", "" if output is None else output, "input_text")
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif not isinstance(kind, str):
            raise fields.type_error(f"{where}.type", "an item type", kind)
        elif kind != "reasoning":  # earlier thoughts are never given to the model again (the engine's rule)
            # a hosted tool's call or result (web_search_call, ...), or an item of a kind added
            # to the API later: nothing the model can read here
            _log_skipped_item(kind)
    return out


@functools.cache
def _log_skipped_item(kind: str) -> None:
    log.info("Responses input items of type %r are left out of the prompt (nothing here reads them)", kind)


def _custom_call(where: str, item: dict) -> dict:
    """An earlier custom tool call, kept as the one-string function call it was offered as."""
    call_id, name, text = item.get("call_id"), item.get("name"), item.get("input", "")
    if not isinstance(call_id, str) or not call_id:
        raise fields.type_error(f"{where}.call_id", "a string", call_id)
    if not isinstance(name, str):
        raise fields.type_error(f"{where}.name", "a string", name)
    arguments = {_CUSTOM_INPUT: fields.text(f"{where}.input", text)}
    return {"id": call_id, "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _input(body: dict) -> list[dict]:
    value = body.get("input")
    if value is None:
        raise bad_request("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": fields.text("input", value)}]
    if not isinstance(value, list):
        raise fields.type_error("input", "a string or a list of input items", value)
    return value


#: a custom (freeform) tool is offered to the model as a function of one string argument
_CUSTOM_INPUT = "input"


def _custom_function(where: str, tool: dict, functions: list[dict]) -> dict:
    description = tool.get("description", "")
    if not isinstance(description, str):
        raise fields.type_error(f"{where}.description", "a string", description)
    schema = {"type": "object", "properties": {_CUSTOM_INPUT: {"type": "string", "description": "the tool's input, as free text"}},
              "required": [_CUSTOM_INPUT]}
    return check_function(where, {"name": tool.get("name"), "description": description, "parameters": schema}, functions)


def _tool_choice(choice: object) -> tuple[str, str | None]:
    """`tool_choice` as (kind, the function it names or None)."""
    if choice is None or choice in ("auto", "none", "required"):
        return str(choice or "auto"), None
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return "function", choice.get("name")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        return "auto", None  # a hosted tool or an allowed_tools list: every offered tool stays allowed
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
                      param="tool_choice", code="invalid_value")


def _tools(body: dict) -> tuple[Tools | None, dict[str, dict]]:
    """`tools` (function tools in Responses' flat shape, the functions of `namespace` tools,
    `custom` freeform tools as functions of one string), `tool_choice` (auto, none, required,
    {type: function|custom, name}) and `parallel_tool_calls` as tools.Tools; and for each tool
    name that is no plain function, what its call item carries (its namespace, or that it is
    custom). Hosted tools (web_search, file_search, ...) run on OpenAI's side: left out, logged."""
    raw = body.get("tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise fields.type_error("parallel_tool_calls", "a boolean", parallel)
    kind, named = _tool_choice(body.get("tool_choice"))
    if raw is None or raw == []:
        if kind not in ("auto", "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None, {}
    if not isinstance(raw, list):
        raise fields.type_error("tools", "a list", raw)
    functions: list[dict] = []
    kinds: dict[str, dict] = {}
    hosted: list[str] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise fields.type_error(where, "an object", tool)
        kind_of = tool.get("type")
        if kind_of == "function":
            functions.append(check_function(where, tool, functions))
        elif kind_of == "custom":
            functions.append(_custom_function(where, tool, functions))
            kinds[functions[-1]["name"]] = {"custom": True}
        elif kind_of == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise fields.type_error(f"{where}.tools", "a list of tools", inner)
            space = fields.text(f"{where}.name", tool.get("name"))
            for j, fn in enumerate(inner):
                at = f"{where}.tools[{j}]"
                if not isinstance(fn, dict):
                    raise fields.type_error(at, "an object", fn)
                if fn.get("type", "function") == "custom":
                    functions.append(_custom_function(at, fn, functions))
                    kinds[functions[-1]["name"]] = {"custom": True, "namespace": space}
                else:
                    functions.append(check_function(at, fn, functions))
                    kinds[functions[-1]["name"]] = {"namespace": space}
        elif isinstance(kind_of, str) and kind_of:
            hosted.append(kind_of)
        else:
            raise fields.type_error(f"{where}.type", "a tool type", kind_of)
    note_hosted_tools("Responses", hosted)
    if named is not None and not any(f["name"] == named for f in functions):
        offered = ", ".join(f["name"] for f in functions)
        raise bad_request(f"tool_choice.name {fields.describe(named)} is not in 'tools' ({offered})", param="tool_choice.name", code="invalid_value")
    if not functions:
        return None, {}
    return Tools(functions, kind, named, parallel), kinds


def _text_format(body: dict):
    """`text.format` (text, json_object, json_schema with name and schema flat): (grammar, echo)."""
    text = body.get("text")
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict):
        raise fields.type_error("text", "an object", text)
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported by this server; leave it out", param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    if not isinstance(fmt, dict):
        raise fields.type_error("text.format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None, fmt
    if kind == "json_object":
        return response_format_grammar({"type": "json_object"}), fmt
    if kind == "json_schema":
        return json_schema_grammar(fmt, "text.format"), fmt
    raise bad_request("text.format.type must be one of text, json_object, json_schema", param="text.format.type", code="invalid_value")


def _reasoning_budget(body: dict, default: int | None) -> tuple[int | None, str | None]:
    """The thinking budget and the effort named: edgechat's `reasoning_budget` (tokens, -1: no
    limit, as on chat completions) wins over `reasoning.effort` (as chat's reasoning_effort)."""
    if body.get("reasoning_budget") is not None:
        budget = fields.opt_int(body, "reasoning_budget", lo=-1)
        return (None if budget == -1 else budget), None
    value = body.get("reasoning")
    if value is None:
        return default, None
    if not isinstance(value, dict):
        raise fields.type_error("reasoning", "an object", value)
    effort = value.get("effort")
    if effort is None:
        return default, None
    if effort not in fields.REASONING_EFFORT:
        raise bad_request(f"'reasoning.effort' must be one of {', '.join(fields.REASONING_EFFORT)}", param="reasoning.effort", code="invalid_value")
    return fields.REASONING_EFFORT[effort], effort


def parse_responses(body: dict, settings: ServerSettings, sampling=None, history: list[dict] | None = None) -> ResponsesRequest:
    """A Responses body as the internal request; `history`: the context of the response
    `previous_response_id` names (its own context, then its output)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise fields.type_error("model", "a string", model)
    for name, off_values in _UNSUPPORTED.items():
        if name in body and not fields.is_off(body[name], off_values):
            raise bad_request(f"'{name}' is not supported by this server; leave it out", param=name, code="unsupported_parameter")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise fields.type_error("metadata", "an object", metadata)
    store = body.get("store") is None or fields.opt_bool(body, "store")
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = fields.text("instructions", instructions)
    history = history or []
    context = history + _input(body)
    messages = _messages(context, len(history), ImageReader(settings))
    if not messages:
        raise bad_request("'input' must hold at least one message", param="input", code="invalid_value")
    if len(messages) > settings.max_messages:
        raise bad_request(f"'input' makes {len(messages)} messages, more than the {settings.max_messages} this server accepts",
                          param="input", code="too_many_messages")
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    tools, kinds = _tools(body)
    active = tools if tools is not None and tools.active else None
    grammar, fmt = _text_format(body)
    if active is not None and grammar is not None:
        raise bad_request("'text.format' cannot be combined with tools here; set tool_choice to 'none' or leave text.format out",
                          param="text.format", code="unsupported_parameter")
    budget, effort = _reasoning_budget(body, settings.reasoning_budget)
    request = ChatRequest(
        messages=messages,
        tools=active,
        sampling=fields.sampling({k: body[k] for k in ("temperature", "top_p") if k in body}, sampling),
        max_tokens=fields.opt_int(body, "max_output_tokens", lo=1),
        reasoning_budget=budget,
        grammar=grammar,
    )
    parsed = ParsedRequest(request, model, fields.opt_bool(body, "stream"), False, 1, active, messages)
    echo = {
        "instructions": instructions,
        "max_output_tokens": request.max_tokens,
        "metadata": metadata or {},
        "parallel_tool_calls": tools.parallel if tools is not None else True,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": effort, "summary": None},
        "store": store,
        "temperature": request.sampling.temperature,
        "text": {"format": fmt},
        "tool_choice": _tool_choice_body(tools),
        "tools": body.get("tools") or [],
        "top_p": request.sampling.top_p,
        "truncation": "disabled",
    }
    return ResponsesRequest(parsed, context, echo, store, kinds)


def _tool_choice_body(tools: Tools | None) -> str | dict:
    if tools is None:
        return "auto"
    return {"type": "function", "name": tools.named} if tools.choice == "function" else tools.choice


# ---- engine events into the Responses shapes -------------------------------------------------


def _usage(finished: Finished) -> dict:
    m = finished.metrics
    return {
        "input_tokens": m.prompt_tokens,
        "input_tokens_details": {"cached_tokens": m.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": m.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": m.reasoning_tokens},
        "total_tokens": m.prompt_tokens + m.completion_tokens,
    }


def _status(finished: Finished) -> str:
    # cut by max_output_tokens (or the loop guard): OpenAI's "incomplete"
    return "incomplete" if finished.reason == "length" else "completed"


def response_body(r: ResponsesRequest, response_id: str, created: int, model: str, status: str, output: list[dict],
                  usage: dict | None = None, error: dict | None = None) -> dict:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model,
        "output": output,
        "usage": usage,
        **r.echo,
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict:
    """An answer's text; None: no content part yet (as a streamed item starts)."""
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning model's thoughts, whole (edgechat does not summarize them)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _custom_input(call: ToolCall) -> str:
    """A custom tool's free text, from the one string argument it was offered as."""
    try:
        value = json.loads(call.arguments).get(_CUSTOM_INPUT, "")
    except (json.JSONDecodeError, AttributeError):
        value = call.arguments
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _call_item(item_id: str, call: ToolCall, status: str, kinds: dict[str, dict]) -> dict:
    """A call as the item its tool's kind makes: function_call (with its namespace, if any) or
    custom_tool_call (its input the text, not JSON)."""
    kind = kinds.get(call.name, {})
    done = status == "completed"
    item = {"id": item_id, "call_id": call.id, "name": call.name}
    if "namespace" in kind:
        item["namespace"] = kind["namespace"]
    if kind.get("custom"):
        return {**item, "type": "custom_tool_call", "input": _custom_input(call) if done else "", "status": status}
    return {**item, "type": "function_call", "arguments": call.arguments if done else "", "status": status}


def output_items(choice: responses.Choice, kinds: dict[str, dict]) -> list[dict]:
    """A finished answer's output: its thoughts, its text (left out when it only calls), its calls."""
    finished, out = choice.finished, []
    if finished.reasoning:
        out.append(_reasoning_item(_new_id("rs"), finished.reasoning, "completed"))
    if choice.content or not choice.tool_calls:
        out.append(_message_item(_new_id("msg"), choice.content, _status(finished)))
    return out + [_call_item(_new_id("fc"), c, "completed", kinds) for c in choice.tool_calls]


class _Events:
    """One response's SSE events: numbered from 0; output items streamed one at a time, in
    order, each text item with one content part (index 0)."""

    def __init__(self, kinds: dict[str, dict]) -> None:
        self.kinds = kinds
        self.sequence = 0
        self.output: list[dict] = []  # the items done, as response.completed lists them
        self.open: dict | None = None  # the text item being streamed (reasoning or message)
        self.text = ""  # its text so far

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _place(self) -> dict:
        assert self.open is not None, "placed only inside an open item"
        return {"item_id": self.open["id"], "output_index": len(self.output), "content_index": 0}

    def start(self, kind: str) -> list[str]:
        """Open a text item: "reasoning" or "message"."""
        out = self.close()
        if kind == "reasoning":
            self.open, part = _reasoning_item(_new_id("rs"), None, "in_progress"), {"type": "reasoning_text", "text": ""}
        else:
            self.open, part = _message_item(_new_id("msg"), None, "in_progress"), _text_part("")
        self.text = ""
        return out + [self.event("response.output_item.added", output_index=len(self.output), item=self.open),
                      self.event("response.content_part.added", **self._place(), part=part)]

    def delta(self, kind: str, text: str) -> list[str]:
        """Text or thoughts, in the open item of their kind or a new one."""
        out = [] if self.open is not None and self.open["type"] == kind else self.start(kind)
        self.text += text
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **self._place(), delta=text)]
        return out + [self.event("response.output_text.delta", **self._place(), delta=text, logprobs=[])]

    def close(self, status: str = "completed") -> list[str]:
        if self.open is None:
            return []
        place, text = self._place(), self.text
        if self.open["type"] == "reasoning":
            done, part = _reasoning_item(self.open["id"], text, "completed"), {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", **place, text=text)]
        else:
            done, part = _message_item(self.open["id"], text, status), _text_part(text)
            out = [self.event("response.output_text.done", **place, text=text, logprobs=[])]
        out += [self.event("response.content_part.done", **place, part=part),
                self.event("response.output_item.done", output_index=place["output_index"], item=done)]
        self.output.append(done)
        self.open = None
        return out

    def call(self, call: ToolCall) -> list[str]:
        """A whole call: its item, its arguments (a custom tool's input) in one delta, its end."""
        out = self.close()
        item_id, index = _new_id("fc"), len(self.output)
        place = {"item_id": item_id, "output_index": index}
        done = _call_item(item_id, call, "completed", self.kinds)
        out.append(self.event("response.output_item.added", output_index=index, item=_call_item(item_id, call, "in_progress", self.kinds)))
        if done["type"] == "custom_tool_call":
            text = [self.event("response.custom_tool_call_input.delta", **place, delta=done["input"]),
                    self.event("response.custom_tool_call_input.done", **place, input=done["input"])]
        else:
            text = [self.event("response.function_call_arguments.delta", **place, delta=call.arguments),
                    self.event("response.function_call_arguments.done", **place, arguments=call.arguments)]
        out += [*text, self.event("response.output_item.done", output_index=index, item=done)]
        self.output.append(done)
        return out

    def has_message(self) -> bool:
        return any(i["type"] == "message" for i in self.output + ([self.open] if self.open else []))


def _held_whitespace(text: str) -> tuple[str, str]:
    """(what to send, what to hold): trailing whitespace waits for more text, since before a
    tool call (or at the end of one) it is not content (the engine's content leaves it out)."""
    body = text.rstrip()
    return body, text[len(body):]


class ResponsesApi(Api):
    """The endpoints on one app's Dispatcher (its admission, queue and models)."""

    def __init__(self, dispatcher):
        super().__init__(dispatcher)
        #: in the data directory the server's engine was given (`serve --data-dir`)
        self.store = ResponseStore(dispatcher.paths)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
        ]

    def _not_found(self, response_id: str, param: str | None = None) -> ApiError:
        return ApiError(404, f"no response with id {fields.describe(response_id)} is stored here", param=param, code="not_found")

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        found = await run_in_threadpool(self.store.get, response_id)
        if found is None:
            raise self._not_found(response_id)
        return JSONResponse(found[0])

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not await run_in_threadpool(self.store.delete, response_id):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def _history(self, body: dict) -> list[dict]:
        """The context `previous_response_id` continues: that response's context and output."""
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise fields.type_error("previous_response_id", "a string", previous)
        found = await run_in_threadpool(self.store.get, previous)
        if found is None:
            raise self._not_found(previous, "previous_response_id")
        stored, context = found
        return context + stored["output"]

    async def _keep(self, r: ResponsesRequest, body: dict) -> None:
        if not r.store:
            return
        try:
            await run_in_threadpool(self.store.put, body["id"], body, r.context)
        except StoreError as exc:
            # the answer is made: the client gets it; only a later GET or continuation will miss it
            log.warning("could not store response %s: %s", body["id"], exc)

    async def input_tokens(self, request: Request) -> Response:
        """The prompt tokens a Responses body (with the context it continues) would decode."""
        dispatcher = self.dispatcher
        body = await dispatcher.read_body(request)
        r = parse_responses(body, dispatcher.settings, None, await self._history(body))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": await dispatcher.count_prompt(r.parsed)})

    async def create(self, request: Request) -> Response:
        dispatcher = self.dispatcher
        arrival = time.monotonic()
        body = await dispatcher.read_body(request)
        r = parse_responses(body, dispatcher.settings, dispatcher.defaults_for(body.get("model")), await self._history(body))
        r.parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))  # an extension, as on chat completions
        # every refusal (queue full, prompt too long, unknown model) is an HTTP status from here
        start = await dispatcher.launch(request, r.parsed, arrival)
        response_id, created = _new_id("resp"), int(time.time())
        if r.parsed.stream:
            return await stream(dispatcher, start, _Stream(r, response_id, created, self._keep))
        started, finished = await whole(dispatcher, request, start)
        choice = responses.Choice(finished[0], finished[0].text, finished[0].tool_calls)
        out = response_body(r, response_id, created, started.served.id, _status(choice.finished), output_items(choice, r.kinds), _usage(choice.finished))
        await self._keep(r, out)
        return JSONResponse(out)


class _Stream(Wire):
    """A streamed response: response.created and in_progress, its items' events (_Events), then
    response.completed (or incomplete), stored as a whole answer is; a failure after it started
    is response.failed, a refusal before it an error event."""

    def __init__(self, r: ResponsesRequest, response_id: str, created: int, keep: Callable[[ResponsesRequest, dict], Awaitable[None]]):
        self.r, self.response_id, self.created, self.keep = r, response_id, created, keep
        self.events = _Events(r.kinds)
        self.calls: list[ToolCall] = []
        self.held = ""  # trailing whitespace not sent yet
        self.model: str | None = None  # the model answering, once under way

    def body(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
        assert self.model is not None, "a body is built once under way"
        return response_body(self.r, self.response_id, self.created, self.model, status, output, usage, error)

    def opened(self, started: Started) -> list[str]:
        self.model = started.served.id
        pending = self.body("in_progress", [])
        return [self.events.event("response.created", response=pending), self.events.event("response.in_progress", response=pending)]

    def part(self, part: Part) -> list[str]:
        events = self.events
        out = events.delta("reasoning", part.thought) if part.thought else []
        text, self.held = _held_whitespace(self.held + part.text)
        out += events.delta("message", text) if text else []
        for call in part.calls:
            self.calls.append(call)
            out += events.call(call)
        return out

    async def end(self, finished: list[Finished]) -> list[str]:
        events, out = self.events, []
        if not self.calls:
            # the whitespace at the end is content after all; and an answer is a message, if empty
            out += events.delta("message", self.held) if self.held else ([] if events.has_message() else events.start("message"))
        status = _status(finished[0])
        out += events.close(status)
        body = self.body(status, events.output, _usage(finished[0]))
        await self.keep(self.r, body)
        return [*out, events.event(f"response.{body['status']}", response=body)]

    def error(self, exc: ApiError) -> list[str]:
        if self.model is None:
            return [self.events.event("error", code=exc.code, message=exc.message, param=exc.param)]
        body = self.body("failed", self.events.output, error={"code": "server_error", "message": exc.message})
        return [self.events.event("response.failed", response=body)]
