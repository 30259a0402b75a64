"""A tiny reranker GGUF for tests: a two-layer BERT cross-encoder with a classification head
(`cls`, `cls.output`: one score per query-document pair, llama.cpp's rank pooling), random
weights from a fixed seed and a small WordPiece vocabulary of letters and a few words. No small
reranker ships as a package; the scores it gives mean nothing, but llama.cpp computes them the
same way it does for a real one."""

from __future__ import annotations

import string
from pathlib import Path

import gguf
from tiny_mmproj import random_weights, write_gguf

N_EMBD = 32
N_HEAD = 2
N_FF = 64
N_LAYER = 2
N_CTX = 128
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "cat", "dog", "sat", "on", "mat", "paris", "is", "capital", "of", "france", "what", "city"]


def vocabulary() -> list[str]:
    # WordPiece as llama.cpp stores it: a word's first piece marked with U+2581, the rest bare
    return SPECIALS + ["\u2581" + w for w in WORDS] + ["\u2581" + c for c in string.ascii_lowercase + string.digits + string.punctuation] \
        + list(string.ascii_lowercase + string.digits)


def write_tiny_reranker(dest: Path, seed: int = 0) -> Path:
    weight = random_weights(seed)
    tokens = vocabulary()
    writer = gguf.GGUFWriter(str(dest), "bert")
    writer.add_name("tiny-reranker")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(N_FF)
    writer.add_block_count(N_LAYER)
    writer.add_head_count(N_HEAD)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_type_count(2)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(1)
    writer.add_bos_token_id(2)
    writer.add_sep_token_id(3)
    writer.add_mask_token_id(4)
    tensors = {
        "token_embd.weight": weight(len(tokens), N_EMBD, scale=0.5),
        "token_types.weight": weight(2, N_EMBD, scale=0.5),
        "position_embd.weight": weight(N_CTX, N_EMBD, scale=0.5),
        "token_embd_norm.weight": 1 + weight(N_EMBD, scale=0.1),
        "token_embd_norm.bias": weight(N_EMBD, scale=0.1),
        "cls.weight": weight(N_EMBD, N_EMBD, scale=0.05),  # tanh unsaturated: scores differ
        "cls.bias": weight(N_EMBD, scale=0.1),
        "cls.output.weight": weight(1, N_EMBD),
        "cls.output.bias": weight(1, scale=0.1),
    }
    for i in range(N_LAYER):
        for name, rows, cols in (("attn_q", N_EMBD, N_EMBD), ("attn_k", N_EMBD, N_EMBD), ("attn_v", N_EMBD, N_EMBD),
                                 ("attn_output", N_EMBD, N_EMBD), ("ffn_up", N_FF, N_EMBD), ("ffn_down", N_EMBD, N_FF)):
            tensors[f"blk.{i}.{name}.weight"] = weight(rows, cols)
            tensors[f"blk.{i}.{name}.bias"] = weight(rows, scale=0.1)
        for norm in ("attn_output_norm", "layer_output_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = 1 + weight(N_EMBD, scale=0.1)
            tensors[f"blk.{i}.{norm}.bias"] = weight(N_EMBD, scale=0.1)
    write_gguf(writer, tensors)
    return dest
