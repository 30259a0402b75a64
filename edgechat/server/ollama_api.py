"""Ollama's API (`/api/...`): its bodies into the server's one internal request (a ParsedRequest
holding the engine's ChatRequest), engine events back into its JSON objects and NDJSON streams,
and every error as Ollama writes it: `{"error": "..."}` with the status.

Images come as each message's (or generate's) `images`, base64 strings (server/images.py).
Chat's `tools` are OpenAI's functions (server/tools.py), offered as `tool_choice` "auto" (Ollama
has no such field); an assistant's `tool_calls` (arguments an object, ids optional) and the
`tool` messages answering them (by `tool_call_id`, else `tool_name`) become the checked
messages chat completions makes, and the engine's call events come back as Ollama writes them.
A generate body with a `suffix` is a fill in the middle (engine/prompt/fim.py: the prompt is the text
before the cursor), laid out as llama-server's /infill. What changes the answer and is not here
(a request's own template, an earlier `context`) is refused in one line; `keep_alive` says how long the model stays loaded
after the request (an empty prompt with it loads or, at 0, unloads the model, as in Ollama);
what only tunes how Ollama itself loads models (`num_ctx`, `num_gpu`, ...) is accepted and
ignored, as Ollama ignores options a model does not use.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import threading
import time
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgechat.engine.output.reasoning import reasoning_format
from edgechat.engine.types.request import ChatRequest, Finished, ImageInput, Infill, ToolCall, Tools
from edgechat.errors import EdgechatError, ModelNotFoundError, UsageError
from edgechat.models import hub
from edgechat.server import fields
from edgechat.server.bridge import Part, Started
from edgechat.server.dispatch import Api
from edgechat.server.embeddings_api import check_dimensions, embed
from edgechat.server.errors import ApiError, answered_as, bad_request
from edgechat.server.fields import ParsedRequest
from edgechat.server.images import ImageReader
from edgechat.server.images import content as content_of
from edgechat.server.keepalive import keep_alive_seconds
from edgechat.server.streaming import Wire, stream, whole
from edgechat.server.structured import response_format_grammar
from edgechat.server.tools import parse_tools

#: the Ollama API version whose fields this follows; clients gate features on it (`think` came in 0.9)
OLLAMA_VERSION = "0.9.0"
#: Ollama names models name:tag; a name without a tag means this one
DEFAULT_TAG = ":latest"
#: the expiry /api/ps gives a model kept loaded until the room is needed
LOADED_UNTIL = "9999-12-31T23:59:59Z"


def owns(path: str) -> bool:
    return path.startswith("/api/")


def error_response(exc: ApiError) -> Response:
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


#: errors raised inside a handler, answered in Ollama's shape (the app's handlers would use OpenAI's)
_ollama_errors = answered_as(error_response)


def _refuse(body: dict, name: str, why: str) -> None:
    if body.get(name):
        raise bad_request(f"'{name}' is not supported by this server: {why}", param=name, code="unsupported_parameter")


def _options(body: dict) -> dict:
    options = body.get("options")
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise fields.type_error("options", "an object", options)
    return options


def _format_grammar(value: object):
    """`format`: "json" (any JSON value an object) or a JSON schema, onto response_format's grammar."""
    if value is None or value == "":
        return None
    if value == "json":
        return response_format_grammar({"type": "json_object"})
    if isinstance(value, dict):
        return response_format_grammar({"type": "json_schema", "json_schema": {"name": "format", "schema": value}})
    raise bad_request("'format' must be \"json\" or a JSON schema object", param="format", code="invalid_value")


def _reasoning_budget(body: dict, default: int | None) -> int | None:
    """`think`: true thinks as long as the model likes, false not at all; the effort levels
    ("low", "medium", "high") some models take are the budgets reasoning_effort means."""
    think = body.get("think")
    if think is None:
        return default
    if isinstance(think, bool):
        return None if think else 0
    if think in ("low", "medium", "high"):
        return fields.REASONING_EFFORT[think]
    raise bad_request("'think' must be true, false, \"low\", \"medium\" or \"high\"", param="think", code="invalid_value")


def _request(body: dict, options: dict, dispatcher, **what) -> ChatRequest:
    """The ChatRequest of a chat or generate body, `what` saying what to answer."""
    num_predict = fields.opt_int(options, "num_predict")
    return ChatRequest(
        sampling=fields.sampling(options, dispatcher.defaults_for(_model(body))),
        # -1: until the end of text, -2: until the context is full (both: no cap of our own)
        max_tokens=num_predict if num_predict is not None and num_predict > 0 else None,
        stop=fields.stop(options),
        reasoning_budget=_reasoning_budget(body, dispatcher.settings.reasoning_budget),
        grammar=_format_grammar(body.get("format")),
        **what,
    )


def _expires(unload_at: float | None) -> str:
    """When an idle model is unloaded, as Ollama writes the time (UTC)."""
    if unload_at is None:
        return LOADED_UNTIL
    at = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=max(0.0, unload_at - time.monotonic()))
    return at.isoformat().replace("+00:00", "Z")


def _model(body: dict) -> str | None:
    model = body.get("model", body.get("name"))
    if model is not None and not isinstance(model, str):
        raise fields.type_error("model", "a string", model)
    return model


def _stream(body: dict) -> bool:
    # Ollama streams unless told not to
    return body.get("stream") is None or fields.opt_bool(body, "stream")


def _images(body: dict, where: str, images: ImageReader) -> list[ImageInput]:
    """A message's or a generate body's `images`: base64 strings, read in order."""
    value = body.get("images")
    if value is None:
        return []
    if not isinstance(value, list):
        raise fields.type_error(where, "a list of base64 strings", value)
    return [images.base64(f"{where}[{k}]", v) for k, v in enumerate(value)]


def _tool_calls(i: int, value: object) -> list[dict]:
    """An assistant's earlier calls, `[{id?, function: {name, arguments: {...}}}]`, in chat
    completions' shape. A call without an id gets one from its place in the conversation, so
    the same history renders the same prompt every time (its cached prefix is reused)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise fields.type_error(where, "a list", value)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise bad_request(f"{where}[{j}] must be {{function: {{name, arguments}}}}", param=f"{where}[{j}]")
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, dict):
            raise fields.type_error(f"{where}[{j}].function.arguments", "an object", arguments)
        call_id = call.get("id") or f"call_{i}_{j}"
        out.append({"id": fields.text(f"{where}[{j}].id", call_id), "type": "function",
                    "function": {"name": fn.get("name"), "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return out


def _chat_messages(messages: object) -> object:
    """Ollama's messages in chat completions' shape: calls as above, and each tool result tied
    to the call it answers: its `tool_call_id`, else the first unanswered call of its
    `tool_name`, else the first unanswered call."""
    if not isinstance(messages, list):
        return messages  # fields.messages says what is wrong with it
    out: list[object] = []
    unanswered: list[tuple[str, str]] = []  # (id, name) of earlier calls no result answered yet
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m["tool_calls"] = _tool_calls(i, m["tool_calls"])
            unanswered += [(c["id"], c["function"]["name"]) for c in m["tool_calls"]]
        elif m.get("role") == "tool" and not m.get("tool_call_id"):
            name = m.get("tool_name")
            match = next((c for c in unanswered if name in (None, c[1])), None)
            if match is None:
                made = f"a call to {fields.describe(name)}" if name is not None else "a call"
                raise bad_request(f"messages[{i}] is a tool result, but no earlier assistant message made {made} it could answer",
                                  param=f"messages[{i}]")
            m["tool_call_id"] = match[0]
        if m.get("role") == "tool":
            unanswered = [c for c in unanswered if c[0] != m["tool_call_id"]]
        out.append(m)
    return out


def _tools(body: dict) -> Tools | None:
    tools = parse_tools({"tools": body.get("tools")})
    return tools if tools is not None and tools.active else None


def parse_chat(body: dict, dispatcher) -> ParsedRequest:
    _refuse(body, "logprobs", "log probabilities are served on /v1/chat/completions")
    tools = _tools(body)
    if tools is not None and body.get("format"):
        raise bad_request("'format' cannot be combined with 'tools' here; leave one of them out", param="format", code="invalid_value")
    images = ImageReader(dispatcher.settings)
    checked = fields.messages({"messages": _chat_messages(body.get("messages"))}, dispatcher.settings.max_messages, images)
    for i, (m, out) in enumerate(zip(body["messages"], checked, strict=True)):
        pictures = _images(m, f"messages[{i}].images", images)
        if pictures and out["role"] != "user":
            raise bad_request(f"messages[{i}].images: images go in user messages", param=f"messages[{i}].images")
        if pictures:
            # before the text, where Ollama puts a message's images
            out["content"] = content_of([*pictures, *(out["content"] if isinstance(out["content"], list) else [out["content"]])])
    request = _request(body, _options(body), dispatcher, messages=checked, tools=tools)
    return ParsedRequest(request, _model(body), _stream(body), False, tools=tools, messages=checked)


def parse_generate(body: dict, dispatcher) -> ParsedRequest:
    _refuse(body, "template", "the model's own chat template is used")
    _refuse(body, "context", "send the conversation as messages to /api/chat")
    _refuse(body, "logprobs", "log probabilities are served on /v1/completions")
    prompt = fields.text("prompt", body.get("prompt", ""))
    pictures = _images(body, "images", ImageReader(dispatcher.settings))
    suffix = fields.text("suffix", body["suffix"]) if body.get("suffix") is not None else ""
    what: dict[str, str | list[dict] | Infill]
    if suffix:
        for name in ("raw", "images"):
            if body.get(name):
                raise bad_request(f"'{name}' cannot be combined with 'suffix' (a fill in the middle)", param=name, code="invalid_value")
        what = {"infill": Infill(prompt, suffix)}
    elif fields.opt_bool(body, "raw"):
        if pictures:
            raise bad_request("'images' need the model's chat template: leave 'raw' out", param="images", code="invalid_value")
        what = {"prompt": prompt}
    else:
        system = body.get("system")
        messages = ([{"role": "system", "content": fields.text("system", system)}] if system else []) + [
            {"role": "user", "content": content_of([*pictures, prompt])}]
        what = {"messages": messages}
    return ParsedRequest(_request(body, _options(body), dispatcher, **what), _model(body), _stream(body), False)


def _capabilities(served) -> list[str]:
    """What Ollama's model listings say a model does: completion and tools (every model is
    offered tools, through its template or the generic format), and vision, thinking."""
    engine = served.engine
    thinks = engine.format.reasoning if engine is not None else reasoning_format(served.model.info.chat_template)
    return ["completion", "tools", *(["vision"] if "vision" in served.modalities else []), *(["thinking"] if thinks else [])]


def _tagged(name: str) -> str:
    return name if ":" in name else name + DEFAULT_TAG


def _untagged(name: str | None) -> str | None:
    return name[: -len(DEFAULT_TAG)] if name and name.endswith(DEFAULT_TAG) else name


class OllamaApi(Api):
    """The /api/ routes on one app's Dispatcher."""

    def routes(self) -> list[Route]:
        return [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/tags", self.tags, methods=["GET"]),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/api/version", self.version, methods=["GET"]),
            Route("/api/embed", self.embed, methods=["POST"]),
            Route("/api/embeddings", self.embeddings, methods=["POST"]),
            Route("/api/pull", self.pull, methods=["POST"]),
        ]

    # ---- models ------------------------------------------------------------------------------

    def find(self, name: str | None):
        """The served model a name means: as Ollama lists it (name:latest) or as the OpenAI routes do."""
        try:
            return self.dispatcher.find_model(name)
        except ApiError:
            return self.dispatcher.find_model(_untagged(name))

    def entry(self, served, name: str | None = None) -> dict:
        info = served.model.info
        stat = info.path.stat()
        # a digest of the file's identity, not its bytes: hashing gigabytes per listing is too slow
        digest = hashlib.sha256(f"{info.path}:{info.size_bytes}:{stat.st_mtime_ns}".encode()).hexdigest()
        n = info.n_params
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
        name = _tagged(name or served.id)
        return {
            "name": name,
            "capabilities": _capabilities(served),
            "model": name,
            "modified_at": datetime.datetime.fromtimestamp(stat.st_mtime, datetime.timezone.utc).isoformat().replace("+00:00", "Z"),
            "size": info.size_bytes,
            "digest": digest,
            "details": {
                "parent_model": "",
                "format": "gguf" if info.path.suffix == ".gguf" else "onnx",
                "family": info.architecture,
                "families": [info.architecture],
                "parameter_size": size,
                "quantization_level": info.quant,
            },
        }

    @_ollama_errors
    async def tags(self, request: Request) -> Response:
        # each alias is listed as a model of its own, as /v1/models lists them
        return JSONResponse({"models": [self.entry(m, name) for m in self.dispatcher.served() for name in (m.id, *m.aliases)]})

    @_ollama_errors
    async def ps(self, request: Request) -> Response:
        models = []
        for served in self.dispatcher.served():
            engine, m = served.engine, served.model
            if engine is None:  # Ollama lists the loaded models only
                continue
            entry = self.entry(served)
            split = getattr(engine, "gpu", None)
            on_gpu = split.gpu_layers / split.n_layer if split is not None and split.n_layer else 0.0
            del entry["modified_at"]
            # size: what it holds in memory (weights, KV cache, compute), as Ollama's ps counts it
            size = m.need or entry["size"]
            models.append({**entry, "size": size, "expires_at": _expires(m.unload_at), "size_vram": int(size * on_gpu),
                           "context_length": engine.n_ctx})
        return JSONResponse({"models": models})

    @_ollama_errors
    async def show(self, request: Request) -> Response:
        body = await self.dispatcher.read_body(request)
        served = self.find(_model(body))
        # what the file says, loaded or not (a loaded engine's template may be config.toml's)
        engine, info = served.engine, served.model.info
        entry = self.entry(served)
        arch = info.architecture
        sampling = served.default_sampling
        n_ctx = engine.n_ctx if engine is not None else served.model.n_ctx
        parameters = "\n".join(
            f"{name:<15}{value}"
            for name, value in (("temperature", sampling.temperature), ("top_k", sampling.top_k), ("top_p", sampling.top_p),
                                ("min_p", sampling.min_p), ("repeat_penalty", sampling.repeat_penalty), ("num_ctx", n_ctx))
        )
        template = engine.format.source if engine is not None else info.chat_template
        return JSONResponse({
            "modelfile": f"FROM {info.path}\n",
            "parameters": parameters,
            "template": template or "",
            "details": entry["details"],
            "model_info": {
                "general.architecture": arch,
                "general.name": info.name,
                "general.parameter_count": info.n_params,
                f"{arch}.context_length": info.context_length,
                f"{arch}.embedding_length": info.n_embd,
                f"{arch}.block_count": info.n_layer,
                f"{arch}.attention.head_count": info.n_head,
                f"{arch}.attention.head_count_kv": info.n_head_kv,
            },
            "capabilities": entry["capabilities"],
            "modified_at": entry["modified_at"],
        })

    @_ollama_errors
    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    # ---- embeddings --------------------------------------------------------------------------

    @_ollama_errors
    async def embed(self, request: Request) -> Response:
        """`input` (a string or a list of them) -> `embeddings`; `truncate` (default true) cuts
        an input the context does not hold instead of refusing it. Nothing to embed answers an
        empty list, as Ollama does when a client preloads a model."""
        body = await self.dispatcher.read_body(request)
        served = self.find(_model(body))
        value = body.get("input")
        if value is None or value == "" or value == []:
            return JSONResponse({"model": _tagged(served.id), "embeddings": [], "total_duration": 0, "load_duration": 0, "prompt_eval_count": 0})
        if isinstance(value, str):
            inputs = [fields.text("input", value)]
        elif isinstance(value, list):
            inputs = [fields.text(f"input[{i}]", v) for i, v in enumerate(value)]
        else:
            raise fields.type_error("input", "a string or a list of strings", value)
        truncate = body.get("truncate") is None or fields.opt_bool(body, "truncate")
        _options(body)  # accepted: none of them changes a vector
        check_dimensions(body, served)
        vectors, n_tokens, seconds = await embed(self.dispatcher, request, served, inputs, "input", truncate)
        return JSONResponse({
            "model": _tagged(served.id),
            "embeddings": [v.tolist() for v in vectors],
            "total_duration": _ns(seconds),
            "load_duration": 0,
            "prompt_eval_count": n_tokens,
        })

    @_ollama_errors
    async def embeddings(self, request: Request) -> Response:
        """The older route: one `prompt` -> one `embedding` (unit length here too)."""
        body = await self.dispatcher.read_body(request)
        served = self.find(_model(body))
        prompt = fields.text("prompt", body.get("prompt", ""))
        if not prompt:
            raise bad_request("'prompt' is empty: there is nothing to embed", param="prompt", code="invalid_value")
        _options(body)
        vectors, _, _ = await embed(self.dispatcher, request, served, [prompt], "prompt", truncate=True)
        return JSONResponse({"embedding": vectors[0].tolist()})

    @_ollama_errors
    async def pull(self, request: Request) -> Response:
        """edgechat's own pull into this machine's model cache (a catalog name or a Hub reference,
        as `edgechat pull` takes them), told in Ollama's status lines. The model is downloaded,
        not served: this server goes on serving the models it started with."""
        body = await self.dispatcher.read_body(request)
        name = fields.text("model", body.get("model", body.get("name", "")))
        if not name:
            raise bad_request("'model' is required: a catalog name or a Hub reference (see: edgechat models --catalog)",
                              param="model", code="missing_required_parameter")
        try:
            ref = hub.pull_ref(name)
        except EdgechatError as exc:
            raise bad_request(str(exc), param="model") from None
        download = _Download(self.dispatcher.paths, ref)
        if _stream(body):
            return StreamingResponse(download.lines(), media_type="application/x-ndjson")
        try:
            await download.run()
        except EdgechatError as exc:
            raise _pull_error(exc) from None
        return JSONResponse({"status": "success"})

    # ---- generation --------------------------------------------------------------------------

    @_ollama_errors
    async def chat(self, request: Request) -> Response:
        return await self.answer(request, parse_chat, "message")

    @_ollama_errors
    async def generate(self, request: Request) -> Response:
        return await self.answer(request, parse_generate, "response")

    async def answer(self, request: Request, parse, field: str) -> Response:
        """`field`: "message" (chat) or "response" (generate), where each shape puts the text."""
        arrival = time.monotonic()
        body = await self.dispatcher.read_body(request)
        served = self.find(_model(body))
        keep_alive = keep_alive_seconds(body.get("keep_alive"))
        if not body.get("prompt" if field == "response" else "messages"):
            # an empty prompt or conversation is how Ollama clients load a model before using it,
            # and, with keep_alive 0, unload it
            if keep_alive == 0:
                await run_in_threadpool(self.dispatcher.pool.unload, served.model.name)
                reason = "unload"
            else:
                await self.dispatcher.lease(served, keep_alive, arrival + self.dispatcher.settings.request_timeout)
                self.dispatcher.pool.release(served.model.name, keep_alive)
                reason = "load"
            return JSONResponse({**_Shape(_tagged(served.id), field).part("", ""), "done": True, "done_reason": reason})
        parsed = parse(body, self.dispatcher)
        parsed.model, parsed.keep_alive = served.id, keep_alive
        start = await self.dispatcher.launch(request, parsed, arrival)
        if parsed.stream:
            return await stream(self.dispatcher, start, _Lines(field))
        started, finished = await whole(self.dispatcher, request, start)
        end = finished[0]
        return JSONResponse(_Shape(_tagged(started.served.id), field).end(end, end.text, end.reasoning, _calls(0, end.tool_calls)))


class _Lines(Wire):
    """The NDJSON stream: a line per batch of tokens, then the counts; an error as its own line.
    NDJSON has no comment: nothing goes out before the request is under way."""

    media_type = "application/x-ndjson"
    headers = None
    keepalive = None

    def __init__(self, field: str):
        self.field = field
        self.n_calls = 0  # the answer's calls sent so far

    def opened(self, started: Started) -> list[str]:
        self.shape = _Shape(_tagged(started.served.id), self.field)
        return []

    def part(self, part: Part) -> list[str]:
        if not (part.text or part.thought or part.calls):
            return []
        calls = _calls(self.n_calls, part.calls)
        self.n_calls += len(calls)
        return [_line(self.shape.part(part.text, part.thought, calls=calls))]

    async def end(self, finished: list[Finished]) -> list[str]:
        return [_line(self.shape.end(finished[0], "", ""))]

    def error(self, exc: ApiError) -> list[str]:
        return [_line({"error": exc.message})]


class _Left(Exception):
    """Raised from the progress callback: the client is gone, so the download stops between two
    chunks (hf_hub_download keeps what it has for the next pull to resume)."""


def _pull_error(exc: EdgechatError) -> ApiError:
    if isinstance(exc, UsageError):
        return bad_request(str(exc), param="model")
    if isinstance(exc, ModelNotFoundError) and not isinstance(exc, hub.HubUnreachableError):
        return ApiError(404, str(exc), code="model_not_found")
    return ApiError(502, str(exc), type="server_error", code="pull_failed")  # the Hub failed, not the request


class _Download:
    """One pull on a worker thread, its progress read on the event loop."""

    def __init__(self, paths, ref: hub.HubRef):
        self.paths, self.ref = paths, ref
        self.left = threading.Event()
        self.done: int | None = None  # bytes so far, and of the whole file where the Hub says
        self.total: int | None = None
        self.changed = asyncio.Event()

    def _progress(self, done: int, total: int | None) -> None:
        if self.left.is_set():
            raise _Left
        self.done, self.total = done, total
        self.loop.call_soon_threadsafe(self.changed.set)

    def _fetch(self):
        if (found := hub.cached(self.ref, self.paths)) is not None:
            return found  # a model already here needs no Hub
        hub.check_reachable(self.ref.text)  # a second, not huggingface_hub's ~25 s of retries
        return hub.resolve_hub(self.ref, self.paths, self._progress)

    def start(self) -> asyncio.Future:
        self.loop = asyncio.get_running_loop()
        task = self.loop.run_in_executor(None, self._fetch)
        # a stream the client left is not awaited: its end (_Left, most likely) is read here
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def run(self):
        try:
            return await self.start()
        except asyncio.CancelledError:
            self.left.set()
            raise

    async def lines(self) -> AsyncIterator[str]:
        yield _line({"status": "pulling manifest"})
        task = self.start()
        layer = self.ref.file or self.ref.text
        try:
            while not task.done():
                waiter = asyncio.ensure_future(self.changed.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if self.changed.is_set():
                    self.changed.clear()
                    yield _line({"status": f"pulling {layer}", "digest": layer, "total": self.total or 0, "completed": self.done})
            try:
                task.result()
            except EdgechatError as exc:
                yield _line({"error": _pull_error(exc).message})
                return
            yield _line({"status": "success"})
        finally:
            self.left.set()  # the client left mid-stream: stop the download at its next chunk


class _Shape:
    """Ollama's objects for one answer: chat's `message` or generate's `response`."""

    def __init__(self, model: str, field: str):
        self.model, self.field = model, field

    def part(self, text: str, thought: str, done: bool = False, calls: list[dict] | None = None) -> dict:
        if self.field == "message":
            message: dict[str, object] = {"role": "assistant", "content": text}
            if thought:
                message["thinking"] = thought
            if calls:
                message["tool_calls"] = calls
            out = {"model": self.model, "created_at": _now(), "message": message, "done": done}
        else:
            out = {"model": self.model, "created_at": _now(), "response": text, "done": done}
            if thought:
                out["thinking"] = thought
        return out

    def end(self, finished: Finished, text: str, thought: str | None, calls: list[dict] | None = None) -> dict:
        m = finished.metrics
        return {
            **self.part(text, thought or "", done=True, calls=calls),
            "done_reason": finished.reason,
            "total_duration": _ns(m.total),
            "load_duration": 0,
            "prompt_eval_count": m.prompt_tokens,
            "prompt_eval_duration": _ns(m.prefill),
            "eval_count": m.completion_tokens,
            "eval_duration": _ns(m.decode),
        }


def _calls(first: int, calls: list[ToolCall]) -> list[dict]:
    """Calls as Ollama writes them: an id, the call's place in the answer, arguments an object."""
    return [{"id": c.id, "function": {"index": first + k, "name": c.name, "arguments": json.loads(c.arguments)}}
            for k, c in enumerate(calls)]


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
