"""llama.cpp's vocabulary of a GGUF: tokenizing, a token's text, special and fill-in-the-middle tokens.

Every backend's text goes through it: `LlamaBackend` is one over its loaded model, and the ONNX
runner reads the vocabulary GGUF in its folder (the model's tokenizer alone, no weights).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L

from edgechat.engine.runners.llamacpp import ensure_backend
from edgechat.errors import ModelFormatError

#: a model's image/audio/video placeholder tokens: GGUF marks them user-defined, not control, so
#: llama.cpp renders them as text, but they are never part of an answer (Gemma 3 270M base wrote
#: runs of `<start_of_image>`). Other user-defined tokens (`<think>`, `<tool_call>`) are text the
#: output processor and the tool parser read, so they stay.
_MEDIA_MARKER = re.compile(rb"<\|?[a-z_]*(?:image|img|vision|video|audio)[a-z0-9_]*\|?>", re.IGNORECASE)


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle token ids (-1: none), as llama.cpp reads them: the GGUF's
    tokenizer.ggml.fim_*_token_id keys, the older prefix/suffix/middle ones, else the tokens known
    by their text (<|fim_prefix|>, <PRE>, ...)."""

    pre: int = -1
    suf: int = -1
    mid: int = -1
    pad: int = -1
    #: repository-level context (Qwen2.5-Coder's <|repo_name|>, <|file_sep|>)
    rep: int = -1
    sep: int = -1

    def missing(self) -> list[str]:
        """The tokens a fill needs and the vocabulary lacks."""
        return [name for name, tok in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid)) if tok < 0]



class Vocabulary:
    """The vocabulary of a GGUF and its metadata. Given only a path it reads the vocabulary alone
    (`vocab_only`: no weights, no context); a runner that loaded the whole model passes it as
    `model`. Either way `close` frees the model."""

    def __init__(self, path: Path, model=None):
        ensure_backend()
        self.path = Path(path)
        if model is None:
            params = L.llama_model_default_params()
            params.vocab_only = True
            model = L.llama_model_load_from_file(os.fsencode(self.path), params)
            if not model:
                raise ModelFormatError(f"cannot read the vocabulary {path}; export the model again")
        self.model = model
        self.vocab = L.llama_model_get_vocab(model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self.bos = L.llama_vocab_bos(self.vocab)
        self.eos = L.llama_vocab_eos(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    # --- metadata -------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            L.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    @property
    def vocab_type(self) -> int:
        """llama.cpp's tokenizer type (SPM, BPE, WPM, ...)."""
        return L.llama_vocab_type(self.vocab)

    @property
    def eot(self) -> int:
        """The end-of-turn token (-1: none)."""
        return L.llama_vocab_eot(self.vocab)

    def rerank_pair(self, query: str, document: str) -> list[int]:
        """A reranker's input for one query and document, as llama-server builds it: the GGUF's
        `rerank` template with both filled in, else [BOS] query [EOS] [SEP] document [EOS], each
        marker where the vocabulary adds it (BERT: [CLS] query [SEP] document)."""
        template = L.llama_model_chat_template(self.model, b"rerank")
        if template:
            text = template.decode().replace("{query}", query).replace("{document}", document)
            return self.tokenize(text, add_bos=False, special=True)
        v = self.vocab
        eos = self.eos if self.eos >= 0 else L.llama_vocab_sep(v)
        add_eos = [eos] if L.llama_vocab_get_add_eos(v) else []
        tokens = [self.bos] if self.add_bos else []
        tokens += self.tokenize(query, special=False) + add_eos
        tokens += [L.llama_vocab_sep(v)] if L.llama_vocab_get_add_sep(v) else []
        return tokens + self.tokenize(document, special=False) + add_eos

    def fim_tokens(self) -> FimTokens:
        """The fill-in-the-middle tokens (engine/prompt/fim.py), as llama.cpp found them in the GGUF."""
        v = self.vocab
        return FimTokens(L.llama_vocab_fim_pre(v), L.llama_vocab_fim_suf(v), L.llama_vocab_fim_mid(v),
                         L.llama_vocab_fim_pad(v), L.llama_vocab_fim_rep(v), L.llama_vocab_fim_sep(v))

    def token_bytes(self, token: int) -> bytes:
        """A token's text in the vocabulary, as stored (no decoding: compared across vocabularies)."""
        return L.llama_vocab_get_text(self.vocab, token) or b""

    # --- text -----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_bos, special)
        return buf[:n]

    def piece(self, token: int) -> bytes:
        """The bytes one token adds to the output: control tokens and media markers render as
        nothing (see _MEDIA_MARKER)."""
        cached = self._pieces.get(token)
        if cached is None:
            n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, False)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, big, -n, 0, False)
                cached = big.raw[:n]
            else:
                cached = self._piece_buf.raw[:n]
            if _MEDIA_MARKER.fullmatch(cached) and L.llama_vocab_get_attr(self.vocab, token) & L.LLAMA_TOKEN_ATTR_USER_DEFINED:
                cached = b""
            self._pieces[token] = cached
        return cached

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        cap = max(64, len(tokens) * 16)
        buf = ctypes.create_string_buffer(cap)
        n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, cap, False, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_detokenize(self.vocab, arr, len(tokens), buf, -n, False, special)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def is_control(self, token: int) -> bool:
        return bool(L.llama_vocab_is_control(self.vocab, token))

    def close(self) -> None:
        if getattr(self, "model", None):
            L.llama_model_free(self.model)
            self.model = None
