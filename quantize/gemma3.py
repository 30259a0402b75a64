"""Gemma 3 (text): Gemma3ForCausalLM checkpoints such as gemma-3-270m and gemma-3-1b."""

from __future__ import annotations

import math

from gguf import MODEL_ARCH

from quantize.architecture import Family, PlannedTensor, register
from quantize.tokenizer import Vocab, convert_vocab


@register
class Gemma3(Family):
    arch = MODEL_ARCH.GEMMA3
    hf_architectures = ("Gemma3ForCausalLM",)
    default_tied = True
    norm_add = 1.0  # Gemma3RMSNorm multiplies by (1 + w)
    sandwich_norms = True
    qk_norm = True

    @property
    def embed_scale(self) -> float:
        return math.sqrt(int(self.need("hidden_size")))

    @property
    def attn_scale(self) -> float:
        return float(self.config["query_pre_attn_scalar"]) ** -0.5

    def layer_attention(self, layer: int) -> tuple[dict, int]:
        """Local (sliding-window) layers, five to each global one unless the config lists them,
        with RoPE settings of their own."""
        c = self.config
        types = c.get("layer_types")
        pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
        sliding = types[layer] == "sliding_attention" if types else (layer + 1) % pattern != 0
        if sliding:
            params = c.get("rope_parameters") or {}
            rope = params.get("sliding_attention") or {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
            # GroupQueryAttention's window counts the tokens before the current one; measured
            # against transformers past 512 tokens, Gemma 3's sliding_window maps to it unchanged
            return rope, int(c["sliding_window"])
        return self.rope, -1

    def write_hparams(self, w) -> None:
        c = self.config
        w.add_block_count(self.n_layer)
        w.add_context_length(int(c.get("max_position_embeddings", 131072)))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_head_count(int(c.get("num_attention_heads", 8)))
        w.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
        w.add_key_length(int(c.get("head_dim", 256)))
        w.add_value_length(int(c.get("head_dim", 256)))
        w.add_rope_freq_base(float(self.rope.get("rope_theta", 1_000_000.0)))  # the global layers
        swa = (c.get("rope_parameters") or {}).get("sliding_attention", {}).get("rope_theta")
        if swa is not None:
            w.add_rope_freq_base_swa(float(swa))
        if c.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(c["final_logit_softcapping"]))
        if c.get("sliding_window_pattern") != 1 and c.get("sliding_window"):
            w.add_sliding_window(int(c["sliding_window"]))
        w.add_head_count_kv(int(c.get("num_key_value_heads", 4)))
        self.write_rope_scaling(w)

    def vocab(self) -> Vocab:
        vocab = convert_vocab(self.folder, self.n_vocab)
        if vocab.model == "llama":
            # Gemma's SentencePiece model adds no leading space
            vocab.add_space_prefix = False
        return vocab

    def transform(self, planned: PlannedTensor, hf_name: str) -> PlannedTensor:
        if hf_name.endswith("norm.weight"):
            # llama.cpp multiplies by the stored value
            planned.add = self.norm_add
        return planned

    def plan(self, checkpoint):
        planned = super().plan(checkpoint)
        for p in planned:
            # rows past the vocabulary are never produced; llama.cpp expects exactly n_vocab rows
            if p.name == "token_embd.weight" and p.shape[0] > self.n_vocab:
                p.shape = (self.n_vocab, *p.shape[1:])  # rows are read by range, so the rest are never read
        return planned
