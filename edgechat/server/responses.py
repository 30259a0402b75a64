"""OpenAI response bodies: whole completions and stream chunks (Choice and usage also for the
other APIs' bodies); streaming.py frames them as SSE."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from edgechat import __version__
from edgechat.engine.runners.llamacpp import llama_version
from edgechat.engine.types.request import Finished, RequestMetrics, TokenLogprob, ToolCall

#: OpenAI's `system_fingerprint`, what answers are computed with (llama.cpp's build and ours), in
#: llama-server's "b<build>-<commit>" shape: a client pairing it with `seed` sees when it changes
SYSTEM_FINGERPRINT = f"b{llama_version()}-edgechat{__version__}"


class ResponseIds(NamedTuple):
    """What every body and chunk of one response carries."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, kind: str, model: str) -> ResponseIds:
        return cls(f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(finished: list[Finished]) -> dict:
    """Counts over all choices: the prompt once (the choices share its cells), every answer."""
    first = finished[0].metrics
    completion = sum(f.metrics.completion_tokens for f in finished)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": sum(f.metrics.reasoning_tokens for f in finished)},
    }


def timings(m: RequestMetrics) -> dict:
    """llama-server's `timings` of one answer (its extension, read by llama.cpp's web UI and
    tools for tokens/s): what was prefilled and decoded, and how fast."""
    prompt_n, predicted_n = m.prompt_tokens - m.cached_tokens, m.completion_tokens
    prompt_ms, predicted_ms = m.prefill * 1e3, m.decode * 1e3
    return {
        "cache_n": m.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": predicted_n * 1e3 / predicted_ms if predicted_ms > 0 else 0.0,
    }


def _token_text(token: bytes) -> str:
    # a token may hold part of a character; its bytes are exact, its text the best reading
    return token.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {
        "content": [
            {
                "token": _token_text(e.token),
                "logprob": e.logprob,
                "bytes": list(e.token),
                "top_logprobs": [{"token": _token_text(t), "logprob": lp, "bytes": list(t)} for t, lp in e.top],
            }
            for e in entries
        ],
        "refusal": None,
    }


def text_logprobs(entries: list[TokenLogprob], offset: int) -> dict:
    """The legacy endpoint's shape: parallel lists, text offsets from `offset` (what came before)."""
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(_token_text(e.token))
    return {
        "tokens": [_token_text(e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def logprobs_body(kind: str, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(entries) if kind == "chat" else text_logprobs(entries, offset)


@dataclass
class Choice:
    """One finished answer: its text (the content, calls taken out) and tool calls."""

    finished: Finished
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls and self.finished.reason == "stop" else self.finished.reason


def completion_body(choices: list[Choice], kind: str, ids: ResponseIds) -> dict:
    """A whole answer: chat.completion (kind "chat") or text_completion."""
    out = []
    for i, c in enumerate(choices):
        if kind == "chat":
            message: dict = {"role": "assistant", "content": c.content if c.content or not c.tool_calls else None}
            if c.finished.reasoning:
                message["reasoning_content"] = c.finished.reasoning
            if c.tool_calls:
                message["tool_calls"] = [call.body() for call in c.tool_calls]
            choice = {"index": i, "message": message}
        else:
            choice = {"index": i, "text": c.content}
        choice.update(logprobs=logprobs_body(kind, c.finished.logprobs), finish_reason=c.finish_reason)
        out.append(choice)
    obj = "chat.completion" if kind == "chat" else "text_completion"
    finished = [c.finished for c in choices]
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": out, "usage": usage(finished), "timings": timings(finished[0].metrics)}


def chunk(
    kind: str,
    ids: ResponseIds,
    text: str | None,
    finish_reason: str | None,
    role: bool = False,
    index: int = 0,
    tool_calls: list[dict] | None = None,
    logprobs: dict | None = None,
    reasoning: str | None = None,
) -> dict:
    """One stream chunk; `role` makes the chat stream's opening chunk; `reasoning` is a reasoning
    model's thoughts, in the field llama-server and vLLM clients read (`reasoning_content`)."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or ""}
        obj = "text_completion"
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    return {"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice]}


def tool_call_deltas(index: int, call: ToolCall) -> list[list[dict]]:
    """A call as OpenAI streams it: id, type and name first, then the arguments."""
    return [
        [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}],
        [{"index": index, "function": {"arguments": call.arguments}}],
    ]


def usage_chunk(kind: str, ids: ResponseIds, finished: list[Finished]) -> dict:
    """The last chunk when the request set stream_options.include_usage: no choices, the counts."""
    return {**chunk(kind, ids, None, None), "choices": [], "usage": usage(finished), "timings": timings(finished[0].metrics)}
