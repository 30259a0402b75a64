"""Chat templates: the GGUF's own Jinja template in a sandbox, a known family template when the
GGUF has none and the family is certain, otherwise plain completion with a visible warning.
Never a silently wrong template (llama-cpp-python falls back to llama-2's format for everything).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgechat.errors import UsageError

# Written for edgechat from the published turn formats of each family.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set sys = namespace(text='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set sys.text = sys.text + m['content'] + '\n\n' %}"
    "{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if m['role'] == 'user' and sys.text %}{{ sys.text }}{% set sys.text = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

#: family templates keyed by the token that proves the family is what we think it is
FAMILY_BY_TOKEN = {"<|im_start|>": ("chatml", CHATML_TEMPLATE), "<|start_header_id|>": ("llama3", LLAMA3_TEMPLATE)}
FAMILY_BY_ARCH = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE, "gemma3n": GEMMA_TEMPLATE}

ROLES = ("system", "user", "assistant")


def _raise(message: str):
    raise TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def validate_messages(messages: list[dict]) -> list[dict]:
    if not messages:
        raise UsageError("no messages to send; write a message first")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UsageError(f"message {i} needs a role of system, user or assistant")
        content = m.get("content")
        if not isinstance(content, str):
            raise UsageError(f"message {i} needs text content")
        clean.append({"role": m["role"], "content": content})
    if not any(m["content"].strip() for m in clean if m["role"] == "user"):
        raise UsageError("the prompt is empty; type a message")
    return clean


@dataclass
class ChatFormat:
    """How messages become a prompt for one model."""

    mode: str  # "chat" (the GGUF's template), "family:<name>" (known fallback) or "completion"
    warning: str | None
    _render: Callable[[list[dict], bool], str]

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._render(messages, add_generation_prompt)
        except TemplateError as exc:
            raise UsageError(f"the model's chat template rejected these messages: {exc}") from None

    def segments(self, messages: list[dict], known: list[str] | None = None) -> list[str]:
        """The prompt split at message boundaries: one string per message, then the generation prompt.

        `known` holds segments already computed for a prefix of these messages (they never change
        when messages are appended), so a long conversation renders only its new messages.
        Templates whose prefixes are not stable fall back to a single segment.
        """
        full = self.render(messages, True)
        segs: list[str] = list(known or [])
        pos = sum(len(s) for s in segs)
        if full[:pos] != "".join(segs):
            segs, pos = [], 0
        for i in range(len(segs) + 1, len(messages) + 1):
            try:
                prefix = self._render(messages[:i], False)
            except TemplateError:
                prefix = None
            if prefix is None or not full.startswith(prefix) or len(prefix) < pos:
                return [full]
            segs.append(prefix[pos:])
            pos = len(prefix)
        segs.append(full[pos:])
        return segs


def _completion(messages: list[dict], add_generation_prompt: bool) -> str:
    return "\n\n".join(m["content"] for m in messages)


def choose_format(template: str | None, architecture: str, bos: str, eos: str, has_token: Callable[[str], bool]) -> ChatFormat:
    """Pick how to render chats for this model; see the module docstring for the rules."""
    source, mode, warning = template, "chat", None
    if not source:
        if architecture in FAMILY_BY_ARCH:
            source, mode = FAMILY_BY_ARCH[architecture], f"family:{architecture}"
        else:
            for token, (name, tmpl) in FAMILY_BY_TOKEN.items():
                if has_token(token):
                    source, mode = tmpl, f"family:{name}"
                    break
        if source:
            warning = f"this model has no chat template; using the known {mode.split(':')[1]} format"
    if not source:
        return ChatFormat(
            "completion",
            "this model has no chat template and its family is unknown: plain completion mode "
            "(your text is continued, not answered)",
            _completion,
        )
    try:
        compiled = _env().from_string(source)
    except TemplateError as exc:
        return ChatFormat("completion", f"the model's chat template is broken ({exc}); plain completion mode", _completion)

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)

    return ChatFormat(mode, warning, render)
