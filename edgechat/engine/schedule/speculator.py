"""The speculator: each decoding sequence's guesses for a step (the n-gram lookup's, or the draft
model's when that pays), put into the step's batch after its next token, and what the
verification kept. The scheduler samples at the drafted positions (schedule/scheduler.py)."""

from __future__ import annotations

import logging

from edgechat.engine.kv.kvcache import KVManager
from edgechat.engine.runners.runner import TokenBatch
from edgechat.engine.schedule.draft import DraftModel
from edgechat.engine.schedule.running import Phase, Running
from edgechat.engine.schedule.speculative import MAX_DRAFT, DraftPolicy, Guesses, NgramDrafter, StepCost
from edgechat.params import SpeculativeMode

log = logging.getLogger("edgechat.engine")


class Speculator:
    """Drafts for the scheduler's sequences, within what speculation is worth on this machine."""

    def __init__(self, kv: KVManager, n_ctx: int, draft: DraftModel | None, prefill_chunk: int):
        self.kv = kv
        self.n_ctx = n_ctx
        self.draft = draft
        #: what a prompt chunk adds to a busy step's width
        self.prefill_chunk = prefill_chunk
        #: what a wider batch costs on this machine, measured on every step
        self.cost = StepCost()

    def guesses(self, run: Running, mode: SpeculativeMode) -> Guesses | None:
        """A starting request's speculation in its mode; None when it never drafts."""
        lookup = lookup_policy = model = None
        if mode in (SpeculativeMode.AUTO, SpeculativeMode.LOOKUP):
            lookup = NgramDrafter(run.prep.tokens)
            lookup_policy = DraftPolicy(forced=mode is SpeculativeMode.LOOKUP)
        # the draft model reads token ids only: a sequence holding an image gets no guesses from it
        if self.draft is not None and mode in (SpeculativeMode.AUTO, SpeculativeMode.DRAFT) and not run.prep.media:
            model = DraftPolicy(forced=mode is SpeculativeMode.DRAFT)
        if lookup_policy is None and model is None:
            return None
        return Guesses(lookup, lookup_policy, model)

    def add_drafts(self, batch: TokenBatch, decoding: list[Running], active: list[Running]) -> None:
        """Put drafted tokens after each decoding sequence's next token, with logits at each."""
        width = len(decoding) + sum(min(len(r.pending), self.prefill_chunk) for r in active if r.phase is Phase.PREFILLING)
        for run in decoding:
            guesses = run.guesses
            if guesses is None or not self.kv.can_rewind:
                continue
            assert run.slot is not None
            slot = run.slot
            room = min(self.n_ctx - len(slot.tokens), batch.free, MAX_DRAFT)
            if run.request.max_tokens is not None:
                # what this step can emit is the drafted tokens plus one
                room = min(room, run.request.max_tokens - run.answer.n_out - 1)
            if room <= 0:
                continue
            guesses.draft = self._guess(run, guesses, room, width, len(decoding))
            if not guesses.draft:
                continue
            base = slot.next_pos
            guesses.indices = [run.out_index] + [batch.add(tok, base + i, slot.seq, True) for i, tok in enumerate(guesses.draft)]
            self.kv.extend(slot, guesses.draft)
            width += len(guesses.draft)

    def _guess(self, run: Running, guesses: Guesses, room: int, width: int, sequences: int) -> list[int]:
        """This step's draft for one sequence: the n-gram lookup's when it has one worth
        trying (it costs nothing to make), else the draft model's when that pays."""
        assert run.slot is not None
        if guesses.lookup is not None:
            assert guesses.drafter is not None  # made with its policy
            guess = guesses.drafter.propose(room)
            k = guesses.lookup.length(self.cost, width, sequences, len(guess))
            if k > 0:
                guesses.by = guesses.lookup
                return guess[:k]
        if guesses.model is not None and self.draft is not None:
            k = guesses.model.length(self.cost, width, sequences, room, *self._draft_cost(run, width))
            if k > 0:
                try:
                    guess = self.draft.propose(run.slot.seq, run.slot.tokens, k)
                except Exception:  # the draft is an aid: its failure costs a guess, never the answer
                    log.exception("the draft model failed to guess")
                    return []
                guesses.by = guesses.model
                return guess
        return []

    def prompt_read(self, run: Running) -> None:
        """The prompt is in the cache and its first token about to be chosen. The draft model
        reads the prompt now, with the model, so its first guess does not wait for it: the
        prompt's cost goes to the time to first token, as a prefill's does."""
        assert run.slot is not None
        if run.guesses is None or run.guesses.model is None or self.draft is None:
            return
        try:
            self.draft.follow(run.slot.seq, run.slot.tokens)
        except Exception:  # the draft is an aid: its failure costs a guess, never the answer
            log.exception("the draft model failed to read the prompt")

    def _draft_cost(self, run: Running, width: int) -> tuple[float, float]:
        """What the draft model takes to guess one token, and to catch up with the tokens this
        sequence gained since its last guess, in steps of `width` tokens: measured once both
        have run, until then a guess that a token is a third of the model's step. The catch-up
        counts beyond the one token any guess decodes: after a pause it decodes every token of
        the pause, which cost a probe of 2 tokens 20 steps of SmolLM2."""
        assert run.slot is not None and self.draft is not None
        step, guess = self.cost.seconds(width), self.draft.cost.seconds(1)
        behind = self.draft.behind(run.slot.seq, run.slot.tokens)
        if step is None or guess is None:
            return 1 / 3, (behind - 1) / 3
        return guess / step, max((self.draft.cost.seconds(behind) or guess) - guess, 0.0) / step
