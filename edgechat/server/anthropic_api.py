"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translator:
its body into the one internal request (a ParsedRequest holding the engine's ChatRequest, the
same one chat completions builds), the engine's events into a Message or its SSE events, and
every error into Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.

Mapping: `system` and text blocks are messages, a user's `image` blocks its pictures
(server/images.py: base64 sources, data: or file:// URLs); `tool_use` blocks are an assistant's
tool calls and `tool_result` blocks the tool messages that answer them, so tools go through the
same machinery (tools.py, the model's own tool template where it has one) as OpenAI's;
`input_schema` is OpenAI's `parameters`; `thinking` is the reasoning budget. Fields that would
change the answer and are not implemented here (documents, server tools, an assistant
prefill) are refused; bookkeeping fields (metadata, service_tier, cache_control) are ignored.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat.engine.output.schema_grammar import tool_schema
from edgechat.engine.output.tools import NAME
from edgechat.engine.types.request import ChatRequest, Finished, ImageInput, ToolCall, Tools
from edgechat.server import fields, responses
from edgechat.server.bridge import Part, Started
from edgechat.server.dispatch import Api
from edgechat.server.errors import ApiError, bad_request
from edgechat.server.fields import ParsedRequest
from edgechat.server.images import ImageReader
from edgechat.server.images import content as content_of
from edgechat.server.keepalive import keep_alive_seconds
from edgechat.server.settings import ServerSettings
from edgechat.server.streaming import Wire, stream, whole
from edgechat.server.tools import note_hosted_tools

#: Anthropic's error type for each HTTP status (any other 4xx is an invalid request, 5xx an api_error)
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
#: stop strings are searched for after every token: a bound keeps that cheap
MAX_STOP_SEQUENCES = 64


def owns(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_status(exc: ApiError) -> int:
    # a full queue is the server's capacity, not the client's rate: Anthropic's 529 (the
    # official clients retry it, honouring Retry-After)
    return 529 if exc.code == "queue_full" else exc.status


def error_body(exc: ApiError) -> dict:
    status = error_status(exc)
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = exc.message
    if exc.tokens is not None:
        # Anthropic's own words, which Claude Code reads to compact the conversation
        message = f"prompt is too long: {exc.tokens[0]} tokens > {exc.tokens[1]} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), status_code=error_status(exc), headers=exc.headers)


# ---- the body into the internal request ------------------------------------------------------


def _blocks(where: str, content: object) -> list[dict]:
    """A content field: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise fields.type_error(where, "a string or a list of content blocks", content)
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise fields.type_error(f"{where}[{j}]", "an object", block)
    return content


def _refuse_block(where: str, kind: object) -> ApiError:
    if kind == "image":
        return bad_request(f"{where}: image blocks go in a user message's content, not here", param=where)
    if kind == "document":
        return bad_request(f"{where}: document blocks are not supported here (send the text)", param=where)
    return bad_request(f"{where}: unknown or misplaced content block type {fields.describe(kind)}", param=where)


def _system_texts(where: str, value: object) -> list[str]:
    parts = []
    for j, block in enumerate(_blocks(where, value)):
        if block.get("type") != "text":
            raise _refuse_block(f"{where}[{j}]", block.get("type"))
        parts.append(fields.text(f"{where}[{j}].text", block.get("text")))
    return parts


def _system(body: dict) -> str | None:
    value = body.get("system")
    if value is None:
        return None
    return "\n\n".join(_system_texts("system", value))


def _tool_result_text(where: str, block: dict) -> str:
    content = block.get("content")
    parts = []
    for j, part in enumerate(_blocks(f"{where}.content", "" if content is None else content)):
        if part.get("type") != "text":
            raise _refuse_block(f"{where}.content[{j}]", part.get("type"))
        parts.append(fields.text(f"{where}.content[{j}].text", part.get("text")))
    text = "\n".join(parts)
    # tool messages have no error flag in any chat template: the model reads it in the text
    return f"Error: {text}" if fields.opt_bool(block, "is_error") else text


def _image(where: str, block: dict, images: ImageReader) -> ImageInput:
    """An image block's source: base64 data, or a URL (data: and file:// URLs; remote ones are refused)."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise fields.type_error(f"{where}.source", "an object", source)
    kind = source.get("type")
    if kind == "base64":
        return images.base64(f"{where}.source.data", source.get("data"))
    if kind == "url":
        return images.url(f"{where}.source.url", source.get("url"))
    raise bad_request(f"{where}.source.type must be base64 or url, got {fields.describe(kind)} (files are not stored here)",
                      param=f"{where}.source.type")


def _message_list(body: dict, max_messages: int) -> list:
    """`messages`, checked to be a list of 1 to `max_messages` items."""
    raw = body.get("messages")
    if raw is None:
        raise bad_request("messages: field required", param="messages")
    if not isinstance(raw, list):
        raise fields.type_error("messages", "a list", raw)
    if not raw:
        raise bad_request("messages: at least one message is required", param="messages")
    if len(raw) > max_messages:
        raise bad_request(f"messages: {len(raw)} messages, more than the {max_messages} this server accepts", param="messages")
    return raw


def _messages(body: dict, max_messages: int, images: ImageReader) -> list[dict]:
    """Anthropic's messages -> the checked chat messages the OpenAI translator makes too
    (fields.messages): {role, content[, tool_calls | tool_call_id]}."""
    out: list[dict] = []
    calls: set[str] = set()  # ids of the tool_use blocks earlier messages made
    for i, message in enumerate(_message_list(body, max_messages)):
        if not isinstance(message, dict):
            raise fields.type_error(f"messages[{i}]", "an object", message)
        role = message.get("role")
        if role == "system":
            # a system message between turns (Claude Code sends them): kept where it stands
            system = "\n\n".join(_system_texts(f"messages[{i}].content", message.get("content")))
            out.append({"role": "system", "content": system})
            continue
        if role not in ("user", "assistant"):
            raise bad_request(f"messages[{i}].role must be 'user', 'assistant' or 'system', got {fields.describe(role)}", param=f"messages[{i}].role")
        text: list = []  # the message's text and images so far, in order
        made: list[dict] = []
        answered = False
        for j, block in enumerate(_blocks(f"messages[{i}].content", message.get("content"))):
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(fields.text(f"{where}.text", block.get("text")))
            elif kind == "image" and role == "user":
                text.append(_image(where, block, images))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier thoughts are never given to the model again (the engine's rule)
            elif kind == "tool_use" and role == "assistant":
                made.append(_tool_use(where, block))
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or call_id not in calls:
                    raise bad_request(
                        f"{where}.tool_use_id must be the id of a tool_use block an earlier assistant message made, got {fields.describe(call_id)}",
                        param=f"{where}.tool_use_id",
                    )
                if text:  # text before a result stays before it
                    out.append({"role": "user", "content": content_of(text)})
                    text = []
                out.append({"role": "tool", "content": _tool_result_text(where, block), "tool_call_id": call_id})
                answered = True
            else:
                raise _refuse_block(where, kind)
        if made:
            out.append({"role": "assistant", "content": "".join(text), "tool_calls": made})
            calls.update(c["id"] for c in made)
        elif text or not answered:
            out.append({"role": role, "content": content_of(text)})
    if out[-1]["role"] == "assistant":
        # the model always answers in a new turn here; continuing a written one is not built
        raise bad_request("messages: the last message must be the user's (an assistant prefill is not supported here)", param="messages")
    return out


def _tool_use(where: str, block: dict) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not call_id:
        raise fields.type_error(f"{where}.id", "a string", call_id)
    if not isinstance(name, str):
        raise fields.type_error(f"{where}.name", "a string", name)
    if not isinstance(args, dict):
        raise fields.type_error(f"{where}.input", "an object", args)
    return {"id": call_id, "name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` as tools.Tools: auto, any (OpenAI's required), tool (a named
    function), none; `disable_parallel_tool_use` is OpenAI's parallel_tool_calls off."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if choice is not None and not isinstance(choice, dict):
        raise fields.type_error("tool_choice", "an object", choice)
    choice = choice or {}
    kind: str = choice.get("type", "auto")
    if kind not in ("auto", "any", "tool", "none"):
        raise bad_request("tool_choice.type must be one of auto, any, tool, none", param="tool_choice.type")
    parallel = not fields.opt_bool(choice, "disable_parallel_tool_use")
    if raw is None or raw == []:
        if kind not in ("auto", "none"):
            raise bad_request(f"tool_choice.type {kind!r} needs 'tools'", param="tool_choice")
        return None
    if not isinstance(raw, list):
        raise fields.type_error("tools", "a list", raw)
    functions: list[dict] = []
    hosted: list[str] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise fields.type_error(where, "an object", tool)
        kind_of = tool.get("type", "custom")
        if not isinstance(kind_of, str):
            raise fields.type_error(f"{where}.type", "a tool type", kind_of)
        if kind_of != "custom":
            # Anthropic's own tools (web_search_20250305, bash_20250124, ...) run on its side or
            # are defined by a model trained on them: none of them can run here
            hosted.append(kind_of)
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request(f"{where}.name must be 1-64 letters, digits, _ or -", param=f"{where}.name")
        if any(f["name"] == name for f in functions):
            raise bad_request(f"{where}.name: '{name}' is offered twice", param=f"{where}.name")
        description = tool.get("description", "")
        if not isinstance(description, str):
            raise fields.type_error(f"{where}.description", "a string", description)
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad_request(f"{where}.input_schema must be a JSON Schema of type object", param=f"{where}.input_schema")
        tool_schema(schema, f"{where}.input_schema")
        functions.append({"name": name, "description": description, "parameters": schema})
    note_hosted_tools("Anthropic", hosted)
    if not functions:
        return None
    named = None
    if kind == "tool":
        named = choice.get("name")
        if not any(f["name"] == named for f in functions):
            offered = ", ".join(f["name"] for f in functions)
            raise bad_request(f"tool_choice.name {fields.describe(named)} is not in 'tools' ({offered})", param="tool_choice.name")
    return Tools(functions, {"any": "required", "tool": "function"}.get(kind, kind), named, parallel)


def _reasoning_budget(body: dict, default: int | None) -> int | None:
    """`thinking`: enabled with budget_tokens (any positive count: small local models think in
    hundreds, not Anthropic's minimum of 1024), disabled, or adaptive (as long as it likes)."""
    value = body.get("thinking")
    if value is None:
        return default
    if not isinstance(value, dict):
        raise fields.type_error("thinking", "an object", value)
    kind = value.get("type")
    if kind == "disabled":
        return 0
    if kind == "adaptive":
        return None
    if kind != "enabled":
        raise bad_request("thinking.type must be enabled, disabled or adaptive", param="thinking.type")
    budget = fields.opt_int({"thinking.budget_tokens": value.get("budget_tokens")}, "thinking.budget_tokens", lo=1)
    if budget is None:
        raise bad_request("thinking.budget_tokens: field required", param="thinking.budget_tokens")
    return budget


def _stop_sequences(body: dict) -> list[str]:
    value = body.get("stop_sequences")
    if value is None:
        return []
    if not isinstance(value, list):
        raise fields.type_error("stop_sequences", "a list of strings", value)
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop_sequences: {len(value)} strings, at most {MAX_STOP_SEQUENCES} here", param="stop_sequences")
    stops = [fields.text(f"stop_sequences[{i}]", s) for i, s in enumerate(value)]
    if "" in stops:
        raise bad_request("stop_sequences must not hold an empty string", param="stop_sequences")
    return stops


def parse_messages(body: dict, settings: ServerSettings, sampling=None, counting: bool = False) -> ParsedRequest:
    """A Messages body as the internal request; `counting`: a count_tokens body (no max_tokens,
    nothing generated)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise fields.type_error("model", "a string", model)
    max_tokens = None
    if not counting:
        max_tokens = fields.opt_int(body, "max_tokens", lo=1)
        if max_tokens is None:
            raise bad_request("max_tokens: field required", param="max_tokens")
    # Anthropic's temperature range is 0-1 (OpenAI's 0-2)
    fields.opt_float(body, "temperature", 0.0, 1.0)
    tools = _tools(body)
    active = tools if tools is not None and tools.active else None
    messages = _messages(body, settings.max_messages, ImageReader(settings))
    system = _system(body)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    request = ChatRequest(
        messages=messages,
        tools=active,
        sampling=fields.sampling({k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}, sampling),
        max_tokens=max_tokens,
        stop=_stop_sequences(body),
        reasoning_budget=_reasoning_budget(body, settings.reasoning_budget),
    )
    return ParsedRequest(request, model, fields.opt_bool(body, "stream"), False, 1, active, messages)


# ---- engine events into Anthropic's shapes ---------------------------------------------------


def _stop_reason(finished: Finished, calls: list[ToolCall]) -> tuple[str, str | None]:
    """stop_reason and stop_sequence."""
    if calls and finished.reason == "stop":
        return "tool_use", None
    if finished.reason == "length":
        return "max_tokens", None
    if finished.stop_sequence is not None:
        return "stop_sequence", finished.stop_sequence
    return "end_turn", None


def _usage(finished: Finished) -> dict:
    # Anthropic's input_tokens leaves out what came from the cache: the prompt is their sum
    m = finished.metrics
    return {"input_tokens": m.prompt_tokens - m.cached_tokens, "cache_read_input_tokens": m.cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": m.completion_tokens}


def _tool_use_block(call: ToolCall, with_input: bool = True) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments) if with_input else {}}


def message_body(message_id: str, model: str, choice: responses.Choice) -> dict:
    finished = choice.finished
    content = []
    if finished.reasoning:
        # edgechat signs nothing: the signature is there because clients read the field
        content.append({"type": "thinking", "thinking": finished.reasoning, "signature": ""})
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    content += [_tool_use_block(c) for c in choice.tool_calls]
    stop_reason, stop_sequence = _stop_reason(finished, choice.tool_calls)
    return {"id": message_id, "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(finished)}


def event(kind: str, **fields) -> str:
    """One SSE event: its name, and the data's `type`, are the kind."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def error_event(exc: ApiError) -> str:
    return f"event: error\ndata: {json.dumps(error_body(exc), ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks of a streamed message: one open at a time, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the type of the open block

    def start(self, block: dict) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        return out + [event("content_block_start", index=self.index, content_block=block)]

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.index)]

    def delta(self, kind: str, text: str) -> list[str]:
        """Text or thoughts, in the open block of their kind or a new one."""
        out = [] if self.open == kind else self.start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
        field = "thinking" if kind == "thinking" else "text"
        return out + [event("content_block_delta", index=self.index, delta={"type": f"{field}_delta", field: text})]

    def tool_use(self, call: ToolCall) -> list[str]:
        return self.start(_tool_use_block(call, with_input=False)) + [
            event("content_block_delta", index=self.index, delta={"type": "input_json_delta", "partial_json": call.arguments})
        ] + self.stop()


class MessagesApi(Api):
    """The two endpoints on one app's Dispatcher (its admission, queue and models)."""

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def count_tokens(self, request: Request) -> Response:
        dispatcher = self.dispatcher
        parsed = parse_messages(await dispatcher.read_body(request), dispatcher.settings, counting=True)
        return JSONResponse({"input_tokens": await dispatcher.count_prompt(parsed)})

    async def messages(self, request: Request) -> Response:
        dispatcher = self.dispatcher
        arrival = time.monotonic()
        body = await dispatcher.read_body(request)
        parsed = parse_messages(body, dispatcher.settings, dispatcher.defaults_for(body.get("model")))
        parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))  # an extension, as on chat completions
        # every refusal (queue full, prompt too long, unknown model) is an HTTP status from here
        start = await dispatcher.launch(request, parsed, arrival)
        message_id = f"msg_{uuid.uuid4().hex}"
        if parsed.stream:
            return await stream(dispatcher, start, _Events(message_id))
        started, finished = await whole(dispatcher, request, start)
        end = finished[0]
        return JSONResponse(message_body(message_id, started.served.id, responses.Choice(end, end.text, end.tool_calls)))


class _Events(Wire):
    """A streamed message's events: message_start, its content blocks, message_delta and
    message_stop; pings while nothing else is due once it started (keep-alive comments before)."""

    def __init__(self, message_id: str):
        self.message_id = message_id
        self.blocks = _Blocks()
        self.calls: list[ToolCall] = []

    def opened(self, started: Started) -> list[str]:
        usage = {"input_tokens": started.gens[0].prompt_tokens, "output_tokens": 0}
        return [event("message_start", message={"id": self.message_id, "type": "message", "role": "assistant", "content": [],
                                                "model": started.served.id, "stop_reason": None, "stop_sequence": None, "usage": usage}),
                event("ping")]

    def idle(self) -> list[str]:
        return [event("ping")]

    def part(self, part: Part) -> list[str]:
        blocks = self.blocks
        out = (blocks.delta("thinking", part.thought) if part.thought else []) + (blocks.delta("text", part.text) if part.text else [])
        for call in part.calls:
            self.calls.append(call)
            out += blocks.tool_use(call)
        return out

    async def end(self, finished: list[Finished]) -> list[str]:
        stop_reason, stop_sequence = _stop_reason(finished[0], self.calls)
        return [*self.blocks.stop(), event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           usage=_usage(finished[0])), event("message_stop")]

    def error(self, exc: ApiError) -> list[str]:
        return [error_event(exc)]
