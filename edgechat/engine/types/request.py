"""A request to the engine, its status, and the events the engine sends back.

Every front end (TUI, `edgechat run`, the HTTP server) builds a ChatRequest, submits it to
engine.Engine and consumes the events from the RequestHandle it gets back.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from edgechat.params import ContextPolicy, Grammar, SamplingParams, SpeculativeMode, choice

log = logging.getLogger("edgechat.engine")


#: the longest answer a front end with a person waiting (`edgechat run`, the chat app) asks for
#: unless told otherwise, so a model that never writes its end-of-text token still ends
DEFAULT_MAX_TOKENS = 512


@dataclass
class Tools:
    """A request's tools, as checked."""

    functions: list[dict]  # {"name", "description", "parameters"}
    choice: str  # "auto" | "required" | "none" | "function" (the named one)
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.functions)

    @property
    def offered(self) -> list[dict]:
        """The functions the model is told of: only the named one for a named choice."""
        return [f for f in self.functions if self.named in (None, f["name"])]


@dataclass(frozen=True)
class Infill:
    """A fill at a cursor: the file's text before and after it, other files that give context
    ((filename, text), in the order the model reads them, most relevant last: the oldest go first
    when the context is short) and text the answer starts with (llama-server's `prompt`)."""

    prefix: str
    suffix: str
    extra: tuple[tuple[str, str], ...] = ()
    prompt: str = ""


@dataclass(frozen=True, eq=False)
class ImageInput:
    """A picture in a message: a `content` may be a list of parts, each a str or an ImageInput,
    in the order the model reads them. The bytes as sent (PNG, JPEG, ...: what the model's
    projector decodes); a model without a vision projector refuses them in one line."""

    data: bytes
    #: "image/png", ... as the client said (None: unknown); the projector reads the bytes themselves
    media_type: str | None = None


@dataclass
class ChatRequest:
    """One generation: chat `messages` (rendered with the model's template), a raw `prompt`, or a
    fill-in-the-middle `infill` (the prompt a code model completes at a cursor: engine/prompt/fim.py)."""

    #: {role, content}; content is text, or a list of parts (str or ImageInput) for a message
    #: with pictures (a vision model's); an assistant message may carry `tool_calls` ([{id, name, arguments (JSON
    #: text)}]), a "tool" message answers one by its `tool_call_id`
    messages: list[dict] | None = None
    prompt: str | None = None
    infill: Infill | None = None
    #: the functions the model may call (engine/output/tools.py): rendered into the prompt with the
    #: messages, through the template's own tool format where it has one; the call syntax's
    #: grammar is the front end's to set in `grammar`
    tools: Tools | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: None: until end of text or the context's answer reserve runs out
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    #: seconds after the first token past which the answer ends at its next newline (an editor's
    #: completion: llama-server's t_max_predict_ms); None: no limit
    line_time_limit: float | None = None
    ignore_eos: bool = False
    #: stop an answer that only repeats itself (stream.LoopGuard); never with ignore_eos, whose
    #: benchmarks want every token they asked for
    loop_guard: bool = True
    #: reasoning models: None thinks as long as it likes, 0 not at all (the template's switch,
    #: else the block closed at once), N at most N tokens, then the engine closes the block
    reasoning_budget: int | None = None
    #: False: a reasoning model's thoughts stay in the answer's text, markers and all
    split_reasoning: bool = True
    #: extra variables for the chat template (`enable_thinking`, ...: chat_template_kwargs)
    template_kwargs: dict = field(default_factory=dict)
    #: a conversation id: its KV sequence is kept between turns for prefix reuse
    session: str | None = None
    context_policy: ContextPolicy = ContextPolicy.SHIFT
    #: messages (by index) kept in context under eviction besides the system prompt
    pinned: frozenset[int] = frozenset()
    #: speculative decoding for this request; None takes the engine's setting
    speculative: SpeculativeMode | None = None
    grammar: Grammar | None = None
    #: None: no log probabilities; n >= 0: each token's, with the n most likely alternatives
    logprobs: int | None = None
    #: another request with the same prompt (n > 1): this one starts once that one's prompt is
    #: in the cache, so it shares those cells instead of prefilling them again
    prompt_shared_with: RequestHandle | None = None

    def __post_init__(self):
        # a caller may give the enums' words ("lookup"); a wrong one is one line naming the others
        self.context_policy = choice(ContextPolicy, self.context_policy, "context_policy")
        if self.speculative is not None:
            self.speculative = choice(SpeculativeMode, self.speculative, "speculative")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # end of text or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens reached
    FINISHED_REPEATING = "finished_repeating"  # the loop guard stopped an answer repeating itself
    FINISHED_CANCELLED = "finished_cancelled"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


#: the one map from terminal status to the finish reason every front end reports
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    # cut short, as by max_tokens: the reason every OpenAI-style client already understands
    RequestStatus.FINISHED_REPEATING: "length",
    RequestStatus.FINISHED_CANCELLED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class RequestMetrics:
    """Lifecycle timings of one request, in seconds unless named otherwise."""

    queue_wait: float = 0.0
    tokenize: float = 0.0
    prefill: float = 0.0
    ttft: float = 0.0
    #: inter-token gaps after the first token
    tpot_mean: float = 0.0
    tpot_p50: float = 0.0
    tpot_p95: float = 0.0
    decode: float = 0.0
    total: float = 0.0
    prompt_tokens: int = 0
    #: prompt tokens that came from the KV cache (live sequence or snapshot), not prefilled
    cached_tokens: int = 0
    completion_tokens: int = 0
    #: of which the model's thoughts (a reasoning model's)
    reasoning_tokens: int = 0
    #: tokens in the sequence's context after the request
    context_tokens: int = 0
    context_size: int = 0
    #: speculative decoding: tokens guessed and verified, and how many of them were kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: the prompt cache (host RAM): True when it held a longer prefix than the slots and that was
    #: restored, False when it had none, None when not consulted; restored_tokens are part of
    #: cached_tokens
    prompt_cache_hit: bool | None = None
    restored_tokens: int = 0

    @property
    def prefill_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill if self.prefill > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode speed counts the rest
        n = self.completion_tokens - 1
        return n / self.decode if self.decode > 0 and n > 0 else 0.0


@dataclass
class TokenLogprob:
    """One generated token's log probability under the model (before any sampler or grammar
    changed the distribution), with the most likely alternatives when asked."""

    token: bytes
    logprob: float
    top: list[tuple[bytes, float]] = field(default_factory=list)
    #: the token's id and its alternatives' (llama-server's /completion returns ids)
    id: int = -1
    top_ids: list[int] = field(default_factory=list)


@dataclass
class TextDelta:
    text: str
    #: with ChatRequest.logprobs: the tokens whose text this delta releases (text held back
    #: for a stop string or an unfinished character comes with a later delta)
    logprobs: list[TokenLogprob] | None = None
    #: the model's thoughts (a reasoning model's), not its answer
    reasoning: bool = False


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def body(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallEvent:
    """A call the answer made, whole: with tools declared, the output processor reads calls out
    of the answer's text (tools.ToolCallParser, in the model family's syntaxes and the JSON
    small models write), and none of their text reaches a TextDelta. A call comes whole because
    its arguments are checked against the tool's schema before it counts as a call."""

    index: int  # the call's place in the answer, from 0
    call: ToolCall


@dataclass
class Evicted:
    """Part of a conversation left the KV cache (never the stored history)."""

    messages: int
    tokens: int
    policy: str
    note: str  # e.g. "3 oldest messages left the context"


@dataclass
class Metrics:
    metrics: RequestMetrics


@dataclass
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    text: str  # the whole answer
    metrics: RequestMetrics
    error: str | None = None
    #: the generated token ids (end-of-generation token excluded)
    token_ids: list[int] = field(default_factory=list)
    #: with ChatRequest.logprobs: one entry per generated token
    logprobs: list[TokenLogprob] | None = None
    #: the loop guard ended it (reason "length"): front ends say so
    repeating: bool = False
    #: a reasoning model's thoughts (not in `text`)
    reasoning: str = ""
    #: the stop string that ended it (reason "stop"; None: end of text or none asked for)
    stop_sequence: str | None = None
    #: with tools declared: the calls the answer made (`text` is then the content without them)
    tool_calls: list[ToolCall] = field(default_factory=list)


Event = TextDelta | ToolCallEvent | Evicted | Metrics | Finished


class RequestHandle:
    """What submit() returns: iterate for events (blocking), cancel() from any thread."""

    def __init__(self, request: ChatRequest, on_event: Callable[[Event], None] | None = None):
        self.request = request
        self.status = RequestStatus.WAITING
        self._cancel = threading.Event()
        #: how a cancelled request ends: stop() ends it as finished, not as cancelled
        self.end_status = RequestStatus.FINISHED_CANCELLED
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._on_event = on_event
        self.finished: Finished | None = None
        self._done = threading.Event()

    # engine side
    def emit(self, event: Event) -> None:
        if isinstance(event, Finished):
            self.finished = event
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                # the consumer is broken: it must not take the engine down with it; its
                # request stops at the next token, and result() still returns
                log.exception("an event callback failed; cancelling its request")
                self._cancel.set()
        else:
            self._events.put(event)
        if isinstance(event, Finished):
            self._done.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # client side
    def cancel(self) -> None:
        """Stop generation; the engine checks before every token and finishes with reason 'cancelled'."""
        self._cancel.set()

    def stop(self) -> None:
        """End the answer where it is, as the end of text would (reason 'stop'): the client has
        what it needs (a tool call that repeats an earlier one ends the calls)."""
        self.end_status = RequestStatus.FINISHED_STOPPED
        self._cancel.set()

    def __iter__(self) -> Iterator[Event]:
        return self.events()

    def events(self, every: float = 0.0) -> Iterator[Event]:
        """Events in order until Finished. With `every` > 0 the consumer wakes at most that often
        and takes what has piled up: on a small machine, waking a thread per token steals CPU
        from llama.cpp's own threads."""
        if self._on_event is not None:
            raise RuntimeError("this handle delivers events to its on_event callback")
        while True:
            if every > 0:
                self._done.wait(every)
                batch = []
                while True:
                    try:
                        batch.append(self._events.get_nowait())
                    except queue.Empty:
                        break
            else:
                batch = [self._events.get()]
            for event in batch:
                yield event
                if isinstance(event, Finished):
                    return

    def result(self, timeout: float | None = None) -> Finished:
        """Wait for the end and return the Finished event (text, reason, metrics)."""
        if not self._done.wait(timeout):
            raise TimeoutError("request still running")
        assert self.finished is not None
        return self.finished
