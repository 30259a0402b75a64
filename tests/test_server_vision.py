"""Images through the server's APIs (OpenAI chat completions and Responses, Anthropic Messages,
Ollama chat and generate) with their official clients, on the embedded SmolLM2 with the tiny
projector tests/tiny_mmproj.py writes (16 cells a picture, random weights), or the real pair
conftest.py's `vision_pair` is given.

What it proves: a picture sent as each API sends one reaches the model (the greedy answer
changes, and is the same for the same picture whichever API sent it), usage counts its cells,
and every refusal (remote URL, file outside --image-dir, too many bytes, pixels or images, a
text-only model) is a one-line 400 in the API's own error shape naming the field. The tiny
projector cannot say what a picture shows: no test reads meaning into an answer.
"""

from __future__ import annotations

import base64

import anthropic
import httpx
import ollama
import openai
import pytest
from serving import serving
from tiny_mmproj import CHECKS, GRADIENT, N_IMAGE_TOKENS, png, text_embedding_width, write_tiny_mmproj

from edgechat.engine import Engine, EngineConfig
from edgechat.engine.pool import ModelPool
from edgechat.engine.runners.media import VISION_MODEL
from edgechat.server import ServerSettings, create_app

MODEL = "smol"
QUESTION = "What is in this picture?"
N = 12

pytestmark = pytest.mark.slow


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def asking(*images: str) -> list[dict]:
    """One user message: its images (as URLs), then the question: Ollama's order too."""
    return [{"role": "user", "content": [*(image_part(u) for u in images), {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def mmproj(smollm2_path, tmp_path_factory):
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf", text_embedding_width(smollm2_path))


@pytest.fixture(scope="module")
def vision(vision_pair, models_root):
    # deterministic: every prompt prefilled from an empty cache, so equal answers mean equal inputs
    config = EngineConfig(model=str(vision_pair.model), paths=models_root, n_ctx=1024 + vision_pair.image_tokens - N_IMAGE_TOKENS,
                          mmproj=str(vision_pair.mmproj), deterministic=True)
    with Engine(config) as engine:
        yield engine


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    (root / "inside").mkdir()
    (root / "inside" / "gradient.png").write_bytes(GRADIENT)
    (root / "outside.png").write_bytes(GRADIENT)
    (root / "inside" / "link.png").symlink_to(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def base_url(vision, image_dir):
    settings = ServerSettings(model_id=MODEL, degrade_queue_wait=None, image_dir=image_dir / "inside")
    with serving(create_app(settings, vision)) as url:
        yield url


@pytest.fixture(scope="module")
def small_limits(vision):
    """The same model with limits the test pictures reach: 2 images, 2,000 pixels, twice GRADIENT's bytes."""
    settings = ServerSettings(model_id=MODEL, degrade_queue_wait=None, max_images=2, max_image_megapixels=0.002,
                              max_image_bytes=2 * len(GRADIENT))
    with serving(create_app(settings, vision)) as url:
        yield url


@pytest.fixture(scope="module")
def text_only(smol):
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), smol)) as url:
        yield url


def oa(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, messages: list[dict]):
    return oa(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=N, temperature=0)


@pytest.fixture(scope="module")
def answers(base_url):
    """The chat completions answers: without a picture, with GRADIENT, with CHECKS."""
    text = chat(base_url, [{"role": "user", "content": QUESTION}])
    return text, chat(base_url, asking(data_url(GRADIENT))), chat(base_url, asking(data_url(CHECKS)))


def refused(call, error=openai.BadRequestError):
    with pytest.raises(error) as info:
        call()
    return info.value


def test_a_data_url_reaches_the_model_and_usage_counts_its_cells(base_url, answers, vision_pair):
    text, gradient, checks = answers
    assert gradient.choices[0].message.content != text.choices[0].message.content
    assert checks.choices[0].message.content != gradient.choices[0].message.content
    assert chat(base_url, asking(data_url(GRADIENT))).choices[0].message.content == gradient.choices[0].message.content
    # the image's cells are prompt tokens (and the text around it, the projector's own, none here)
    assert gradient.usage.prompt_tokens == text.usage.prompt_tokens + vision_pair.image_tokens
    two = chat(base_url, asking(data_url(GRADIENT), data_url(CHECKS)))
    assert two.usage.prompt_tokens == text.usage.prompt_tokens + 2 * vision_pair.image_tokens


def test_each_api_sends_a_picture_to_the_same_answer(base_url, answers):
    _, gradient, _ = answers
    expected, encoded = gradient.choices[0].message.content, base64.b64encode(GRADIENT).decode()

    message = anthropic.Anthropic(base_url=base_url, api_key="none", max_retries=0, timeout=120).messages.create(
        model=MODEL, max_tokens=N, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == gradient.usage.prompt_tokens

    response = oa(base_url).responses.create(model=MODEL, max_output_tokens=N, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(GRADIENT)}, {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected and response.usage.input_tokens == gradient.usage.prompt_tokens

    client = ollama.Client(host=base_url, timeout=120)
    options = {"temperature": 0, "num_predict": N}
    shown = client.chat(model=MODEL, messages=[{"role": "user", "content": QUESTION, "images": [GRADIENT]}], options=options)
    assert shown.message.content == expected and shown.prompt_eval_count == gradient.usage.prompt_tokens
    generated = client.generate(model=MODEL, prompt=QUESTION, images=[GRADIENT], options=options)
    assert generated.response == expected


def test_file_urls_are_read_only_inside_the_image_dir(base_url, vision, answers, image_dir):
    _, gradient, _ = answers
    inside = (image_dir / "inside" / "gradient.png").as_uri()
    assert chat(base_url, asking(inside)).choices[0].message.content == gradient.choices[0].message.content
    for url in ((image_dir / "outside.png").as_uri(), f"{image_dir.as_uri()}/inside/../outside.png",
                (image_dir / "inside" / "link.png").as_uri()):  # a link out of the folder is outside it
        error = refused(lambda u=url: chat(base_url, asking(u)))
        assert error.param == "messages[0].content[0].image_url.url" and "--image-dir" in error.message
    error = refused(lambda: chat(base_url, asking((image_dir / "inside" / "none.png").as_uri())))
    assert "cannot read the file" in error.message
    # a server without an image folder says how to give it one
    with serving(create_app(ServerSettings(model_id=MODEL, degrade_queue_wait=None), vision)) as url:
        error = refused(lambda: chat(url, asking(inside)))
    assert "--image-dir" in error.message and "\n" not in error.message


def test_remote_urls_and_bad_data_are_refused_in_one_line(base_url):
    error = refused(lambda: chat(base_url, asking("https://example.com/cat.png")))
    assert error.status_code == 400 and error.param == "messages[0].content[0].image_url.url"
    assert "offline" in error.message and "data:image/png;base64" in error.message and "\n" not in error.message
    for url, words in (("data:image/png;base64,not base64!", "base64"), (data_url(b"GIF89a"), "cut short"),
                       (data_url(b"plain text"), "not an image"), (data_url(GRADIENT[:20]), "cut short"),
                       # a WebP's header reads, but llama.cpp's loader would not decode it: refused before it
                       (data_url(b"RIFF\x16\0\0\0WEBPVP8L\x05\0\0\0\x2f\xff\xff\x07\0"), "convert it to PNG")):
        error = refused(lambda u=url: chat(base_url, asking(u)))
        assert words in error.message and error.param == "messages[0].content[0].image_url.url", error.message
    # images are a user's: elsewhere they are refused by place
    error = refused(lambda: chat(base_url, [{"role": "system", "content": [image_part(data_url(GRADIENT))]},
                                            {"role": "user", "content": QUESTION}]))
    assert error.param == "messages[0].content[0]"


def test_limits_on_bytes_pixels_and_count_are_400s_naming_the_field(small_limits, vision_pair):
    big = GRADIENT + bytes(2 * len(GRADIENT))  # a valid header, then more bytes than the limit
    error = refused(lambda: chat(small_limits, asking(data_url(big))))
    assert error.code == "image_too_large" and error.param == "messages[0].content[0].image_url.url" and "--max-image-mib" in error.message
    wide = png(50, 50, lambda x, y: (0, 0, 0))  # 2,500 pixels in a few hundred bytes
    error = refused(lambda: chat(small_limits, asking(data_url(wide))))
    assert error.code == "image_too_large" and "50x50" in error.message and "--max-image-megapixels" in error.message
    error = refused(lambda: chat(small_limits, asking(*[data_url(GRADIENT)] * 3)))
    assert error.code == "too_many_images" and error.param == "messages[0].content[2].image_url.url"
    assert chat(small_limits, asking(data_url(GRADIENT), data_url(CHECKS))).usage.prompt_tokens > 2 * vision_pair.image_tokens

    # the other APIs' fields, in their own error shapes
    r = httpx.post(f"{small_limits}/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(big).decode()}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("messages[0].content[0].source.data: the image is")
    r = httpx.post(f"{small_limits}/api/chat", json={"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [base64.b64encode(wide).decode()]}]})
    assert r.status_code == 400 and r.json()["error"].startswith("messages[0].images[0]: the image is 50x50")
    r = httpx.post(f"{small_limits}/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(GRADIENT)} for _ in range(3)]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[2].image_url"


def test_a_text_only_model_refuses_an_image_naming_a_vision_model(text_only):
    error = refused(lambda: chat(text_only, asking(data_url(GRADIENT))))
    assert error.status_code == 400 and VISION_MODEL in error.message and "\n" not in error.message
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic.Anthropic(base_url=text_only, api_key="none", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(GRADIENT).decode()}}]}])
    assert VISION_MODEL in info.value.body["error"]["message"]
    with pytest.raises(ollama.ResponseError) as oinfo:
        ollama.Client(host=text_only).chat(model=MODEL, messages=[{"role": "user", "content": "hi", "images": [GRADIENT]}])
    assert oinfo.value.status_code == 400 and VISION_MODEL in oinfo.value.error


def test_model_lists_say_vision(base_url, text_only, smollm2_path, models_root, mmproj):
    assert httpx.get(f"{base_url}/v1/models").json()["data"][0]["meta"]["modalities"] == ["vision"]
    assert httpx.get(f"{text_only}/v1/models").json()["data"][0]["meta"]["modalities"] == []
    assert "vision" in httpx.get(f"{base_url}/api/tags").json()["models"][0]["capabilities"]
    assert "vision" not in httpx.get(f"{text_only}/api/tags").json()["models"][0]["capabilities"]
    assert "vision" in ollama.Client(host=base_url).show(MODEL).capabilities
    assert httpx.get(f"{base_url}/props").json()["modalities"] == {"vision": True, "audio": False}
    assert httpx.get(f"{text_only}/props").json()["modalities"] == {"vision": False, "audio": False}
    # a model not loaded yet: its projector is known from its config, without loading it
    pool = ModelPool()
    try:
        pool.add("later", EngineConfig(model=str(smollm2_path), paths=models_root, n_ctx=256, mmproj=str(mmproj)))
        pool.add("plain", EngineConfig(model=str(smollm2_path), paths=models_root, n_ctx=256))
        with serving(create_app(ServerSettings(degrade_queue_wait=None), pool=pool)) as url:
            cards = {c["id"]: c["meta"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
            assert cards["later"]["state"] == "unloaded" and cards["later"]["modalities"] == ["vision"]
            assert cards["plain"]["modalities"] == []
            assert "vision" in ollama.Client(host=url).show("later").capabilities
    finally:
        pool.close()
