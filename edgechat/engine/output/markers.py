"""Text that may still become a marker: the one helper the output processor (stop strings), the
reasoning splitter (thinking tags) and the tool-call parser (openers) hold text back with."""

from __future__ import annotations


def marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what must be
    held back because it may still become the marker (a stop string, a thinking or tool-call tag)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
