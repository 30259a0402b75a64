"""A running server's /metrics read back: each histogram's count and quantiles (p50, p95, p99)
per model, estimated as Prometheus's histogram_quantile does, by linear interpolation inside
the bucket the rank falls in (the last finite bound where it falls past them all)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

QUANTILES = (0.5, 0.95, 0.99)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile from cumulative (upper bound, count) pairs sorted by bound; None if empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def histograms(text: str) -> dict[str, dict[str, tuple[int, list[float | None]]]]:
    """{histogram name: {model: (count, [p50, p95, p99])}}, the priority classes added together."""
    out: dict[str, dict[str, tuple[int, list[float | None]]]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        per_model: dict[str, dict[float, float]] = {}
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                model = sample.labels.get("model", "")
                bound = float(sample.labels["le"])
                cum = per_model.setdefault(model, {})
                cum[bound] = cum.get(bound, 0.0) + sample.value
        out[family.name] = {}
        for model, cum in per_model.items():
            buckets = sorted(cum.items())
            out[family.name][model] = (int(buckets[-1][1]) if buckets else 0, [quantile(q, buckets) for q in QUANTILES])
    return out
