"""`keep_alive`: how long a model stays loaded after a request, as Ollama's API takes it (a
number of seconds, or a duration such as "30s", "5m", "1h30m"; 0 unloads it after the answer, a
negative value keeps it until the room is needed). The OpenAI endpoints take it as an extension."""

from __future__ import annotations

import math
import re

from edgechat.engine.pool import KEEP_FOREVER
from edgechat.server.errors import bad_request

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ms|s|m|h)")


def keep_alive_seconds(value) -> float | None:
    """Seconds to keep the model loaded once idle (KEEP_FOREVER: no limit); None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _invalid(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise _invalid(value) from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise _invalid(value)
    return KEEP_FOREVER if seconds < 0 else seconds


def _invalid(value):
    return bad_request(f"'keep_alive' must be seconds or a duration such as \"5m\" (negative: keep loaded), got {str(value)[:40]!r}",
                       param="keep_alive", code="invalid_value")
