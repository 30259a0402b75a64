"""llama-server's own endpoints, which llama.cpp's web UI and tools call: /completion, /infill
(the fill in the middle editors' plugins ask for: llama.vscode, llama.vim), /tokenize, /detokenize, /apply-template and /props, translated onto the server's one internal
request; errors in llama-server's shape, `{"error": {"code": status, "message", "type"}}`.
(Its unprefixed OpenAI routes, /chat/completions and friends, are the OpenAI handlers: app.py.)

As in llama-server's router mode, each names its model by the body's `model` (GET /props: the
`model` query parameter), the first model when it names none; each holds a lease on that model
while it reads the engine, so the pool never unloads it under them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgechat import __version__
from edgechat.engine.fim import DEFAULT_FILENAME, Infill
from edgechat.engine.request import ChatRequest, Finished, SamplingParams, TokenLogprob
from edgechat.errors import UsageError
from edgechat.server import responses
from edgechat.server.errors import ApiError, bad_request
from edgechat.server.images import ImageReader
from edgechat.server.schemas import (
    MAX_TOP_LOGPROBS,
    ParsedRequest,
    _messages,
    _opt_bool,
    _opt_int,
    _reasoning_budget,
    _refuse_unsupported,
    _sampling,
    _stop,
    _template_kwargs,
    _text,
    _type_error,
    extension_grammar,
    model_field,
)
from edgechat.server.tools import parse_tools

PATHS = frozenset({"/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props"})


def owns(path: str) -> bool:
    return path in PATHS


def error_body(exc: ApiError) -> dict:
    return {"error": {"code": exc.status, "message": exc.message, "type": exc.type}}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


def _llamacpp_errors(handler):
    """Errors raised inside a handler, answered in llama-server's shape."""

    @functools.wraps(handler)
    async def wrapped(self, request: Request) -> Response:
        try:
            return await handler(self, request)
        except ApiError as exc:
            return error_response(exc)
        except UsageError as exc:
            return error_response(bad_request(str(exc)))

    return wrapped


def parse_completion(body: dict, server) -> ParsedRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _type_error("prompt", "a string (token prompts are not supported)", prompt)
    return _generation(body, server, prompt=_text("prompt", prompt))


def parse_infill(body: dict, server) -> ParsedRequest:
    """/infill: the text before and after the cursor (both required), other files'
    `input_extra` [{filename, text}] and `prompt` (text the answer starts with), laid out by the
    engine as llama-server lays them out (engine/fim.py); the rest as /completion's."""
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise bad_request(f"'{name}' is required", param=name, code="missing_required_parameter")
    extra = body.get("input_extra")
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise _type_error("input_extra", 'an array of {"filename": string, "text": string}', extra)
    chunks = []
    for i, chunk in enumerate(extra):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise _type_error(where, 'an object {"filename": string, "text": string}', chunk)
        filename = chunk.get("filename")
        chunks.append((DEFAULT_FILENAME if filename is None else _text(f"{where}.filename", filename),
                       _text(f"{where}.text", chunk.get("text"))))
    prompt = body.get("prompt")
    infill = Infill(_text("input_prefix", body["input_prefix"]), _text("input_suffix", body["input_suffix"]), tuple(chunks),
                    "" if prompt is None else _text("prompt", prompt))
    return _generation(body, server, infill=infill)


def _generation(body: dict, server, **fields) -> ParsedRequest:
    """The request of a /completion or /infill body, `fields` saying what to answer."""
    # what would change the answer and is not served (logit_bias, mirostat, ...) is refused, as on
    # every API; n_probs is served here
    _refuse_unsupported({k: v for k, v in body.items() if k != "n_probs"})
    if _opt_bool(body, "post_sampling_probs"):
        # the engine reads the model's distribution before any sampler: probabilities after
        # top-k/top-p would be different numbers under the same names
        raise bad_request("'post_sampling_probs' is not supported; leave it out for the model's own log probabilities (n_probs)",
                          param="post_sampling_probs", code="unsupported_parameter")
    n_probs = _opt_int(body, "n_probs", lo=0, hi=MAX_TOP_LOGPROBS)
    n_predict = _opt_int(body, "n_predict")
    t_max_predict_ms = _opt_int(body, "t_max_predict_ms")
    request = ChatRequest(
        sampling=_sampling(body, server.defaults_for(model_field(body))),
        # -1 (llama-server's default): until the end of text
        max_tokens=n_predict if n_predict is not None and n_predict >= 0 else None,
        stop=_stop(body),
        ignore_eos=_opt_bool(body, "ignore_eos"),
        grammar=extension_grammar(body),
        logprobs=n_probs or None,  # llama-server's default 0: none
        # -1 or 0 (llama-server's default -1): no time limit
        line_time_limit=t_max_predict_ms / 1000 if t_max_predict_ms is not None and t_max_predict_ms > 0 else None,
        **fields,
    )
    if request.max_tokens == 0:
        raise bad_request("'n_predict' must be -1 or at least 1", param="n_predict", code="invalid_value")
    return ParsedRequest(request, model_field(body), _opt_bool(body, "stream"), False,
                         client_grammar=bool(body.get("grammar")))


def response_fields(body: dict) -> list[str]:
    """`response_fields`: the answer's fields to return, a slash reaching into a nested one
    (`timings/prompt_n`, returned under that name); none: every field."""
    fields = body.get("response_fields")
    if fields is None:
        return []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise _type_error("response_fields", "an array of strings", fields)
    return fields


def pick_fields(answer: dict, fields: list[str]) -> dict:
    """The fields asked for (llama-server's response_fields): those the answer lacks are left out."""
    if not fields:
        return answer
    out = {}
    for path in fields:
        value: object = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


def generation_settings(req: ChatRequest, stream: bool) -> dict:
    """A request's own settings, flat, as llama-server reports them with each answer."""
    n_predict = -1 if req.max_tokens is None else req.max_tokens
    return {
        **sampling_settings(req.sampling), "n_predict": n_predict, "max_tokens": n_predict,
        "stop": list(req.stop), "ignore_eos": req.ignore_eos, "stream": stream, "n_probs": req.logprobs or 0,
    }


def sampling_settings(s: SamplingParams) -> dict:
    return {
        "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
        "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.penalty_last_n,
        "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
        "seed": -1 if s.seed is None else s.seed,
    }


def probabilities(entries: list[TokenLogprob]) -> list[dict]:
    """llama-server's `completion_probabilities`: per token its id, text, bytes and log
    probability, with the most likely alternatives in the same shape."""

    def one(token_id: int, token: bytes, logprob: float) -> dict:
        # a token may hold part of a character: its bytes are exact, its text the whole characters
        return {"id": token_id, "token": token.decode("utf-8", errors="ignore"), "bytes": list(token), "logprob": logprob}

    return [{**one(e.id, e.token, e.logprob), "top_logprobs": [one(i, t, lp) for i, (t, lp) in zip(e.top_ids, e.top, strict=True)]} for e in entries]


def _stop_type(finished: Finished) -> str:
    if finished.reason == "length":
        return "limit"
    return "word" if finished.stop_sequence else "eos"


class LlamaCppApi:
    """llama-server's native routes on one app's _Server."""

    def __init__(self, server):
        self.server = server

    def routes(self) -> list[Route]:
        return [
            Route("/completion", self.completion, methods=["POST"]),
            Route("/infill", self.infill, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/props", self.props, methods=["GET"]),
        ]

    @contextlib.asynccontextmanager
    async def model(self, name: str | None):
        """The model named (a 404 listing the models for an unknown name), loaded and leased
        for the block: (its _Served, its engine)."""
        served = self.server.find_model(name)
        async with self.server.using(served) as engine:
            yield served, engine

    @_llamacpp_errors
    async def props(self, request: Request) -> Response:
        async with self.model(request.query_params.get("model")) as (served, engine):
            return JSONResponse({
                "default_generation_settings": {
                    "n_ctx": engine.n_ctx,
                    "params": {**sampling_settings(engine.default_sampling), "n_predict": -1},
                },
                "total_slots": engine.config.n_parallel,
                "model_alias": served.id,
                "model_path": str(engine.model_info.path),
                "chat_template": engine.format.source or "",
                "n_ctx": engine.n_ctx,
                "modalities": {kind: kind in engine.modalities for kind in ("vision", "audio")},
                "build_info": f"edgechat {__version__}",
            })

    @_llamacpp_errors
    async def tokenize(self, request: Request) -> Response:
        body = await self.server.read_body(request)
        content = _text("content", body.get("content"))
        add_bos = _opt_bool(body, "add_special")
        parse_special = body.get("parse_special") is None or _opt_bool(body, "parse_special")
        with_pieces = _opt_bool(body, "with_pieces")
        async with self.model(model_field(body)) as (_, engine):
            if parse_special:
                tokens = await run_in_threadpool(engine.prompt_text_tokens, content, add_bos)
            else:
                bos = engine.prompts.bos
                tokens = ([bos] if add_bos and bos is not None else []) + await run_in_threadpool(engine.tokenize, content)
            if not with_pieces:
                return JSONResponse({"tokens": tokens})
            pieces = [{"id": t, "piece": engine.detokenize([t])} for t in tokens]
        return JSONResponse({"tokens": pieces})

    @_llamacpp_errors
    async def detokenize(self, request: Request) -> Response:
        body = await self.server.read_body(request)
        tokens = body.get("tokens", [])
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise _type_error("tokens", "a list of token ids", tokens)
        async with self.model(model_field(body)) as (_, engine):
            return JSONResponse({"content": await run_in_threadpool(engine.detokenize, tokens)})

    @_llamacpp_errors
    async def apply_template(self, request: Request) -> Response:
        body = await self.server.read_body(request)
        messages = _messages(body, self.server.settings.max_messages, ImageReader(self.server.settings))
        generation_prompt = body.get("add_generation_prompt") is None or _opt_bool(body, "add_generation_prompt")
        # as a chat request's prompt is rendered: its tools, the thinking switch, the client's template variables
        chat = ChatRequest(messages=messages, tools=parse_tools(body), template_kwargs=_template_kwargs(body),
                           reasoning_budget=_reasoning_budget(body, self.server.settings.reasoning_budget))
        async with self.model(model_field(body)) as (_, engine):
            prompt = await run_in_threadpool(engine.prompts.text, chat, generation_prompt)
        return JSONResponse({"prompt": prompt})

    @_llamacpp_errors
    async def completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.server.read_body(request)
        return await self.answer(request, body, parse_completion(body, self.server), arrival)

    @_llamacpp_errors
    async def infill(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.server.read_body(request)
        return await self.answer(request, body, parse_infill(body, self.server), arrival)

    async def answer(self, request: Request, body: dict, parsed: ParsedRequest, arrival: float) -> Response:
        """/completion's answer (and /infill's), whole or streamed."""
        return_tokens = _opt_bool(body, "return_tokens")
        fields = response_fields(body)
        req = parsed.request
        prompt = req.prompt or ""
        if req.infill is not None:
            # the prompt as llama-server reports a fill's: its tokens' text, markers written out
            async with self.model(parsed.model) as (_, engine):
                prompt = await run_in_threadpool(lambda: engine.detokenize(engine.prompt_tokens(req), special=True))
        served, req, gens = await (await self.server.launch(request, parsed, arrival))
        self.server.opened(served, parsed, req, "text")
        gen = gens[0]
        if parsed.stream:
            return StreamingResponse(self.events(gen, served, req, prompt, fields), media_type="text/event-stream",
                                     headers=responses.SSE_HEADERS)
        finished = await self.server.wait(request, gens)
        if finished is None:
            # the client left; nobody reads this
            return Response(status_code=499)
        end = finished[0]
        answer = self.end(end, end.text, served, req, prompt, stream=False, tokens=end.token_ids if return_tokens else [])
        if end.logprobs is not None:
            answer["completion_probabilities"] = probabilities(end.logprobs)
        return JSONResponse(pick_fields(answer, fields))

    def end(self, finished: Finished, content: str, served, req: ChatRequest, prompt: str, stream: bool, tokens: list[int]) -> dict:
        m = finished.metrics
        return {
            "index": 0,
            "content": content,
            "tokens": tokens,
            "id_slot": 0,
            "stop": True,
            "model": served.id,
            "tokens_predicted": m.completion_tokens,
            "tokens_evaluated": m.prompt_tokens,
            "tokens_cached": m.cached_tokens,
            "generation_settings": generation_settings(req, stream),
            "prompt": prompt,
            "has_new_line": "\n" in finished.text,
            "truncated": False,
            "stop_type": _stop_type(finished),
            "stopping_word": finished.stop_sequence or "",
            "timings": responses.timings(m),
        }

    async def events(self, gen, served, req: ChatRequest, prompt: str, fields: list[str]) -> AsyncIterator[str]:
        """The SSE stream: `{"content", "stop": false}` per batch of tokens, then the counts with `"stop": true`."""
        try:
            while True:
                batch = await gen.batch()
                if batch.expired:
                    yield responses.sse(error_body(ApiError(504, "the request timed out and was cancelled", type="timeout")))
                    return
                finished = batch.finished
                text = batch.thought + batch.text  # this API has no thoughts of its own: they come first, as written
                if text or batch.logprobs:
                    chunk = {"index": 0, "content": text, "stop": False, "id_slot": 0}
                    if batch.logprobs is not None:
                        chunk.update(tokens=[e.id for e in batch.logprobs], completion_probabilities=probabilities(batch.logprobs))
                    yield responses.sse(chunk)
                if finished is not None:
                    if finished.reason not in ("stop", "length"):
                        message = finished.error or f"the generation ended: {finished.reason}"
                        yield responses.sse(error_body(ApiError(500, message, type="server_error")))
                    else:
                        yield responses.sse(pick_fields(self.end(finished, "", served, req, prompt, stream=True, tokens=[]), fields))
                    return
        finally:
            # the client left (the task was cancelled) or the request timed out: free the sequence now
            if not gen.finished.done():
                gen.handle.cancel()
