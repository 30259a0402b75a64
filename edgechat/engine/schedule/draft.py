"""A draft model: a smaller model of the same vocabulary that guesses the target's next tokens.

It runs in its own llama.cpp context on the engine thread, one sequence per target slot. Its
cache has an owner of its own kind: a `KVManager` on the draft's runner, whose slots mirror
what each sequence holds and whose `check` compares them with llama.cpp's cells; it never shares
cells between sequences, holds no conversation and keeps no snapshot or prompt cache. Each
sequence follows the target's lazily: before guessing, it keeps the longest prefix it shares
with the target slot's tokens, truncates the rest and decodes what it lacks, so prefix reuse,
truncation, rejected drafts, snapshot restores and a slot changing hands all come out right
without being told; an eviction shift is applied to both, so a long chat does not recompute the
draft's whole context after each one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from edgechat.engine.kv.kvcache import KVManager, Slot
from edgechat.engine.kv.prefix import common_prefix
from edgechat.engine.kv.promptcache import PromptCache
from edgechat.engine.runners.llama import LlamaBackend
from edgechat.engine.schedule.speculative import StepCost
from edgechat.errors import UsageError

log = logging.getLogger("edgechat.engine")

#: vocabularies may differ in size by this many tokens (added padding or a few extra specials)
VOCAB_SIZE_MARGIN = 128
#: a guess stops at the first token the draft model gives less than this probability: an
#: unsure guess is mostly rejected, and each one costs the draft a decode and the target a column
MIN_CONFIDENCE = 0.5


class DraftVocabError(UsageError):
    """The draft model's tokens do not mean what the target's do."""


def check_vocab(target: LlamaBackend, draft: LlamaBackend) -> None:
    """Refuse a draft whose token ids could not be fed to the target: the same tokenizer type,
    sizes within a margin, the same special tokens, and the same text for every shared id."""
    name = draft.path.name
    if target.vocab_type != draft.vocab_type:
        raise DraftVocabError(
            f"draft model {name} uses another kind of tokenizer (type {draft.vocab_type}, the model's is {target.vocab_type}); "
            "pick a draft of the same family"
        )
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_MARGIN:
        raise DraftVocabError(
            f"draft model {name} has {draft.n_vocab} tokens, the model {target.n_vocab}; pick a draft of the same family"
        )
    for what, attr in (("BOS", "bos"), ("EOS", "eos"), ("EOT", "eot")):
        if getattr(target, attr) != getattr(draft, attr):
            raise DraftVocabError(f"draft model {name} has another {what} token; pick a draft of the same family")
    if target.add_bos != draft.add_bos:
        raise DraftVocabError(f"draft model {name} adds a BOS token differently; pick a draft of the same family")
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if target.token_bytes(token) != draft.token_bytes(token):
            raise DraftVocabError(
                f"draft model {name}: token {token} is {draft.token_text(token)!r}, the model's is "
                f"{target.token_text(token)!r}; pick a draft of the same family"
            )


class DraftModel:
    def __init__(self, path: Path, target: LlamaBackend, n_ctx: int, n_threads: int, flash_attn: str = "auto"):
        self.runner = LlamaBackend(
            path,
            n_ctx_total=n_ctx * target.n_seq_max,
            n_seq_max=target.n_seq_max,
            n_threads=n_threads,
            n_batch=512,
            flash_attn=flash_attn,
        )
        try:
            check_vocab(target, self.runner)
        except Exception:
            self.runner.close()
            raise
        self.path = Path(path)
        #: the owner of the draft's cache: one slot per target slot, never shared, no snapshots
        self.kv = KVManager(self.runner, target.n_seq_max, prompt_cache=PromptCache(0, dict))
        #: what the draft's own decodes cost: a guess is a one-token step, catching up a batch
        self.cost = StepCost()
        self._batch = self.runner.new_batch(512)

    def propose(self, seq: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens the draft model expects after `tokens` (the target slot's whole
        sequence), stopping early at an unsure one."""
        index = self.follow(seq, tokens)
        out: list[int] = []
        while True:
            logits = self.runner.logits(index)
            best = int(logits.argmax())
            # the probability of the best token: 1 / sum(exp(l - max))
            if 1.0 / np.exp(logits - logits[best]).sum() < MIN_CONFIDENCE:
                break
            out.append(best)
            if len(out) == k:
                break
            index = self._decode(self.kv.slots[seq], [best])
        return out

    def behind(self, seq: int, tokens: list[int]) -> int:
        """How many tokens the sequence must decode before it can guess what follows `tokens`."""
        return len(tokens) - self._shared(seq, tokens)

    def follow(self, seq: int, tokens: list[int]) -> int:
        """Make the sequence hold `tokens`; returns the batch index of the last one's logits.
        The last token is always decoded again if need be: its logits are what guesses next."""
        slot = self.kv.slots[seq]
        # memory that refuses partial removal (recurrent) is cleared whole: the rest is decoded
        kept = self.kv.truncate(slot, self._shared(seq, tokens))
        return self._decode(slot, tokens[kept:])

    def drop(self, seq: int, a: int, b: int) -> None:
        """The target dropped positions [a, b) of this sequence and shifted the rest back: do the
        same, or forget what follows a where this memory cannot shift or the sequence never held
        b tokens (it is recomputed lazily)."""
        slot = self.kv.slots[seq]
        if not self.kv.drop(slot, a, b):
            self.kv.truncate(slot, a)

    def problems(self) -> list[str]:
        """Every way the draft's mirrors disagree with its llama.cpp cells."""
        return [f"draft {problem}" for problem in self.kv.check()]

    def close(self) -> None:
        self._batch.close()
        self.runner.close()

    # ------------------------------------------------------------------ following the target
    def _shared(self, seq: int, tokens: list[int]) -> int:
        """The prefix of `tokens` the sequence holds, short of the last token."""
        return common_prefix(self.kv.slots[seq].tokens, tokens[:-1])

    def _decode(self, slot: Slot, tokens: list[int]) -> int:
        """Decode tokens after the slot's cells, in batches; returns the last one's logits index."""
        be, batch = self.runner, self._batch
        idx = -1
        for i in range(0, len(tokens), batch.capacity):
            batch.clear()
            chunk = tokens[i : i + batch.capacity]
            pos = len(slot.tokens)
            for j, tok in enumerate(chunk):
                idx = batch.add(tok, pos + j, slot.seq, i + j == len(tokens) - 1)
            started = time.perf_counter()
            try:
                be.decode(batch)
            except Exception:
                # what the failed decode left is unknown: the sequence starts afresh next time
                self.kv.clear(slot)
                raise
            self.cost.observe(batch.n, time.perf_counter() - started)
            self.kv.extend(slot, chunk)
        return idx
