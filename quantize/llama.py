"""The llama family: Llama 2/3.x, SmolLM/SmolLM2, TinyLlama, Mistral (dense)."""

from __future__ import annotations

import math

import numpy as np
from gguf import MODEL_ARCH

from quantize.architecture import Family, PlannedTensor, permutation_for_rope, register


@register
class Llama(Family):
    arch = MODEL_ARCH.LLAMA
    hf_architectures = ("LlamaForCausalLM", "MistralForCausalLM")

    @property
    def is_70b(self) -> bool:
        # llama.cpp gives 70B llamas (80 layers) more bits in attn_v
        return self.n_layer == 80

    def write_hparams(self, w) -> None:
        super().write_hparams(w)
        w.add_vocab_size(self.n_vocab)
        w.add_rope_dimension_count(self.head_dim)

    def transform(self, planned: PlannedTensor, hf_name: str) -> PlannedTensor:
        if hf_name.endswith("q_proj.weight"):
            planned.row_index = permutation_for_rope(planned.shape[0], self.n_head)
        elif hf_name.endswith("k_proj.weight"):
            planned.row_index = permutation_for_rope(planned.shape[0], self.n_head_kv)
        return planned

    def extra_tensors(self) -> list[PlannedTensor]:
        if (self.rope.get("rope_type") or "").lower() != "llama3":
            return []
        # Llama 3.1+ scales low RoPE frequencies; llama.cpp reads the per-dimension factors
        # from a rope_freqs tensor.
        base = float(self.rope.get("rope_theta", 10000.0))
        dim = self.head_dim
        factor = float(self.rope.get("factor", 8.0))
        low, high = float(self.rope.get("low_freq_factor", 1.0)), float(self.rope.get("high_freq_factor", 4.0))
        old_ctx = float(self.rope.get("original_max_position_embeddings", 8192))
        freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
        factors = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < old_ctx / high:
                factors.append(1.0)
            elif wavelen > old_ctx / low:
                factors.append(factor)
            else:
                smooth = (old_ctx / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        values = np.array(factors, dtype=np.float32)
        return [PlannedTensor("rope_freqs.weight", values.shape, values=values)]
