"""ONNX model folders (edgechat quantize --format onnx, onnxruntime-genai's layout): recognising
one and reading what the engine, the planner and the server need to know of it."""

from __future__ import annotations

import json
from pathlib import Path

from edgechat.errors import ModelFormatError
from edgechat.models.ggufinfo import ModelInfo, read_model_info

#: the files edgechat's ONNX backend needs in the folder
REQUIRED = ("genai_config.json", "model.onnx", "tokenizer.gguf")
#: onnxruntime's resident memory per byte of model files once a session is loaded: it keeps
#: MatMulNBits weights prepacked for its kernels, beside bytes other nodes still read (a tied
#: embedding). Measured 1.6-1.7x for int4 exports (SmolLM2, Gemma 3), 0.85x for float32.
RESIDENT_PER_FILE_BYTE = 1.7
#: the KV cache's element size: onnxruntime's CPU graphs take float32 past/present
KV_ELEMENT_BYTES = 4.0


def is_onnx_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "genai_config.json").is_file() or (path / "model.onnx").is_file())


def read_info(path: Path) -> ModelInfo:
    """A GGUF file's or an ONNX folder's ModelInfo (for listings and fit checks)."""
    return read_onnx_info(path) if is_onnx_folder(path) else read_model_info(path)


def read_onnx_info(folder: Path) -> ModelInfo:
    """The folder's ModelInfo; a one-line ModelFormatError when a file it needs is missing."""
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        hint = " (export it with: edgechat quantize SRC --format onnx)" if "tokenizer.gguf" in missing else ""
        raise ModelFormatError(f"{folder} is not a complete ONNX model folder: {', '.join(missing)} missing{hint}")
    try:
        genai = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
        model = genai["model"]
        dec = model["decoder"]
        n_layer, n_head, n_kv = int(dec["num_hidden_layers"]), int(dec["num_attention_heads"]), int(dec["num_key_value_heads"])
        head, hidden, ctx = int(dec["head_size"]), int(dec["hidden_size"]), int(model["context_length"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFormatError(f"{folder / 'genai_config.json'} is not a valid genai config ({exc})") from None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.startswith("model.onnx"))
    return ModelInfo(
        path=folder, size_bytes=size, architecture=str(model.get("type", "onnx")), name=folder.name, quant="onnx",
        n_params=0, n_layer=n_layer, n_head=n_head, n_head_kv=n_kv, n_embd=hidden, head_dim_k=head, head_dim_v=head,
        context_length=ctx, sliding_window=None, swa_layers=(False,) * n_layer, chat_template=None,
        kv_element_bytes=KV_ELEMENT_BYTES, resident_bytes=int(size * RESIDENT_PER_FILE_BYTE),
    )
