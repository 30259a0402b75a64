"""Per-request timing: turns timestamps into the RequestMetrics every front end reports."""

from __future__ import annotations

import math
import time

from edgechat.engine.types.request import RequestMetrics


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


class RequestClock:
    def __init__(self) -> None:
        self.submitted = time.perf_counter()
        self.admitted = 0.0
        self.first_token = 0.0
        self.last_token = 0.0
        self.tokenize = 0.0
        self.gaps: list[float] = []

    def token(self) -> None:
        now = time.perf_counter()
        if not self.first_token:
            self.first_token = now
        else:
            self.gaps.append(now - self.last_token)
        self.last_token = now

    def build(self, prompt_tokens: int, cached: int, completion: int, context_tokens: int, context_size: int) -> RequestMetrics:
        end = time.perf_counter()
        gaps = sorted(self.gaps)
        first = self.first_token or end
        admitted = self.admitted or end
        return RequestMetrics(
            queue_wait=admitted - self.submitted,
            tokenize=self.tokenize,
            prefill=first - admitted,
            ttft=first - self.submitted,
            tpot_mean=sum(gaps) / len(gaps) if gaps else 0.0,
            tpot_p50=percentile(gaps, 50),
            tpot_p95=percentile(gaps, 95),
            decode=(self.last_token - self.first_token) if self.first_token else 0.0,
            total=end - self.submitted,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            completion_tokens=completion,
            context_tokens=context_tokens,
            context_size=context_size,
        )
