"""OpenAI's embeddings API (`POST /v1/embeddings`): its body into the engine's embedding inputs
(texts or token arrays), the vectors back as floats or base64, errors in OpenAI's shape naming
the field. `embed` is the one way every API here asks the engine for vectors (Ollama's too).
Reranking (`/rerank`, `/v1/rerank`: llama-server's, Jina's and Cohere's shape) runs the same way
on a reranker GGUF (rank pooling), `rerank` its one way to the engine."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from edgechat.engine.embeddings import EmbeddingInputError, EmbeddingJob
from edgechat.errors import EdgechatError
from edgechat.server import fields
from edgechat.server.dispatch import Api
from edgechat.server.errors import ApiError, bad_request, from_engine_error

#: how often a waiting request checks that its client is still there
DISCONNECT_POLL_S = 0.5


async def embed(dispatcher, request: Request, served, inputs: list, field: str, truncate: bool = False) -> tuple[list[np.ndarray], int, float]:
    """The vectors of `inputs` on `served`'s engine, their token count and the seconds taken;
    a bad input is a 400 naming `field`, a client that leaves cancels the work."""
    started = time.monotonic()
    async with dispatcher.using(served) as engine:
        return await _run(dispatcher, request, lambda finished: engine.embed(inputs, truncate, finished), field, started)


async def rerank(dispatcher, request: Request, served, query: str, documents: list[str]) -> tuple[list[np.ndarray], int, float]:
    """`embed` for a reranker: each document's scores for `query`."""
    started = time.monotonic()
    async with dispatcher.using(served) as engine:
        return await _run(dispatcher, request, lambda finished: engine.rerank(query, documents, False, finished), "documents", started)


async def _run(dispatcher, request: Request, submit: Callable[[Callable], EmbeddingJob], field: str, started: float):
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle() -> None:
        if not done.done():
            done.set_result(None)

    def finished(job: EmbeddingJob) -> None:  # on the engine thread
        loop.call_soon_threadsafe(settle)

    try:
        # tokenizing long inputs takes a while: off the event loop
        job = await asyncio.to_thread(submit, finished)
    except EmbeddingInputError as exc:
        raise bad_request(f"'{field}': {exc}", param=field, code="invalid_value") from None
    except EdgechatError as exc:
        raise from_engine_error(exc, dispatcher.retry_after()) from None
    deadline = started + dispatcher.settings.request_timeout
    try:
        while not done.done():
            if time.monotonic() > deadline:
                job.cancel()
                raise ApiError(504, f"the embeddings were not computed within {dispatcher.settings.request_timeout:g} s", type="timeout", code="timeout")
            await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
            if not done.done() and await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client left", code="client_closed")
    except asyncio.CancelledError:
        job.cancel()
        raise
    if isinstance(job.error, EmbeddingInputError):
        raise bad_request(f"'{field}': {job.error}", param=field, code="invalid_value")
    if isinstance(job.error, EdgechatError):
        raise from_engine_error(job.error, dispatcher.retry_after())
    if job.error is not None:
        raise ApiError(500, str(job.error), type="server_error", code="embedding_failed")
    return job.vectors, job.n_tokens, time.monotonic() - started


def parse_input(value: object) -> list:
    """`input`: a string, an array of strings, an array of token ids or an array of token arrays."""
    if isinstance(value, str):
        return [fields.text("input", value)]
    if not isinstance(value, list):
        raise fields.type_error("input", "a string or an array", value)
    if not value:
        raise bad_request("'input' is empty: there is nothing to embed", param="input", code="invalid_value")
    if all(isinstance(v, str) for v in value):
        return [fields.text(f"input[{i}]", v) for i, v in enumerate(value)]
    if all(_is_id(v) for v in value):
        return [value]
    for i, v in enumerate(value):
        if not isinstance(v, list) or not all(_is_id(t) for t in v):
            raise bad_request(
                f"'input[{i}]' must be a token array, as the other items are (strings, token ids and token arrays cannot be mixed)",
                param="input", code="invalid_type",
            )
    return value


def check_dimensions(body: dict, served) -> None:
    """`dimensions` only as the model's own size: a shorter vector would need a model trained
    for it (Matryoshka), and cutting another's loses what it means."""
    dimensions = body.get("dimensions")
    embedder = getattr(served.engine, "embedder", None)  # an ONNX engine has none; embed says so
    if dimensions is not None and embedder is not None and (not _is_id(dimensions) or dimensions != embedder.n_embd):
        raise bad_request(f"'dimensions' must be {embedder.n_embd}, this model's size: its vectors cannot be shortened", param="dimensions", code="invalid_value")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EmbeddingsApi(Api):
    """The /v1/embeddings route on one app's Dispatcher."""

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                *(Route(path, self.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking"))]

    async def rerank(self, request: Request) -> Response:
        """llama-server's /rerank (Jina's and Cohere's shape): `query`, `documents`, `top_n` ->
        `results` [{index, relevance_score}], best first; a model that is not a reranker is a 400."""
        body = await self.dispatcher.read_body(request)
        served = self.dispatcher.find_model(fields.model_field(body))
        query = fields.text("query", body.get("query"))
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise bad_request("'documents' must be a non-empty array of strings", param="documents", code="invalid_value")
        documents = [fields.text(f"documents[{i}]", d) for i, d in enumerate(documents)]
        top_n = body.get("top_n")
        if top_n is not None and (not _is_id(top_n) or top_n < 1):
            raise bad_request("'top_n' must be a positive integer", param="top_n", code="invalid_value")
        scores, n_tokens, _ = await rerank(self.dispatcher, request, served, query, documents)
        results = sorted(({"index": i, "relevance_score": float(v[0])} for i, v in enumerate(scores)), key=lambda r: -r["relevance_score"])
        return JSONResponse({"model": body.get("model") or served.id, "object": "list",
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "results": results[:top_n]})

    async def embeddings(self, request: Request) -> Response:
        body = await self.dispatcher.read_body(request)
        served = self.dispatcher.find_model(fields.model_field(body))
        inputs = parse_input(body.get("input"))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad_request(f"'encoding_format' must be \"float\" or \"base64\", got {str(encoding)[:40]!r}", param="encoding_format", code="invalid_value")
        check_dimensions(body, served)
        vectors, n_tokens, _ = await embed(self.dispatcher, request, served, inputs, "input")
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": served.id, "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


def _encoded(vector: np.ndarray, encoding: str):
    if encoding == "base64":  # what the openai SDK asks for by default: little-endian float32
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
