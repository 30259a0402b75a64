"""OpenAI's chat completions and legacy completions (`/v1/chat/completions`, `/v1/completions`,
and llama-server's unprefixed `/chat/completions`, `/completions`) and the model listing
(`/v1/models`) as a translator: a body into the one internal request (a ParsedRequest holding the
engine's ChatRequest), the engine's events into a completion or its chunks (bodies built in
responses.py), n choices through one queue. Errors are OpenAI's own shape (ApiError's body).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat.engine.speech.models import speech_cards
from edgechat.engine.types.request import ChatRequest, Finished, Infill
from edgechat.params import SamplingParams
from edgechat.server import fields, responses
from edgechat.server.bridge import Part, Started
from edgechat.server.dispatch import Api, Served
from edgechat.server.errors import ApiError, bad_request
from edgechat.server.fields import ParsedRequest
from edgechat.server.images import ImageReader
from edgechat.server.keepalive import keep_alive_seconds
from edgechat.server.responses import ResponseIds
from edgechat.server.settings import ServerSettings
from edgechat.server.streaming import Wire, sse, stream, whole
from edgechat.server.structured import response_format_grammar
from edgechat.server.tools import parse_tools

#: OpenAI's limit on alternatives per token on the legacy endpoint (chat's: fields.MAX_TOP_LOGPROBS)
MAX_COMPLETION_LOGPROBS = 5
#: choices per request; the server also holds n to its engine's parallel sequences
MAX_N = 16


# ---- the body into the internal request ------------------------------------------------------


def _common(body: dict) -> tuple[str | None, bool, bool, int]:
    """model, stream, include_usage, n, and the features we refuse rather than silently ignore."""
    model = fields.model_field(body)
    n = fields.opt_int(body, "n", lo=1, hi=MAX_N) or 1
    fields.refuse_unsupported(body)
    stream = fields.opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise fields.type_error("stream_options", "an object", options)
    include_usage = fields.opt_bool(options or {}, "include_usage")
    return model, stream, include_usage, n


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (alternatives per token)."""
    top = fields.opt_int(body, "top_logprobs", lo=0, hi=fields.MAX_TOP_LOGPROBS)
    if not fields.opt_bool(body, "logprobs"):
        if top:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
        return None
    return top or 0


def _max_tokens(body: dict, default: int | None) -> int | None:
    value = fields.opt_int(body, "max_completion_tokens", lo=1)
    if value is None:
        value = fields.opt_int(body, "max_tokens", lo=1)
    return default if value is None else value


def parse_chat(body: dict, max_messages: int = ServerSettings.max_messages, sampling: SamplingParams | None = None,
               reasoning_budget: int | None = None, images: ImageReader | None = None) -> ParsedRequest:
    """A chat completions body as the internal request; `images` reads its image parts (the
    server's settings; default ones if not given)."""
    model, stream, include_usage, n = _common(body)
    tools = parse_tools(body)
    active = tools if tools is not None and tools.active else None
    grammar = response_format_grammar(body.get("response_format"))
    extension = fields.extension_grammar(body)
    if extension is not None:
        field = "grammar" if body.get("grammar") else "json_schema"
        if grammar is not None:
            raise bad_request(f"'{field}' cannot be combined with response_format; give one of them", param=field, code="invalid_value")
        if active is not None:
            raise bad_request(f"'{field}' cannot be combined with tools; set tool_choice to 'none' or leave '{field}' out",
                              param=field, code="invalid_value")
        grammar = extension
    if active is not None and grammar is not None:
        raise bad_request(
            "'response_format' cannot be combined with tools here; set tool_choice to 'none' or leave response_format out",
            param="response_format",
            code="unsupported_parameter",
        )
    ignore_eos = fields.opt_bool(body, "ignore_eos")
    if ignore_eos and (grammar is not None or active is not None):
        # a finished grammar allows only the end of text: ignoring it would repeat that to max_tokens
        raise bad_request("'ignore_eos' cannot be combined with response_format, grammar, json_schema or tools", param="ignore_eos",
                          code="invalid_value")
    messages = fields.messages(body, max_messages, images or ImageReader(ServerSettings()))
    request = ChatRequest(
        messages=messages,
        tools=active,
        sampling=fields.sampling(body, sampling),
        max_tokens=_max_tokens(body, None),
        stop=fields.stop(body),
        ignore_eos=ignore_eos,
        loop_guard=fields.loop_guard(body),
        reasoning_budget=fields.reasoning_budget(body, reasoning_budget),
        template_kwargs=fields.template_kwargs(body),
        speculative=fields.speculative(body),
        grammar=grammar,
        logprobs=_chat_logprobs(body),
    )
    return ParsedRequest(request, model, stream, include_usage, n, active, messages, client_grammar=bool(body.get("grammar")))


def parse_completion(body: dict, sampling: SamplingParams | None = None) -> ParsedRequest:
    model, stream, include_usage, n = _common({k: v for k, v in body.items() if k != "suffix"})
    for name in ("tools", "tool_choice", "response_format", "top_logprobs"):
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is for /v1/chat/completions", param=name, code="unsupported_parameter")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt", code="missing_required_parameter")
    if not isinstance(prompt, str):
        raise fields.type_error("prompt", "a string (token arrays and batches are not supported)", prompt)
    # with a suffix, a fill in the middle: the prompt is the text before the cursor (empty at a
    # file's start), laid out as llama-server's /infill (engine/prompt/fim.py)
    suffix = fields.text("suffix", body["suffix"]) if body.get("suffix") is not None else ""
    if prompt == "" and not suffix:
        raise bad_request("'prompt' must not be empty", param="prompt", code="invalid_value")
    text = fields.text("prompt", prompt)
    request = ChatRequest(
        prompt=None if suffix else text,
        infill=Infill(text, suffix) if suffix else None,
        sampling=fields.sampling(body, sampling),
        # OpenAI's legacy endpoint answers 16 tokens unless told otherwise
        max_tokens=_max_tokens(body, 16),
        stop=fields.stop(body),
        ignore_eos=fields.opt_bool(body, "ignore_eos"),
        loop_guard=fields.loop_guard(body),
        speculative=fields.speculative(body),
        logprobs=fields.opt_int(body, "logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS),
        grammar=fields.extension_grammar(body),
    )
    return ParsedRequest(request, model, stream, include_usage, n, client_grammar=bool(body.get("grammar")))


# ---- engine events into OpenAI's shapes ------------------------------------------------------


def model_card(served: Served, created: int, name: str | None = None) -> dict:
    """A model as /v1/models lists it, with edgechat's lifecycle under `meta`."""
    m, engine = served.model, served.engine
    info = m.info
    idle = m.idle_seconds()
    return {
        "id": name or served.id,
        "object": "model",
        "created": created,
        "owned_by": "edgechat",
        "meta": {
            "architecture": info.architecture,
            "quant": info.quant,
            "size_bytes": info.size_bytes,
            "n_ctx": engine.n_ctx if engine is not None else m.n_ctx,
            "n_parallel": m.n_parallel,
            "template_mode": engine.template_mode if engine is not None else None,
            # edgechat's model lifecycle: loaded or not, what it takes (the planner's count:
            # weights, KV cache, compute), requests running on it, seconds idle
            "state": m.state.value,
            "memory_bytes": m.need,
            "running": m.users,
            "idle_seconds": None if idle is None else round(idle, 1),
            "unloads_in": None if m.unload_at is None else round(max(0.0, m.unload_at - time.monotonic()), 1),
            "load_seconds": m.load_seconds,
            "path": str(info.path),
            # what it reads besides text: ["vision"] with an image projector
            "modalities": list(served.modalities),
        },
    }


class _ChoiceSent:
    """What one choice's chunks have carried so far."""

    def __init__(self) -> None:
        self.offset = 0  # text sent (the legacy logprobs' text_offset)
        self.calls: list = []


class _Chunks(Wire):
    """A completion's chunks: the role chunk once the answer starts (until then only keep-alive
    comments, so a client's first data is the answer's), each choice's text, thoughts and calls,
    its finish_reason, the usage if asked, [DONE]."""

    def __init__(self, parsed: ParsedRequest, kind: str):
        self.parsed, self.kind = parsed, kind
        self.role_sent = kind != "chat"

    def opened(self, started: Started) -> list[str]:
        self.ids = ResponseIds.new(self.kind, started.served.id)
        self.choices = [_ChoiceSent() for _ in started.gens]
        return []

    def part(self, part: Part) -> list[str]:
        kind, ids, c = self.kind, self.ids, self.choices[part.index]
        out = []
        if not self.role_sent:
            self.role_sent = True
            out += [sse(responses.chunk(kind, ids, None, None, role=True, index=i)) for i in range(len(self.choices))]
        if part.thought and kind == "chat":
            # thoughts before the answer's text: tool calls and stop strings never see them
            out.append(sse(responses.chunk(kind, ids, None, None, index=part.index, reasoning=part.thought)))
        if part.text or part.logprobs:
            logprobs = responses.logprobs_body(kind, part.logprobs, c.offset)
            c.offset += len(part.text)
            out.append(sse(responses.chunk(kind, ids, part.text or None, None, index=part.index, logprobs=logprobs)))
        for call in part.calls:
            out += [sse(responses.chunk(kind, ids, None, None, index=part.index, tool_calls=d)) for d in responses.tool_call_deltas(len(c.calls), call)]
            c.calls.append(call)
        return out

    def choice_end(self, index: int, finished: Finished) -> list[str]:
        reason = responses.Choice(finished, "", self.choices[index].calls).finish_reason
        return [sse(responses.chunk(self.kind, self.ids, None, reason, index=index))]

    async def end(self, finished: list[Finished]) -> list[str]:
        usage = [sse(responses.usage_chunk(self.kind, self.ids, finished))] if self.parsed.include_usage else []
        return [*usage, sse("[DONE]")]

    def error(self, exc: ApiError) -> list[str]:
        return [sse(exc.body())]


class ChatApi(Api):
    """The OpenAI routes on one app's Dispatcher."""

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            # llama-server's unprefixed OpenAI routes, which its own front ends call
            Route("/models", self.list_models, methods=["GET"]),
            Route("/chat/completions", self.chat, methods=["POST"]),
            Route("/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/completions", self.completions, methods=["POST"]),
        ]

    async def list_models(self, request: Request) -> Response:
        dispatcher = self.dispatcher
        cards = [model_card(m, dispatcher.created, name) for m in dispatcher.served() for name in (m.id, *m.aliases)]
        return JSONResponse({"object": "list", "data": [*cards, *speech_cards(dispatcher.speech, dispatcher.created)]})

    async def get_model(self, request: Request) -> Response:
        return JSONResponse(model_card(self.dispatcher.find_model(request.path_params["model"]), self.dispatcher.created))

    def _parse_chat(self, body: dict) -> ParsedRequest:
        """A chat body as the server answers it (and counts it: the same prompt either way)."""
        settings = self.dispatcher.settings
        return parse_chat(body, settings.max_messages, self.dispatcher.defaults_for(body.get("model")), settings.reasoning_budget,
                          ImageReader(settings))

    async def chat(self, request: Request) -> Response:
        dispatcher, arrival = self.dispatcher, time.monotonic()
        body = await dispatcher.read_body(request)
        parsed = self._parse_chat(body)
        parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))
        return await self.answer(request, parsed, "chat", arrival)

    async def input_tokens(self, request: Request) -> Response:
        """llama-server's count of a chat body's prompt tokens (its tools and template included)."""
        parsed = self._parse_chat(await self.dispatcher.read_body(request))
        return JSONResponse({"input_tokens": await self.dispatcher.count_prompt(parsed)})

    async def completions(self, request: Request) -> Response:
        dispatcher, arrival = self.dispatcher, time.monotonic()
        body = await dispatcher.read_body(request)
        parsed = parse_completion(body, dispatcher.defaults_for(body.get("model")))
        parsed.keep_alive = keep_alive_seconds(body.get("keep_alive"))
        return await self.answer(request, parsed, "text", arrival)

    async def answer(self, request: Request, parsed: ParsedRequest, kind: str, arrival: float) -> Response:
        start = await self.dispatcher.launch(request, parsed, arrival)
        if parsed.stream:
            return await stream(self.dispatcher, start, _Chunks(parsed, kind))
        started, finished = await whole(self.dispatcher, request, start)
        choices = [responses.Choice(f, f.text, f.tool_calls) for f in finished]
        return JSONResponse(responses.completion_body(choices, kind, ResponseIds.new(kind, started.served.id)))
