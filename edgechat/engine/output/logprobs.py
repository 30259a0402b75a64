"""Log probabilities of sampled tokens, from a row of logits (for requests that ask for them)."""

from __future__ import annotations

import numpy as np


def token_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The log probability of `token` under `logits` (a log-softmax), and the n most likely
    tokens with theirs, most likely first."""
    top = logits.max()
    log_z = float(top + np.log(np.exp(logits - top).sum(dtype=np.float64)))
    best: list[int] | np.ndarray = np.argpartition(logits, -n)[-n:] if n else []
    alts = sorted(((int(t), float(logits[t]) - log_z) for t in best), key=lambda x: -x[1])
    return float(logits[token]) - log_z, alts
