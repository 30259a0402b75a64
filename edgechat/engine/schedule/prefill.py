"""Prefill at once: tokens decoded into a sequence outside the step's batch, for what must be in
the cache before the step goes on (cells recomputed after a cut, a check's cold prompt)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from edgechat.engine.kv.kvcache import KVManager, Slot, is_sentinel
from edgechat.engine.runners.runner import ModelRunner

if TYPE_CHECKING:
    from edgechat.engine.runners.media import MediaChunk, Projector


def text_run(tokens: list[int], limit: int) -> int:
    """How many of the first `limit` tokens come before the first image cell."""
    for i in range(min(limit, len(tokens))):
        if is_sentinel(tokens[i]):
            return i
    return min(limit, len(tokens))


class Prefiller:
    """Decodes tokens into a sequence in batches of its own, the images among them encoded again."""

    def __init__(self, runner: ModelRunner, kv: KVManager, projector: Projector | None):
        self.runner = runner
        self.kv = kv
        self.projector = projector

    def now(self, slot: Slot, tokens: list[int], logits_last: bool = False,
            media: Mapping[int, MediaChunk] | None = None) -> int:
        """Decode tokens into the slot, the images among them (`media`: their chunks by first
        sentinel) encoded again here; returns the batch index of the last token's logits in the
        final chunk."""
        batch = self.runner.new_batch(self.runner.n_batch)
        idx = -1
        i = 0
        try:
            while i < len(tokens):
                if is_sentinel(tokens[i]):
                    chunk = (media or {}).get(tokens[i])
                    if chunk is None or self.projector is None:
                        raise ValueError("an image's cells must be recomputed, and its picture is not at hand")
                    self.projector.eval(chunk, slot.seq, slot.next_pos)
                    self.kv.extend(slot, tokens[i : i + chunk.n_tokens], chunk.n_pos)
                    i += chunk.n_tokens
                    continue
                batch.clear()
                chunk_tokens = tokens[i : i + text_run(tokens[i:], self.runner.n_batch)]
                base = slot.next_pos
                for j, tok in enumerate(chunk_tokens):
                    last = logits_last and i + j == len(tokens) - 1
                    idx = batch.add(tok, base + j, slot.seq, last)
                self.kv.extend(slot, chunk_tokens)
                self.runner.decode(batch)
                i += len(chunk_tokens)
        finally:
            batch.close()
        return idx
