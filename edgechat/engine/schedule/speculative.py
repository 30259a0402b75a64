"""Speculative decoding: guess the next tokens of a sequence cheaply, verify them in one pass.

A drafter proposes up to k tokens for a sequence; the speculator (speculator.py) puts them into
the step's llama_decode after the sequence's next token, the scheduler samples at each position
with the sequence's own sampler chain, and keeps the drafted tokens while they equal what was
sampled. What the model says is unchanged (greedy or sampled); only the number of passes drops.

Verification is not free on a CPU: a batch of 1 + k tokens costs more than one token. `StepCost`
measures that cost on this machine as the engine runs, and `DraftPolicy` drafts only as many
tokens as the sequence's recent acceptance makes worth it, backing off when nothing is accepted.
"""

from __future__ import annotations

import statistics
from collections import deque

from edgechat.engine.kv.kvcache import is_sentinel

#: the most tokens drafted for one sequence in one step (llama.cpp's default too): on a long
#: quote, Gemma 3 gained 2.2x with 16 against 1.9x with 8; the policy keeps SmolLM2's drafts short
MAX_DRAFT = 16
#: how much faster a draft must be expected to make the step for any to be tried
START_GAIN = 1.1
#: n-gram lengths matched, longest first: a longer match predicts its continuation better
NGRAM_SIZES = (4, 3, 2)


class NgramDrafter:
    """Prompt lookup: the longest recent n-gram of the sequence's own tokens (prompt, earlier
    turns, the answer so far) that occurred before proposes what followed it then. Pays on
    grounded work: rewriting a pasted text, editing code, quoting a document or a tool's output."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        #: n-gram -> the position right after its latest earlier occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq, index = self.tokens, self._next
        for tok in tokens:
            seq.append(tok)
            end = len(seq) - 1  # the new token's position: what followed each n-gram ending before it
            for n in NGRAM_SIZES:
                if end >= n:
                    index[tuple(seq[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        seq = self.tokens
        for n in NGRAM_SIZES:
            if len(seq) <= n:
                continue
            at = self._next.get(tuple(seq[-n:]))
            if at is not None:
                guess = seq[at : at + k]
                # an image's cells are never a token to guess
                return next((guess[:i] for i, t in enumerate(guess) if is_sentinel(t)), guess)
        return []


class StepCost:
    """Seconds one llama_decode takes for a batch of n tokens, measured as the engine runs: the
    median of each size's recent steps, once it has TRUSTED of them; other sizes are
    interpolated, with a prior that a token more costs 25% of a one-token step.

    A median, not a mean: one step stalled by another process (a phone's background task, a
    test run next door took a step 100x its usual time here) would otherwise make its size look
    too dear to draft, and a size never drafted is never measured again, so speculation stayed
    off for good.

    Only batches the size of decode steps are kept: a prefill chunk is compute-bound and says
    nothing of what a few more tokens cost a memory-bound decode step. Measured here (2 cores):
    SmolLM2-135M pays ~45-70% of a one-token step per extra token (compute-bound on 2 cores),
    Gemma 3 270M ~50% (its 262k-entry output layer runs once per token that needs logits), so
    guessing pays only when the guesses are mostly right, and the prior is optimistic on
    purpose: a size is tried, then known."""

    PRIOR = 0.25
    #: recent steps kept per size, and how many make a size's median trusted
    WINDOW = 9
    TRUSTED = 3
    #: the largest batch whose cost is tracked (decoding sequences plus their drafts)
    MAX_TRACKED = 64

    def __init__(self) -> None:
        self._steps: dict[int, deque[float]] = {}
        self._seconds: dict[int, float] = {}  # the median of each trusted size

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > self.MAX_TRACKED:
            return
        steps = self._steps.setdefault(n_tokens, deque(maxlen=self.WINDOW))
        steps.append(seconds)
        if len(steps) >= self.TRUSTED:
            self._seconds[n_tokens] = statistics.median(steps)

    def ratio(self, base: int, extra: int) -> float:
        """How much longer a step of base + extra tokens takes than one of base tokens."""
        if extra <= 0:
            return 1.0
        b, w = self._estimate(base), self._estimate(base + extra)
        if b is None or w is None:
            return 1.0 + self.PRIOR * extra
        return max(w / b, 1.0)

    def seconds(self, n: int) -> float | None:
        """The estimated time of a step of n tokens, None until some size is trusted."""
        return self._estimate(n)

    def _estimate(self, n: int) -> float | None:
        known = self._seconds
        if n in known:
            return known[n]
        lower = max((m for m in known if m < n), default=None)
        upper = min((m for m in known if m > n), default=None)
        if lower is not None and upper is not None:
            f = (n - lower) / (upper - lower)
            return known[lower] + f * (known[upper] - known[lower])
        near = lower if lower is not None else upper
        if near is None:
            return None
        # scale the nearest measured size by the prior's cost curve, 1 + PRIOR * (tokens - 1)
        return known[near] * (1 + self.PRIOR * (n - 1)) / (1 + self.PRIOR * (near - 1))


class DraftPolicy:
    """How many tokens to draft for one sequence: the k that maximizes expected tokens per unit
    of step cost, given how this sequence's drafts have fared.

    Two rates, not one: a lookup's guess is either the passage the answer is copying, and then
    its tokens keep coming right, or not, and then its first is wrong. So `first` is how often a
    draft's first token is kept, and `follow` how often a drafted token is kept when the one
    before it was. One rate of kept over drafted read 7 kept of 16 as 0.44 and cut the next
    draft to 2 where the copy went on. Replayed on recorded answers of both models with a token
    more costing 0.2-0.5 of a step, the two rates gained 0-6% over the one."""

    ALPHA = 0.3  # per draft, for `first`
    FOLLOW_ALPHA = 0.1  # per token after a kept one, for `follow`: many more of those
    #: tokens drafted by a probe: when drafting does not look worth it, a short guess now and
    #: then tells whether the text has become predictable (a quote, a repeated block)
    PROBE = 2
    MAX_PROBE_INTERVAL = 64

    def __init__(self, forced: bool = False):
        #: draft at every step whatever the acceptance (a mode the user chose), as much as pays
        #: if every guess is kept
        self.forced = forced
        # optimistic starts: a guess offered at all was usually right (the first token of 124 of
        # 145 lookup proposals on the bench's recorded answers), and an answer copying a passage
        # is short enough that a slow start costs much of the gain (measured against 0.5 and
        # 0.8: Gemma 3 1.93 vs 1.76 on a rewrite, SmolLM2 open chat 1.14 vs 1.03)
        self.first = 0.7
        self.follow = 0.9
        self.cooldown = 0  # steps to skip drafting after misses
        self._backoff = 1
        self._probe_every = 4
        self._since_probe = 0
        self.drafted = 0
        self.accepted = 0

    def length(self, cost: StepCost, batch: int, sequences: int, available: int, draft_cost: float = 0.0,
               setup: float = 0.0) -> int:
        """Tokens to draft now, 0 for none. `batch` is the step's width so far, `sequences` how
        many sequences it decodes (each emits a token), `available` what the drafter offers,
        `draft_cost` what guessing one token costs the drafter and `setup` what it must do
        before any guess (a draft model catching up), both in steps of `batch` tokens.

        Every sequence in the step waits for the wider batch, so a draft is scored over the
        whole step: (sequences + expected kept) / sequences per unit of step cost. Alone, that
        is (1 + expected) / cost; in a busy server's wide batch it is rarely worth it."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        limit = min(available, MAX_DRAFT)
        if limit == 0:
            return 0  # nothing offered is no reason to count towards a probe

        def step_cost(k: int) -> float:  # of a step with k drafted tokens, in steps without
            return cost.ratio(batch, k) + draft_cost * k + setup

        if self.forced:
            # always a draft, of the length that pays best if every guess is kept: the cost is
            # not smooth in the batch size on the CPU's kernels (Gemma 3: 16 tokens cost 5.7
            # one-token steps, 15 cost 6.6 and 17 cost 7.1), so up to 16 is not always 16
            return max(range(1, limit + 1), key=lambda k: ((1 + k) / step_cost(k), k))
        best_k, best_gain = 0, 1.0
        expected, kept = 0.0, self.first
        for k in range(1, limit + 1):
            expected += kept  # the k-th drafted token is kept only if all before it were
            kept *= self.follow
            gain = (sequences + expected) / sequences / step_cost(k)
            # a draft at all must be expected to gain a tenth: the rates are estimates, optimistic
            # at a request's start, and a 7% hope lost on SmolLM2's code and open chat (0.91-0.96x
            # of plain; 0.98-1.03x with the tenth, Gemma 3 no worse); a longer one, 2% more
            if gain > best_gain * (1.02 if best_k else START_GAIN):
                best_k, best_gain = k, gain
        if best_k:
            self._probe_every = 4
            return best_k
        self._since_probe += 1
        if self._since_probe < self._probe_every:
            return 0
        k = min(self.PROBE, limit)
        if (sequences + k) / sequences / step_cost(k) < START_GAIN:
            # not even the probe kept whole would gain a tenth (a draft model as slow as the model
            # or far behind it; a wide batch, where every sequence waits for the probe's tokens)
            return 0
        # a probe; if it misses too, the next one waits twice as long
        self._since_probe = 0
        self._probe_every = min(self._probe_every * 2, self.MAX_PROBE_INTERVAL)
        return k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.first += self.ALPHA * ((accepted > 0) - self.first)
        if accepted > 0:
            # accepted - 1 tokens kept after a kept one, then one missed unless all were kept
            self.follow = 1 - (1 - self.follow) * (1 - self.FOLLOW_ALPHA) ** (accepted - 1)
            if accepted < drafted:
                self.follow *= 1 - self.FOLLOW_ALPHA
        if accepted == 0:
            # a miss: wait a little before the next guess, longer after each miss in a row
            self.cooldown = self._backoff
            self._backoff = min(self._backoff * 2, 32)
        else:
            self._backoff = 1


class Guesses:
    """One sequence's speculation: its n-gram drafter and policy (`lookup`), the draft model's
    policy (`model`), and this step's draft, from whom, with the batch indices of the logits
    that verify it (the sequence's next token's first)."""

    def __init__(self, lookup: NgramDrafter | None, lookup_policy: DraftPolicy | None, model: DraftPolicy | None):
        self.drafter = lookup
        self.lookup = lookup_policy
        self.model = model
        self.by: DraftPolicy | None = None
        self.draft: list[int] = []
        self.indices: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        """Tokens went into the sequence: the lookup reads them."""
        if self.drafter is not None:
            self.drafter.extend(tokens)

    def settle(self, accepted: int) -> None:
        """This step's draft was verified: its policy learns how it fared."""
        assert self.by is not None
        self.by.update(len(self.draft), accepted)
        self.draft, self.indices, self.by = [], [], None

    @property
    def counts(self) -> tuple[int, int]:
        """Tokens drafted and accepted over the answer, by both drafters."""
        policies = [p for p in (self.lookup, self.model) if p is not None]
        return sum(p.drafted for p in policies), sum(p.accepted for p in policies)
