"""The prompt cache: KV states of recent prompts in host RAM, beyond what the slots hold.

Agents and apps re-send the same long contexts (system prompt, tool definitions, the
conversation so far) across more distinct prompts than there are sequences. When an idle slot
is taken over, the KV manager saves what it holds here (`llama_state_seq_get_data`: the
prompt and the answer, whose cells a follow-up request starts with, and the logits after the
prompt); on admission, the entry sharing the longest prefix with the new prompt is restored into
the slot if it beats what the slots hold, and only the rest is prefilled (nothing at all for the
same prompt again: its first token comes from the kept logits).

Entries carry the snapshot store's tags (model hash, context size, KV type, state version):
one whose tags differ from the engine's is never restored. The budget is in bytes; the least
recently used entries leave first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from edgechat.engine.kvcache import NextLogits, common_prefix

__all__ = ["CachedPrompt", "PromptCache"]


@dataclass
class CachedPrompt:
    tokens: list[int]
    data: bytearray  # as LlamaBackend.state_seq_get returns it
    tags: dict
    next_logits: NextLogits | None = None  # the slot's, kept with its state

    @property
    def nbytes(self) -> int:
        return len(self.data) + (self.next_logits.values.nbytes if self.next_logits is not None else 0)


class PromptCache:
    """Sequence states by token prefix, LRU within `budget` bytes (0: off)."""

    def __init__(self, budget: int, tags: Callable[[], dict]):
        self.budget = budget
        self._tags = tags  # called on first use: it hashes the model
        self._entries: OrderedDict[int, CachedPrompt] = OrderedDict()  # by id(entry), least recently used first

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CachedPrompt]:
        return list(self._entries.values())

    def longest(self, prompt: list[int]) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with the prompt, and that length (None, 0 if none)."""
        best, best_n = None, 0
        for entry in self._usable():
            n = common_prefix(entry.tokens, prompt)
            if n > best_n:
                best, best_n = entry, n
        return best, best_n

    def covers(self, tokens: list[int]) -> bool:
        """An entry already holds these tokens (and maybe more after them)."""
        return any(len(e.tokens) >= len(tokens) and e.tokens[: len(tokens)] == tokens for e in self._usable())

    def touch(self, entry: CachedPrompt) -> None:
        self._entries.move_to_end(id(entry))

    def put(self, tokens: list[int], data: bytearray, next_logits: NextLogits | None = None) -> None:
        """Keep a sequence's state; entries it extends (their tokens are a prefix of these) go."""
        entry = CachedPrompt(list(tokens), data, self._tags(), next_logits)
        if entry.nbytes > self.budget:
            return
        for key, old in list(self._entries.items()):
            if len(old.tokens) <= len(tokens) and tokens[: len(old.tokens)] == old.tokens:
                del self._entries[key]
        self._entries[id(entry)] = entry
        total = self.bytes
        while total > self.budget:
            total -= self._entries.pop(next(iter(self._entries))).nbytes

    def drop(self, entry: CachedPrompt) -> None:
        self._entries.pop(id(entry), None)

    def _usable(self) -> list[CachedPrompt]:
        """The entries made for this engine's model, context and KV type; any other (a state
        of another model, say) is never restored, so it goes."""
        if not self._entries:
            return []
        tags = self._tags()
        for key, entry in list(self._entries.items()):
            if entry.tags != tags:
                del self._entries[key]
        return list(self._entries.values())
