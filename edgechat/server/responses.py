"""OpenAI response bodies: whole completions, stream chunks and the SSE lines that carry them."""

from __future__ import annotations

import json
import time
import uuid
from typing import NamedTuple

from edgechat.engine.request import Finished

#: proxies must pass each event on at once, not buffer the stream
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ResponseIds(NamedTuple):
    """What every body and chunk of one response carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> ResponseIds:
        return cls(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(finished: Finished) -> dict:
    m = finished.metrics
    return {
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.completion_tokens,
        "total_tokens": m.prompt_tokens + m.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": m.cached_tokens},
    }


def completion_body(finished: Finished, kind: str, ids: ResponseIds) -> dict:
    """A whole answer: chat.completion (kind "chat") or text_completion."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": finished.text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": finished.text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=finished.reason)
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [choice], "usage": usage(finished)}


def chunk(kind: str, ids: ResponseIds, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
    """One stream chunk; `role` makes the chat stream's opening chunk."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or ""}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=finish_reason)
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [choice]}


def usage_chunk(kind: str, ids: ResponseIds, finished: Finished) -> dict:
    """The last chunk when the request set stream_options.include_usage: no choices, the counts."""
    return {**chunk(kind, ids, None, None), "choices": [], "usage": usage(finished)}
