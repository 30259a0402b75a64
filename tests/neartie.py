"""Comparing two greedy answers of the real model: llama.cpp's numerics depend on batch shape (a
batch of several sequences, a verification batch, cells computed in another slot), so two runs may
part where the model's top logits nearly tie. Equal, or parted at a near-tie: anything else fails."""

from __future__ import annotations

import math

from edgechat.engine import ChatRequest

#: how far below the top logit either diverging token may be
NEAR_TIE = 0.5
#: the same where the model is unsure (its top token holds under FLAT of the top ten's mass): there,
#: batch shapes moved Gemma 3's top logits by up to 0.71 against each other (measured, a base model
#: rambling after the text it was asked to repeat; 0.72 at a share of 0.31 with weights in plain
#: buffers, as on AMX CPUs), and which draft lengths a run picks, and so its batch shapes, depends
#: on the step times it measured
FLAT_NEAR_TIE = 1.0
FLAT = 0.35


def assert_same_or_near_tie(engine, messages: list[dict], expected: list[int], got: list[int]) -> None:
    if got != expected:
        assert_same_tokens_or_near_tie(engine, engine.prompt_tokens(ChatRequest(messages=messages)), expected, got)


def assert_same_tokens_or_near_tie(engine, prompt: list[int], expected: list[int], got: list[int]) -> None:
    """The same, after a prompt given as tokens (the top logits are computed cold after it)."""
    if got == expected:
        return
    i = next(i for i, (a, b) in enumerate(zip(expected + [-1], got + [-1], strict=False)) if a != b)
    top = dict(engine.top_logits(prompt + expected[:i], 10))
    best = max(top.values())
    chosen = [t for t in ((expected + [-1])[i], (got + [-1])[i]) if t != -1]
    gaps = [best - top[t] if t in top else float("inf") for t in chosen]
    share = 1 / sum(math.exp(v - best) for v in top.values())  # the top token's share of the top ten
    margin = FLAT_NEAR_TIE if share < FLAT else NEAR_TIE
    print(f"divergence at token {i}: {chosen} trail the top logit {best:.3f} (share {share:.2f}) by {gaps}")
    assert max(gaps) < margin, (gaps, share, engine.detokenize(expected), engine.detokenize(got))
