"""Reading an OpenAI-compatible streaming answer: the one parser of Server-Sent Events (through
httpx-sse) that the chat app's remote mode and the load generator share."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
from httpx_sse import EventSource, ServerSentEvent

from edgechat.errors import EdgechatError


class StreamError(EdgechatError):
    """The stream broke off: the server sent an error event, or a chunk that is not JSON."""


@dataclass
class Chunk:
    #: what the chunk adds to the answer (a chat delta's content or a completion's text)
    text: str
    #: set on the chunk that ends the answer
    finish_reason: str | None
    #: token counts, on the last chunk when the request set stream_options.include_usage
    usage: dict | None
    #: a reasoning model's thoughts in the chunk (delta.reasoning_content, as llama-server and
    #: vLLM send them, or delta.reasoning, as Ollama and OpenRouter do)
    reasoning: str = ""


def error_message(data: object) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), or the body itself."""
    err = data.get("error", data) if isinstance(data, dict) else data
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def _parse(sse: ServerSentEvent) -> Chunk | None:
    """One event as a Chunk; None for the [DONE] that ends the stream."""
    if sse.data == "[DONE]":
        return None
    try:
        event = json.loads(sse.data)
    except json.JSONDecodeError:
        raise StreamError(f"the server sent a chunk that is not JSON: {sse.data[:80]!r}") from None
    if not isinstance(event, dict):
        raise StreamError(f"the server sent a chunk that is not a JSON object: {sse.data[:80]!r}")
    if event.get("error"):
        # the server gave up mid-answer (timeout, engine error): what came before is partial
        raise StreamError(f"the server stopped the answer: {error_message(event)}")
    choices = event.get("choices") or []
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in choices)
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    deltas = [c.get("delta") or {} for c in choices]
    reasoning = "".join(_text(d.get("reasoning_content")) or _text(d.get("reasoning")) for d in deltas)
    return Chunk(text, finish, event.get("usage") or None, reasoning)


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def iter_chunks(response: httpx.Response) -> Iterator[Chunk]:
    """The chunks of a streaming response until [DONE]. Raises StreamError, or an httpx error
    (a reply that is not an event stream is httpx-sse's SSEError, an httpx.TransportError)."""
    for sse in EventSource(response).iter_sse():
        chunk = _parse(sse)
        if chunk is None:
            return
        yield chunk


async def aiter_chunks(response: httpx.Response) -> AsyncIterator[Chunk]:
    """iter_chunks for an httpx.AsyncClient's response."""
    async with contextlib.aclosing(EventSource(response).aiter_sse()) as events:
        async for sse in events:
            chunk = _parse(sse)
            if chunk is None:
                return
            yield chunk
