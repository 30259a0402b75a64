"""Every supported family converts to a GGUF whose logits match transformers' on the same checkpoint.

The checkpoints are tiny random models built by transformers from a config (two layers, GQA),
with SmolLM2's tokenizer: small enough to build in the test, real enough that a wrong
hyperparameter, tensor name or row permutation changes the logits.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from quantize import convert
from quantize.llm import Model
from tests.hf_fixtures import hf_checkpoint

pytestmark = pytest.mark.slow

COMMON = dict(
    vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
)


def _config(arch: str):
    import transformers as tf

    if arch == "llama3":
        # Llama 3.1-style RoPE scaling (a rope_freqs tensor), untied output
        return tf.LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        })
    if arch == "qwen2":
        return tf.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
    if arch == "phi3":
        return tf.Phi3Config(**COMMON, pad_token_id=0)
    raise AssertionError(arch)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "phi3"])
def test_logits_match_transformers(arch, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
    # the folder name becomes general.name; llama.cpp applies Phi-3 tokenizer quirks to names
    # containing "phi3", which SmolLM2's tokenizer (no </s>) does not satisfy
    folder = tmp_path / "tiny-model"
    if arch == "llama3":
        # also covers bf16 weights and a sharded checkpoint with an index
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="4MB")
        assert (folder / "model.safetensors.index.json").is_file()
    else:
        model.save_pretrained(folder)
    # the reference reads the saved checkpoint back, as a user's transformers would
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer_src = hf_checkpoint("smollm2-135m-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_src / name, folder / name)

    result = convert(folder, tmp_path / "model.gguf", type_name="F32", outtype="f32")
    ids = [1] + list(range(300, 700, 3))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    with Model(result.path, n_ctx=512) as ours:
        got = np.concatenate([logits for _, logits in ours.logits(ids)])
    # llama.cpp keeps its KV cache in F16, so logits differ slightly, and random weights make
    # near-ties that may flip; a wrong hyperparameter or permutation moves them by far more
    assert np.abs(got - expected).max() < 0.03 * expected.std()
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.95
