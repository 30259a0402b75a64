"""Writing a conversation out as Markdown or JSON, atomically (temp file in the same folder, then rename)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from edgechat.fsutil import atomic_write_text
from edgechat.store.db import Store

_ROLE_HEADINGS = {"user": "You", "assistant": "Assistant", "system": "System"}


def _answer_model(m: dict) -> str | None:
    return (m.get("meta") or {}).get("model") if m["role"] == "assistant" else None


def to_markdown(data: dict) -> str:
    """Markdown of an export_conversation() dict: title, settings worth knowing, then each message,
    an answer under the name of the model that wrote it, its thoughts (if any) quoted before it."""
    lines = [f"# {data['title']}", ""]
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(data["created_at"]))
    # The conversation's model is the last one used; the answers may come from others before it.
    answered = [model for m in data["messages"] if (model := _answer_model(m))]
    models = list(dict.fromkeys(answered)) or ([data["model"]] if data.get("model") else [])
    label = "model" if len(models) == 1 else "models"
    lines.append(f"*{created}" + (f" · {label} {', '.join(models)}" if models else "") + "*")
    system = (data.get("settings") or {}).get("system_prompt")
    if system:
        lines += ["", f"> **System:** {system}"]
    for m in data["messages"]:
        heading = _ROLE_HEADINGS.get(m["role"], m["role"].title())
        status = m.get("status", "complete")
        notes = [n for n in (_answer_model(m), None if status == "complete" else status) if n]
        if notes:
            heading += f" ({', '.join(notes)})"
        lines += ["", f"## {heading}", ""]
        thoughts = (m.get("reasoning") or "").strip()
        if thoughts:
            # the model's thoughts, quoted before the answer they led to
            lines += ["> **Thoughts**", ">", *(f"> {line}".rstrip() for line in thoughts.splitlines()), ""]
        lines.append(m["content"].rstrip())
        for call in m.get("tool_calls") or ():
            # each call and what came back, as the app shows them
            lines += ["", f"> **Tool call** `{call['server']}.{call['name']}({call['arguments']})`: {call['outcome']}", ">",
                      *(f"> {line}".rstrip() for line in str(call["result"]).splitlines())]
    return "\n".join(lines) + "\n"


def export_conversation(store: Store, conv_id: str, path: str | os.PathLike, fmt: str | None = None) -> Path:
    """Write a conversation to `path` as Markdown (.md) or JSON (.json, or fmt='json')."""
    data = store.export_conversation(conv_id)
    fmt = fmt or ("json" if str(path).endswith(".json") else "markdown")
    if fmt == "json":
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    else:
        text = to_markdown(data)
    return atomic_write_text(path, text)
