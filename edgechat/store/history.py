"""A stored conversation as the model is given it, for every front end that continues one.

The rule for turns that did not end well, the same for the CLI, the chat app and anything else
that continues a stored conversation:

- an answer with text is sent as it is stored, stopped or killed ("interrupted") ones included:
  the model sees what the user saw;
- a failed answer ("error") and an answer with no text are left out, and so is the question
  they belonged to: a question goes into a prompt only with an answer after it, or as the last
  message (the one being asked now). A killed turn then never changes what the next answer is about.
"""

from __future__ import annotations

from edgechat.engine.types.request import ImageInput


def model_messages(store, conv_id: str) -> list[dict]:
    """The conversation's user and assistant messages under the rule above, oldest first; an
    answer that called tools counts as one with text, and is followed by what each call gave
    back (a result, a refusal or an error) as "tool" messages. A message sent with pictures
    has them back as ImageInput parts before its text, the bytes as sent: the engine finds the
    same picture's cells in its cache (its sha256) and does not encode it again."""
    kept = [
        {"role": m.role, "content": _content(store, m), **({"tool_calls": m.tool_calls} if m.tool_calls else {})}
        for m in store.messages(conv_id)
        if m.role in ("user", "assistant") and m.status != "error" and (m.content or m.tool_calls or m.images)
    ]
    # A question followed by another question got no answer that counts.
    out: list[dict] = []
    for m, after in zip(kept, kept[1:] + [None], strict=True):
        if m["role"] == "user" and after is not None and after["role"] == "user":
            continue
        calls = m.pop("tool_calls", None)
        if calls:
            m["tool_calls"] = [{"id": c["id"], "name": c["name"], "arguments": c["arguments"]} for c in calls]
        out.append(m)
        # a call the app never finished (it was quit while asking) did not run
        out += [{"role": "tool", "content": c["result"] or "The call did not run.", "tool_call_id": c["id"]} for c in calls or ()]
    return out


def _content(store, message) -> str | list:
    if not message.images:
        return message.content
    pictures = [ImageInput(store.image_data(i), i.media_type) for i in message.images]
    return pictures + ([message.content] if message.content else [])


def with_system_prompt(settings: dict, messages: list[dict]) -> list[dict]:
    """The conversation's system prompt (its `system_prompt` setting), if any, then the messages."""
    system = (settings or {}).get("system_prompt")
    return ([{"role": "system", "content": system}] if system else []) + messages
