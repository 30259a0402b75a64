"""Real Hugging Face checkpoints, written by transformers from the two embedded GGUF models.

The quantizer's tests need what a user downloads from the Hub: config.json, safetensors in
bf16, tokenizer files and a chat template. transformers can load a GGUF but refuses to save
a GGUF-loaded model, so the weights go through a fresh model built from the config. Building
takes a minute and needs torch, so each checkpoint is built once per machine into a fixed cache
(the per-test XDG overrides in conftest.py must not send it elsewhere), atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from edgechat.config import get_paths
from edgechat.models import resolve_model

#: where the built checkpoints live; fixed so that every test session reuses them
CACHE_ENV = "EDGECHAT_TEST_FIXTURES"

# Bumped when the way a fixture is built changes, so stale copies are rebuilt.
FIXTURE_VERSION = "1"


def fixtures_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    root = Path(override) if override else Path.home() / ".cache" / "edgechat-test-fixtures"
    return root / f"v{FIXTURE_VERSION}"


def _write_sentencepiece_model(gguf_path: Path, out: Path) -> None:
    """Gemma's repos ship tokenizer.model; transformers only writes tokenizer.json, so rebuild it
    from the GGUF's own vocabulary (pieces, scores, types), as llama.cpp's converter reads it."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2 as spm

    reader = gguf.GGUFReader(str(gguf_path))
    tokens = reader.fields["tokenizer.ggml.tokens"]
    scores = reader.fields["tokenizer.ggml.scores"]
    types = reader.fields["tokenizer.ggml.token_type"]
    proto = spm.ModelProto()
    proto.trainer_spec.model_type = spm.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.vocab_size = len(tokens.data)
    proto.trainer_spec.unk_id = int(reader.fields["tokenizer.ggml.unknown_token_id"].contents())
    proto.trainer_spec.bos_id = int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    proto.trainer_spec.eos_id = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    proto.trainer_spec.pad_id = int(reader.fields["tokenizer.ggml.padding_token_id"].contents())
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    for i in range(len(tokens.data)):
        piece = proto.pieces.add()
        piece.piece = bytes(tokens.parts[tokens.data[i]]).decode("utf-8")
        piece.score = float(scores.parts[scores.data[i]][0])
        piece.type = int(types.parts[types.data[i]][0])
    out.write_bytes(proto.SerializeToString())


def _build(gguf_path: Path, dest: Path, *, sentencepiece: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    fresh.tie_weights()

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if sentencepiece:
            _write_sentencepiece_model(gguf_path, tmp / "tokenizer.model")
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another test session built it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_checkpoint(model: str) -> Path:
    """The folder of the Hugging Face checkpoint made from embedded model `model`, built once."""
    dest = fixtures_root() / model
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    paths = get_paths(fixtures_root() / "edgechat-data")
    _build(resolve_model(model, paths), dest, sentencepiece=model.startswith("gemma"))
    return dest
