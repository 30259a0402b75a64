"""Which ggml type each tensor gets for a file type: the rules of llama.cpp's quantizer.

llama.cpp's Q4_K_M, Q3_K_M, IQ2_XS, ... are mixtures: the type named is the default, some tensors
get more bits (the output/tied embedding, some attn_v and ffn_down layers), some fewer, and
tensors whose rows do not split into the type's blocks fall back to a compatible type. The facts
come from llama_model_quantize (src/llama-quant.cpp); tests compare our choice with its output.
Rules for architectures and MoE layouts we do not convert (Falcon, 8-expert models) are left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F

from quantize.errors import QuantizeError


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
        FileType("Q5_K_S", F.MOSTLY_Q5_K_S, T.Q5_K),
        FileType("Q5_1", F.MOSTLY_Q5_1, T.Q5_1),
        FileType("Q5_0", F.MOSTLY_Q5_0, T.Q5_0),
        FileType("Q4_K_M", F.MOSTLY_Q4_K_M, T.Q4_K),
        FileType("Q4_K_S", F.MOSTLY_Q4_K_S, T.Q4_K),
        FileType("Q4_1", F.MOSTLY_Q4_1, T.Q4_1),
        FileType("Q4_0", F.MOSTLY_Q4_0, T.Q4_0),
        FileType("IQ4_NL", F.MOSTLY_IQ4_NL, T.IQ4_NL),
        FileType("IQ4_XS", F.MOSTLY_IQ4_XS, T.IQ4_XS),
        FileType("Q3_K_L", F.MOSTLY_Q3_K_L, T.Q3_K),
        FileType("Q3_K_M", F.MOSTLY_Q3_K_M, T.Q3_K),
        FileType("Q3_K_S", F.MOSTLY_Q3_K_S, T.Q3_K),
        FileType("IQ3_M", F.MOSTLY_IQ3_M, T.IQ3_S),
        FileType("IQ3_S", F.MOSTLY_IQ3_S, T.IQ3_S),
        FileType("IQ3_XS", F.MOSTLY_IQ3_XS, T.IQ3_S),
        FileType("IQ3_XXS", F.MOSTLY_IQ3_XXS, T.IQ3_XXS),
        FileType("Q2_K", F.MOSTLY_Q2_K, T.Q2_K),
        FileType("Q2_K_S", F.MOSTLY_Q2_K_S, T.Q2_K),
        FileType("IQ2_M", F.MOSTLY_IQ2_M, T.IQ2_S),
        FileType("IQ2_S", F.MOSTLY_IQ2_S, T.IQ2_XS),
        FileType("IQ2_XS", F.MOSTLY_IQ2_XS, T.IQ2_XS),
        FileType("IQ2_XXS", F.MOSTLY_IQ2_XXS, T.IQ2_XXS),
        FileType("IQ1_M", F.MOSTLY_IQ1_M, T.IQ1_M),
        FileType("IQ1_S", F.MOSTLY_IQ1_S, T.IQ1_S),
    )
}

#: what a type becomes when a tensor's rows do not split into its blocks
_FALLBACK = {
    **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS), T.IQ4_NL),
    **dict.fromkeys((T.Q2_K, T.Q3_K), T.Q4_0),
    T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}

#: tensor types whose kernels give garbage without an importance matrix
_NEEDS_IMATRIX = {T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S}

# file types in llama.cpp's "very low bit" group, which shares one set of rules
_IQ_LOW = {F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def file_type(name: str) -> FileType:
    return FILE_TYPES[name.upper()]


def tensor_type(name: str) -> T:
    """A ggml tensor type by its name (q6_k, Q8_0, f16, ...), as llama-quantize's options take it."""
    try:
        return T[name.upper()]
    except KeyError:
        raise QuantizeError(f"unknown tensor type {name}; use a ggml type such as q8_0, q6_k or f16") from None


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
        ("attn_qkv.weight", "attn_qkv"),
        ("attn_kv_b.weight", "attn_kv_b"),
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


_ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")


def _more_bits(i: int, n: int) -> bool:
    # the first and last eighth of the layers, and every third one in between
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class TensorShape:
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order: rows first, row length last
    stored: T  # type the tensor has before quantization (F32 for norms, the outtype otherwise)


@dataclass(frozen=True)
class Model:
    """What the rules need to know about the model."""

    n_layer: int
    n_gqa: int = 1  # query heads per KV head
    is_70b: bool = False


@dataclass(frozen=True)
class Overrides:
    """The user's choices on top of a mixture, as llama-quantize's options of the same names."""

    tensor_types: tuple[tuple[str, T], ...] = ()  # --tensor-type PATTERN=TYPE: first regex search that hits wins
    output: T | None = None  # --output-tensor-type
    token_embedding: T | None = None  # --token-embedding-type
    patterns: tuple[tuple[re.Pattern, T], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        compiled = []
        for pattern, qtype in self.tensor_types:
            try:
                compiled.append((re.compile(pattern.lower()), qtype))
            except re.error as exc:
                raise QuantizeError(f"--tensor-type {pattern!r} is not a valid regular expression: {exc}") from None
        object.__setattr__(self, "patterns", tuple(compiled))

    def manual(self, name: str) -> T | None:
        for pattern, qtype in self.patterns:
            if pattern.search(name):
                return qtype
        return None


class _Counters:
    def __init__(self, n_attn_v: int, n_layer: int):
        self.n_attn_v, self.i_attn_v = n_attn_v, 0
        self.n_ffn, self.i_ffn_down, self.i_ffn_gate, self.i_ffn_up = n_layer, 0, 0, 0


def _rule(cat: str, new: T, ft: F, cols: int, tied: bool, model: Model, has_imatrix: bool, c: _Counters,
          output: T | None) -> T:
    """llama.cpp's choice for one tensor of category `cat`, starting from the file type's default `new`.

    Counters advance as llama.cpp's do, so a tensor the user overrides does not count."""
    gqa4 = model.n_gqa >= 4
    if cat == "output" or (tied and cat == "token_embd"):
        if output is not None:  # a tied embedding is the output too
            return output
        if cols % block_size(new) != 0:
            return T.Q8_0
        if ft in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ3_XXS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ2_S,
                  F.MOSTLY_IQ2_M, F.MOSTLY_IQ1_M):
            return T.Q5_K
        return new if new == T.Q8_0 else T.Q6_K
    if cat == "token_embd":
        if ft in (F.MOSTLY_IQ2_XXS, F.MOSTLY_IQ2_XS, F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
            return T.Q2_K
        if ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M, F.MOSTLY_IQ3_XXS):
            return T.IQ3_S
        return new
    iq2_sm = ft in (F.MOSTLY_IQ2_S, F.MOSTLY_IQ2_M)
    if ft in _IQ_LOW:
        if cat in _ATTN_V_LIKE:
            c.i_attn_v += 1
            return T.Q4_K if gqa4 else (T.IQ3_S if iq2_sm else T.Q2_K)
        if cat == "ffn_down":
            low = c.i_ffn_down < c.n_ffn // 8
            c.i_ffn_down += 1
            return (T.IQ3_S if iq2_sm else T.Q2_K) if low else new
        if cat == "attn_output":
            if ft in (F.MOSTLY_IQ1_S, F.MOSTLY_IQ1_M):
                return T.IQ2_XXS
            if iq2_sm:
                return T.IQ3_S
        return new
    if cat in _ATTN_V_LIKE:
        i, n = c.i_attn_v, c.n_attn_v
        c.i_attn_v += 1
        if ft == F.MOSTLY_Q2_K:
            new = T.Q4_K if gqa4 else T.Q3_K
        elif ft == F.MOSTLY_Q2_K_S and gqa4:
            new = T.Q4_K
        elif ft == F.MOSTLY_IQ3_XXS:
            new = T.Q4_K if gqa4 else (T.IQ3_XXS if has_imatrix else T.IQ3_S)
        elif (ft in (F.MOSTLY_IQ3_XS, F.MOSTLY_IQ3_S) and gqa4) or ft == F.MOSTLY_IQ3_M:
            new = T.Q4_K
        elif ft == F.MOSTLY_Q3_K_M:
            new = T.Q5_K if i < 2 else T.Q4_K
        elif ft == F.MOSTLY_Q3_K_L or (ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and gqa4):
            new = T.Q5_K
        elif ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and _more_bits(i, n):
            new = T.Q6_K
        elif ft == F.MOSTLY_Q4_K_S and i < 4:
            new = T.Q5_K
        if model.is_70b and new in (T.Q3_K, T.Q4_K):
            # 8 query heads share each attn_v row there, so more bits cost little
            new = T.Q5_K
        return new
    if cat in ("attn_k", "attn_q"):
        if ft == F.MOSTLY_IQ3_XS:
            return T.IQ3_XXS
        if ft == F.MOSTLY_IQ3_XXS:
            return T.IQ2_S
        return new
    if cat == "ffn_down":
        i, n = c.i_ffn_down, c.n_ffn
        c.i_ffn_down += 1
        if ft == F.MOSTLY_Q2_K:
            return T.Q3_K
        if ft == F.MOSTLY_Q2_K_S:
            return T.Q4_K if i < n // 8 else new
        if ft == F.MOSTLY_IQ3_XXS and not has_imatrix:
            return T.Q4_K if i < n // 8 else T.Q3_K
        if ft == F.MOSTLY_Q3_K_M:
            return T.Q5_K if i < n // 16 else T.Q4_K
        if ft == F.MOSTLY_IQ3_M and i < n // 8:
            return T.Q4_K
        if ft == F.MOSTLY_Q3_K_L:
            return T.Q5_K
        if ft == F.MOSTLY_Q4_K_M:
            return T.Q6_K if _more_bits(i, n) else new
        if i < n // 8 and ft in (F.MOSTLY_IQ4_NL, F.MOSTLY_IQ4_XS) and not has_imatrix:
            return T.Q5_K
        if ft == F.MOSTLY_Q5_K_M and _more_bits(i, n):
            return T.Q6_K
        if ft == F.MOSTLY_Q4_K_S and i < n // 8:
            return T.Q5_K
        if ft in (F.MOSTLY_Q4_0, F.MOSTLY_Q5_0) and has_imatrix and i < n // 8:
            # llama.cpp guards the first ffn_down layers only with an imatrix, so that a plain
            # Q4_0 stays what it always was
            return T.Q4_1 if ft == F.MOSTLY_Q4_0 else T.Q5_1
        return new
    if cat == "attn_output":
        return {F.MOSTLY_Q2_K: T.Q3_K, F.MOSTLY_IQ3_XXS: T.IQ3_S, F.MOSTLY_Q3_K_M: T.Q4_K,
                F.MOSTLY_Q3_K_L: T.Q5_K, F.MOSTLY_IQ3_M: T.Q4_K}.get(ft, new)
    if cat in ("ffn_gate", "ffn_up"):
        if cat == "ffn_gate":
            i = c.i_ffn_gate
            c.i_ffn_gate += 1
        else:
            i = c.i_ffn_up
            c.i_ffn_up += 1
        if ft == F.MOSTLY_IQ3_XS and c.n_ffn // 8 <= i < 7 * c.n_ffn // 8:
            return T.IQ3_XXS
    return new


def _fits(new: T, cols: int) -> T:
    if cols % block_size(new) == 0:
        return new
    fallback = _FALLBACK.get(new, new)
    return fallback if cols % block_size(fallback) == 0 else T.F16


def choose_types(tensors: list[TensorShape], ftype: FileType, model: Model, *, has_imatrix: bool = False,
                 overrides: Overrides | None = None) -> dict[str, T]:
    """The type of every tensor in a file of type `ftype`."""
    # llama.cpp counts attn_v and ffn tensors in layer order; its tensor map sorts by layer, then name.
    overrides = overrides or Overrides()
    ordered = sorted(tensors, key=lambda t: (int(m.group(1)) if (m := _LAYER.match(t.name)) else -1, t.name))
    tied = not any(t.name == "output.weight" for t in ordered)
    counters = _Counters(sum(_category(t.name) in _ATTN_V_LIKE for t in ordered), model.n_layer)
    result: dict[str, T] = {}
    for t in ordered:
        if not allows_quantization(t.name, len(t.shape)):
            result[t.name] = t.stored
            continue
        cat = _category(t.name)
        if overrides.token_embedding is not None and cat == "token_embd" and (
            t.name != "per_layer_token_embd.weight" or overrides.manual(t.name) is None
        ):
            result[t.name] = overrides.token_embedding
            continue
        if overrides.output is not None and cat == "output":
            result[t.name] = overrides.output
            continue
        if not is_quantized(ftype.default):
            result[t.name] = t.stored
            continue
        new = overrides.manual(t.name)
        if new is None:
            new = _rule(cat, ftype.default, ftype.ftype, t.shape[-1], tied, model, has_imatrix, counters,
                        overrides.output)
        result[t.name] = _fits(new, t.shape[-1])
    return result


def needs_imatrix(name: str, qtype: T, ftype: FileType) -> bool:
    """Whether llama.cpp refuses to write this tensor as `qtype` without an importance matrix."""
    if _category(name) in ("token_embd", "output"):
        return False
    return qtype in _NEEDS_IMATRIX or (qtype == T.Q2_K and ftype.ftype == F.MOSTLY_Q2_K_S)
