"""Shared fixtures: every test gets its own data/config/cache dirs; real models are located once."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgechat.config import DATA_DIR_ENV, get_paths
from edgechat.models import resolve_model


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """No test reads or writes the user's real conversations, config or caches."""
    root = tmp_path / "edgechat-data"
    monkeypatch.setenv(DATA_DIR_ENV, str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    return get_paths(root)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    """One cache for assembled embedded models across the whole run (Gemma 3 is assembled once)."""
    return get_paths(tmp_path_factory.mktemp("models-root"))


@pytest.fixture(scope="session")
def smollm2_path(models_root):
    return resolve_model("smollm2-135m-instruct", models_root)


@pytest.fixture(scope="session")
def gemma3_path(models_root):
    return resolve_model("gemma3-270m", models_root)


def split_gguf(src: Path, dest_stem: Path, parts: int) -> list[Path]:
    """Split a GGUF into `parts` files as llama.cpp's gguf-split does (split.no, split.count and
    split.tensors.count in every part, names STEM-0000i-of-0000n.gguf), with gguf's own writer."""
    import gguf
    from gguf.scripts.gguf_new_metadata import copy_with_new_metadata

    reader = gguf.GGUFReader(str(src))
    per_part = -(-len(reader.tensors) // parts)
    writer = gguf.GGUFWriter(f"{dest_stem}.gguf", reader.fields["general.architecture"].contents(), split_max_tensors=per_part)
    copy_with_new_metadata(reader, writer, {}, [])
    return [Path(f"{dest_stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]


@pytest.fixture(scope="session")
def smollm2_split(smollm2_path, tmp_path_factory):
    """The embedded SmolLM2 GGUF split in two parts (real tensors, nothing left out)."""
    files = split_gguf(smollm2_path, tmp_path_factory.mktemp("split") / "smollm2", 2)
    assert all(f.is_file() for f in files)
    return files
