"""A tiny M-RoPE pair for tests: a Qwen2-VL-layout text model (llama.cpp arch `qwen2vl`) and a
`qwen2vl_merger` projector for it, both written with random weights from a fixed seed, since no
Qwen2-VL model ships offline. The pair exists to show what llama.cpp does with an M-RoPE image's
positions (docs/mrope-notes.md); it can say nothing about what a picture shows.

- Text model (src/models/qwen2vl.cpp): SmolLM2's tokenizer metadata copied from its GGUF (so its
  vocabulary and chat tokens), TEXT_LAYERS blocks of width TEXT_EMBD, tied output, M-RoPE with
  `qwen2vl.rope.dimension_sections` summing to half a head (Qwen2-VL's [16, 24, 24, 0] scaled).
- Projector (tools/mtmd/models/qwen2vl.cpp): the two-frame patch convolution
  (`v.patch_embd.weight` and `.weight.1`, no patch bias: the graph asserts it), ViT blocks with
  2-D M-RoPE inside, then 2x2 patches merged into one token by mm.0 -> GELU -> mm.2, out to
  TEXT_EMBD. Its preprocessing keeps a picture's aspect, rounds each side to a multiple of
  PATCH_SIZE * 2, and clamps the pixel count to 8..4096 tokens: a 40x40 picture becomes 10x10
  patches, 5x5 = 25 image tokens that take max(5, 5) = 5 positions.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tiny_mmproj import MM_HIDDEN, N_EMBD, clip_header, random_weights, vit_blocks, write_gguf

TEXT_EMBD = 64
TEXT_HEADS = 4
TEXT_KV_HEADS = 2
TEXT_FF = 128
TEXT_LAYERS = 2
#: M-RoPE sections (temporal, height, width, unused) in rotated pairs: half the head of 16
ROPE_SECTIONS = [2, 3, 3, 0]
PATCH_SIZE = 4


def tokens_per_side(side: int) -> int:
    """Image tokens along a picture's side of `side` pixels (a multiple of 2 * PATCH_SIZE, which
    the preprocessing keeps): patches merged two by two."""
    return side // (2 * PATCH_SIZE)


def write_tiny_qwen2vl(dest: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the text model to `dest`, its tokenizer (every `tokenizer.*` key) and vocabulary size
    taken from the GGUF `tokenizer_from` (SmolLM2's); returns `dest`."""
    source = gguf.GGUFReader(str(tokenizer_from))
    n_vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    weight = random_weights(seed)
    head = TEXT_EMBD // TEXT_HEADS
    assert sum(ROPE_SECTIONS) * 2 == head, "Qwen2-VL's sections cover the rotated half of a head"

    writer = gguf.GGUFWriter(str(dest), "qwen2vl")
    writer.add_name("edgechat tiny M-RoPE test model (random weights)")
    writer.add_context_length(4096)
    writer.add_embedding_length(TEXT_EMBD)
    writer.add_block_count(TEXT_LAYERS)
    writer.add_feed_forward_length(TEXT_FF)
    writer.add_head_count(TEXT_HEADS)
    writer.add_head_count_kv(TEXT_KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_sections(ROPE_SECTIONS)
    writer.add_vocab_size(n_vocab)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)

    tensors = {
        "token_embd.weight": weight(n_vocab, TEXT_EMBD, scale=1.0),
        "output_norm.weight": np.ones(TEXT_EMBD, np.float32),
    }
    kv = TEXT_KV_HEADS * head
    for il in range(TEXT_LAYERS):
        tensors |= {
            f"blk.{il}.attn_norm.weight": np.ones(TEXT_EMBD, np.float32),
            f"blk.{il}.attn_q.weight": weight(TEXT_EMBD, TEXT_EMBD),
            f"blk.{il}.attn_k.weight": weight(kv, TEXT_EMBD),
            f"blk.{il}.attn_v.weight": weight(kv, TEXT_EMBD),
            f"blk.{il}.attn_output.weight": weight(TEXT_EMBD, TEXT_EMBD),
            f"blk.{il}.ffn_norm.weight": np.ones(TEXT_EMBD, np.float32),
            f"blk.{il}.ffn_gate.weight": weight(TEXT_FF, TEXT_EMBD),
            f"blk.{il}.ffn_up.weight": weight(TEXT_FF, TEXT_EMBD),
            f"blk.{il}.ffn_down.weight": weight(TEXT_EMBD, TEXT_FF),
        }
    write_gguf(writer, tensors)
    return dest


def write_tiny_qwen2vl_mmproj(dest: Path, n_embd_text: int = TEXT_EMBD, seed: int = 0) -> Path:
    """Write the `qwen2vl_merger` projector with output width `n_embd_text` to `dest`; returns it."""
    weight = random_weights(seed)
    writer = gguf.GGUFWriter(str(dest), "clip")
    # the merger's preprocessing sizes a picture by its own pixels; image_size is only read
    clip_header(writer, "edgechat tiny M-RoPE test projector (random weights)", "qwen2vl_merger", 8 * PATCH_SIZE,
                PATCH_SIZE, n_embd_text)

    # the patch embedding is a convolution per frame of a two-frame pair; a still image goes
    # through both and the results are summed
    conv_scale = 1.0 / np.sqrt(2 * 3 * PATCH_SIZE * PATCH_SIZE)
    tensors = {
        "v.patch_embd.weight": weight(N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=conv_scale),
        "v.patch_embd.weight.1": weight(N_EMBD, 3, PATCH_SIZE, PATCH_SIZE, scale=conv_scale),
    }
    tensors |= vit_blocks(weight)
    # the merger: 2x2 neighbouring patches (4 * N_EMBD) -> one text embedding
    tensors["mm.0.weight"] = weight(MM_HIDDEN, 4 * N_EMBD)
    tensors["mm.0.bias"] = np.zeros(MM_HIDDEN, np.float32)
    tensors["mm.2.weight"] = weight(n_embd_text, MM_HIDDEN)
    tensors["mm.2.bias"] = np.zeros(n_embd_text, np.float32)
    write_gguf(writer, tensors)
    return dest
