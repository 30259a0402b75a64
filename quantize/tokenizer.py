"""Tokenizer conversion: a Hugging Face tokenizer folder to the vocabulary keys llama.cpp reads.

Two kinds: GPT-2 style byte-level BPE from tokenizer.json (tokenizer.ggml.model "gpt2", with
tokenizer.ggml.pre naming the pre-tokenizer regexes llama.cpp must apply), and SentencePiece
(model "llama") from tokenizer.model or, failing that, an equivalent tokenizer.json.
Special token ids, add_bos/add_eos, merges and the chat template come from the tokenizer configs.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFWriter, TokenType

from quantize.errors import QuantizeError

# The pre-tokenizer regexes of tokenizer.json, as llama.cpp names them. Matched by the regex
# text itself, so a tokenizer whose splitting llama.cpp does not know is refused, not mangled.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    ("bytelevel-regex",): "gpt-2",
    ("digits-individual", "bytelevel-regex"): "smollm",
    ("split:" + _LLAMA3_SPLIT, "bytelevel"): "llama-bpe",
    ("split:" + _QWEN2_SPLIT, "bytelevel"): "qwen2",
}

# Added tokens that some repos leave unmarked although they are control tokens (llama.cpp's list).
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


@dataclass
class Vocab:
    model: str  # "gpt2" or "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    special: Specials | None = field(default=None, repr=False)

    def write(self, writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        if self.special is not None:
            self.special.write(writer)


def looks_special(text: str) -> bool:
    return (
        text in _LOOKS_SPECIAL
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QuantizeError(f"cannot read {path.name}: {exc}") from None


_SPECIAL_KINDS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


@dataclass
class Specials:
    """Special token ids, add_bos/add_eos, merges and the chat template."""

    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    merges: list[str] = field(default_factory=list)
    chat_template: str | None = None

    def write(self, w: GGUFWriter) -> None:
        if self.merges:
            w.add_token_merges(self.merges)
        for kind, i in self.ids.items():
            getattr(w, f"add_{kind}_token_id")(i)
        for kind, value in self.add.items():
            getattr(w, f"add_add_{kind}_token")(value)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _specials(folder: Path, tok: dict | None, n_vocab: int, merges: bool) -> Specials:
    """Read from tokenizer.json (already parsed: it can be large), tokenizer_config.json and config.json."""
    tok = tok or {}
    tok_config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    config = _read_json(folder / "config.json")
    out = Specials()

    by_text = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab = tok.get("model", {}).get("vocab")
    for kind in _SPECIAL_KINDS:
        text = _token_text(tok_config.get(f"{kind}_token"))
        i = by_text.get(text) if text is not None else None
        if i is None and text is not None and isinstance(vocab, dict):
            i = vocab.get(text)
        if i is None:
            i = config.get(f"{kind}_token_id")
            if isinstance(i, list):
                i = i[0] if i else None
        if isinstance(i, int) and 0 <= i < n_vocab:
            out.ids[kind] = i

    for kind in ("bos", "eos"):
        if isinstance(tok_config.get(f"add_{kind}_token"), bool):
            out.add[kind] = tok_config[f"add_{kind}_token"]
    post = tok.get("post_processor") or {}
    for step in post.get("processors", [post]):
        if step.get("type") != "TemplateProcessing":
            continue
        # The single-sequence template says which special tokens the tokenizer puts around text;
        # llama.cpp must do the same or its ids differ from the Hugging Face tokenizer's.
        single = step.get("single") or []
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
        bos_text = _token_text(tok_config.get("bos_token"))
        eos_text = _token_text(tok_config.get("eos_token"))
        out.add.setdefault("bos", first is not None and first == bos_text)
        out.add.setdefault("eos", last is not None and last == eos_text)

    if merges:
        raw = tok.get("model", {}).get("merges") or []
        if raw and isinstance(raw[0], list):
            # tokenizer.json's newer pair format allows spaces inside a part; GGUF merges are
            # space-separated, so a space inside a part is stored shifted by 256 as llama.cpp expects
            out.merges = [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in raw]
        else:
            out.merges = list(raw)

    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: llama.cpp uses the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (folder / "chat_template.json").is_file():
        template = _read_json(folder / "chat_template.json").get("chat_template")
    out.chat_template = template if isinstance(template, str) else None
    return out


def _pre_signature(pre: dict | None) -> tuple[str, ...]:
    if not pre:
        return ()
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    sig = []
    for step in steps or []:
        kind = step.get("type")
        if kind == "ByteLevel":
            sig.append("bytelevel-regex" if step.get("use_regex", True) else "bytelevel")
        elif kind == "Digits":
            sig.append("digits-individual" if step.get("individual_digits") else "digits")
        elif kind == "Split":
            pattern = step.get("pattern", {})
            sig.append("split:" + str(pattern.get("Regex", pattern.get("String"))))
        else:
            sig.append(str(kind))
    return tuple(sig)


def _bpe_vocab(folder: Path, tok: dict, n_vocab: int) -> Vocab:
    signature = _pre_signature(tok.get("pre_tokenizer"))
    pre = _PRE_TOKENIZERS.get(signature)
    if pre is None:
        raise QuantizeError(
            f"the tokenizer's pre-tokenizer ({', '.join(signature) or 'none'}) is not one llama.cpp implements; "
            "cannot convert this tokenizer"
        )
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens: list[str | None] = [None] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    for text, i in vocab.items():
        if i < n_vocab:
            tokens[i], types[i] = text, int(TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        i, text = added["id"], added["content"]
        if i >= n_vocab:
            continue
        if added.get("special") or looks_special(text):
            types[i] = int(TokenType.CONTROL)
        else:
            # llama.cpp matches user-defined tokens against raw text, so SentencePiece spaces become spaces
            text = text.replace("\u2581", " ")
            types[i] = int(TokenType.USER_DEFINED)
        tokens[i] = text
    filled = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    return Vocab("gpt2", pre, filled, types, special=_specials(folder, tok, n_vocab, merges=True))


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


def _skip(buf: bytes, pos: int, wire: int) -> int:
    if wire == 0:
        return _varint(buf, pos)[1]
    if wire == 1:
        return pos + 8
    if wire == 2:
        n, pos = _varint(buf, pos)
        return pos + n
    if wire == 5:
        return pos + 4
    raise ValueError(f"wire type {wire}")


def _read_sentencepiece(path: Path) -> tuple[list[tuple[str, float, int]], bool]:
    """Pieces (text, score, type) and the add_dummy_prefix flag from a SentencePiece ModelProto.

    A small protobuf reader rather than the sentencepiece package: only field 1 (pieces: text 1,
    score 2, type 3) and field 3 (normalizer_spec: add_dummy_prefix 3) are needed, and this keeps
    the quantizer free of that dependency. Written as flat loops: Gemma has 262k pieces.
    """
    buf = path.read_bytes()
    unpack_float = struct.Struct("<f").unpack_from
    pieces = []
    add_dummy_prefix = True
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key, pos = _varint(buf, pos)
            num, wire = key >> 3, key & 7
            if wire != 2 or num not in (1, 3):
                pos = _skip(buf, pos, wire)
                continue
            n, pos = _varint(buf, pos)
            stop = pos + n
            if num == 1:
                text, score, kind = "", 0.0, 1
                while pos < stop:
                    key = buf[pos]  # piece fields are 1..3: one-byte keys
                    pos += 1
                    if key == 0x0A:
                        ln, pos = _varint(buf, pos)
                        text = buf[pos : pos + ln].decode("utf-8")
                        pos += ln
                    elif key == 0x15:
                        score = unpack_float(buf, pos)[0]
                        pos += 4
                    elif key == 0x18:
                        kind, pos = _varint(buf, pos)
                    else:
                        pos = _skip(buf, pos, key & 7)
                pieces.append((text, score, kind))
            else:
                while pos < stop:
                    key, pos = _varint(buf, pos)
                    if key == 0x18:
                        value, pos = _varint(buf, pos)
                        add_dummy_prefix = bool(value)
                    else:
                        pos = _skip(buf, pos, key & 7)
            pos = stop
    except (IndexError, ValueError, UnicodeDecodeError, struct.error):
        raise QuantizeError(f"{path.name} is truncated or not a SentencePiece model") from None
    if not pieces:
        raise QuantizeError(f"{path.name} has no pieces; it is not a SentencePiece model")
    return pieces, add_dummy_prefix


def _spm_vocab(folder: Path, tok: dict | None, n_vocab: int) -> Vocab:
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    add_space_prefix = None
    model_file = folder / "tokenizer.model"
    if model_file.is_file():
        # SentencePiece's piece types use the same numbers as GGUF token types.
        pieces, add_space_prefix = _read_sentencepiece(model_file)
        for i, (text, score, kind) in enumerate(pieces[:n_vocab]):
            tokens[i], scores[i], types[i] = text, score, kind
    else:
        assert tok is not None, "convert_vocab passes no tokenizer.json only beside a tokenizer.model"
        model = tok["model"]
        if model["type"] == "Unigram":
            for i, (text, score) in enumerate(model["vocab"][:n_vocab]):
                tokens[i], scores[i], types[i] = text, float(score), int(TokenType.NORMAL)
            if model.get("unk_id") is not None and model["unk_id"] < n_vocab:
                types[model["unk_id"]] = int(TokenType.UNKNOWN)
        else:
            # A SentencePiece BPE model numbers its pieces in merge order, and llama.cpp merges the
            # highest-scoring pair first: a score of -id reproduces that order.
            for text, i in model["vocab"].items():
                if i < n_vocab:
                    tokens[i], scores[i], types[i] = text, -float(i), int(TokenType.NORMAL)
                    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                        types[i], scores[i] = int(TokenType.BYTE), 0.0
            unk = model.get("unk_token")
            if unk in model["vocab"] and model["vocab"][unk] < n_vocab:
                types[model["vocab"][unk]] = int(TokenType.UNKNOWN)
        for added in tok.get("added_tokens", []):
            if added["id"] < n_vocab and types[added["id"]] == int(TokenType.NORMAL):
                types[added["id"]] = int(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
    # Like llama.cpp's converter: added tokens override pieces; the special ones become control tokens.
    added_file = folder / "added_tokens.json"
    if added_file.is_file():
        for text, i in _read_json(added_file).items():
            if i < n_vocab:
                tokens[i], scores[i], types[i] = text, -1000.0, int(TokenType.USER_DEFINED)
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        for key, data in _read_json(config_file).get("added_tokens_decoder", {}).items():
            i, text = int(key), data["content"]
            if i >= n_vocab:
                continue
            if data.get("special") or looks_special(text):
                types[i] = int(TokenType.CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types[i] = int(TokenType.USER_DEFINED)
            tokens[i], scores[i] = text, -1000.0
    return Vocab(
        "llama", "default", tokens, types, scores=scores, add_space_prefix=add_space_prefix,
        special=_specials(folder, tok, n_vocab, merges=False),
    )


def convert_vocab(folder: Path, n_vocab: int, *, prefer_sentencepiece: bool = True) -> Vocab:
    """The vocabulary of the checkpoint in `folder`, padded or cut to the model's `n_vocab` rows."""
    tok_file = folder / "tokenizer.json"
    tok = _read_json(tok_file) if tok_file.is_file() else None
    if prefer_sentencepiece and (folder / "tokenizer.model").is_file():
        return _spm_vocab(folder, tok, n_vocab)
    if tok is None:
        raise QuantizeError(f"no tokenizer.json or tokenizer.model in {folder}; download the tokenizer files too")
    model = tok.get("model", {})
    if model.get("type") == "BPE" and not model.get("byte_fallback") and "ByteLevel" in json.dumps(tok.get("pre_tokenizer")):
        return _bpe_vocab(folder, tok, n_vocab)
    if model.get("type") == "Unigram" or (model.get("type") == "BPE" and model.get("byte_fallback")):
        return _spm_vocab(folder, tok, n_vocab)
    raise QuantizeError(f"tokenizer type {model.get('type')!r} in {tok_file.name} is not supported")
