"""What every API's request gets, whatever wire format it came in: applied by the dispatcher once,
after the translator, to a copy per model (so a request that fails over is fitted afresh for the
fallback). A translator only translates: its `ChatRequest` carries the client's tools, grammar
and max_tokens as sent."""

from __future__ import annotations

import dataclasses

from edgechat.engine.output.toolfamilies import ToolFamily
from edgechat.engine.output.tools import tool_grammar
from edgechat.engine.types.request import ChatRequest
from edgechat.server.settings import ServerSettings


def for_model(req: ChatRequest, family: ToolFamily, settings: ServerSettings) -> ChatRequest:
    """`req` as the model whose template writes `family`'s tool calls runs it: with tools, the
    grammar of that syntax (the generic one where the template takes none; the engine's prompt
    builder renders tools, calls and results through the same template); the thoughts apart
    unless the server keeps them in the text (--reasoning-format none)."""
    grammar = tool_grammar(req.tools, family) if req.tools is not None else req.grammar
    return dataclasses.replace(req, grammar=grammar, split_reasoning=settings.reasoning_format != "none")


def fit_max_tokens(max_tokens: int | None, prompt_tokens: int, n_ctx: int) -> int | None:
    """max_tokens cut to the room the prompt leaves in the context. The engine keeps going past
    a full context by shifting it, so an unbounded or huge max_tokens (10**9) would never end."""
    room = n_ctx - prompt_tokens
    if max_tokens is not None and max_tokens > room >= 1:
        return room
    if max_tokens is None and room >= n_ctx // 4:
        # with no max_tokens the engine keeps a quarter of the context for the answer and
        # refuses longer prompts itself (in submit)
        return room
    return max_tokens
