"""The output processor: token bytes in, UTF-8-safe text out, stop strings cut exactly.

Every front end gets its text through here, so a character split across tokens (Chinese, emoji)
is never emitted half-done, and text that could still turn into a stop string is held back.
"""

from __future__ import annotations

import codecs
from collections import deque
from typing import TYPE_CHECKING

from edgechat.engine.output.markers import marker_tail

if TYPE_CHECKING:
    from edgechat.engine.output.reasoning import ChannelSplitter, ReasoningSplitter
    from edgechat.engine.output.tools import ToolCallParser
    from edgechat.engine.types.request import ToolCall


class LoopGuard:
    """Tells when an answer has become a loop: nearly every recent token ends a run of GRAM
    tokens that the answer itself already wrote. Exact repeats and sampled near-repeats alike
    trip it; text quoted from the prompt does not (only the answer's own runs are remembered),
    and a loop is caught one WINDOW after its first copy ends."""

    GRAM = 6
    WINDOW = 192
    SHARE = 0.9

    def __init__(self) -> None:
        self._recent: deque[int] = deque(maxlen=self.GRAM)
        self._seen: set[tuple[int, ...]] = set()
        self._hits: deque[bool] = deque(maxlen=self.WINDOW)
        self._n_hits = 0

    def feed(self, token: int) -> bool:
        """Add one generated token; True when the answer is only repeating itself."""
        self._recent.append(token)
        if len(self._recent) < self.GRAM:
            return False
        gram = tuple(self._recent)
        hit = gram in self._seen
        self._seen.add(gram)
        if len(self._hits) == self.WINDOW:
            self._n_hits -= self._hits[0]
        self._hits.append(hit)
        self._n_hits += hit
        return len(self._hits) == self.WINDOW and self._n_hits >= self.SHARE * self.WINDOW


class OutputProcessor:
    """With a `splitter` (a reasoning model's), text inside its thoughts goes to `reasoning`
    (taken with take_reasoning()) and only the answer to the returned text, where stop strings
    apply: a stop string written while thinking does not end the answer. The splitter gets each
    token's id with its text (harmony's markers are told by id). With a `parser` (a request
    that declared tools), the answer's calls are taken out of its text (take_calls()); a call
    that repeats an earlier one ends the answer as a stop string would."""

    def __init__(self, stop: list[str] | None = None, loop_guard: bool = False,
                 splitter: ReasoningSplitter | ChannelSplitter | None = None, parser: ToolCallParser | None = None):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in (stop or []) if s]
        self._guard = LoopGuard() if loop_guard else None
        self._splitter = splitter
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self.text = ""  # everything emitted so far
        self.reasoning = ""  # the thoughts so far
        self.reasoning_tokens = 0
        self._new_reasoning = ""
        self.stopped = False  # a stop string was found, or the loop guard tripped
        #: the stop string that ended the answer (Anthropic's API reports which one)
        self.stop_found: str | None = None
        self.repeating = False  # the loop guard tripped
        self.parser = parser
        self._calls_taken = 0

    @property
    def thinking(self) -> bool:
        return self._splitter is not None and self._splitter.thinking

    def feed(self, data: bytes, token: int | None = None) -> str:
        """Add one token's bytes (and its id, for the loop guard); return the answer's text that
        is now safe to emit."""
        if self.stopped:
            return ""
        text = self._decoder.decode(data)
        if self._splitter is not None:
            was_thinking = self.thinking
            thought, text = self._splitter.feed(text, token)
            self._add_reasoning(thought)
            # the token that opens the block and the one that closes it are the thoughts' too
            self.reasoning_tokens += was_thinking or self.thinking
        self._held += text
        out = self._release(final=False)
        if token is not None and self._guard is not None and not self.stopped and self._guard.feed(token):
            self.stopped = self.repeating = True
        return out

    def take_calls(self) -> list[tuple[int, ToolCall]]:
        """The calls completed since the last call, with their index in the answer."""
        if self.parser is None or self._calls_taken == len(self.parser.calls):
            return []
        start, self._calls_taken = self._calls_taken, len(self.parser.calls)
        return list(enumerate(self.parser.calls[start:], start))

    @property
    def content(self) -> str:
        """The answer's text without its calls (the whole text where no tools were declared)."""
        return self.parser.text if self.parser is not None else self.text

    def take_reasoning(self) -> str:
        """The thoughts released since the last call."""
        out, self._new_reasoning = self._new_reasoning, ""
        return out

    def parts(self, text: str) -> list[tuple[str, bool]]:
        """What goes out now, in order, as (text, is_reasoning): the thoughts released since the
        last call, then `text` (what feed() or finish() returned); empty ones left out."""
        return [(part, reasoning) for part, reasoning in ((self.take_reasoning(), True), (text, False)) if part]

    def finish(self) -> str:
        """End of generation: flush what was held. An incomplete UTF-8 tail (a character cut by
        max_tokens) is dropped, not rendered as U+FFFD: llama-server ends such answers cleanly too."""
        self._decoder.reset()
        if self._splitter is not None and not self.stopped:
            thought, text = self._splitter.finish()
            self._add_reasoning(thought)
            self._held += text
        if not self._held and self.parser is not None and not self.parser.ended:
            tail = self.parser.finish()  # what it held back was no call after all
            self.text += tail
            return tail
        return self._release(final=True)

    def _add_reasoning(self, text: str) -> None:
        self.reasoning += text
        self._new_reasoning += text

    def _release(self, final: bool) -> str:
        held = self._held
        if not held:
            return ""
        cut = -1
        for stop in self._stops:
            i = held.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, self.stop_found = i, stop
        if cut != -1:
            out, self._held, self.stopped = held[:cut], "", True
        elif final:
            out, self._held = held, ""
        else:
            keep = self._partial_stop_len(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        if self.parser is not None:
            out = self.parser.feed(out)[0] if out else ""
            if self.parser.ended:
                self.stopped = True
            elif final or self.stopped:
                out += self.parser.finish()
        self.text += out
        return out

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        return max((marker_tail(text, stop) for stop in self._stops), default=0)
