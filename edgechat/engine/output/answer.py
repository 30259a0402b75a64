"""One request's answer, token by token: its text and events go out here, and here it is decided
whether a token ends it (stops, max_tokens, line time, JSON closing) or makes the engine write
tokens of its own after it (a spent thinking budget). The scheduler feeds it the sampled tokens
and puts into the cache what `feed` says; the answer builds the request's Metrics and Finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgechat.engine.output.jsonvalue import JsonPrefix, step_texts
from edgechat.engine.output.logprobs import token_logprobs
from edgechat.engine.output.stream import OutputProcessor
from edgechat.engine.output.tools import ToolCallParser, answered_calls
from edgechat.engine.types.metrics import RequestClock
from edgechat.engine.types.request import (
    FINISH_REASONS,
    ChatRequest,
    Finished,
    Metrics,
    RequestHandle,
    RequestStatus,
    TextDelta,
    TokenLogprob,
    ToolCallEvent,
)

if TYPE_CHECKING:
    from edgechat.engine.output.reasoning import Thinking
    from edgechat.engine.output.toolfamilies import ToolFamily
    from edgechat.engine.prompt.prompt import Prepared
    from edgechat.engine.runners.runner import ModelRunner

#: how close to max_tokens an answer held to a JSON Schema starts checking what its end would take
JSON_CLOSE_WINDOW = 64


@dataclass(frozen=True)
class Fed:
    """What one sampled token did: nothing more to do (the token goes into the cache next), the
    answer ended (`ended`, the token stays out of the cache), or the engine wrote `inject` after
    it, to go into the cache with it."""

    ended: RequestStatus | None = None
    inject: tuple[int, ...] | None = None


GO_ON = Fed()


@dataclass(frozen=True)
class Usage:
    """What the scheduler knows of a request's cells when it ends, for its metrics."""

    prompt_tokens: int
    context_tokens: int
    context_size: int
    #: speculative decoding's (drafted, accepted) tokens; None when it never drafted
    drafts: tuple[int, int] | None = None


class JsonCloser:
    """An answer held to a JSON Schema under max_tokens: the JSON so far (how far it has read the
    answer's text) and the last closing counted, so that the answer ends validly in time."""

    def __init__(self, schema: dict, words: ModelRunner):
        self._json: JsonPrefix | None = JsonPrefix(schema)
        self._words = words
        self._read = 0
        self._closing: tuple[str, list[int]] = ("", [])
        #: the most tokens one step can add to that closing (a key or an item opened: step_texts),
        #: counted once the answer first comes near max_tokens
        self._step: int | None = None

    def closing(self, text: str, left: int) -> list[int]:
        """Once the `left` tokens come down to what the shortest valid end of the JSON in `text`
        takes, that end's tokens; else none."""
        json = self._json
        if json is None or left > JSON_CLOSE_WINDOW:
            return []
        json.feed(text[self._read :])
        self._read = len(text)
        if not json.valid or json.end is not None:
            self._json = None  # nothing to close: a complete value, or text the schema never made
            return []
        closing = json.closing()
        if closing != self._closing[0]:
            self._closing = (closing, self._tokenize(closing) if closing else [])
        tokens = self._closing[1]
        if self._step is None:
            self._step = max((len(self._tokenize(t)) for t in step_texts(json.root)), default=1)
        # the end's length and what the next token may add to it: opening a key or an item
        # (an object whose required fields come with it) makes the end longer in one step
        if not tokens or left > len(tokens) + self._step + 2:
            return []
        return tokens

    def _tokenize(self, text: str) -> list[int]:
        return self._words.tokenize(text, add_bos=False, special=False)


class Answer:
    """A request's output from its first token to its Finished. Until `open` (the request has
    not started) it has no text: an end then sends no text, only Metrics and Finished."""

    def __init__(self, handle: RequestHandle, request: ChatRequest, clock: RequestClock):
        self.handle = handle
        self.request = request
        self.clock = clock
        self.proc: OutputProcessor | None = None
        self._words: ModelRunner | None = None
        self._thinking: Thinking | None = None
        self._json: JsonCloser | None = None
        self.n_out = 0
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # per sampled token, when asked
        self._logprobs_sent = 0  # of which delivered with a TextDelta
        self.cached = 0  # prompt tokens the cache held
        self.restored: int | None = None  # prompt tokens from the prompt cache (None: not consulted)

    def open(self, prep: Prepared, words: ModelRunner, thinking: Thinking, tool_family: ToolFamily) -> None:
        """The request starts: its tokens' text comes from `words`, its thoughts are split as
        `thinking` says and its calls read in `tool_family`'s syntax."""
        req = self.request
        tools = req.tools if req.tools is not None and req.tools.active else None
        # a call identical to one the last turn answered is text, not a new call
        parser = ToolCallParser(tool_family, tools.offered, answered_calls(req.messages)) if tools is not None else None
        self.proc = OutputProcessor(req.stop, loop_guard=req.loop_guard and not req.ignore_eos,
                                    splitter=thinking.splitter(req, prep), parser=parser)
        self._words, self._thinking = words, thinking
        if req.grammar is not None and req.grammar.json_schema is not None and req.max_tokens is not None:
            self._json = JsonCloser(req.grammar.json_schema, words)

    def feed(self, token: int) -> Fed:
        """One sampled token reaches the answer: its text goes out; says whether it ended the
        answer or the engine wrote tokens after it."""
        assert self.proc is not None and self._words is not None and self._thinking is not None
        req, words = self.request, self._words
        self.clock.token()
        if words.is_eog(token) and not req.ignore_eos:
            return Fed(RequestStatus.FINISHED_STOPPED)
        self._write(token)
        if self.proc.stopped:
            return Fed(RequestStatus.FINISHED_REPEATING if self.proc.repeating else RequestStatus.FINISHED_STOPPED)
        if self._json is not None and req.max_tokens is not None:
            closing = self._json.closing(self.proc.text, req.max_tokens - self.n_out)
            if closing:
                # the end of the JSON is written as the thinking budget writes the end of
                # thoughts; the last token stays out of the cache, as at any length finish
                for closer in closing:
                    self._write(closer)
                return Fed(RequestStatus.FINISHED_LENGTH)
        if req.max_tokens is not None and self.n_out >= req.max_tokens:
            return Fed(RequestStatus.FINISHED_LENGTH)
        if (req.line_time_limit is not None and b"\n" in words.piece(token)
                and self.clock.last_token - self.clock.first_token > req.line_time_limit):
            return Fed(RequestStatus.FINISHED_LENGTH)
        if self._thinking.spent(req, self.proc):
            # the budget is spent: the engine writes the end of the thoughts itself, into the
            # sequence as if the model had, and the answer follows them
            for closer in self._thinking.closing:
                self._write(closer)
            return Fed(inject=tuple(self._thinking.closing))
        return GO_ON

    def record_logprob(self, logits: np.ndarray, token: int) -> None:
        """Only for requests that ask: the others never read their logits in Python."""
        n = self.request.logprobs
        assert n is not None and self._words is not None
        piece = self._words.piece
        logprob, top = token_logprobs(logits, token, n)
        self.logprobs.append(TokenLogprob(piece(token), logprob, [(piece(t), lp) for t, lp in top], token, [t for t, _ in top]))

    def finish(self, status: RequestStatus, error: str | None, usage: Usage) -> None:
        """The request ended (what it held is freed): the text held back, then Metrics and Finished."""
        proc = self.proc
        self._emit(proc.finish() if proc is not None and status is not RequestStatus.FINISHED_ERROR else "")
        self.handle.status = status
        metrics = self.clock.build(usage.prompt_tokens, self.cached, self.n_out, usage.context_tokens, usage.context_size)
        if self.restored is not None:
            metrics.prompt_cache_hit, metrics.restored_tokens = self.restored > 0, self.restored
        if proc is not None:
            metrics.reasoning_tokens = proc.reasoning_tokens
        if usage.drafts is not None:
            metrics.drafted_tokens, metrics.accepted_tokens = usage.drafts
        self.handle.emit(Metrics(metrics))
        logprobs = self.logprobs[: self.n_out] if self.request.logprobs is not None else None
        self.handle.emit(Finished(FINISH_REASONS[status], proc.content if proc is not None else "", metrics, error,
                                  self.tokens, logprobs,
                                  repeating=status is RequestStatus.FINISHED_REPEATING,
                                  reasoning=proc.reasoning if proc is not None else "",
                                  stop_sequence=proc.stop_found if proc is not None else None,
                                  tool_calls=list(proc.parser.calls) if proc is not None and proc.parser else []))

    def _write(self, token: int) -> None:
        """The one way a token becomes part of the answer: counted, kept, its text sent."""
        assert self.proc is not None and self._words is not None
        self.n_out += 1
        self.tokens.append(token)
        self._emit(self.proc.feed(self._words.piece(token), token))

    def _emit(self, text: str) -> None:
        """Text to the client, after the thoughts released with it, with the log probabilities
        of the tokens emitted since the last text (the end-of-generation token has none)."""
        if self.proc is None:  # ended before it started: nothing was written
            return
        for part, reasoning in self.proc.parts(text):
            logprobs = None
            if self.request.logprobs is not None:  # the closing tokens of a thinking budget have none
                logprobs = self.logprobs[self._logprobs_sent :]
                self._logprobs_sent = len(self.logprobs)
            self.handle.emit(TextDelta(part, logprobs, reasoning))
        for index, call in self.proc.take_calls():
            self.handle.emit(ToolCallEvent(index, call))
