"""Named presets: a system prompt, sampling, a model and the thinking setting, applied to a
conversation at once. A few are shipped; `[presets.NAME]` in config.toml adds or replaces them."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgechat.config import Paths, load_settings
from edgechat.errors import UsageError
from edgechat.tui.config import CHAT_DEFAULTS, validate_settings

#: what a preset may set besides conversation settings
_OWN_KEYS = ("description", "model")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str = ""
    #: conversation settings it sets (CHAT_DEFAULTS keys); the others stay as they are
    settings: dict = field(default_factory=dict)
    #: a model to load with it (a name or path, as /model takes); None keeps the current one
    model: str | None = None

    def apply(self, settings: dict) -> dict:
        """`settings` with this preset's on top, checked."""
        return validate_settings({**settings, **self.settings})


SHIPPED: dict[str, dict] = {
    "concise": {
        "description": "short, direct answers",
        "system_prompt": "Answer in as few words as the question allows. No preamble, no summary at the end. "
        "If you do not know, say so in one sentence.",
        "temperature": 0.3,
        "top_p": 0.9,
        "thinking": "off",
    },
    "code": {
        "description": "code helper: code first, brief why",
        "system_prompt": "You are a careful programming assistant. Give working code in fenced blocks with "
        "the language named, then at most three sentences on why. Point out bugs and edge cases you notice. "
        "Ask when the question is ambiguous instead of guessing.",
        "temperature": 0.2,
        "top_p": 0.95,
    },
    "translator": {
        "description": "translate into English (or the language asked for)",
        "system_prompt": "You are a translator. Translate the user's text into English, or into the language "
        "they name. Keep meaning, tone and formatting. Reply with the translation only.",
        "temperature": 0.1,
        "top_p": 0.9,
        "thinking": "off",
    },
}


def load_presets(paths: Paths) -> dict[str, Preset]:
    """The shipped presets and config.toml's, by name (config.toml's win); a bad table is a
    one-line UsageError naming it."""
    tables = dict(SHIPPED)
    user = load_settings(paths).get("presets") or {}
    if not isinstance(user, dict):
        raise UsageError(f"{paths.config_file}: presets must be tables, [presets.NAME]")
    tables.update(user)
    return {name: _preset(name, table, paths) for name, table in tables.items()}


def _preset(name: str, table, paths: Paths) -> Preset:
    where = f"{paths.config_file}: [presets.{name}]"
    if not isinstance(table, dict):
        raise UsageError(f"{where} must be a table of settings")
    unknown = sorted(set(table) - set(CHAT_DEFAULTS) - set(_OWN_KEYS))
    if unknown:
        known = ", ".join([*_OWN_KEYS, *CHAT_DEFAULTS])
        raise UsageError(f"{where}: unknown {', '.join(unknown)}; a preset takes {known}")
    settings = {k: v for k, v in table.items() if k in CHAT_DEFAULTS}
    try:
        checked = validate_settings({**CHAT_DEFAULTS, **settings})
    except UsageError as exc:
        raise UsageError(f"{where}: {exc}") from None
    model = table.get("model")
    return Preset(
        name,
        str(table.get("description") or ""),
        {k: checked[k] for k in settings},
        str(model) if model else None,
    )


def find_preset(presets: dict[str, Preset], name: str) -> Preset:
    """The preset called `name` (any case); UsageError listing the ones there are."""
    found = presets.get(name) or next((p for n, p in presets.items() if n.lower() == name.lower()), None)
    if found is None:
        raise UsageError(f"No preset {name!r}; presets: {', '.join(sorted(presets))} (add one as [presets.NAME] "
                         "in config.toml)")
    return found
