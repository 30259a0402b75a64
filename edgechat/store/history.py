"""A stored conversation as the model is given it, for every front end that continues one."""

from __future__ import annotations


def model_messages(store, conv_id: str) -> list[dict]:
    """Every user and assistant message with text, stopped answers included, failed ones not."""
    return [
        {"role": m.role, "content": m.content}
        for m in store.messages(conv_id)
        if m.role in ("user", "assistant") and m.status != "error" and m.content
    ]


def with_system_prompt(settings: dict, messages: list[dict]) -> list[dict]:
    """The conversation's system prompt (its `system_prompt` setting), if any, then the messages."""
    system = (settings or {}).get("system_prompt")
    return ([{"role": "system", "content": system}] if system else []) + messages
