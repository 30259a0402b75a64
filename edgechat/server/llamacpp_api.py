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
import math
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat import __version__
from edgechat.engine.prompt.fim import DEFAULT_FILENAME
from edgechat.engine.types.request import ChatRequest, Finished, Infill, TokenLogprob
from edgechat.params import SamplingParams
from edgechat.server import fields, responses
from edgechat.server.bridge import Part, Started
from edgechat.server.dispatch import Api
from edgechat.server.errors import ApiError, answered_as, bad_request
from edgechat.server.fields import ParsedRequest
from edgechat.server.images import ImageReader
from edgechat.server.streaming import Wire, sse, stream, whole
from edgechat.server.tools import parse_tools

PATHS = frozenset({"/completion", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props"})


def owns(path: str) -> bool:
    return path in PATHS


def error_body(exc: ApiError) -> dict:
    return {"error": {"code": exc.status, "message": exc.message, "type": exc.type}}


def error_response(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


#: errors raised inside a handler, answered in llama-server's shape
_llamacpp_errors = answered_as(error_response, usage_errors=True)


def parse_completion(body: dict, dispatcher) -> ParsedRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise fields.type_error("prompt", "a string (token prompts are not supported)", prompt)
    return _generation(body, dispatcher, prompt=fields.text("prompt", prompt))


def parse_infill(body: dict, dispatcher) -> ParsedRequest:
    """/infill: the text before and after the cursor (both required), other files'
    `input_extra` [{filename, text}] and `prompt` (text the answer starts with), laid out by the
    engine as llama-server lays them out (engine/prompt/fim.py); the rest as /completion's."""
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise bad_request(f"'{name}' is required", param=name, code="missing_required_parameter")
    extra = body.get("input_extra")
    if extra is None:
        extra = []
    if not isinstance(extra, list):
        raise fields.type_error("input_extra", 'an array of {"filename": string, "text": string}', extra)
    chunks = []
    for i, chunk in enumerate(extra):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict):
            raise fields.type_error(where, 'an object {"filename": string, "text": string}', chunk)
        filename = chunk.get("filename")
        chunks.append((DEFAULT_FILENAME if filename is None else fields.text(f"{where}.filename", filename),
                       fields.text(f"{where}.text", chunk.get("text"))))
    prompt = body.get("prompt")
    infill = Infill(fields.text("input_prefix", body["input_prefix"]), fields.text("input_suffix", body["input_suffix"]), tuple(chunks),
                    "" if prompt is None else fields.text("prompt", prompt))
    return _generation(body, dispatcher, infill=infill)


def _generation(body: dict, dispatcher, **what) -> ParsedRequest:
    """The request of a /completion or /infill body, `what` saying what to answer."""
    # what would change the answer and is not served (mirostat, typical_p, ...) is refused, as on
    # every API; n_probs is served here
    fields.refuse_unsupported({k: v for k, v in body.items() if k != "n_probs"})
    if fields.opt_bool(body, "post_sampling_probs"):
        # the engine reads the model's distribution before any sampler: probabilities after
        # top-k/top-p would be different numbers under the same names
        raise bad_request("'post_sampling_probs' is not supported; leave it out for the model's own log probabilities (n_probs)",
                          param="post_sampling_probs", code="unsupported_parameter")
    n_probs = fields.opt_int(body, "n_probs", lo=0, hi=fields.MAX_TOP_LOGPROBS)
    n_predict = fields.opt_int(body, "n_predict")
    t_max_predict_ms = fields.opt_int(body, "t_max_predict_ms")
    request = ChatRequest(
        sampling=fields.sampling(body, dispatcher.defaults_for(fields.model_field(body))),
        # -1 (llama-server's default): until the end of text
        max_tokens=n_predict if n_predict is not None and n_predict >= 0 else None,
        stop=fields.stop(body),
        ignore_eos=fields.opt_bool(body, "ignore_eos"),
        grammar=fields.extension_grammar(body),
        logprobs=n_probs or None,  # llama-server's default 0: none
        # -1 or 0 (llama-server's default -1): no time limit
        line_time_limit=t_max_predict_ms / 1000 if t_max_predict_ms is not None and t_max_predict_ms > 0 else None,
        **what,
    )
    if request.max_tokens == 0:
        raise bad_request("'n_predict' must be -1 or at least 1", param="n_predict", code="invalid_value")
    return ParsedRequest(request, fields.model_field(body), fields.opt_bool(body, "stream"), False,
                         client_grammar=bool(body.get("grammar")))


def response_fields(body: dict) -> list[str]:
    """`response_fields`: the answer's fields to return, a slash reaching into a nested one
    (`timings/prompt_n`, returned under that name); none: every field."""
    wanted = body.get("response_fields")
    if wanted is None:
        return []
    if not isinstance(wanted, list) or not all(isinstance(f, str) for f in wanted):
        raise fields.type_error("response_fields", "an array of strings", wanted)
    return wanted


def pick_fields(answer: dict, wanted: list[str]) -> dict:
    """The fields asked for (llama-server's response_fields): those the answer lacks are left out."""
    if not wanted:
        return answer
    out = {}
    for path in wanted:
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
        # a banned token's bias as the request wrote it: JSON has no -inf
        "logit_bias": [{"token": t, "bias": False if b == -math.inf else b} for t, b in req.sampling.logit_bias],
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


class LlamaCppApi(Api):
    """llama-server's native routes on one app's Dispatcher."""

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
        served = self.dispatcher.find_model(name)
        async with self.dispatcher.using(served) as engine:
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
        body = await self.dispatcher.read_body(request)
        content = fields.text("content", body.get("content"))
        add_bos = fields.opt_bool(body, "add_special")
        parse_special = body.get("parse_special") is None or fields.opt_bool(body, "parse_special")
        with_pieces = fields.opt_bool(body, "with_pieces")
        async with self.model(fields.model_field(body)) as (_, engine):
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
        body = await self.dispatcher.read_body(request)
        tokens = body.get("tokens", [])
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise fields.type_error("tokens", "a list of token ids", tokens)
        async with self.model(fields.model_field(body)) as (_, engine):
            return JSONResponse({"content": await run_in_threadpool(engine.detokenize, tokens)})

    @_llamacpp_errors
    async def apply_template(self, request: Request) -> Response:
        body = await self.dispatcher.read_body(request)
        messages = fields.messages(body, self.dispatcher.settings.max_messages, ImageReader(self.dispatcher.settings))
        generation_prompt = body.get("add_generation_prompt") is None or fields.opt_bool(body, "add_generation_prompt")
        # as a chat request's prompt is rendered: its tools, the thinking switch, the client's template variables
        chat = ChatRequest(messages=messages, tools=parse_tools(body), template_kwargs=fields.template_kwargs(body),
                           reasoning_budget=fields.reasoning_budget(body, self.dispatcher.settings.reasoning_budget))
        async with self.model(fields.model_field(body)) as (_, engine):
            prompt = await run_in_threadpool(engine.prompts.text, chat, generation_prompt)
        return JSONResponse({"prompt": prompt})

    @_llamacpp_errors
    async def completion(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.dispatcher.read_body(request)
        return await self.answer(request, body, parse_completion(body, self.dispatcher), arrival)

    @_llamacpp_errors
    async def infill(self, request: Request) -> Response:
        arrival = time.monotonic()
        body = await self.dispatcher.read_body(request)
        return await self.answer(request, body, parse_infill(body, self.dispatcher), arrival)

    async def answer(self, request: Request, body: dict, parsed: ParsedRequest, arrival: float) -> Response:
        """/completion's answer (and /infill's), whole or streamed."""
        return_tokens = fields.opt_bool(body, "return_tokens")
        wanted = response_fields(body)
        req = parsed.request
        prompt = req.prompt or ""
        if req.infill is not None:
            # the prompt as llama-server reports a fill's: its tokens' text, markers written out
            async with self.model(parsed.model) as (_, engine):
                prompt = await run_in_threadpool(lambda: engine.detokenize(engine.prompt_tokens(req), special=True))
        start = await self.dispatcher.launch(request, parsed, arrival)
        if parsed.stream:
            return await stream(self.dispatcher, start, _Chunks(prompt, wanted))
        started, finished = await whole(self.dispatcher, request, start)
        end = finished[0]
        answer = _answer(end, end.text, started, prompt, streamed=False, tokens=end.token_ids if return_tokens else [])
        if end.logprobs is not None:
            answer["completion_probabilities"] = probabilities(end.logprobs)
        return JSONResponse(pick_fields(answer, wanted))


class _Chunks(Wire):
    """/completion's SSE stream: `{"content", "stop": false}` per batch of tokens, then the counts
    with `"stop": true`; keep-alive comments while queued (llama.cpp's clients read `data:` lines
    only)."""

    def __init__(self, prompt: str, wanted: list[str]):
        self.prompt, self.wanted = prompt, wanted

    def opened(self, started: Started) -> list[str]:
        self.started = started
        return []

    def part(self, part: Part) -> list[str]:
        text = part.thought + part.text  # this API has no thoughts of its own: they come first, as written
        if not text and not part.logprobs:
            return []
        chunk = {"index": 0, "content": text, "stop": False, "id_slot": 0}
        if part.logprobs is not None:
            chunk.update(tokens=[e.id for e in part.logprobs], completion_probabilities=probabilities(part.logprobs))
        return [sse(chunk)]

    async def end(self, finished: list[Finished]) -> list[str]:
        return [sse(pick_fields(_answer(finished[0], "", self.started, self.prompt, streamed=True, tokens=[]), self.wanted))]

    def error(self, exc: ApiError) -> list[str]:
        return [sse(error_body(exc))]


def _answer(finished: Finished, content: str, started: Started, prompt: str, streamed: bool, tokens: list[int]) -> dict:
    """The answer's body (a stream's last event, without its text)."""
    m = finished.metrics
    return {
        "index": 0,
        "content": content,
        "tokens": tokens,
        "id_slot": 0,
        "stop": True,
        "model": started.served.id,
        "tokens_predicted": m.completion_tokens,
        "tokens_evaluated": m.prompt_tokens,
        "tokens_cached": m.cached_tokens,
        "generation_settings": generation_settings(started.request, streamed),
        "prompt": prompt,
        "has_new_line": "\n" in finished.text,
        "truncated": False,
        "stop_type": _stop_type(finished),
        "stopping_word": finished.stop_sequence or "",
        "timings": responses.timings(m),
    }
