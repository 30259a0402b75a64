"""The readers every API's translator shares: a body's fields checked strictly, each wrong value
a 400 naming the field (a wrong type reaching the engine would be a crash, not a user error), and
`ParsedRequest`, what each translator makes of a body.

Fields that change nothing (user, metadata, store, unknown ones) are ignored, as OpenAI does;
fields that would change the answer and that the engine does not implement are refused
(`refuse_unsupported`), since a client that sets them expects their effect. The readers are
public and read qualified (`fields.text(...)`, `fields.opt_int(...)`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from edgechat.engine.output.schema_grammar import check_schema, schema_rules
from edgechat.engine.types.request import ChatRequest, Tools
from edgechat.errors import InvalidFieldError
from edgechat.params import SAMPLING_LIMITS, Grammar, SamplingParams, SpeculativeMode, choice
from edgechat.server.errors import ApiError, bad_request, field_error
from edgechat.server.images import ImageReader
from edgechat.server.images import content as content_of
from edgechat.server.structured import check_gbnf

#: roles a request may send; OpenAI's newer "developer" role is a system prompt, "tool" carries
#: a tool's result back (rendered by the prompt builder, see engine/output/tools.py)
_ROLES = {"system", "user", "assistant", "developer", "tool"}
#: OpenAI's limit
_MAX_STOPS = 4
#: OpenAI's limit on alternatives per token (chat's top_logprobs; llama-server's n_probs too)
MAX_TOP_LOGPROBS = 20

#: Fields OpenAI defines (and common llama-server / vLLM extensions) that would change what is
#: generated or returned, with the values that leave them off; any other value is refused.
#: tool_choice / function_call "auto" means "none" when no tools are given, and tools are refused.
_UNSUPPORTED: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "audio": (),
    "verbosity": (),
    "web_search_options": (),
    # served by /v1/completions (a fill in the middle), refused elsewhere
    "suffix": ("",),
    "echo": (False,),
    "best_of": (1,),
    "typical_p": (1,),
    "tfs_z": (1,),
    "mirostat": (0,),
    "dynatemp_range": (0,),
    "dry_multiplier": (0,),
    "xtc_probability": (0,),
    "top_a": (0,),
    "min_tokens": (0,),
    "n_probs": (0,),
    "repetition_penalty": (1,),
    "use_beam_search": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
}


@dataclass
class ParsedRequest:
    request: ChatRequest
    model: str | None
    stream: bool
    include_usage: bool
    n: int = 1
    #: the tools offered and how they may be called (chat only)
    tools: Tools | None = None
    #: the checked chat messages, tool calls and results included (`request` holds them too: the
    #: engine's prompt builder renders them, through the model's template where it takes tools)
    messages: list[dict] | None = None
    #: the request's grammar is the client's own GBNF (`grammar`): llama.cpp's parser checks it
    #: before anything is queued
    client_grammar: bool = False
    #: seconds the model stays loaded once idle after this request (server/keepalive.py); None: its default
    keep_alive: float | None = None


def decode_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        # the C decoder gives up at the interpreter's recursion limit, before reading much
        raise bad_request("the request body is nested too deeply (arrays or objects inside each other)") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def type_error(name: str, expected: str, value: object) -> ApiError:
    got = "null" if value is None else type(value).__name__
    return bad_request(f"'{name}' must be {expected}, not {got}", param=name, code="invalid_type")


def describe(value: object) -> str:
    """A short quote of a client's value for an error message: a repr of a deep or huge value
    would be slow, recurse past the interpreter's limit, or echo megabytes back."""
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def is_off(value: object, off_values: tuple) -> bool:
    # JSON true/false are not the numbers 1/0, though Python's == says they are
    return value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in off_values)


def refuse_unsupported(body: dict) -> None:
    for name, off_values in _UNSUPPORTED.items():
        if name in body and not is_off(body[name], off_values):
            raise bad_request(
                f"'{name}' is not supported by this server; leave it out", param=name, code="unsupported_parameter"
            )


def text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise type_error(name, "a string", value)
    try:
        # lone surrogates are valid JSON escapes but cannot be tokenized
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{name}' contains invalid Unicode (a lone surrogate)", param=name) from None
    return value


def opt_int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass in Python; JSON true is not a number
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise type_error(name, "an integer", value)
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be at least {lo}, got {value}", param=name, code="invalid_value")
    if hi is not None and value > hi:
        raise bad_request(f"'{name}' must be at most {hi}, got {value}", param=name, code="invalid_value")
    return value


def opt_float(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, "a number", value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {value}", param=name, code="invalid_value")
    return float(value)


def opt_bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise type_error(name, "a boolean", value)
    return value


def speculative(body: dict) -> SpeculativeMode | None:
    """edgechat's own field: speculative decoding for this request (the server's setting if absent)."""
    value = body.get("speculative")
    if value is None:
        return None
    try:
        return choice(SpeculativeMode, value, "'speculative'", "speculative")
    except InvalidFieldError as exc:
        raise field_error(exc) from None


def stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise type_error("stop", "a string or a list of strings", value)
    if len(stops) > _MAX_STOPS:
        raise bad_request(f"'stop' has {len(stops)} strings, at most {_MAX_STOPS} are allowed", param="stop")
    out = [text("stop", s) for s in stops]
    if any(s == "" for s in out):
        raise bad_request("'stop' strings must not be empty", param="stop")
    return out


#: image_url.detail's values: read and ignored, since a projector resizes every picture its own way
_DETAILS = ("auto", "low", "high")


def _content(index: int, content: object, role: str, images: ImageReader) -> str | list:
    """A message's content: text, or (a user's) text and image parts, as the engine takes them."""
    name = f"messages[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return text(name, content)
    if not isinstance(content, list):
        raise type_error(name, "a string or a list of content parts", content)
    parts: list = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(text(f"{name}.text", part.get("text")))
        elif kind == "image_url" and role == "user":
            where = f"{name}[{j}].image_url"
            ref = part.get("image_url")
            # OpenAI's shape is {url, detail}; a bare URL string is accepted as llama-server does
            if isinstance(ref, dict):
                if ref.get("detail") not in (None, *_DETAILS):
                    raise bad_request(f"{where}.detail must be one of {', '.join(_DETAILS)}", param=f"{where}.detail", code="invalid_value")
                ref = ref.get("url")
                where += ".url"
            parts.append(images.url(where, ref))
        elif kind == "image_url":
            raise bad_request(f"{name}[{j}]: images go in user messages", param=f"{name}[{j}]", code="invalid_value")
        else:
            got = describe(kind) if isinstance(part, dict) else f"a {type(part).__name__}"
            raise bad_request(f"{name}[{j}]: only text and image_url parts are supported, got {got}", param=f"{name}[{j}]")
    return content_of(parts)


def messages(body: dict, max_messages: int, images: ImageReader) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise type_error("messages", "a list", messages)
    if not messages:
        raise bad_request("'messages' must not be empty", param="messages", code="invalid_value")
    if len(messages) > max_messages:
        raise bad_request(
            f"'messages' has {len(messages)} messages, more than the {max_messages} this server accepts",
            param="messages",
            code="too_many_messages",
        )
    out = []
    calls: set[str] = set()  # ids of the tool calls earlier messages made
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise type_error(f"messages[{i}]", "an object", message)
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}, got {describe(role)}", param=f"messages[{i}].role"
            )
        parsed: dict[str, object] = {"role": "system" if role == "developer" else role, "content": _content(i, message.get("content"), role, images)}
        if role == "assistant" and message.get("tool_calls"):
            tool_calls = _tool_calls(i, message["tool_calls"])
            parsed["tool_calls"] = tool_calls
            calls.update(c["id"] for c in tool_calls)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise bad_request(
                    f"messages[{i}].tool_call_id must be the id of a tool call an earlier assistant message made, got {describe(call_id)}",
                    param=f"messages[{i}].tool_call_id",
                    code="invalid_value",
                )
            parsed["tool_call_id"] = call_id
        out.append(parsed)
    return out


def _tool_calls(index: int, value: object) -> list[dict]:
    """An assistant message's earlier calls: [{id, name, arguments (JSON object text)}]."""
    name = f"messages[{index}].tool_calls"
    if not isinstance(value, list):
        raise type_error(name, "a list", value)
    out = []
    for j, call in enumerate(value):
        where = f"{name}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != "function":
            raise bad_request(f"{where} must be {{id, type: function, function: {{name, arguments}}}}", param=where)
        if not isinstance(fn.get("name"), str):
            raise type_error(f"{where}.function.name", "a string", fn.get("name"))
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(text(f"{where}.function.arguments", args))
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request(f"{where}.function.arguments must be a JSON object in a string", param=f"{where}.function.arguments")
        out.append({"id": call["id"], "name": fn["name"], "arguments": json.dumps(parsed, ensure_ascii=False)})
    return out


#: llama-server's names for SamplingParams fields, where they differ
_WIRE_NAMES = {"penalty_last_n": "repeat_last_n"}


def sampling(body: dict, base: SamplingParams | None) -> SamplingParams:
    """The body's sampling fields over `base` (the model's recommended sampling, else our
    defaults), each checked against the engine's one table of limits."""
    params = dataclasses.replace(base or SamplingParams())
    for name, limit in SAMPLING_LIMITS.items():
        field = _WIRE_NAMES.get(name, name)
        if body.get(field) is not None:
            try:
                setattr(params, name, limit.check(body[field], f"'{field}'", field))
            except InvalidFieldError as exc:
                raise field_error(exc) from None
    # llama.cpp seeds are 32-bit; OpenAI clients send any integer
    seed = opt_int(body, "seed")
    if seed is not None:
        params.seed = seed & 0xFFFFFFFF
    if body.get("logit_bias"):
        params.logit_bias = logit_bias(body["logit_bias"])
    return params


#: OpenAI's range for a token's bias (-100 bans it in effect, 100 all but forces it)
_MAX_BIAS = 100


def logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (an object: token id as a string -> bias from -100 to 100), or
    llama-server's list of [token id, bias] pairs, where a bias of false bans the token. The
    ids are checked against the model's vocabulary when the request is built."""
    pairs: list
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = value
    else:
        raise type_error("logit_bias", "an object of token ids to biases (or a list of [token id, bias] pairs)", value)
    out = []
    for token, bias in pairs:
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad_request(f"logit_bias: {json.dumps(token)[:40]} is not a token id; POST /tokenize gives a text's ids",
                              param="logit_bias", code="invalid_value")
        if bias is False:
            out.append((token, -math.inf))
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -_MAX_BIAS <= bias <= _MAX_BIAS:
            raise bad_request(f"logit_bias: the bias of token {token} must be a number from -{_MAX_BIAS} to {_MAX_BIAS} "
                              f"(got {json.dumps(bias)[:40]})", param="logit_bias", code="invalid_value")
        out.append((token, float(bias)))
    return tuple(out)


def model_field(body: dict) -> str | None:
    """The model a body names (None: the server's first)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise type_error("model", "a string", model)
    return model


#: reasoning_effort's values and the thinking budget each means (None: as long as the model likes)
REASONING_EFFORT = {"none": 0, "minimal": 0, "low": 512, "medium": 2048, "high": None}


def reasoning_budget(body: dict, default: int | None) -> int | None:
    """edgechat's `reasoning_budget` (tokens; -1: no limit), else OpenAI's `reasoning_effort`,
    else the server's default (`serve --reasoning-budget`)."""
    if body.get("reasoning_budget") is not None:
        budget = opt_int(body, "reasoning_budget", lo=-1)
        return None if budget == -1 else budget
    effort = body.get("reasoning_effort")
    if effort is None:
        return default
    if effort not in REASONING_EFFORT:
        raise bad_request(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORT)}", param="reasoning_effort",
                          code="invalid_value")
    return REASONING_EFFORT[effort]


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`: variables for the model's chat template (llama-server's and vLLM's
    field), scalars only: a template is code, and nothing else is needed to switch it."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
                                              for k, v in value.items()):
        raise bad_request("'chat_template_kwargs' must be an object of strings, numbers, booleans or nulls",
                          param="chat_template_kwargs", code="invalid_type")
    return dict(value)


def loop_guard(body: dict) -> bool:
    """edgechat's own field: `"loop_guard": false` lets an answer that repeats itself go on."""
    return body.get("loop_guard") is None or opt_bool(body, "loop_guard")


def extension_grammar(body: dict) -> Grammar | None:
    """llama-server's two fields that constrain an answer: `grammar` (GBNF; empty: none) or
    `json_schema` (a JSON Schema, as response_format's)."""
    gbnf, schema = body.get("grammar"), body.get("json_schema")
    if gbnf and schema is not None:
        raise bad_request("give 'grammar' or 'json_schema', not both", param="grammar", code="invalid_value")
    if gbnf:
        check_gbnf(text("grammar", gbnf), "grammar")
        return Grammar(gbnf)
    if schema is not None:
        check_schema(schema, "json_schema")
        return Grammar(schema_rules([("", schema)], "json_schema"), json_schema=schema)
    return None


