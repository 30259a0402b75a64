"""Which ggml type each tensor gets for a file type: the rules of llama.cpp's quantizer.

llama.cpp's Q4_K_M, Q5_K_M, ... are mixtures: the type named is the default, some tensors get
more bits (the output/tied embedding, some attn_v and ffn_down layers) and tensors whose rows do
not split into the type's blocks fall back to a compatible type. The facts come from
llama_model_quantize (src/llama-quant.cpp); tests compare our choice with its output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F


@dataclass(frozen=True)
class FileType:
    name: str
    ftype: F
    default: T


FILE_TYPES = {
    ft.name: ft
    for ft in (
        FileType("F32", F.ALL_F32, T.F32),
        FileType("F16", F.MOSTLY_F16, T.F16),
        FileType("BF16", F.MOSTLY_BF16, T.BF16),
        FileType("Q8_0", F.MOSTLY_Q8_0, T.Q8_0),
        FileType("Q6_K", F.MOSTLY_Q6_K, T.Q6_K),
        FileType("Q5_K_M", F.MOSTLY_Q5_K_M, T.Q5_K),
        FileType("Q4_K_M", F.MOSTLY_Q4_K_M, T.Q4_K),
        FileType("Q4_K_S", F.MOSTLY_Q4_K_S, T.Q4_K),
        FileType("Q4_0", F.MOSTLY_Q4_0, T.Q4_0),
    )
}

#: what a 256-block K-quant becomes when a tensor's rows are not a multiple of 256
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def file_type(name: str) -> FileType:
    return FILE_TYPES[name.upper()]


def is_quantized(t: T) -> bool:
    return t not in (T.F32, T.F16, T.BF16)


def block_size(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def allows_quantization(name: str, n_dims: int) -> bool:
    """llama.cpp quantizes 2D+ weights except norms (the exceptions for other architectures do not apply here)."""
    return n_dims >= 2 and name.endswith("weight") and "_norm.weight" not in name


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for part, cat in (
        ("attn_qkv.weight", "attn_v"),
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if part in name:
            return cat
    return "other"


def _more_bits(i: int, n: int) -> bool:
    # the first and last eighth of the layers, and every third one in between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class TensorShape:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order: rows first, row length last
    stored: T  # type the tensor has before quantization (F32 for norms, the outtype otherwise)


def choose_types(tensors: list[TensorShape], ftype: FileType, n_layer: int, *, is_70b: bool = False) -> dict[str, T]:
    """The type of every tensor in a file of type `ftype`."""
    if not is_quantized(ftype.default):
        return {t.name: t.stored for t in tensors}
    # llama.cpp counts attn_v tensors in layer order; its tensor map sorts by layer, then name.
    ordered = sorted(tensors, key=lambda t: (int(m.group(1)) if (m := _LAYER.match(t.name)) else -1, t.name))
    n_attn_v = sum(_category(t.name) == "attn_v" for t in ordered)
    tied = not any(t.name == "output.weight" for t in ordered)
    i_attn_v = 0
    result: dict[str, T] = {}
    for t in ordered:
        if not allows_quantization(t.name, len(t.shape)):
            result[t.name] = t.stored
            continue
        cat = _category(t.name)
        ncols = t.shape[-1]
        new = ftype.default
        ft = ftype.ftype
        if cat == "output" or (tied and cat == "token_embd"):
            if ncols % block_size(new) != 0:
                new = T.Q8_0
            elif new != T.Q8_0:
                new = T.Q6_K
        elif cat == "attn_v":
            if ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i_attn_v, n_attn_v):
                new = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and i_attn_v < 4:
                new = T.Q5_K
            if is_70b and new in (T.Q3_K, T.Q4_K):
                # 8 query heads share each attn_v row there, so more bits cost little
                new = T.Q5_K
            i_attn_v += 1
        elif cat == "ffn_down":
            layer = int(_LAYER.match(t.name).group(1))
            if ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(layer, n_layer):
                new = T.Q6_K
            elif ft == F.MOSTLY_Q4_K_S and layer < n_layer // 8:
                new = T.Q5_K
        if ncols % block_size(new) != 0:
            new = _FALLBACK.get(new, new)
            if ncols % block_size(new) != 0:
                new = T.F16
        result[t.name] = new
    return result
