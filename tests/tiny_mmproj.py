"""Tiny vision projector GGUFs for tests: no small vision model ships as a package, so the tests
write one in the layout llama.cpp's clip loader reads (tools/mtmd/clip.cpp, clip-impl.h) and pair
it with an embedded text model.

Two projector types, the ones with the fewest tensors and a fixed-size resize as their only
preprocessing, each a patch embedding (a convolution), position embeddings and two ViT blocks:
- "mlp" (LLaVA): the graph stops at the second-to-last block, so one runs; then mm.0 -> GELU ->
  mm.2 out to the text model's width; causal image cells, one position each.
- "gemma3" (Gemma 3's): both blocks, an average pool (scale factor 2 here), an RMS norm and one
  projection; mtmd wraps the image in <start_of_image> ... <end_of_image> and decodes its cells
  with non-causal attention.
Random weights from a fixed seed: a file is the same every time it is written, and it can say
nothing about what a picture shows.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import gguf
import numpy as np

IMAGE_SIZE = 32
#: image tokens per picture, for either type: mlp's 4x4 patch grid (no class embedding),
#: gemma3's 8x8 grid pooled 2x2
N_IMAGE_TOKENS = 16
PATCH_SIZE = {"mlp": 8, "gemma3": 4}
GEMMA3_POOL = 2
N_EMBD = 64
N_HEAD = 4
N_FF = 128
N_LAYER = 2
MM_HIDDEN = 128


def text_embedding_width(model: Path) -> int:
    """The text model's embedding width, from its GGUF (`ARCH.embedding_length`)."""
    reader = gguf.GGUFReader(str(model))
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.embedding_length"].contents())


def random_weights(seed: int):
    """A maker of random float32 tensors from a fixed seed, each scaled as an initializer would."""
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float | None = None) -> np.ndarray:
        # numpy shapes are ggml's ne reversed: (rows = outputs, columns = inputs)
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return weight


def clip_header(writer: gguf.GGUFWriter, name: str, projector: str, image_size: int, patch: int, n_embd_text: int) -> None:
    """The keys llama.cpp's clip loader reads for a vision projector of this module's ViT size."""
    writer.add_name(name)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", projector)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", image_size)
    writer.add_uint32("clip.vision.patch_size", patch)
    writer.add_uint32("clip.vision.embedding_length", N_EMBD)
    writer.add_uint32("clip.vision.feed_forward_length", N_FF)
    writer.add_uint32("clip.vision.block_count", N_LAYER)
    writer.add_uint32("clip.vision.projection_dim", n_embd_text)
    writer.add_uint32("clip.vision.attention.head_count", N_HEAD)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])


def vit_blocks(weight) -> dict[str, np.ndarray]:
    """The ViT blocks' tensors (attention and FFN with biases, layer norms), from `weight`."""
    tensors = {}
    for il in range(N_LAYER):
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"v.blk.{il}.{name}.weight"] = weight(N_EMBD, N_EMBD)
            tensors[f"v.blk.{il}.{name}.bias"] = np.zeros(N_EMBD, np.float32)
        for name in ("ln1", "ln2"):
            tensors[f"v.blk.{il}.{name}.weight"] = np.ones(N_EMBD, np.float32)
            tensors[f"v.blk.{il}.{name}.bias"] = np.zeros(N_EMBD, np.float32)
        tensors[f"v.blk.{il}.ffn_up.weight"] = weight(N_FF, N_EMBD)
        tensors[f"v.blk.{il}.ffn_up.bias"] = np.zeros(N_FF, np.float32)
        tensors[f"v.blk.{il}.ffn_down.weight"] = weight(N_EMBD, N_FF)
        tensors[f"v.blk.{il}.ffn_down.bias"] = np.zeros(N_EMBD, np.float32)
    return tensors


def write_gguf(writer: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` and write the file out."""
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_mmproj(dest: Path, n_embd_text: int, projector: str = "mlp", seed: int = 0) -> Path:
    """Write a `projector` ("mlp" or "gemma3") to `dest` with output width `n_embd_text`;
    returns `dest`."""
    patch = PATCH_SIZE[projector]
    n_patches = (IMAGE_SIZE // patch) ** 2
    weight = random_weights(seed)

    writer = gguf.GGUFWriter(str(dest), "clip")
    clip_header(writer, "edgechat tiny test projector (random weights)", projector, IMAGE_SIZE, patch, n_embd_text)
    if projector == "gemma3":
        writer.add_uint32("clip.vision.projector.scale_factor", GEMMA3_POOL)

    tensors = {
        "v.patch_embd.weight": weight(N_EMBD, 3, patch, patch, scale=1.0 / np.sqrt(3 * patch * patch)),
        "v.patch_embd.bias": np.zeros(N_EMBD, np.float32),
        "v.position_embd.weight": weight(n_patches, N_EMBD, scale=0.1),
    }
    tensors |= vit_blocks(weight)
    # outputs of about a text embedding's size, so the picture weighs in the next-token choice
    if projector == "mlp":
        tensors["mm.0.weight"] = weight(MM_HIDDEN, N_EMBD)
        tensors["mm.0.bias"] = np.zeros(MM_HIDDEN, np.float32)
        tensors["mm.2.weight"] = weight(n_embd_text, MM_HIDDEN, scale=0.05)
        tensors["mm.2.bias"] = np.zeros(n_embd_text, np.float32)
    else:
        tensors["mm.soft_emb_norm.weight"] = np.ones(N_EMBD, np.float32)
        # ggml's ne [text width, N_EMBD]: the graph multiplies by its transpose
        tensors["mm.input_projection.weight"] = weight(N_EMBD, n_embd_text, scale=0.05)
    write_gguf(writer, tensors)
    return dest


def png(width: int, height: int, pixel) -> bytes:
    """An 8-bit RGB PNG whose pixel (x, y) is `pixel(x, y)` -> (r, g, b), written with zlib."""

    def part(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\0" + bytes(c for x in range(width) for c in pixel(x, y)) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + part(b"IHDR", header) + part(b"IDAT", zlib.compress(rows)) + part(b"IEND", b"")


GRADIENT = png(40, 40, lambda x, y: (x * 6, y * 6, 128))
CHECKS = png(40, 40, lambda x, y: (255, 255, 255) if (x // 5 + y // 5) % 2 else (0, 0, 0))
