"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` fields -> the engine's `Tools`."""

from __future__ import annotations

import functools
import logging

from edgechat.engine.output.tools import check_function
from edgechat.engine.types.request import Tools
from edgechat.server.errors import bad_request

log = logging.getLogger("edgechat.server")


def note_hosted_tools(api: str, kinds: list[str]) -> None:
    """Tools a hosted API runs on its own side (web search, code execution, ...), which a client
    offers along with its own: left out of the prompt and logged once per set, never a 400."""
    if kinds:
        _log_hosted(api, tuple(sorted(set(kinds))))


@functools.cache
def _log_hosted(api: str, kinds: tuple[str, ...]) -> None:
    log.info("%s tools left out (they run on the hosted API's side, not here): %s", api, ", ".join(kinds))


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, each wrong value a 400 naming it."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls", code="invalid_type")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice", code="invalid_value")
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", param="tools", code="invalid_type")
    functions: list[dict] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function'", param=f"{where}.type", code="invalid_value")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", param=f"{where}.function", code="invalid_type")
        functions.append(check_function(f"{where}.function", fn, functions))
    named = None
    if choice is None or choice in ("auto", "none", "required"):
        kind = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        named = choice["function"].get("name")
        if not any(f["name"] == named for f in functions):
            offered = ", ".join(f["name"] for f in functions)
            raise bad_request(
                f"tool_choice names the function {named!r}, which is not in 'tools' ({offered})",
                param="tool_choice",
                code="invalid_value",
            )
        kind = "function"
    else:
        raise bad_request(
            "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            param="tool_choice",
            code="invalid_value",
        )
    return Tools(functions, kind, named, parallel)
