"""The one percentile every report uses: nearest rank, the smallest value with q% at or below it."""

from edgechat.engine.types.metrics import percentile


def test_nearest_rank_percentile():
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.0  # half the values are <= 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    values = [float(i) for i in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99), percentile(values, 100)) == (50.0, 95.0, 99.0, 100.0)
