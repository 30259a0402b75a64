"""What a user may set, checked in one place for every front end.

`SAMPLING_LIMITS` is the one table of sampling ranges: the engine checks a request's
`SamplingParams` against it, the server's schemas check each API's fields against it (the 400
naming the field), the chat app checks its settings against it and the CLI's options are built
from it, so one value gets one verdict everywhere. The ranges are OpenAI's where OpenAI defines
the field (temperature 0-2, top_p 0-1, the two penalties -2..2); llama-server's own fields
(top_k, min_p, repeat_penalty, repeat_last_n) take what llama.cpp's samplers can do something
with. An API whose own range is narrower (Anthropic's temperature, 0-1) checks that on top.

Settings that take one of a few words are enums, each defined once; `choice` parses one with a
one-line error naming the values it takes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from edgechat.errors import InvalidFieldError


@dataclass
class SamplingParams:
    """llama.cpp's native sampler chain settings. temperature 0 means greedy."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    #: None: a fresh random seed per request
    seed: int | None = None
    #: (token id, bias) pairs added to those tokens' logits before any other sampler (OpenAI's
    #: logit_bias; -inf bans a token)
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Grammar:
    """A GBNF grammar the answer must follow (llama.cpp's grammar sampler).

    With `triggers` (regular expressions over the text so far) it is lazy: nothing is
    constrained until one matches, then the text from the match's first group (or the whole
    match) on must follow the grammar, as a tool call after its opener does.
    """

    gbnf: str
    root: str = "root"
    triggers: tuple[str, ...] = ()
    #: the JSON Schema the grammar was made from, for an answer that is one JSON value: before
    #: max_tokens cuts it, the engine writes the shortest text that ends it validly
    #: (jsonvalue.JsonPrefix.closing), so a structured answer always parses (reason still "length")
    json_schema: dict | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class Limit:
    """One sampling field: its type and range, both ends included unless `lo_open`."""

    #: the SamplingParams field
    name: str
    kind: type  # int or float
    lo: float
    #: None: no upper end
    hi: float | None
    #: `lo` itself is refused (a repeat penalty of 0 would divide the scores by zero)
    lo_open: bool = False
    #: what the value does, for help texts
    meaning: str = ""
    #: the value that leaves it off (or what its end means), quoted in errors
    off: str = ""

    def describe(self) -> str:
        """The range in words: "between 0 and 2", "0 or more", "above 0 and at most 10"."""
        lo, hi = _number(self.lo), None if self.hi is None else _number(self.hi)
        kind = "an integer " if self.kind is int else ""
        if hi is None:
            return f"{kind}above {lo}" if self.lo_open else f"{kind}{lo} or more"
        if self.lo_open:
            return f"{kind}above {lo} and at most {hi}"
        return f"{kind}between {lo} and {hi}"

    def accepts(self, value: object) -> bool:
        try:
            self.check(value)
        except InvalidFieldError:
            return False
        return True

    def check(self, value: object, name: str | None = None, param: str | None = None) -> int | float:
        """`value` as the field's type, or InvalidFieldError (param: `param`, else `name`, else
        the field) saying the range. `name` is what the caller calls the field in its message."""
        name = name or self.name
        param = param or name
        # bool is an int subclass in Python; JSON's true is not a number
        if isinstance(value, float) and self.kind is int and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.kind is int and isinstance(value, float)):
            got = "null" if value is None else type(value).__name__
            expected = "an integer" if self.kind is int else "a number"
            raise InvalidFieldError(f"{name} must be {expected}, not {got}", param=param, code="invalid_type")
        low = value <= self.lo if self.lo_open else value < self.lo
        if not math.isfinite(value) or low or (self.hi is not None and value > self.hi):
            hint = f"; {self.off}" if self.off else ""
            raise InvalidFieldError(f"{name} must be {self.describe()} (got {_number(value)}){hint}", param=param,
                                    code="invalid_value")
        return self.kind(value)


def _number(value: float) -> str:
    """2.0 as 2, 0.5 as 0.5: ranges read as people write them."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


#: every sampling field a user sets, in the order front ends show them (seed is any integer)
SAMPLING_LIMITS: dict[str, Limit] = {limit.name: limit for limit in (
    Limit("temperature", float, 0.0, 2.0, meaning="how random the choice of each token is", off="0 = greedy"),
    Limit("top_k", int, 0, None, meaning="only the k most likely tokens are candidates", off="0 = off"),
    # 0 keeps only the most likely token (llama.cpp keeps at least one), as OpenAI takes it
    Limit("top_p", float, 0.0, 1.0, meaning="only the most likely tokens whose probabilities add up to p", off="1 = off"),
    Limit("min_p", float, 0.0, 1.0, meaning="tokens less likely than min_p times the most likely one are dropped",
          off="0 = off"),
    # llama.cpp divides a repeated token's positive score by it (0 would divide by zero); 10 is
    # already a ban on repeating, and the cap the server and the GGUF reader always held
    Limit("repeat_penalty", float, 0.0, 10.0, lo_open=True, meaning="recent tokens' scores are divided by it",
          off="1 = off"),
    Limit("presence_penalty", float, -2.0, 2.0, meaning="subtracted from the score of every token already written",
          off="0 = off"),
    Limit("frequency_penalty", float, -2.0, 2.0, meaning="subtracted once for each time a token was written",
          off="0 = off"),
    Limit("penalty_last_n", int, 0, None, meaning="how many recent tokens the penalties look at", off="0 = none"),
)}


def check_sampling(params: SamplingParams, n_vocab: int | None = None) -> None:
    """The engine's check of a request's sampling (front ends have checked theirs already);
    with `n_vocab`, logit_bias's token ids against the model's vocabulary."""
    for limit in SAMPLING_LIMITS.values():
        limit.check(getattr(params, limit.name))
    for token, bias in params.logit_bias:
        if n_vocab is not None and not 0 <= token < n_vocab:
            raise InvalidFieldError(f"logit_bias: token {token} is not in this model's vocabulary (0-{n_vocab - 1})",
                                    param="logit_bias", code="invalid_value")
        if math.isnan(bias) or bias == math.inf:
            raise InvalidFieldError(f"logit_bias: the bias of token {token} must be a number (got {bias})",
                                    param="logit_bias", code="invalid_value")


class Word(str, enum.Enum):  # noqa: UP042 (StrEnum is 3.11+; requires-python is 3.10)
    """A setting that is one of a few words: compares equal to its word and prints as it (in
    messages, f-strings, JSON), so a caller may give either."""

    def __str__(self) -> str:
        return self.value


class SpeculativeMode(Word):
    """Speculative decoding (engine/schedule/speculative.py)."""

    AUTO = "auto"  # n-gram lookup, and the draft model when one is loaded, each where it pays
    OFF = "off"
    LOOKUP = "lookup"  # n-gram lookup only, even where the cost model would not draft
    DRAFT = "draft"  # the draft model only, even where the cost model would not draft


class ContextPolicy(Word):
    """What to do when a conversation outgrows the context window (see engine/kv/kvcache.py)."""

    SHIFT = "shift"
    TRUNCATE = "truncate"
    SUMMARIZE = "summarize"


class KVType(Word):
    """The KV cache's element type (llama.cpp's type_k and type_v)."""

    F16 = "f16"
    Q8_0 = "q8_0"  # half the memory of f16, near-lossless; needs flash attention (turned on for it)
    Q4_0 = "q4_0"


class SwaCache(Word):
    """Sliding-window models (Gemma 3): the cache of their sliding layers."""

    AUTO = "auto"  # small only where the full one does not fit
    FULL = "full"  # every position: conversations shift when the context fills
    SMALL = "small"  # the window only: 3-5x less memory, no shifting, so conversations truncate


class FlashAttn(Word):
    """llama.cpp's flash attention."""

    AUTO = "auto"  # llama.cpp decides (on for the CPU)
    ON = "on"
    OFF = "off"  # on a 2-core CPU, answers sooner deep into long chats


#: the string settings, by the name front ends and config.toml give them
CHOICES: dict[str, type[enum.Enum]] = {
    "speculative": SpeculativeMode,
    "context_policy": ContextPolicy,
    "kv_type": KVType,
    "swa_cache": SwaCache,
    "flash_attn": FlashAttn,
}


def values(setting: type[enum.Enum]) -> list[str]:
    """A setting's words, in the enum's order (click.Choice's, a select's options)."""
    return [m.value for m in setting]


def choice(setting: type[enum.Enum], value: object, name: str, param: str | None = None):
    """`value` (a word, or already a member) as a member of `setting`; else one line naming what
    it takes (InvalidFieldError, param: `param`, else `name`)."""
    try:
        return setting(value)
    except ValueError:
        shown = repr(value) if isinstance(value, str) and len(value) <= 40 else f"a {type(value).__name__}"
        *others, last = values(setting)
        raise InvalidFieldError(f"{name} must be {', '.join(others)} or {last} (got {shown})", param=param or name,
                                code="invalid_value") from None
