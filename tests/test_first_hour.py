"""What a newcomer meets in the first hour (issue 24): commands that end, one-line errors for a
bad data dir, a quick answer offline, no control tokens in answers, messages without internals."""

from __future__ import annotations

import pytest

from tests.test_cli import assert_one_line_error, edgechat


@pytest.mark.parametrize("command", [
    ["run", "hi"],
    ["serve", "--port", "0"],
    ["models"],
    ["models", "--catalog"],
    ["doctor"],
    ["pull", "qwen2.5-0.5b-instruct"],
    ["sessions"],
    [],  # the chat app
])
def test_a_data_dir_under_a_file_is_one_line_for_every_command(tmp_path, command):
    blocker = tmp_path / "hostname"
    blocker.write_text("not a directory\n")
    proc = edgechat("--data-dir", str(blocker / "sub"), *command) if not command else \
        edgechat(*command, "--data-dir", str(blocker / "sub"))
    assert_one_line_error(proc, f"cannot create {blocker / 'sub'}", "is a file")


def _refusing_port() -> int:
    """A loopback port nothing listens on: a stand-in Hub that refuses every connection."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command, says", [
    (["pull", "qwen2.5-0.5b-instruct"], "cannot download qwen2.5-0.5b-instruct: the Hub (127.0.0.1) cannot be reached"),
    (["run", "-m", "qwen3-0.6b", "hi"], "connect once and run `edgechat pull qwen3-0.6b`"),
])
def test_an_unreachable_hub_is_one_quick_line(command, says):
    import time

    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": f"http://127.0.0.1:{_refusing_port()}"}
    start = time.monotonic()
    proc = edgechat(*command, env_extra=env, timeout=120)
    elapsed = time.monotonic() - start
    assert_one_line_error(proc, says)
    if command[0] == "pull":
        assert "run this again" in proc.stderr and "edgechat pull" not in proc.stderr
    # huggingface_hub's own retries took ~25 s here; a refused connection is not worth retrying
    assert elapsed < 15, f"{elapsed:.1f} s"


def test_the_readme_example_ends_and_a_cut_answer_says_length():
    """The README's base-model example once repeated itself for 10 minutes: `run` has a default
    answer length (in --help), and the JSON says when an answer was cut there."""
    import json

    from edgechat.engine.types.request import DEFAULT_MAX_TOKENS

    readme = edgechat("run", "--raw", "-m", "gemma3-270m", "--json", "--seed", "1", "The Eiffel Tower is in the city of")
    assert readme.returncode == 0, readme.stderr
    assert json.loads(readme.stdout)["completion_tokens"] <= DEFAULT_MAX_TOKENS
    # past end-of-text and with no loop guard, only the default cap can end it
    proc = edgechat("run", "--raw", "-m", "gemma3-270m", "--json", "--ignore-eos",
                    "The Eiffel Tower is in the city of")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["finish_reason"] == "length" and data["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert f"reached {DEFAULT_MAX_TOKENS} tokens" in proc.stderr
    assert f"default: {DEFAULT_MAX_TOKENS}" in edgechat("run", "--help").stdout


def test_a_context_beyond_training_names_the_model_by_its_short_name():
    proc = edgechat("run", "--ctx", "999999999", "hi")
    assert_one_line_error(proc, "more than smollm2-135m-instruct was trained for")


def test_models_catalog_fits_the_terminal():
    for columns in (50, 80, 120):
        proc = edgechat("models", "--catalog", env_extra={"COLUMNS": str(columns)})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert len(lines) > 10 and all(len(line) <= columns for line in lines), (columns, max(map(len, lines)))
        assert "qwen3-0.6b" in proc.stdout


def test_the_models_page_lists_every_catalog_model():
    from pathlib import Path

    from edgechat.models.catalog import load_catalog

    # the README links to docs/models.md, where the catalog is described
    page = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    models = page.split("# Models", 1)[1].split("```", 1)[0]
    missing = [name for name in load_catalog() if f"`{name}`" not in models]
    assert not missing, missing


@pytest.fixture(scope="module")
def engines(smollm2_path, gemma3_path, models_root):
    from edgechat.engine import Engine, EngineConfig

    with Engine(EngineConfig(model=str(smollm2_path), n_ctx=2048, paths=models_root)) as smol, \
            Engine(EngineConfig(model=str(gemma3_path), n_ctx=1024, paths=models_root)) as gemma:
        yield smol, gemma


def test_a_looping_answer_is_stopped_by_the_guard_and_not_without_it(engines):
    """SmolLM2 answers this greedily with one phrase over and over (seen: 2,629 tokens of it)."""
    from edgechat.engine.types.request import ChatRequest
    from edgechat.params import SamplingParams

    smol, _ = engines
    ask = dict(messages=[{"role": "user", "content": "What is the capital of France?"}],
               sampling=SamplingParams(temperature=0), max_tokens=320)
    guarded = smol.submit(ChatRequest(**ask)).result()
    free = smol.submit(ChatRequest(**ask, loop_guard=False)).result()
    assert free.reason == "length" and free.metrics.completion_tokens == 320 and not free.repeating
    assert free.text.startswith(guarded.text)  # the same answer, cut where it began to loop
    tail = free.text[-120:]
    assert free.text[:-120].count(tail[:40]) >= 2  # it really was repeating
    assert guarded.repeating and guarded.reason == "length" and guarded.metrics.completion_tokens < 320


def test_an_answer_that_does_not_repeat_is_left_alone(engines):
    from edgechat.engine.types.request import ChatRequest
    from edgechat.params import SamplingParams

    smol, _ = engines
    text = "Write a Python function that returns the n-th Fibonacci number, with a docstring and three tests."
    done = smol.submit(ChatRequest(messages=[{"role": "user", "content": text}], sampling=SamplingParams(temperature=0.7, seed=3),
                                   max_tokens=400)).result()
    assert not done.repeating


def test_media_marker_tokens_never_reach_the_text(engines):
    """Gemma 3 270M base sometimes samples its `<start_of_image>` token (a user-defined token,
    which llama.cpp renders as text)."""
    from edgechat.engine.types.request import ChatRequest
    from edgechat.params import SamplingParams

    _, gemma = engines
    marker = gemma.backend.tokenize("<start_of_image>", special=True)
    assert len(marker) == 1
    seen = 0
    for seed in range(8):
        done = gemma.submit(ChatRequest(prompt="The Eiffel Tower is in the city of", sampling=SamplingParams(seed=seed),
                                        max_tokens=64)).result()
        seen += marker[0] in done.token_ids
        assert "<start_of_image>" not in done.text and "start_of_image" not in done.text
    assert seen, "no seed sampled the marker: this test no longer shows anything"


@pytest.fixture(scope="module")
def greedy_by_its_maker(smollm2_path, tmp_path_factory):
    """SmolLM2 whose file recommends greedy decoding (general.sampling.temp = 0, as llama.cpp's
    converter writes from a generation_config.json): no embedded model carries these keys."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    out = tmp_path_factory.mktemp("sampling") / "smollm2-greedy.gguf"
    reader = gguf.GGUFReader(str(smollm2_path))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    F32 = gguf.GGUFValueType.FLOAT32
    copy_with_new_metadata(reader, writer, {"general.sampling.temp": MetadataDetails(F32, 0.0),
                                            "general.sampling.top_k": MetadataDetails(gguf.GGUFValueType.INT32, 7)}, [])
    return out


def test_the_models_recommended_sampling_is_the_default(greedy_by_its_maker, smollm2_path):
    import json

    from edgechat.models import read_model_info

    assert read_model_info(greedy_by_its_maker).sampling == {"temperature": 0.0, "top_k": 7}
    assert read_model_info(smollm2_path).sampling == {}
    ask = ["--json", "--max-tokens", "24", "Tell me a story about a dragon."]
    runs = [json.loads(edgechat("run", "-m", str(greedy_by_its_maker), "--seed", str(seed), *ask).stdout)["text"] for seed in (1, 2)]
    greedy = json.loads(edgechat("run", "--temperature", "0", *ask).stdout)["text"]
    assert runs[0] == runs[1] == greedy
    # what the user asks for still wins over what the file recommends
    hot = {json.loads(edgechat("run", "-m", str(greedy_by_its_maker), "--temperature", "1.5", "--top-k", "0", "--seed", str(seed),
                               *ask).stdout)["text"] for seed in (1, 2, 3)}
    assert len(hot) > 1


def test_the_server_lays_a_request_over_the_models_recommended_sampling():
    from edgechat.params import SamplingParams
    from edgechat.server.openai_chat_api import parse_chat, parse_completion

    base = SamplingParams(temperature=0.0, top_k=7)
    user = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": user}, sampling=base).request.sampling == base
    asked = parse_chat({"messages": user, "temperature": 1.2}, sampling=base).request.sampling
    assert (asked.temperature, asked.top_k) == (1.2, 7) and base.temperature == 0.0
    assert parse_completion({"prompt": "hi"}, sampling=base).request.sampling == base
    assert parse_chat({"messages": user, "loop_guard": False}).request.loop_guard is False
    assert parse_chat({"messages": user}).request.loop_guard is True
