"""The engine's options mean the same in `run`, `serve` and the chat app: one set of flags, one
builder of the EngineConfig (cli/engine_options.py). No model is loaded: the configuration the
engine would get is recorded and the load stopped."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import edgechat.cli.chat
import edgechat.engine
from edgechat.cli import cli
from edgechat.engine import EngineConfig

FLAGS = ["--ctx", "1024", "--threads", "2", "--gpu-layers", "0", "--kv-type", "q8_0", "--flash-attn", "off", "--swa-cache", "full",
         "--speculative", "off", "--deterministic"]
FIELDS = ("n_ctx", "n_threads", "n_gpu_layers", "kv_type", "flash_attn", "swa_cache", "speculative", "deterministic")


class _Stop(Exception):
    pass


@pytest.fixture
def built(isolated_dirs, monkeypatch):
    """Each front end's EngineConfig for the arguments given, as the engine would get it."""
    seen: list[EngineConfig] = []

    def record(config):
        seen.append(config)
        raise _Stop  # the configuration is all these tests need

    def app(model, url, api_key, data_dir, engine_options=None):
        # the chat app's local client lays these into its EngineConfig (tui/client.py)
        seen.append(EngineConfig(model=model, **(engine_options or {})))

    monkeypatch.setattr(edgechat.engine, "open_engine", record)
    monkeypatch.setattr(edgechat.cli.chat, "open_app", app)

    def build(*args) -> EngineConfig:
        before = len(seen)
        result = CliRunner().invoke(cli, list(args))
        assert len(seen) == before + 1, result.output
        return seen[-1]

    return build


def test_run_serve_and_the_app_build_the_same_engine_from_the_same_flags(built):
    configs = {"run": built("run", *FLAGS, "Hello"), "serve": built("serve", "--port", "0", *FLAGS), "app": built(*FLAGS)}
    wanted = {"n_ctx": 1024, "n_threads": 2, "n_gpu_layers": 0, "kv_type": "q8_0", "flash_attn": "off", "swa_cache": "full",
              "speculative": "off", "deterministic": True}
    for front, config in configs.items():
        assert {name: getattr(config, name) for name in FIELDS} == wanted, front
    defaults = {"run": built("run", "Hello"), "serve": built("serve", "--port", "0"), "app": built()}
    for front, config in defaults.items():
        assert {name: getattr(config, name) for name in FIELDS} == {name: getattr(EngineConfig(), name) for name in FIELDS}, front


def test_serve_takes_the_onnx_execution_provider_for_its_first_model(built):
    assert built("serve", "--port", "0", "--ep", "cpu").ep == "cpu"
    assert built("run", "--ep", "cpu", "Hello").ep == "cpu"
