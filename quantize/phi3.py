"""Phi-3 (mini/medium, 4k and 128k): fused qkv and gate_up projections, kept fused as llama.cpp wants."""

from __future__ import annotations

from gguf import MODEL_ARCH

from quantize.architecture import Family, PlannedTensor, register
from quantize.errors import QuantizeError


@register
class Phi3(Family):
    arch = MODEL_ARCH.PHI3
    hf_architectures = ("Phi3ForCausalLM",)

    def write_hparams(self, w) -> None:
        c = self.config
        w.add_block_count(self.n_layer)
        w.add_context_length(int(self.need("max_position_embeddings")))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_head_count(self.n_head)
        w.add_head_count_kv(self.n_head_kv)
        w.add_layer_norm_rms_eps(float(self.need("rms_norm_eps")))
        w.add_rope_dimension_count(int(self.head_dim * float(c.get("partial_rotary_factor", 1.0))))
        w.add_rope_freq_base(float(self.rope.get("rope_theta", 10000.0)))
        if c.get("sliding_window"):
            w.add_sliding_window(int(c["sliding_window"]))

    def write_rope_scaling(self, w) -> None:
        pass

    def extra_tensors(self) -> list[PlannedTensor]:
        scaling = self.config.get("rope_scaling") or {}
        if scaling.get("type", scaling.get("rope_type")) in ("longrope", "su"):
            # the 128k models need rope_factors_long/short tensors and attention scaling keys
            raise QuantizeError("Phi-3 long-context (128k) checkpoints are not supported yet; use a 4k variant")
        return []
