"""The app's part of config.toml: default conversation settings ([chat]), the app's own settings
([tui]: theme, model, idle_unload) and the MCP servers whose tools conversations may use
([mcp.servers.NAME])."""

from __future__ import annotations

from dataclasses import dataclass, field

import tomli_w

from edgechat.config import Paths, load_settings
from edgechat.engine.types.request import DEFAULT_MAX_TOKENS, ChatRequest
from edgechat.errors import UsageError
from edgechat.fsutil import atomic_write_text
from edgechat.params import SAMPLING_LIMITS, ContextPolicy, SamplingParams, SpeculativeMode, choice
from edgechat.store.history import with_system_prompt
from edgechat.tui.mcp import ServerConfig, parse_servers

#: the sampler settings a conversation keeps (SamplingParams fields), in the order the settings show them
SAMPLING_SETTINGS = tuple(name for name in SAMPLING_LIMITS if name != "penalty_last_n")

#: the per-conversation settings and their defaults (overridden by [chat] in config.toml)
CHAT_DEFAULTS: dict = {
    "system_prompt": "",
    **{name: getattr(SamplingParams(), name) for name in SAMPLING_SETTINGS},
    "max_tokens": DEFAULT_MAX_TOKENS,
    "seed": None,
    "context_policy": ContextPolicy.SHIFT.value,
    "speculative": SpeculativeMode.AUTO.value,
    "loop_guard": True,
    #: a reasoning model's thoughts: "on" (no limit), "off", or at most N tokens
    "thinking": "on",
}


#: seconds a local model switched away from stays loaded ([tui] idle_unload; the model in use never leaves)
DEFAULT_IDLE_UNLOAD = 600.0


@dataclass
class AppConfig:
    chat: dict = field(default_factory=lambda: dict(CHAT_DEFAULTS))
    theme: str | None = None
    model: str | None = None
    #: None: models switched away from stay loaded until another needs the memory
    idle_unload: float | None = DEFAULT_IDLE_UNLOAD
    mcp_servers: dict[str, ServerConfig] = field(default_factory=dict)
    #: answers read aloud as they stream ([tui] speak; /speak)
    speak: bool = False


def load_config(paths: Paths) -> AppConfig:
    raw = load_settings(paths)
    chat = dict(CHAT_DEFAULTS)
    chat.update({k: v for k, v in (raw.get("chat") or {}).items() if k in CHAT_DEFAULTS})
    try:
        chat = validate_settings(chat)
    except UsageError as exc:
        # a value the settings dialog could not even show: say where it is, before the app starts
        raise UsageError(f"{paths.config_file}: [chat] {exc}; fix or remove that line") from None
    tui = raw.get("tui") or {}
    try:
        servers = parse_servers((raw.get("mcp") or {}).get("servers"))
    except UsageError as exc:
        raise UsageError(f"{paths.config_file}: {exc}") from None
    idle = _idle_unload(tui.get("idle_unload", DEFAULT_IDLE_UNLOAD), paths)
    return AppConfig(chat=chat, theme=tui.get("theme"), model=tui.get("model"), idle_unload=idle, mcp_servers=servers,
                     speak=tui.get("speak") is True)


def _idle_unload(value, paths: Paths) -> float | None:
    """[tui] idle_unload: seconds (0: as soon as another model is in use), or false for never."""
    if value is False:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise UsageError(f"{paths.config_file}: [tui] idle_unload must be a number of seconds (0 or more) or false, not {value!r}")
    return float(value)


def save_tui_setting(paths: Paths, key: str, value: str | bool) -> None:
    """Set [tui] key = value in config.toml, keeping everything else in the file, atomically."""
    raw = load_settings(paths)
    raw.setdefault("tui", {})[key] = value
    atomic_write_text(paths.config_file, tomli_w.dumps(raw))


def validate_settings(settings: dict) -> dict:
    """Check user-entered conversation settings; returns them normalised, raises UsageError."""
    out = dict(settings)
    for name in SAMPLING_SETTINGS:
        out[name] = _sampling_setting(name, out.get(name))
    try:
        mt = out.get("max_tokens")
        out["max_tokens"] = int(mt) if mt not in (None, "") else None
        seed = out.get("seed")
        out["seed"] = int(seed) if seed not in (None, "") else None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"not a number: {exc}") from None
    if out["max_tokens"] is not None and out["max_tokens"] < 1:
        raise UsageError("max tokens must be at least 1")
    out["context_policy"] = choice(ContextPolicy, out.get("context_policy") or ContextPolicy.SHIFT, "context policy").value
    out["speculative"] = choice(SpeculativeMode, out.get("speculative") or SpeculativeMode.AUTO, "speculative decoding").value
    guard = out.get("loop_guard", True)
    if not isinstance(guard, bool):
        raise UsageError("loop_guard must be true or false")
    out["loop_guard"] = guard
    out["thinking"] = thinking_setting(out.get("thinking", "on"))
    out["system_prompt"] = str(out.get("system_prompt") or "")
    return out


def _sampling_setting(name: str, value):
    """One sampler setting, typed in the dialog ("0.3") or written in config.toml (0.3), checked
    against the engine's table (named as the dialog names it: top-p); empty: the default."""
    limit = SAMPLING_LIMITS[name]
    label = name.replace("_", "-")
    if value in (None, ""):
        return CHAT_DEFAULTS[name]
    if isinstance(value, str):
        try:
            value = limit.kind(value.strip())
        except ValueError:
            raise UsageError(f"{label} is not a number: {value!r}") from None
    return limit.check(value, label)


def thinking_setting(value) -> str | int:
    """"on", "off" or a budget of at least 1 token (typed as "8" in the dialog, 8 in config.toml)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = str(value if value is not None else "").strip().lower()
    if text in ("", "on"):
        return "on"
    if text in ("off", "0"):
        return "off"
    try:
        budget = int(text)
    except ValueError:
        raise UsageError(f"thinking must be on, off or a number of tokens (got {value!r})") from None
    if budget < 0:
        raise UsageError("thinking's budget must be 1 token or more (off: no thinking)")
    return budget


def reasoning_budget(thinking) -> int | None:
    """The thinking setting as ChatRequest.reasoning_budget: None no limit, 0 off, N tokens."""
    value = thinking_setting(thinking)
    if isinstance(value, int):
        return value
    return None if value == "on" else 0


def build_request(settings: dict, history: list[dict], session: str | None) -> ChatRequest:
    """A ChatRequest for a conversation: its system prompt, then its messages, with its settings."""
    s = {**CHAT_DEFAULTS, **settings}
    return ChatRequest(
        messages=with_system_prompt(s, history),
        sampling=SamplingParams(**{name: s[name] for name in SAMPLING_SETTINGS}, seed=s["seed"]),
        max_tokens=s["max_tokens"],
        session=session,
        context_policy=ContextPolicy(s["context_policy"]),
        speculative=SpeculativeMode(s["speculative"]),
        loop_guard=s["loop_guard"],
        reasoning_budget=reasoning_budget(s["thinking"]),
    )
