"""What the KV manager and the prompt cache both compare and keep: a token prefix shared by two
sequences (`common_prefix`) and the logits kept after one (`NextLogits`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in blocks first: long shared histories are the common case
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class NextLogits:
    """The model's logits for the token after a sequence's first n tokens, kept from the decode
    that computed them: a prompt the cache already holds whole (sent again: a retry, a
    regenerate, the n choices of one request) then needs no decode before its first token.
    llama.cpp keeps only the last batch's logits, and its state holds none."""

    n: int
    values: np.ndarray  # read-only, shared by the slots and prompt cache entries that keep it
