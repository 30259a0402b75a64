"""Chat templates: the GGUF's own Jinja template in a sandbox, a known family template when the
GGUF has none and the family is certain, otherwise plain completion with a visible warning.
Never a silently wrong template (llama-cpp-python falls back to llama-2's format for everything).
"""

from __future__ import annotations

import bisect
import datetime
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgechat.engine.output.reasoning import ChannelFormat, ReasoningFormat, reasoning_format
from edgechat.engine.output.toolfamilies import ToolFamily, family_for
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

ROLES = ("system", "user", "assistant", "tool")
#: the most messages whose prompt is split by rendering each prefix, where one render with
#: markers cannot tell the boundaries (a tool call with no text; results a template groups)
MAX_PREFIX_SPLIT = 256
#: private-use characters around the numbered stand-ins for contents (see ChatFormat._cuts)
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"


def _raise(message: str):
    raise TemplateError(message)


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    # the JSON tool templates write (tools, call arguments) must be what the model was trained
    # on: Jinja's own tojson escapes <, > and & for HTML, transformers' does not
    env.filters["tojson"] = _tojson
    return env


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def validate_messages(messages: list[dict] | None) -> list[dict]:
    if not messages:
        raise UsageError("no messages to send; write a message first")
    clean = []
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UsageError(f"message {i} needs a role of system, user, assistant or tool")
        content = m.get("content")
        if not isinstance(content, str):
            raise UsageError(f"message {i} needs text content")
        message = {"role": m["role"], "content": content}
        if m.get("images"):  # the pictures whose markers the content holds (prompt.py)
            message["images"] = m["images"]
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = m["tool_calls"]
            calls.update(c["id"] for c in m["tool_calls"])
        elif m["role"] == "tool":
            if m.get("tool_call_id") not in calls:
                raise UsageError(f"message {i} is a tool result whose call no earlier message made")
            message["tool_call_id"] = m["tool_call_id"]
        clean.append(message)
    if not any(m["content"].strip() for m in clean if m["role"] == "user"):
        raise UsageError("the prompt is empty; type a message")
    return clean


@dataclass
class ChatFormat:
    """How messages become a prompt for one model."""

    mode: str  # "chat" (the GGUF's template), "family:<name>" (known fallback) or "completion"
    warning: str | None
    _render: Callable[..., str]
    #: the Jinja source rendered (None in completion mode): the server reads its tool syntax there
    source: str | None = None

    @functools.cached_property
    def reasoning(self) -> ReasoningFormat | ChannelFormat | None:
        """The thinking markers of a reasoning model's template (None: the model does not think);
        read once, not on every prompt."""
        return reasoning_format(self.source)

    @functools.cached_property
    def tool_family(self) -> ToolFamily:
        """The tool-call syntax the template writes (the generic one where it takes no tools)."""
        return family_for(self.source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
        """The prompt; `variables` go to the template as they are (`tools` for one that takes them)."""
        try:
            return self._render(messages, add_generation_prompt, **variables)
        except TemplateError as exc:
            raise UsageError(f"the model's chat template rejected these messages: {exc}") from None

    def segments(self, messages: list[dict], **variables) -> list[str]:
        """The prompt split at message boundaries: one string per message, then the generation prompt.

        Segment i is what rendering messages[:i+1] adds to rendering messages[:i], as if the
        template were rendered once per prefix, but found from a constant number of renders so
        the cost grows linearly with the conversation. Where that cannot tell the boundaries (a
        tool call without text, results the template groups in one turn), a conversation with
        tool messages of up to MAX_PREFIX_SPLIT messages is split by rendering each prefix, a message that ends no
        prefix of the prompt sharing the next one's segment (its own is empty). When the
        template does not render messages in place (it rewrites their content, or emits one
        later than where it stands), the whole prompt is one segment.
        """
        full = self.render(messages, True, **variables)
        try:
            cuts = self._cuts(messages, full, variables)
            if cuts is None and len(messages) <= MAX_PREFIX_SPLIT and any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
                cuts = self._prefix_cuts(messages, full, variables)
        except TemplateError:
            cuts = None
        if cuts is None:
            return [full]
        return [full[a:b] for a, b in pairwise([0, *cuts, len(full)])]

    def _cuts(self, messages: list[dict], full: str, variables: dict) -> list[int] | None:
        """Where each message's rendering ends in `full`, or None if that cannot be told.

        The template is rendered once with each content replaced by a numbered marker, which
        locates every content; what a template writes after a content (its end-of-turn text)
        depends on the role, so one short probe per role tells where a message ends. Mapping
        back to the real render checks every literal between contents, so a template that
        treats real text differently from markers is caught, not trusted.
        """
        marks = [f"{_MARK_OPEN}{i}{_MARK_CLOSE}" for i in range(len(messages))]
        marked = [{**m, "content": mk} for m, mk in zip(messages, marks, strict=True)]
        g = self._render(marked, True, **variables)
        starts: list[int] = []
        pos = 0
        for mk in marks:
            at = g.find(mk, pos)
            if at < 0:
                return None
            starts.append(at)
            pos = at + len(mk)
        suffix: dict[str, str | None] = {}
        cuts_g: list[int] = []
        for i, m in enumerate(messages):
            role, end = m["role"], starts[i] + len(marks[i])
            if role not in suffix:
                probe = self._render(marked[: i + 1], False, **variables)
                at = probe.rfind(marks[i])
                if at < 0:
                    # rendered later (Gemma puts the system prompt inside the first user turn):
                    # its segment is what the template wrote before it, once only
                    if not g.startswith(probe):
                        return None
                    suffix[role] = None
                    cuts_g.append(len(probe))
                    continue
                suffix[role] = probe[at + len(marks[i]) :]
            tail = suffix[role]
            if tail is None or not g.startswith(tail, end):
                return None
            cuts_g.append(end + len(tail))
        if any(b < a for a, b in pairwise(cuts_g)):
            return None
        # the real render is the marked one with each marker replaced by its (maybe trimmed) content
        shift: list[int] = []  # length change of the real render after marker i
        fpos = gpos = 0
        total = 0
        for i, m in enumerate(messages):
            literal = g[gpos : starts[i]]
            if not full.startswith(literal, fpos):
                return None
            fpos += len(literal)
            gpos = starts[i] + len(marks[i])
            nxt = g[gpos : starts[i + 1]] if i + 1 < len(messages) else g[gpos:]
            c = m["content"]
            text = next((t for t in dict.fromkeys((c, c.strip(), c.rstrip(), c.lstrip())) if full.startswith(t, fpos) and full.startswith(nxt, fpos + len(t))), None)
            if text is None:
                return None
            fpos += len(text)
            total += len(text) - len(marks[i])
            shift.append(total)
        if full[fpos:] != g[gpos:]:
            return None
        ends = [s + len(mk) for s, mk in zip(starts, marks, strict=True)]
        cuts: list[int] = []
        for c in cuts_g:
            # the markers wholly before a cut move it (a cut never falls inside a marker)
            k = bisect.bisect_right(ends, c)
            cuts.append(c + (shift[k - 1] if k else 0))
        return cuts


    def _prefix_cuts(self, messages: list[dict], full: str, variables: dict) -> list[int] | None:
        """Where each message's rendering ends in `full`, from one render per prefix (quadratic:
        for short conversations only); None if no message ends a prefix of it."""
        cuts: list[int] = []
        found = False
        for i in range(len(messages)):
            probe = self._render(messages[: i + 1], False, **variables)
            ends_here = full.startswith(probe) and len(probe) >= (cuts[-1] if cuts else 0)
            found |= ends_here
            cuts.append(len(probe) if ends_here else (cuts[-1] if cuts else 0))
        return cuts if found else None


def _completion(messages: list[dict], add_generation_prompt: bool, **variables) -> str:
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

    def render(messages: list[dict], add_generation_prompt: bool, **variables) -> str:
        # Llama 3.x templates write "Today Date" from date_string, else a fixed placeholder day;
        # llama.cpp gives them today's, as Meta's own prompt format does
        variables.setdefault("date_string", datetime.date.today().strftime("%d %b %Y"))
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **variables)

    return ChatFormat(mode, warning, render, source)
