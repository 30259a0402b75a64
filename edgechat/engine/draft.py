"""A draft model: a smaller model of the same vocabulary that guesses the target's next tokens.

It runs in its own llama.cpp context on the engine thread, one sequence per target slot. Each
sequence follows the target's lazily: before guessing, it keeps the longest prefix it shares
with the target slot's tokens, removes the rest (`llama_memory_seq_rm`) and decodes what it
lacks, so prefix reuse, truncation, rejected drafts, snapshot restores and a slot changing hands
all come out right without being told; an eviction shift is applied to both, so a long chat
does not recompute the draft's whole context after each one.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import llama_cpp as L
import numpy as np

from edgechat.engine.kvcache import common_prefix
from edgechat.engine.llama import Batch, LlamaBackend
from edgechat.engine.speculative import StepCost
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
    t_type, d_type = L.llama_vocab_type(target.vocab), L.llama_vocab_type(draft.vocab)
    if t_type != d_type:
        raise DraftVocabError(f"draft model {name} uses another kind of tokenizer (type {d_type}, the model's is {t_type}); pick a draft of the same family")
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_SIZE_MARGIN:
        raise DraftVocabError(
            f"draft model {name} has {draft.n_vocab} tokens, the model {target.n_vocab}; pick a draft of the same family"
        )
    for what, fn in (("BOS", L.llama_vocab_bos), ("EOS", L.llama_vocab_eos), ("EOT", L.llama_vocab_eot)):
        if fn(target.vocab) != fn(draft.vocab):
            raise DraftVocabError(f"draft model {name} has another {what} token; pick a draft of the same family")
    if target.add_bos != draft.add_bos:
        raise DraftVocabError(f"draft model {name} adds a BOS token differently; pick a draft of the same family")
    for token in range(min(target.n_vocab, draft.n_vocab)):
        if L.llama_vocab_get_text(target.vocab, token) != L.llama_vocab_get_text(draft.vocab, token):
            raise DraftVocabError(
                f"draft model {name}: token {token} is {draft.token_text(token)!r}, the model's is "
                f"{target.token_text(token)!r}; pick a draft of the same family"
            )


class DraftModel:
    def __init__(self, path: Path, target: LlamaBackend, n_ctx: int, n_threads: int, flash_attn: str = "auto"):
        self.backend = LlamaBackend(
            path,
            n_ctx_total=n_ctx * target.n_seq_max,
            n_seq_max=target.n_seq_max,
            n_threads=n_threads,
            n_batch=512,
            flash_attn=flash_attn,
        )
        try:
            check_vocab(target, self.backend)
        except Exception:
            self.backend.close()
            raise
        self.path = Path(path)
        #: per sequence, the tokens its cells hold, as for the target's slots
        self.tokens: list[list[int]] = [[] for _ in range(target.n_seq_max)]
        #: what the draft's own decodes cost: a guess is a one-token step, catching up a batch
        self.cost = StepCost()
        self._batch = Batch(512, target.n_seq_max)

    def propose(self, seq: int, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens the draft model expects after `tokens` (the target slot's whole
        sequence), stopping early at an unsure one."""
        index = self.follow(seq, tokens)
        mirror = self.tokens[seq]
        out: list[int] = []
        while True:
            logits = self.backend.logits(index)
            best = int(logits.argmax())
            # the probability of the best token: 1 / sum(exp(l - max))
            if 1.0 / np.exp(logits - logits[best]).sum() < MIN_CONFIDENCE:
                break
            out.append(best)
            if len(out) == k:
                break
            index = self._decode(seq, [best], len(mirror), logits_last=True)
        return out

    def behind(self, seq: int, tokens: list[int]) -> int:
        """How many tokens the sequence must decode before it can guess what follows `tokens`."""
        return len(tokens) - self._shared(seq, tokens)

    def follow(self, seq: int, tokens: list[int]) -> int:
        """Make the sequence hold `tokens`; returns the batch index of the last one's logits.
        The last token is always decoded again if need be: its logits are what guesses next."""
        same = self._shared(seq, tokens)
        self._truncate(seq, same)
        return self._decode(seq, tokens[same:], same, logits_last=True)

    def drop(self, seq: int, a: int, b: int) -> None:
        """The target dropped positions [a, b) of this sequence and shifted the rest back: do the
        same, or forget what follows a where this memory cannot shift (it is recomputed lazily)."""
        be, mirror = self.backend, self.tokens[seq]
        if b > len(mirror):
            self._truncate(seq, min(a, len(mirror)))
            return
        if be.can_shift and be.seq_rm(seq, a, b):
            be.seq_add(seq, b, -1, -(b - a))
            del mirror[a:b]
        else:
            self._truncate(seq, a)

    def problems(self) -> list[str]:
        """Every way the draft's mirrors disagree with its llama.cpp cells."""
        out = []
        for seq, mirror in enumerate(self.tokens):
            if self.backend.seq_cell_positions(seq) != list(range(len(mirror))):
                out.append(f"draft seq {seq}: cells do not sit at positions 0..{len(mirror) - 1}")
        return out

    def close(self) -> None:
        self._batch.close()
        self.backend.close()

    # ------------------------------------------------------------------ following the target
    def _shared(self, seq: int, tokens: list[int]) -> int:
        """The prefix of `tokens` the sequence holds, short of the last token."""
        return common_prefix(self.tokens[seq], tokens[:-1])

    def _truncate(self, seq: int, n: int) -> None:
        mirror = self.tokens[seq]
        if n >= len(mirror):
            return
        if not self.backend.seq_rm(seq, n, -1):
            # memory that refuses partial removal (recurrent): start the sequence afresh
            self.backend.seq_rm(seq, -1, -1)
            n = 0
        del mirror[n:]

    def _decode(self, seq: int, tokens: list[int], pos: int, logits_last: bool) -> int:
        be, batch, mirror = self.backend, self._batch, self.tokens[seq]
        idx = -1
        for i in range(0, len(tokens), batch.capacity):
            batch.clear()
            chunk = tokens[i : i + batch.capacity]
            for j, tok in enumerate(chunk):
                idx = batch.add(tok, pos + i + j, seq, logits_last and i + j == len(tokens) - 1)
            started = time.perf_counter()
            try:
                be.decode(batch)
            except Exception:
                # what the failed decode left is unknown: the sequence starts afresh next time
                be.seq_rm(seq, -1, -1)
                mirror.clear()
                raise
            self.cost.observe(batch.n, time.perf_counter() - started)
            mirror.extend(chunk)
        return idx
