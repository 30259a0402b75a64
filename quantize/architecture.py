"""What every model family shares: hyperparameters from config.json, the tensor plan, the registry.

A family turns a checkpoint into (GGUF name, rows source) pairs plus metadata keys. Rows are
read lazily, block by block, so a family's transforms (row permutations, norm shifts, trimmed
vocabulary rows) never need a whole tensor in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)

from quantize.errors import QuantizeError
from quantize.safetensors import Checkpoint, TensorRef
from quantize.tokenizer import Vocab, convert_vocab


@dataclass
class PlannedTensor:
    """One output tensor: its GGUF name, shape (numpy order) and how to read its rows as float32."""

    name: str
    shape: tuple[int, ...]
    source: TensorRef | None = None
    row_index: np.ndarray | None = None  # output row i is source row row_index[i]
    add: float = 0.0  # a constant the format expects folded in (Gemma's norms store 1 + w)
    values: np.ndarray | None = None  # a tensor computed from the config rather than read

    @property
    def n_rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    def rows(self, start: int, stop: int) -> np.ndarray:
        source = self.source
        if self.values is not None:
            data = self.values.reshape(self.n_rows, -1)[start:stop]
        elif source is None:
            raise ValueError(f"{self.name} has neither a source tensor nor values")
        elif len(self.shape) == 1:
            data = source.rows_f32(slice(None)).reshape(1, -1)
        else:
            rows = self.row_index[start:stop] if self.row_index is not None else slice(start, stop)
            data = source.rows_f32(rows)
            if self.row_index is None:
                source.release(start, stop)
        data = data.astype(np.float32, copy=False)
        return data + np.float32(self.add) if self.add else data


class Family:
    """A model family: subclasses name their architectures and adjust hyperparameters and tensors."""

    arch: MODEL_ARCH
    hf_architectures: tuple[str, ...] = ()
    default_tied = False

    # What the layers compute beyond the hyperparameters (read by the ONNX export, which writes
    # the graph itself; llama.cpp knows each architecture's graph).
    #: added to the stored RMS-norm weights (Gemma's norms multiply by 1 + w)
    norm_add = 0.0
    #: RMS norms after attention and the MLP as well as before them (Gemma 3)
    sandwich_norms = False
    #: per-head RMS norms of the queries and keys (Gemma 3, Qwen3)
    qk_norm = False
    #: biases on the q, k and v projections (Qwen2)
    qkv_bias = False
    #: q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (Phi-3)
    fused_projections = False

    def __init__(self, folder: Path, config: dict):
        self.folder = folder
        self.config = config

    # -- hyperparameters --------------------------------------------------------------------
    def need(self, *keys: str):
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        raise QuantizeError(f"config.json has no {keys[0]}; is this a complete checkpoint?")

    @property
    def arch_name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]

    @property
    def n_layer(self) -> int:
        return int(self.need("num_hidden_layers", "n_layer"))

    @property
    def n_vocab(self) -> int:
        return int(self.need("vocab_size"))

    @property
    def n_head(self) -> int:
        return int(self.need("num_attention_heads"))

    @property
    def n_head_kv(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.need("hidden_size") // self.n_head)

    @property
    def rope(self) -> dict:
        # transformers 5 nests RoPE settings under rope_parameters (per attention type for some
        # models); older configs keep rope_theta and rope_scaling at the top level.
        params = self.config.get("rope_parameters")
        if params is None:
            params = dict(self.config.get("rope_scaling") or {})
            if "rope_theta" in self.config:
                params["rope_theta"] = self.config["rope_theta"]
        return params.get("full_attention", params)

    @property
    def embed_scale(self) -> float | None:
        """What the token embeddings are multiplied by before the first layer (None: nothing)."""
        return None

    @property
    def attn_scale(self) -> float:
        """The attention scores' scale."""
        return self.head_dim ** -0.5

    def layer_attention(self, layer: int) -> tuple[dict, int]:
        """(RoPE settings, local window or -1) of one layer: every layer attends to the whole
        context unless the config turns its sliding window on."""
        window = self.config.get("sliding_window")
        if window and self.config.get("use_sliding_window"):
            return self.rope, int(window)
        return self.rope, -1

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", self.default_tied))

    @property
    def is_70b(self) -> bool:
        return False

    def write_hparams(self, w: GGUFWriter) -> None:
        c = self.config
        w.add_block_count(self.n_layer)
        if c.get("max_position_embeddings"):
            w.add_context_length(int(c["max_position_embeddings"]))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_head_count(self.n_head)
        w.add_head_count_kv(self.n_head_kv)
        if self.rope.get("rope_theta") is not None:
            w.add_rope_freq_base(float(self.rope["rope_theta"]))
        w.add_layer_norm_rms_eps(float(self.need("rms_norm_eps")))
        if c.get("head_dim") is not None:
            w.add_key_length(int(c["head_dim"]))
            w.add_value_length(int(c["head_dim"]))
        self.write_rope_scaling(w)

    def write_rope_scaling(self, w: GGUFWriter) -> None:
        kind, factor = self.rope.get("rope_type") or self.rope.get("type"), self.rope.get("factor")
        if kind == "linear" and factor:
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(factor))
        elif kind == "yarn" and factor:
            w.add_rope_scaling_type(RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(factor))
            w.add_rope_scaling_orig_ctx_len(int(self.rope["original_max_position_embeddings"]))
        elif kind not in (None, "default", "llama3"):
            raise QuantizeError(f"RoPE scaling {kind!r} in config.json is not supported")

    # -- vocabulary -------------------------------------------------------------------------
    def vocab(self) -> Vocab:
        return convert_vocab(self.folder, self.n_vocab)

    # -- tensors ----------------------------------------------------------------------------
    def skip(self, hf_name: str) -> bool:
        return hf_name.endswith("rotary_emb.inv_freq") or (self.tied and hf_name == "lm_head.weight")

    def transform(self, planned: PlannedTensor, hf_name: str) -> PlannedTensor:
        return planned

    def extra_tensors(self) -> list[PlannedTensor]:
        return []

    def plan(self, checkpoint: Checkpoint) -> list[PlannedTensor]:
        names = get_tensor_name_map(self.arch, self.n_layer)
        planned = list(self.extra_tensors())
        for hf_name, ref in checkpoint.tensors.items():
            if self.skip(hf_name):
                continue
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise QuantizeError(f"tensor {hf_name} has no place in a {self.arch_name} GGUF; is config.json right?")
            planned.append(self.transform(PlannedTensor(name, ref.shape, ref), hf_name))
        if not any(p.name == "token_embd.weight" for p in planned):
            raise QuantizeError("the checkpoint has no token embedding tensor; is it complete?")
        return planned


FAMILIES: dict[str, type[Family]] = {}


def register(cls: type[Family]) -> type[Family]:
    for name in cls.hf_architectures:
        FAMILIES[name] = cls
    return cls


def family_for(folder: Path, config: dict) -> Family:
    from quantize import gemma3, llama, phi3, qwen  # noqa: F401  (each module registers its families)

    archs = config.get("architectures") or []
    for arch in archs:
        if arch in FAMILIES:
            return FAMILIES[arch](folder, config)
    supported = ", ".join(sorted(FAMILIES))
    got = ", ".join(archs) or f"model_type {config.get('model_type')!r}"
    raise QuantizeError(f"architecture {got} is not supported; supported: {supported}")


def permutation_for_rope(n_rows: int, n_head: int) -> np.ndarray:
    """Row order llama.cpp's rotary embedding expects for a q/k projection stored in HF order.

    HF rotates the two halves of each head; llama.cpp rotates interleaved pairs. Within each
    head, output row 2*i + t is input row t*half + i.
    """
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)
