"""Qwen2/2.5 and Qwen3 (dense). Same tensor layout as llama without the q/k row permutation;
Qwen2 has q/k/v biases, Qwen3 per-head q/k norms instead."""

from __future__ import annotations

from gguf import MODEL_ARCH

from quantize.architecture import Family, register


@register
class Qwen2(Family):
    arch = MODEL_ARCH.QWEN2
    hf_architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True


@register
class Qwen3(Family):
    arch = MODEL_ARCH.QWEN3
    hf_architectures = ("Qwen3ForCausalLM",)
    qk_norm = True
