"""The output processor: token bytes in, UTF-8-safe text out, stop strings cut exactly.

Every front end gets its text through here, so a character split across tokens (Chinese, emoji)
is never emitted half-done, and text that could still turn into a stop string is held back.
"""

from __future__ import annotations

import codecs


class OutputProcessor:
    def __init__(self, stop: list[str] | None = None):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in (stop or []) if s]
        self._held = ""  # decoded text not yet emitted: it may be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found

    def feed(self, data: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(data)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: flush what was held (an incomplete UTF-8 tail becomes U+FFFD)."""
        if not self.stopped:
            self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        held = self._held
        if not held:
            return ""
        cut = -1
        for stop in self._stops:
            i = held.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            out, self._held, self.stopped = held[:cut], "", True
        elif final:
            out, self._held = held, ""
        else:
            keep = self._partial_stop_len(held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
        return out

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
