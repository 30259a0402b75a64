"""Shared fixtures: every test gets its own data/config/cache dirs; real models are located once."""

from __future__ import annotations

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
