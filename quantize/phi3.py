"""Phi-3 (mini/medium, 4k context): fused qkv and gate_up projections, kept fused as llama.cpp wants."""

from __future__ import annotations

from gguf import MODEL_ARCH

from quantize.architecture import Family, PlannedTensor, register
from quantize.errors import QuantizeError


@register
class Phi3(Family):
    arch = MODEL_ARCH.PHI3
    hf_architectures = ("Phi3ForCausalLM",)
    fused_projections = True

    def layer_attention(self, layer: int) -> tuple[dict, int]:
        """Every layer slides when the config gives a window: Phi-3 has no use_sliding_window switch."""
        window = self.config.get("sliding_window")
        return self.rope, int(window) if window else -1

    def write_hparams(self, w) -> None:
        c = self.config
        n_embd = int(self.need("hidden_size"))
        rotary = float(self.rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        orig_ctx = self.rope.get("original_max_position_embeddings", c.get("original_max_position_embeddings"))
        w.add_context_length(int(self.need("max_position_embeddings")))
        if orig_ctx:
            w.add_rope_scaling_orig_ctx_len(int(orig_ctx))
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_block_count(self.n_layer)
        w.add_head_count(self.n_head)
        w.add_head_count_kv(self.n_head_kv)
        w.add_layer_norm_rms_eps(float(self.need("rms_norm_eps")))
        w.add_rope_dimension_count(int(rotary * n_embd) // self.n_head)
        w.add_rope_freq_base(float(self.rope.get("rope_theta", 10000.0)))
        # llama.cpp tells Phi-4 (which has no sliding window) from Phi-3 by a window of 0
        w.add_sliding_window(int(c.get("sliding_window") or 0))

    def extra_tensors(self) -> list[PlannedTensor]:
        if self.rope.get("long_factor") or (self.config.get("rope_scaling") or {}).get("long_factor"):
            # 128k variants need rope_factors_long/short tensors and an attention factor
            raise QuantizeError("Phi-3 long-context (128k) checkpoints are not supported yet; use a 4k variant")
        return []
