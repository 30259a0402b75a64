"""Tokenizer conversion: a Hugging Face tokenizer folder to the vocabulary keys llama.cpp reads.

Two kinds: GPT-2 style byte-level BPE from tokenizer.json (tokenizer.ggml.model "gpt2", with
tokenizer.ggml.pre naming the pre-tokenizer regexes llama.cpp must apply), and SentencePiece
(model "llama") from tokenizer.model or, failing that, an equivalent tokenizer.json.
Special token ids, add_bos/add_eos, merges and the chat template come through gguf's SpecialVocab.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf import GGUFWriter, SpecialVocab, TokenType

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
    special: SpecialVocab | None = field(default=None, repr=False)

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
            self.special.add_to_gguf(writer, quiet=True)


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


def _special_vocab(folder: Path, tok: dict | None, n_vocab: int, merges: bool) -> SpecialVocab:
    # SpecialVocab logs each choice at INFO and odd templates at WARNING; the CLI prints its own summary.
    log = logging.getLogger("gguf.vocab")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        special = SpecialVocab(folder, load_merges=merges, n_vocab=n_vocab)
    except ValueError as exc:
        raise QuantizeError(f"unsupported tokenizer in {folder}: {exc}") from None
    finally:
        log.setLevel(level)
    post = (tok or {}).get("post_processor") or {}
    if post.get("type") == "TemplateProcessing" and "bos" not in special.add_special_token:
        # A template that adds no token before the text means no BOS; left unset, llama.cpp
        # would add one and tokenize differently from the Hugging Face tokenizer.
        single = post.get("single") or []
        if not single or "SpecialToken" not in single[0]:
            special.add_special_token["bos"] = False
    return special


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
    return Vocab("gpt2", pre, filled, types, special=_special_vocab(folder, tok, n_vocab, merges=True))


def _read_sentencepiece(path: Path) -> tuple[list[tuple[str, float, int]], bool]:
    """Pieces (text, score, type) and the add_dummy_prefix flag from a SentencePiece ModelProto.

    A small protobuf reader rather than the sentencepiece package: only fields 1 (pieces) and
    3 (normalizer_spec) are needed, and this keeps the quantizer free of that dependency.
    """
    data = path.read_bytes()

    def varint(buf: bytes, pos: int) -> tuple[int, int]:
        result = shift = 0
        while True:
            if pos >= len(buf):
                raise QuantizeError(f"{path.name} is truncated or not a SentencePiece model")
            b = buf[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result, pos
            shift += 7

    def fields(buf: bytes):
        pos = 0
        while pos < len(buf):
            key, pos = varint(buf, pos)
            num, wire = key >> 3, key & 7
            if wire == 0:
                val, pos = varint(buf, pos)
            elif wire == 1:
                val, pos = buf[pos : pos + 8], pos + 8
            elif wire == 2:
                n, pos = varint(buf, pos)
                val, pos = buf[pos : pos + n], pos + n
            elif wire == 5:
                val, pos = buf[pos : pos + 4], pos + 4
            else:
                raise QuantizeError(f"{path.name} is not a SentencePiece model")
            yield num, wire, val

    pieces = []
    add_dummy_prefix = True
    for num, wire, val in fields(data):
        if num == 1 and wire == 2:
            text, score, kind = "", 0.0, int(TokenType.NORMAL)
            for pnum, pwire, pval in fields(val):
                if pnum == 1 and pwire == 2:
                    text = pval.decode("utf-8")
                elif pnum == 2 and pwire == 5:
                    score = struct.unpack("<f", pval)[0]
                elif pnum == 3 and pwire == 0:
                    kind = pval
            pieces.append((text, score, kind))
        elif num == 3 and wire == 2:
            for nnum, nwire, nval in fields(val):
                if nnum == 3 and nwire == 0:
                    add_dummy_prefix = bool(nval)
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
        special=_special_vocab(folder, tok, n_vocab, merges=False),
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
