"""JSON values against the schemas the engine's grammars enforce (schema_grammar.py checks which
keywords those are): whether a decoded value fits a schema (`fits`: a tool call's arguments), and,
for text still being written, whether it can still become JSON and the shortest text that ends it
as a value that fits (`JsonPrefix`: the tool-call parser holds text back with it, and an answer held
to a schema is closed with it before max_tokens cuts it)."""

from __future__ import annotations

import json
import re

_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def _resolve(schema: object, root: dict) -> dict:
    """The schema a `$ref` points at (inside `root`), followed until it is not one."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
        ref, target = schema["$ref"], root
        for part in ref[2:].split("/") if ref.startswith("#/") else []:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part, {}) if isinstance(target, dict) else {}
        schema, seen = target, seen + 1
    return schema if isinstance(schema, dict) else {}


def _type_ok(value: object, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(kind, object))


def fits(value: object, schema: object, root: dict | None = None) -> bool:
    """Whether `value` is valid under `schema` (the keywords the grammar converter enforces)."""
    root = root if root is not None else schema if isinstance(schema, dict) else {}
    s = _resolve(schema, root)
    if "const" in s and value != s["const"]:
        return False
    if "enum" in s and value not in s["enum"]:
        return False
    kind = s.get("type")
    if kind is not None and not any(_type_ok(value, k) for k in (kind if isinstance(kind, list) else [kind])):
        return False
    if any(not fits(value, part, root) for part in s.get("allOf", ())):
        return False
    for key in ("anyOf", "oneOf"):
        if key in s and not any(fits(value, part, root) for part in s[key]):
            return False
    if isinstance(value, str):
        if len(value) < s.get("minLength", 0) or len(value) > s.get("maxLength", len(value)):
            return False
        if "pattern" in s and not re.search(s["pattern"], value):
            return False
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in s and value < s["minimum"] or "maximum" in s and value > s["maximum"]:
            return False
    elif isinstance(value, list):
        if len(value) < s.get("minItems", 0) or len(value) > s.get("maxItems", len(value)):
            return False
        items = s.get("items")
        if isinstance(items, dict) and any(not fits(v, items, root) for v in value):
            return False
    elif isinstance(value, dict):
        props = s.get("properties", {})
        if any(k not in value for k in s.get("required", ())):
            return False
        extra = s.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                if not fits(v, props[k], root):
                    return False
            elif extra is False or isinstance(extra, dict) and not fits(v, extra, root):
                return False
    return True


def shortest(schema: object, root: dict | None = None, depth: int = 0) -> str:
    """The shortest JSON text valid under `schema` (an untyped schema: null)."""
    root = root if root is not None else schema if isinstance(schema, dict) else {}
    s = _resolve(schema, root)
    if depth > 16:
        return "null"
    if "const" in s:
        return json.dumps(s["const"])
    if s.get("enum"):
        return min((json.dumps(v) for v in s["enum"]), key=len)
    for key in ("anyOf", "oneOf"):
        if s.get(key):
            return min((shortest(part, root, depth + 1) for part in s[key]), key=len)
    kind = s.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds:
        return "null"
    kind = kinds[0] if kinds[0] is not None else ("object" if "properties" in s or "required" in s else None)
    if kind == "string":
        return '"' + "a" * s.get("minLength", 0) + '"'
    if kind in ("integer", "number"):
        low = s.get("minimum", s.get("exclusiveMinimum", -1) + 1 if "exclusiveMinimum" in s else 0)
        high = s.get("maximum")
        value = low if low > 0 or high is None or high >= 0 else high
        return str(int(value) if kind == "integer" or float(value).is_integer() else value)
    if kind == "boolean":
        return "false"
    if kind == "array":
        item = shortest(s.get("items", {}), root, depth + 1)
        return "[" + ", ".join([item] * s.get("minItems", 0)) + "]"
    if kind == "object":
        props = _properties(s, root)
        fields = [f"{json.dumps(k)}: {shortest(props.get(k, {}), root, depth + 1)}" for k in _required(s, root)]
        return "{" + ", ".join(fields) + "}"
    return "null"


def step_texts(schema: object, root: dict | None = None, depth: int = 0) -> list[str]:
    """What one more token of an answer can add to its shortest end: in every object of the
    schema a key being opened (`"key": <shortest value>`), in every array an item (its shortest
    value). The longest of these bounds how much an end grows in one step."""
    root = root if root is not None else schema if isinstance(schema, dict) else {}
    s = _resolve(schema, root)
    if depth > 16:
        return []
    out: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for part in s.get(key) or ():
            out += step_texts(part, root, depth + 1)
    for name, sub in _properties(s, root).items():
        out.append(f"{json.dumps(name)}: {shortest(sub, root, depth + 1)}")
        out += step_texts(sub, root, depth + 1)
    if isinstance(s.get("items"), dict):
        out.append(shortest(s["items"], root, depth + 1))
        out += step_texts(s["items"], root, depth + 1)
    return out


def _properties(s: dict, root: dict) -> dict:
    props = dict(s.get("properties", {}))
    for part in s.get("allOf", ()):
        props.update(_resolve(part, root).get("properties", {}))
    return props


def _required(s: dict, root: dict) -> list[str]:
    required = list(s.get("required", ()))
    for part in s.get("allOf", ()):
        required += [k for k in _resolve(part, root).get("required", ()) if k not in required]
    return required


class _Frame:
    """An open object or array: where in it the text is, and its schema."""

    __slots__ = ("kind", "state", "schema", "keys", "key", "items")

    def __init__(self, kind: str, schema: dict):
        self.kind, self.schema = kind, schema
        self.state = "first"  # object: first, key, colon, value, next; array: first, value, next
        self.keys: list[str] = []
        self.key = ""
        self.items = 0


_WS = " \t\n\r"
_LITERALS = ("true", "false", "null")
_NUMBER = set("0123456789+-.eE")


class JsonPrefix:
    """Text fed piece by piece; tells whether it is still the start of one JSON value (`valid`),
    where that value ended (`end`: the index just past it, None until then), and the shortest
    text that ends it as a value valid under `schema` (`closing()`). The check is syntax only:
    the schema's constraints shape the closing, and the grammar that wrote the text kept them."""

    def __init__(self, schema: dict | None = None):
        self.root = schema or {}
        self.valid = True
        self.end: int | None = None
        self.started = False
        self._n = 0
        self._stack: list[_Frame] = []
        self._scalar = ""  # "string", "key", "number", "literal", or "" between tokens
        self._buf = ""  # the open scalar's text so far
        self._escape = ""  # an open escape: "\\" or "\\u" plus its hex digits
        self._value_schema: dict = _resolve(self.root, self.root)

    def feed(self, text: str) -> None:
        for ch in text:
            if not self.valid or self.end is not None:
                return
            self._char(ch)
            self._n += 1

    # -- the scanner
    def _char(self, ch: str) -> None:
        if self._scalar in ("string", "key"):
            self._string_char(ch)
            return
        if self._scalar == "number":
            if ch in _NUMBER:
                self._buf += ch
                return
            self._end_scalar()
        elif self._scalar == "literal":
            self._buf += ch
            word = next((w for w in _LITERALS if w.startswith(self._buf)), None)
            if word is None:
                self.valid = False
            elif word == self._buf:
                self._end_scalar()
            return
        if self.end is not None:
            return
        if ch in _WS:
            return
        top = self._stack[-1] if self._stack else None
        if top is None:
            if self.started:
                self.valid = False
            else:
                self._start_value(ch, self._value_schema)
            return
        if top.kind == "object":
            if top.state in ("first", "key") and ch == '"':
                self._scalar, self._buf = "key", ""
            elif top.state == "first" and ch == "}" or top.state == "next" and ch == "}":
                self._close()
            elif top.state == "colon" and ch == ":":
                top.state = "value"
            elif top.state == "value":
                self._start_value(ch, self._child_schema(top))
            elif top.state == "next" and ch == ",":
                top.state = "key"
            else:
                self.valid = False
        else:
            if top.state in ("first", "next") and ch == "]":
                self._close()
            elif top.state == "next" and ch == ",":
                top.state = "value"
            elif top.state in ("first", "value"):
                self._start_value(ch, self._child_schema(top))
            else:
                self.valid = False

    def _start_value(self, ch: str, schema: dict) -> None:
        self.started = True
        if ch == "{":
            self._stack.append(_Frame("object", schema))
        elif ch == "[":
            self._stack.append(_Frame("array", schema))
        elif ch == '"':
            self._scalar, self._buf = "string", ""
        elif ch in "-0123456789":
            self._scalar, self._buf = "number", ch
        elif ch in "tfn":
            self._scalar, self._buf = "literal", ch
        else:
            self.valid = False

    def _string_char(self, ch: str) -> None:
        if ch != '"' or self._escape:
            self._buf += ch  # as written, escapes included
        if self._escape:
            if self._escape == "\\":
                if ch == "u":
                    self._escape = "\\u"
                elif ch in '"\\/bfnrt':
                    self._escape = ""
                else:
                    self.valid = False
            elif ch in "0123456789abcdefABCDEF":
                self._escape += ch
                if len(self._escape) == 6:
                    self._escape = ""
            else:
                self.valid = False
        elif ch == "\\":
            self._escape = "\\"
        elif ch == '"':
            if self._scalar == "key":
                top = self._stack[-1]
                top.key, top.state = json.loads('"' + self._buf + '"'), "colon"
                top.keys.append(top.key)
                self._scalar, self._buf = "", ""
            else:
                self._end_scalar()
        elif ch < " ":
            self.valid = False

    def _end_scalar(self) -> None:
        if self._scalar == "number":
            try:
                float(self._buf)
            except ValueError:
                self.valid = False
                return
        self._scalar, self._buf = "", ""
        self._value_done()

    def _close(self) -> None:
        self._stack.pop()
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self.end = self._n + (0 if self._scalar == "number" else 1)
            return
        top = self._stack[-1]
        top.state = "next"
        top.items += top.kind == "array"

    def _child_schema(self, frame: _Frame) -> dict:
        s = frame.schema
        if frame.kind == "object":
            props = _properties(s, self.root)
            extra = s.get("additionalProperties")
            return _resolve(props.get(frame.key, extra if isinstance(extra, dict) else {}), self.root)
        items = s.get("items", {})
        return _resolve(items if isinstance(items, dict) else {}, self.root)

    # -- the closing
    def closing(self) -> str:
        """The shortest text that, written after what was fed, ends the value validly."""
        if not self.valid or self.end is not None:
            return ""
        if not self._scalar and not self.started:
            return shortest(self.root, self.root)
        out, closed_key = self._close_scalar()
        for depth in range(len(self._stack) - 1, -1, -1):
            frame = self._stack[depth]
            # a frame below the top, or the top with a scalar open, has just received its child value
            child = depth < len(self._stack) - 1 or bool(self._scalar)
            state = "next" if child else frame.state
            if frame.kind == "object":
                props = _properties(frame.schema, self.root)
                keys = frame.keys + ([closed_key] if closed_key is not None and depth == len(self._stack) - 1 else [])
                if state == "colon":
                    out += ": " + shortest(props.get(frame.key, {}), self.root)
                elif state == "value":
                    out += shortest(props.get(frame.key, {}), self.root)
                missing = [k for k in _required(frame.schema, self.root) if k not in keys]
                if state == "key":  # after a comma a key must follow
                    key = missing.pop(0) if missing else next((k for k in props if k not in keys), "_")
                    out += f"{json.dumps(key)}: {shortest(props.get(key, {}), self.root)}"
                    keys.append(key)
                fields = [f"{json.dumps(k)}: {shortest(props.get(k, {}), self.root)}" for k in missing]
                out += (", " if keys and fields else "") + ", ".join(fields) + "}"
            else:
                items = frame.schema.get("items", {})
                item = shortest(items if isinstance(items, dict) else {}, self.root)
                n = frame.items + (child or state == "value")
                if state == "value":
                    out += item
                out += "".join(", " + item if n + i else item for i in range(max(0, frame.schema.get("minItems", 0) - n))) + "]"
        return out

    def _close_scalar(self) -> tuple[str, str | None]:
        """The end of the scalar open at the end of the text (none open: ""), and the key it
        closed, if a key."""
        out, closed_key = "", None
        if self._scalar in ("string", "key"):
            if self._escape == "\\":
                out += "\\"
            elif self._escape:
                out += "0" * (6 - len(self._escape))
            elif self._scalar == "string":
                # a string the schema lists: the rest of the shortest listed one it begins
                value_schema = self._child_schema(self._stack[-1]) if self._stack else self._value_schema
                options = [v for v in value_schema.get("enum", [value_schema.get("const")]) if isinstance(v, str)]
                written = [json.dumps(v, ensure_ascii=False)[1:-1] for v in options]
                rest = [v[len(self._buf):] for v in written if v.startswith(self._buf)]
                out += min(rest, key=len) if rest else ""
            if self._scalar == "key":
                # a key the schema has that begins so: a missing required one first
                top = self._stack[-1]
                props = _properties(top.schema, self.root)
                names = [k for k in _required(top.schema, self.root) if k not in top.keys] + [k for k in props if k not in top.keys]
                keys = [json.dumps(k, ensure_ascii=False)[1:-1] for k in names]
                match = next((k for k in keys if k.startswith(self._buf + out)), None)
                out += match[len(self._buf + out):] if match is not None else ""
            out += '"'
            if self._scalar == "key":
                closed_key = json.loads('"' + self._buf + out)  # out ends an open escape first
                out += ": " + shortest(_properties(self._stack[-1].schema, self.root).get(closed_key, {}), self.root)
        elif self._scalar == "number":
            out += "0" if self._buf[-1] in "+-.eE" else ""
        elif self._scalar == "literal":
            out += next(w for w in _LITERALS if w.startswith(self._buf))[len(self._buf):]
        return out, closed_key
