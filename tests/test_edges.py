"""Nothing lost at the edges (issue 31): an answer cut by max_tokens in the middle of a multi-byte
character ends at the last whole character, streamed or not, through the server and the CLI."""

from __future__ import annotations

import json

import openai
import pytest
from serving import serving

from edgechat.engine import ChatRequest, Engine, EngineConfig
from edgechat.params import SamplingParams
from edgechat.server import ServerSettings, create_app
from tests.test_cli import edgechat

MODEL = "smollm2-135m-instruct"
PROMPTS = ["한국의 전통 음식 세 가지를 소개해 주세요.", "Write a birthday message with lots of emoji 🎉🎂🥳 in it."]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    with Engine(EngineConfig(model=MODEL, n_ctx=1024, n_parallel=2, paths=models_root)) as eng:
        yield eng


def cut_mid_character(engine, prompt: str, seed: int = 7) -> int:
    """A max_tokens that ends the greedy answer to `prompt` inside a multi-byte character: the
    answer's tokens are read once, long, and the first count whose bytes end unfinished is taken."""
    done = engine.submit(ChatRequest(messages=[{"role": "user", "content": prompt}], max_tokens=160,
                                     sampling=SamplingParams(temperature=0, seed=seed))).result()
    data = b""
    for n, token in enumerate(done.token_ids, 1):
        data += engine.backend.piece(token)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data" and n > 8:
                return n
    pytest.fail(f"no token of the answer to {prompt!r} ends inside a character")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_cut_character_is_held_back_in_the_server_streamed_and_not(engine, prompt):
    n = cut_mid_character(engine, prompt)
    with serving(create_app(ServerSettings(model_id=MODEL), engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0, seed=7)
        whole = client.chat.completions.create(**args)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices)
        legacy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, seed=7)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == n
    assert "\ufffd" not in text and streamed == text
    assert "\ufffd" not in legacy.choices[0].text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_cut_character_is_held_back_by_the_cli(engine, prompt):
    n = cut_mid_character(engine, prompt)
    args = ["run", "--temperature", "0", "--seed", "7", "--max-tokens", str(n), prompt]
    as_json = edgechat(*args[:-1], "--json", prompt)
    streamed = edgechat(*args)
    assert as_json.returncode == 0 and streamed.returncode == 0, as_json.stderr + streamed.stderr
    text = json.loads(as_json.stdout)["text"]
    assert "\ufffd" not in text and "\ufffd" not in streamed.stdout
    assert streamed.stdout.rstrip("\n") == text
