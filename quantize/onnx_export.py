"""Hugging Face checkpoint -> ONNX folder for onnxruntime (and onnxruntime-genai), without PyTorch.

The graph is written with onnx's helpers from numpy weights and uses the operators
onnxruntime's CPU kernels for LLMs are made for: com.microsoft GroupQueryAttention (rotary
inside, packed QKV, KV cache [batch, kv_heads, seq, head_dim]), SkipSimplifiedLayerNormalization,
MatMulNBits for every linear layer and GatherBlockQuantized for the embedding. Int4 weights are
quantized as GGUF's Q4_1 is (see min_step_int4), the 8-bit embedding and output layer by
onnxruntime's own block quantizer; all are streamed into `model.onnx.data` one tensor at a time,
so memory stays bounded by the largest tensor, not the model.

The folder: model.onnx + model.onnx.data, the checkpoint's tokenizer files, genai_config.json
(onnxruntime-genai's layout) and tokenizer.gguf (the vocabulary as llama.cpp reads it, which
edgechat's ONNX backend uses for tokenizing, the chat template and sampling).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantize.architecture import Family, family_for
from quantize.errors import QuantizeError
from quantize.safetensors import Checkpoint
from quantize.source import read_config, resolve_source
from quantize.writer import StreamingGGUF

BITS = (4, 8, 32)
BLOCK_SIZES = (16, 32, 64, 128)
#: the tokenizer files copied beside the model, for onnxruntime-genai and for people
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "config.json")
DATA_FILE = "model.onnx.data"
#: a graph input with a default (an initializer of the same name): 0 computes logits for every
#: position, as onnxruntime-genai expects; edgechat's backend passes 1 to prefill, so a long
#: prompt on a 262k vocabulary does not run the output layer (and allocate logits) per token
LOGITS_TO_KEEP = "num_logits_to_keep"
#: rows quantized at a time: bounds the float32 copies of a large embedding (262k rows for Gemma)
ROW_CHUNK = 16384
#: bits of the embedding and the output layer (tied or not) in a quantized export: at 4 bits they
#: cost most of the quality (SmolLM2 from Q4_1: KLD 0.11 vs 0.004 against float32), as for
#: llama.cpp, whose Q4_K_M keeps them at 6-8 bits
EMBED_BITS = 8
# Room left free on the disk beyond the estimate.
DISK_MARGIN = 64 * 1024 * 1024

Progress = Callable[[str, int, int], None]


@dataclass
class Result:
    path: Path
    arch: str
    bits: int
    nbytes: int
    n_layers: int


def _onnx():
    try:
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import (
            DefaultWeightOnlyQuantConfig,
            DefaultWeightOnlyQuantizer,
        )
    except ImportError as exc:
        raise QuantizeError(f"ONNX export needs the onnx and onnx-ir packages ({exc.name} is missing): "
                            "pip install onnx onnx-ir") from None
    return onnx, DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer


@dataclass
class Shape:
    """What the graph needs to know of a family beyond the registry's hyperparameters."""

    hidden: int
    intermediate: int
    eps: float
    norm_add: float  # Gemma's norms multiply by (1 + w)
    embed_scale: float | None
    act: str  # "silu" or "gelu_tanh"
    sandwich: bool  # Gemma 3: norms after attention and MLP as well as before
    qk_norm: bool
    qkv_bias: bool
    attn_scale: float
    rotary_dim: int
    final_softcap: float | None
    max_len: int


def _shape(family: Family) -> Shape:
    c = family.config
    act = str(c.get("hidden_activation") or c.get("hidden_act") or "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise QuantizeError(f"activation {act!r} is not supported by the ONNX export")
    hidden = int(family.need("hidden_size"))
    rotary = float(family.rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    if c.get("attn_logit_softcapping"):
        raise QuantizeError("attention logit softcapping is not supported by the ONNX export")
    return Shape(
        hidden=hidden,
        intermediate=int(family.need("intermediate_size")),
        eps=float(family.need("rms_norm_eps")),
        norm_add=family.norm_add,
        embed_scale=family.embed_scale,
        act="silu" if act == "silu" else "gelu_tanh",
        sandwich=family.sandwich_norms,
        qk_norm=family.qk_norm,
        qkv_bias=family.qkv_bias,
        attn_scale=family.attn_scale,
        rotary_dim=int(family.head_dim * rotary),
        final_softcap=c.get("final_logit_softcapping") or None,
        max_len=int(c.get("max_position_embeddings") or 4096),
    )


def _inv_freq(rope: dict, dim: int) -> np.ndarray:
    base = float(rope.get("rope_theta", 10000.0))
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    kind = (rope.get("rope_type") or rope.get("type") or "default").lower()
    if kind == "linear":
        inv = inv / float(rope["factor"])
    elif kind == "llama3":
        factor = float(rope.get("factor", 8.0))
        low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
        old = float(rope.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
        inv = (1 - smooth) * inv / factor + smooth * inv
    elif kind != "default":
        raise QuantizeError(f"RoPE scaling {kind!r} is not supported by the ONNX export")
    return inv


class _Graph:
    """Nodes, initializers (written to the data file as they come) and value names."""

    def __init__(self, onnx, data, quantizer, bits: int, block_size: int, accuracy_level: int):
        self.onnx = onnx
        self.h = onnx.helper
        self.data = data
        self.offset = 0
        self.nodes = []
        self.initializers = []
        self.quantizer = quantizer  # onnxruntime's, 8 bits
        self.bits = bits
        # the embedding and output layer: 8 bits unless float (see EMBED_BITS)
        self.embed_bits = 32 if bits == 32 else EMBED_BITS
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        self._n = 0
        self._sums: dict[str, str] = {}

    def name(self, stem: str) -> str:
        self._n += 1
        return f"/{stem}_{self._n}"

    def init(self, name: str, array: np.ndarray | Iterator[np.ndarray]) -> str:
        """An initializer stored in the data file (aligned so onnxruntime can map it). Given an
        iterator of row chunks, each is written as it comes: the tensor is their concatenation,
        never held whole."""
        start, rows = None, 0
        for part in [array] if isinstance(array, np.ndarray) else array:
            part = np.ascontiguousarray(part)
            if start is None:
                pad = -self.offset % (4096 if part.nbytes >= 1 << 20 else 64)
                if pad:
                    self.data.write(b"\0" * pad)
                    self.offset += pad
                start, first = self.offset, part
            self.data.write(part.tobytes())
            self.offset += part.nbytes
            rows += part.shape[0] if part.ndim else 1
        t = self.onnx.TensorProto()
        t.name = name
        t.data_type = self.h.np_dtype_to_tensor_dtype(first.dtype)
        t.dims.extend(first.shape if isinstance(array, np.ndarray) else (rows, *first.shape[1:]))
        t.data_location = self.onnx.TensorProto.EXTERNAL
        for key, value in (("location", DATA_FILE), ("offset", str(start)), ("length", str(self.offset - start))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(t)
        return name

    def const(self, name: str, array) -> str:
        t = self.h.make_tensor(name, self.h.np_dtype_to_tensor_dtype(np.asarray(array).dtype),
                               np.asarray(array).shape, np.asarray(array).reshape(-1).tolist())
        self.initializers.append(t)
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str | None = None, **attrs) -> list[str]:
        outs = [self.name(f"{op_type}/out{i}") for i in range(n_out)]
        self.nodes.append(self.h.make_node(op_type, inputs, outs, name=self.name(op_type), domain=domain, **attrs))
        return outs

    def quantize(self, name: str, rows: Callable[[int, int], np.ndarray], n: int, k: int) -> tuple[str, str, str]:
        """Block-quantize an HF [n, k] weight to 8 bits along k with onnxruntime's quantizer,
        ROW_CHUNK rows at a time (blocks never cross rows, so chunks give the same bytes as the
        whole): (weights, scales, zero points)."""
        scales, zero_points = [], []

        def packed():
            for a in range(0, n, ROW_CHUNK):
                q, scale, zp = self.quantizer.qbits_block_quant(np.ascontiguousarray(rows(a, min(a + ROW_CHUNK, n)).T))
                scales.append(scale)
                zero_points.append(zp)
                yield q

        return (self.init(f"{name}.weight_Q8", packed()),
                self.init(f"{name}.weight_scales", np.concatenate(scales)),
                self.init(f"{name}.weight_zp", np.concatenate(zero_points)))

    def block_sums(self, x: str, k: int) -> str:
        """x summed over each block of `block_size` inputs, [..., blocks] (once per value)."""
        if x not in self._sums:
            padded, pad = x, -k % self.block_size
            if pad:  # MatMulNBits pads its last block with zeros; so do these sums
                padded = self.op("Pad", [x, self.const(self.name("pads"), np.array([0, 0, 0, 0, 0, pad], np.int64))])[0]
            shape = self.const(self.name("blocks"), np.array([0, 0, -1, self.block_size], np.int64))
            blocks = self.op("Reshape", [padded, shape])[0]
            self._sums[x] = self.op("ReduceSum", [blocks, self.const(self.name("axes"), np.array([-1], np.int64))],
                                    keepdims=0)[0]
        return self._sums[x]

    def linear(self, x: str, name: str, weight: np.ndarray | None = None, quantized: tuple | None = None,
               shape: tuple[int, int] | None = None, bits: int | None = None) -> str:
        """x @ weight.T for an HF [out, in] weight: MatMul in float32, MatMulNBits of onnxruntime's
        quantization for 8 bits (of `quantized` when given, a tied embedding), and for 4 bits
        MatMulNBits of `min_step_int4` plus each block's offset times the sum of its inputs."""
        n, k = weight.shape if weight is not None else shape
        bits = bits or self.bits
        if bits == 32:
            return self.op("MatMul", [x, self.init(f"{name}.weight", weight.T)])[0]
        if quantized is None and bits == 8:
            quantized = self.quantize(name, lambda a, b: weight[a:b], n, k)
        if quantized is not None:
            return self.op("MatMulNBits", [x, *quantized], domain="com.microsoft", K=k, N=n, bits=8,
                           block_size=self.block_size, accuracy_level=self.accuracy_level)[0]
        steps, offsets = [], []

        def packed():
            for a in range(0, n, ROW_CHUNK):
                q, step, offset = min_step_int4(weight[a : a + ROW_CHUNK], self.block_size)
                steps.append(step)
                offsets.append(offset)
                yield q

        packed = self.init(f"{name}.weight_Q4", packed())
        steps = self.init(f"{name}.weight_scales", np.concatenate(steps))
        offsets = self.init(f"{name}.weight_offsets", np.concatenate(offsets, axis=1))
        y = self.op("MatMulNBits", [x, packed, steps], domain="com.microsoft", K=k, N=n, bits=4,
                    block_size=self.block_size, accuracy_level=self.accuracy_level)[0]
        return self.op("Add", [y, self.op("MatMul", [self.block_sums(x, k), offsets])[0]])[0]

    def embedding(self, ids: str, rows: Callable[[int, int], np.ndarray], n: int, k: int) -> tuple[str, tuple | None]:
        """The embedding lookup, and its quantized weights (for a tied output layer to share)."""
        if self.bits == 32:
            return self.op("Gather", [self.init("model.embed_tokens.weight", rows(0, n)), ids])[0], None
        quantized = packed, scales, zp = self.quantize("model.embed_tokens", rows, n, k)
        # the same bytes as MatMulNBits' [n, blocks, block bytes], seen as [n, k * bits / 8]
        data = self.op("Reshape", [packed, self.const("/const/embed_shape", np.array([n, -1], np.int64))])[0]
        if k % self.block_size:  # the last block's padding is MatMulNBits' layout, not part of a row
            data = self.op("Slice", [data, *(self.const(f"/const/embed_{what}", np.array([v], np.int64))
                                             for what, v in (("start", 0), ("end", k), ("axis", 1)))])[0]
        out = self.op("GatherBlockQuantized", [data, ids, scales, zp], domain="com.microsoft",
                      bits=8, block_size=self.block_size, gather_axis=0, quantize_axis=1)[0]
        return out, quantized


def min_step_int4(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Int4 for an HF [n, k] weight, as GGUF's Q4_1 does it: each block of `block` inputs is its
    minimum plus 0..15 steps of (max - min) / 15, so a checkpoint already on such a grid (made
    from a 4-bit GGUF) comes back exactly. onnxruntime's own quantizer cannot: its zero point is
    an integer, which puts 0 on the grid and shifts every other value by up to half a step (on
    SmolLM2 made from Q4_1: KLD 0.38 vs 0.0004 this way). MatMulNBits without zero points reads
    q as (q - 8) * step; the rest of each value, min + 8 steps, is the block's offset, which the
    graph adds as (sum of the block's inputs) * offset. Returns (packed [n, blocks, block / 2],
    steps [n, blocks], offsets [blocks, n])."""
    n, k = w.shape
    blocks = -(-k // block)
    if blocks * block != k:  # repeating the last value widens no block's range
        w = np.pad(w, ((0, 0), (0, blocks * block - k)), mode="edge")
    w = w.reshape(n, blocks, block)
    low = w.min(axis=-1)
    step = (w.max(axis=-1) - low) / np.float32(15)
    inverse = np.divide(np.float32(1), step, out=np.zeros_like(step), where=step > 0)
    q = np.rint((w - low[..., None]) * inverse[..., None]).astype(np.uint8)
    np.minimum(q, 15, out=q)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, step, np.ascontiguousarray((low + 8 * step).T)


def _weights(checkpoint: Checkpoint):
    def get(name: str, required: bool = True) -> np.ndarray | None:
        ref = checkpoint.tensors.get(name)
        if ref is None:
            if required:
                raise QuantizeError(f"the checkpoint has no tensor {name}; is it complete?")
            return None
        data = ref.rows_f32(slice(None))
        ref.release(0, ref.shape[0] if ref.shape else 1)  # mapped pages count as ours until dropped
        return data

    return get


def _build(family: Family, checkpoint: Checkpoint, g: _Graph, progress: Progress | None) -> tuple[list, list]:
    onnx, h = g.onnx, g.h
    s = _shape(family)
    w = _weights(checkpoint)
    n_layer, n_head, n_kv, hd = family.n_layer, family.n_head, family.n_head_kv, family.head_dim
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    inputs = [h.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
              h.make_tensor_value_info("attention_mask", i64, ["batch_size", "total_sequence_length"])]
    outputs = [h.make_tensor_value_info("logits", f32, ["batch_size", "sequence_length", family.n_vocab])]
    kv_shape = ["batch_size", n_kv, "past_sequence_length", hd]
    present_shape = ["batch_size", n_kv, "total_sequence_length", hd]

    # seqlens_k (tokens before the last, per row) and the total length, as GroupQueryAttention wants
    one = g.const("/const/one", np.array(1, np.int64))
    ones = g.const("/const/axes1", np.array([1], np.int64))
    summed = g.op("ReduceSum", ["attention_mask", ones], keepdims=0)[0]
    seqlens_k = g.op("Cast", [g.op("Sub", [summed, one])[0]], to=onnx.TensorProto.INT32)[0]
    mask_shape = g.op("Shape", ["attention_mask"])[0]
    total = g.op("Gather", [mask_shape, one], axis=0)[0]
    total_len = g.op("Cast", [total], to=onnx.TensorProto.INT32)[0]

    def norm_w(name: str) -> np.ndarray:
        return w(name) + np.float32(s.norm_add)

    embed = checkpoint.tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise QuantizeError("the checkpoint has no tensor model.embed_tokens.weight; is it complete?")
    def embed_rows(a: int, b: int) -> np.ndarray:
        data = embed.rows_f32(slice(a, b))
        embed.release(a, b)
        return data

    x, embed_q = g.embedding("input_ids", embed_rows, family.n_vocab, s.hidden)
    if s.embed_scale is not None:
        x = g.op("Mul", [x, g.const("/const/embed_scale", np.array(s.embed_scale, np.float32))])[0]

    caches: dict[float, tuple[str, str]] = {}

    def rotary_cache(rope: dict) -> tuple[str, str]:
        inv = _inv_freq(rope, s.rotary_dim)
        key = tuple(inv[:4].tolist())
        if key not in caches:
            angles = np.outer(np.arange(s.max_len, dtype=np.float64), inv)
            i = len(caches)
            caches[key] = (g.init(f"cos_cache_{i}", np.cos(angles).astype(np.float32)),
                           g.init(f"sin_cache_{i}", np.sin(angles).astype(np.float32)))
        return caches[key]

    def rms(value: str, weight: np.ndarray, name: str, axis: int = -1) -> str:
        return g.op("SimplifiedLayerNormalization", [value, g.init(name, weight)], axis=axis, epsilon=s.eps)[0]

    def per_head_norm(value: str, heads: int, weight: np.ndarray, name: str) -> str:
        shaped = g.op("Reshape", [value, g.const(f"{name}/shape", np.array([0, 0, heads, hd], np.int64))])[0]
        normed = rms(shaped, weight, name)
        return g.op("Reshape", [normed, g.const(f"{name}/flat", np.array([0, 0, heads * hd], np.int64))])[0]

    residual = None
    normed = rms(x, norm_w("model.layers.0.input_layernorm.weight"), "model.layers.0.input_layernorm.weight")
    residual = x
    for i in range(n_layer):
        if progress:
            progress(f"layer {i}", i, n_layer)
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if family.fused_projections:
            qkv_w = w(f"{a}.qkv_proj.weight")
        else:
            qkv_w = np.concatenate([w(f"{a}.q_proj.weight"), w(f"{a}.k_proj.weight"), w(f"{a}.v_proj.weight")])
        qkv = g.linear(normed, f"{a}.qkv_proj", qkv_w)
        del qkv_w
        if s.qkv_bias:
            bias = np.concatenate([w(f"{a}.q_proj.bias"), w(f"{a}.k_proj.bias"), w(f"{a}.v_proj.bias")])
            qkv = g.op("Add", [qkv, g.init(f"{a}.qkv_proj.bias", bias)])[0]
        rope, window = family.layer_attention(i)
        cos, sin = rotary_cache(rope)
        if s.qk_norm:
            split = g.const(f"{a}/split", np.array([n_head * hd, n_kv * hd, n_kv * hd], np.int64))
            q, k, v = g.op("Split", [qkv, split], n_out=3, axis=-1)
            q = per_head_norm(q, n_head, norm_w(f"{a}.q_norm.weight"), f"{a}.q_norm.weight")
            k = per_head_norm(k, n_kv, norm_w(f"{a}.k_norm.weight"), f"{a}.k_norm.weight")
        else:
            q, k, v = qkv, "", ""
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        inputs += [h.make_tensor_value_info(past_k, f32, kv_shape), h.make_tensor_value_info(past_v, f32, kv_shape)]
        outputs += [h.make_tensor_value_info(f"present.{i}.key", f32, present_shape),
                    h.make_tensor_value_info(f"present.{i}.value", f32, present_shape)]
        attn = g.name(f"{a}/GroupQueryAttention/output")
        g.nodes.append(h.make_node(
            "GroupQueryAttention", [q, k, v, past_k, past_v, seqlens_k, total_len, cos, sin],
            [attn, f"present.{i}.key", f"present.{i}.value"], name=f"{a}/GroupQueryAttention", domain="com.microsoft",
            num_heads=n_head, kv_num_heads=n_kv, scale=s.attn_scale, local_window_size=window, do_rotary=1,
            rotary_interleaved=0,
        ))
        attn = g.linear(attn, f"{a}.o_proj", w(f"{a}.o_proj.weight"))
        if s.sandwich:
            attn = rms(attn, norm_w(f"{p}.post_attention_layernorm.weight"), f"{p}.post_attention_layernorm.weight")
            pre_mlp = f"{p}.pre_feedforward_layernorm.weight"
        else:
            pre_mlp = f"{p}.post_attention_layernorm.weight"
        normed, _, _, residual = g.op("SkipSimplifiedLayerNormalization", [attn, residual, g.init(pre_mlp, norm_w(pre_mlp))],
                                      n_out=4, domain="com.microsoft", epsilon=s.eps)
        m = f"{p}.mlp"
        if family.fused_projections:
            gate_up = w(f"{m}.gate_up_proj.weight")
            gate_w, up_w = gate_up[: s.intermediate], gate_up[s.intermediate :]
            del gate_up
        else:
            gate_w, up_w = w(f"{m}.gate_proj.weight"), w(f"{m}.up_proj.weight")
        gate = g.linear(normed, f"{m}.gate_proj", gate_w)
        up = g.linear(normed, f"{m}.up_proj", up_w)
        del gate_w, up_w
        if s.act == "silu":
            gate = g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])[0]
        else:
            gate = g.op("FastGelu", [gate], domain="com.microsoft")[0]
        mlp = g.linear(g.op("Mul", [gate, up])[0], f"{m}.down_proj", w(f"{m}.down_proj.weight"))
        if s.sandwich:
            mlp = rms(mlp, norm_w(f"{p}.post_feedforward_layernorm.weight"), f"{p}.post_feedforward_layernorm.weight")
        last = i == n_layer - 1
        next_norm = "model.norm.weight" if last else f"model.layers.{i + 1}.input_layernorm.weight"
        normed, _, _, residual = g.op("SkipSimplifiedLayerNormalization", [mlp, residual, g.init(next_norm, norm_w(next_norm))],
                                      n_out=4, domain="com.microsoft", epsilon=s.eps)

    # only the last `num_logits_to_keep` positions (all when 0) reach the output layer
    keep = h.make_tensor(LOGITS_TO_KEEP, i64, [], [0])
    g.initializers.append(keep)
    inputs.append(h.make_tensor_value_info(LOGITS_TO_KEEP, i64, []))
    hs_shape = g.op("Shape", [normed])[0]
    seq = g.op("Gather", [hs_shape, one], axis=0)[0]
    zero = g.const("/const/zero", np.array(0, np.int64))
    start = g.op("Where", [g.op("Greater", [LOGITS_TO_KEEP, zero])[0], g.op("Sub", [seq, LOGITS_TO_KEEP])[0], zero])[0]
    start = g.op("Unsqueeze", [start, g.const("/const/axes0", np.array([0], np.int64))])[0]
    big = g.const("/const/end", np.array([1 << 62], np.int64))
    normed = g.op("Slice", [normed, start, big, ones])[0]
    if family.tied and embed_q is not None:
        logits = g.linear(normed, "lm_head", quantized=embed_q, shape=(family.n_vocab, s.hidden))
    else:  # read again rather than held through the layers: memory stays one tensor's
        logits = g.linear(normed, "lm_head", w("model.embed_tokens.weight" if family.tied else "lm_head.weight")[: family.n_vocab],
                          bits=g.embed_bits)
    if s.final_softcap:
        cap = g.const("/const/softcap", np.array(s.final_softcap, np.float32))
        logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])[0]])[0], cap])[0]
    g.nodes.append(h.make_node("Identity", [logits], ["logits"], name="/logits"))
    return inputs, outputs


def _genai_config(family: Family, s: Shape, generation: dict) -> dict:
    c = family.config

    def first(value):
        return value[0] if isinstance(value, list) else value

    eos = generation.get("eos_token_id", c.get("eos_token_id"))
    return {
        "model": {
            "bos_token_id": first(generation.get("bos_token_id", c.get("bos_token_id"))),
            "context_length": s.max_len,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": family.head_dim,
                "hidden_size": s.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": family.n_head,
                "num_hidden_layers": family.n_layer,
                "num_key_value_heads": family.n_head_kv,
            },
            "eos_token_id": eos,
            "pad_token_id": first(c.get("pad_token_id", generation.get("pad_token_id", first(eos)))),
            "type": str(c.get("model_type", family.arch_name)),
            "vocab_size": family.n_vocab,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": s.max_len, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
            "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
            "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _write_tokenizer_gguf(family: Family, path: Path) -> None:
    """A vocabulary-only GGUF: llama.cpp's tokenizer, chat template and samplers for the backend."""
    vocab = family.vocab()
    with StreamingGGUF(path, family.arch_name) as out:
        w = out.writer
        w.add_type("model")
        family.write_hparams(w)
        vocab.write(w)
        out.begin_data()
        out.commit()


def estimate_size(checkpoint: Checkpoint, bits: int, block_size: int) -> int:
    n = sum(int(np.prod(t.shape)) for t in checkpoint.tensors.values())
    per = 4.0 if bits == 32 else 1 + 8 / block_size  # at most: the embedding's 8 bits, scales and offsets
    return int(n * per)


def export(
    src: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    bits: int = 4,
    block_size: int = 32,
    accuracy_level: int = 4,
    force: bool = False,
    progress: Progress | None = None,
) -> Result:
    """Export the checkpoint `src` (folder or Hub repo id) to an ONNX folder at `out`."""
    if bits not in BITS:
        raise QuantizeError(f"--bits must be one of {', '.join(map(str, BITS))} (got {bits})")
    if block_size not in BLOCK_SIZES:
        raise QuantizeError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))} (got {block_size})")
    if not 0 <= accuracy_level <= 4:
        raise QuantizeError(f"--accuracy-level must be 0 to 4 (got {accuracy_level})")
    onnx, Config, Quantizer = _onnx()
    folder, model_name = resolve_source(str(src))
    config = read_config(folder)
    family = family_for(folder, config)
    shape = _shape(family)  # unsupported settings fail before anything is written
    suffix = "fp32" if bits == 32 else f"int{bits}"
    out_dir = Path(out) if out else Path.cwd() / f"{model_name}-onnx-{suffix}"
    if out_dir.exists() and not force:
        raise QuantizeError(f"{out_dir} exists; pass --force to overwrite it")
    parent = out_dir.absolute().parent
    if not parent.is_dir():
        raise QuantizeError(f"output folder {parent} does not exist")
    quantizer = Quantizer(Config(block_size=block_size, is_symmetric=False, bits=8, accuracy_level=accuracy_level))
    with Checkpoint(folder) as checkpoint:
        if not checkpoint.tensors:
            raise QuantizeError(f"the safetensors files in {folder} hold no tensors")
        need = estimate_size(checkpoint, bits, block_size) + DISK_MARGIN
        free = shutil.disk_usage(parent).free
        if free < need:
            raise QuantizeError(f"not enough disk space in {parent}: need {need / 1e6:.0f} MB, {free / 1e6:.0f} MB free")
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=parent))
        try:
            with open(tmp / DATA_FILE, "wb") as data:
                g = _Graph(onnx, data, quantizer, bits, block_size, accuracy_level)
                inputs, outputs = _build(family, checkpoint, g, progress)
            graph = onnx.helper.make_graph(g.nodes, model_name, inputs, outputs, g.initializers)
            model = onnx.helper.make_model(
                graph, opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("com.microsoft", 1)],
                producer_name="edgechat",
            )
            model.ir_version = 10
            onnx.save_model(model, str(tmp / "model.onnx"))
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copyfile(folder / name, tmp / name)
            _write_tokenizer_gguf(family, tmp / "tokenizer.gguf")
            genai = _genai_config(family, shape, _read_json(folder / "generation_config.json"))
            (tmp / "genai_config.json").write_text(json.dumps(genai, indent=2) + "\n", encoding="utf-8")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if progress:
        progress("done", family.n_layer, family.n_layer)
    nbytes = sum(f.stat().st_size for f in out_dir.iterdir())
    return Result(out_dir, family.arch_name, bits, nbytes, family.n_layer)


class OnnxModel:
    """An exported folder loaded for evaluation: `tokenize` and `logits` batch by batch, as
    quantize.llm.Model gives them for a GGUF (the quality report compares the two ways)."""

    def __init__(self, folder: str | os.PathLike, n_batch: int = 64, threads: int | None = None):
        import onnxruntime as ort

        from quantize.llm import Model

        self.folder = Path(folder)
        dec = json.loads((self.folder / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
        self.n_layer, self.n_kv, self.head = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.log_severity_level = 3  # the overridable num_logits_to_keep default draws a warning
        self.session = ort.InferenceSession(str(self.folder / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        self.vocab = Model(self.folder / "tokenizer.gguf", vocab_only=True)
        self.n_vocab = self.vocab.n_vocab
        self.n_batch = n_batch

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special)

    def logits(self, tokens: list[int]):
        """Yield (start, logits) for consecutive batches: logits[i] predicts tokens[start + i + 1]."""
        past = [np.zeros((1, self.n_kv, 0, self.head), np.float32)] * (2 * self.n_layer)
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            feed = {"input_ids": np.array([chunk], np.int64),
                    "attention_mask": np.ones((1, start + len(chunk)), np.int64)}
            for i in range(self.n_layer):
                feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"] = past[2 * i], past[2 * i + 1]
            logits, *past = self.session.run(None, feed)
            yield start, logits[0]

    def close(self) -> None:
        self.vocab.close()

    def __enter__(self) -> OnnxModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def compare(quantized: str | os.PathLike, reference: str | os.PathLike, threads: int | None = None):
    """The quality report (quantize.report) of an exported folder against its float32 export."""
    from quantize.report import N_CTX, SAMPLE_TEXT, compare_logits

    with OnnxModel(reference, threads=threads) as ref, OnnxModel(quantized, threads=threads) as quant:
        tokens = ref.tokenize(SAMPLE_TEXT)[:N_CTX]
        return compare_logits(ref.logits(tokens), quant.logits(tokens), tokens)
