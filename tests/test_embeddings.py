"""Embeddings on `edgechat serve`: OpenAI's /v1/embeddings through the `openai` SDK and Ollama's
/api/embed through the `ollama` SDK, on a real engine with SmolLM2 (mean pooling)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import ollama
import openai
import pytest
from serving import serving

from edgechat.engine import Engine, EngineConfig, embeddings
from edgechat.server import ServerSettings, create_app

KEY = "sk-test-key"
MODEL = "smollm2-135m-instruct"
SENTENCES = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Water boils at one hundred degrees."]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(models_root):
    eng = Engine(EngineConfig(model=MODEL, n_ctx=256, n_parallel=2, paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def base_url(engine):
    with serving(create_app(ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None), engine)) as url:
        yield url


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0)


def _vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


def test_batched_equals_single_unit_norm_deterministic_and_usage(client, engine):
    batched = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    vectors = _vectors(batched)
    assert vectors.shape == (3, engine.embedder.n_embd) and batched.model == MODEL
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    singles = np.array([_vectors(client.embeddings.create(model=MODEL, input=s, encoding_format="float"))[0] for s in SENTENCES])
    # other batch shapes round differently in llama.cpp's kernels: equal within float tolerance
    assert np.all(np.sum(vectors * singles, axis=1) > 0.999)
    assert np.abs(vectors - singles).max() < 0.02
    again = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float"))
    assert np.array_equal(again, vectors)
    n_tokens = sum(len(engine.tokenize(s)) for s in SENTENCES)
    assert batched.usage.prompt_tokens == batched.usage.total_tokens == n_tokens


def test_base64_is_the_floats_and_token_arrays_equal_the_text(client, base_url, engine):
    # the SDK asks for base64 by default and decodes it to floats itself
    decoded = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES[:2]))
    floats = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES[:2], encoding_format="float"))
    assert np.array_equal(decoded, floats.astype(np.float32))
    raw = httpx.post(f"{base_url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"},
                     json={"input": SENTENCES[0], "encoding_format": "base64"}).json()
    alone = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float"))[0]
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), alone.astype(np.float32))

    ids = [engine.tokenize(s) for s in SENTENCES[:2]]
    assert np.array_equal(_vectors(client.embeddings.create(model=MODEL, input=ids, encoding_format="float")), floats)
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert np.array_equal(_vectors(one)[0], alone) and one.usage.prompt_tokens == len(ids[0])


def test_similar_sentences_are_closer_than_unrelated_ones(client):
    texts = ["How do I bake bread at home?", "What is a simple recipe for homemade bread?",
             "The train to Berlin leaves at noon.", "Which platform does the Berlin train depart from?"]
    v = _vectors(client.embeddings.create(model=MODEL, input=texts, encoding_format="float"))
    sim = v @ v.T
    assert sim[0, 1] > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3])
    assert sim[2, 3] > max(sim[0, 2], sim[0, 3], sim[1, 2], sim[1, 3])


@pytest.fixture(scope="module")
def small_batches(models_root):
    """An engine whose embedding batches hold 32 tokens: inputs split across chunks, and a
    batch of a few sentences takes many chunks."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embeddings, "MAX_BATCH", 32)
        eng = Engine(EngineConfig(model=MODEL, n_ctx=256, paths=models_root))
    yield eng
    eng.close()


def test_inputs_split_across_batches_are_pooled_as_a_whole(small_batches, engine):
    # each input is cut where a 32-token chunk ends; its later part is decoded on top of its
    # cells, and the mean over the parts is the mean over the whole
    long = " ".join(f"item{i}" for i in range(30))
    assert len(small_batches.tokenize(long)) > 2 * small_batches.embedder.n_batch
    split = small_batches.embed(SENTENCES + [long]).result(60)
    whole = engine.embed(SENTENCES + [long]).result(60)
    assert all(float(a @ b) > 0.999 for a, b in zip(split, whole, strict=True))
    assert small_batches.kv_problems() == [] and engine.kv_problems() == []


def test_chat_is_answered_while_a_long_batch_runs_and_no_cells_are_left(small_batches):
    app = create_app(ServerSettings(api_key=KEY, model_id=MODEL, degrade_queue_wait=None), small_batches)
    with serving(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        greedy = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0, "seed": 1}
        alone = client.chat.completions.create(**greedy).choices[0].message.content
        # about 27 chunks of 32 tokens; the chat's 6 tokens come one step between two chunks
        batch = [f"Sentence number {i} is about {w}." for i, w in enumerate(["rain", "cats", "maps", "tea"] * 20)]
        job = small_batches.embed(batch)
        during = client.chat.completions.create(**greedy).choices[0].message.content
        running = not job.done.is_set()
        vectors = job.result(120)
    assert during == alone
    assert running, "the batch ended before the chat answer: it did not run alongside"
    assert len(vectors) == len(batch) and all(v is not None for v in vectors)
    assert small_batches.kv_problems() == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": 7.5}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": [[1, 2], "b"]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "word " * 400}, "input"),
        ({"input": "hi", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": "hi", "model": "no-such-model"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url, body, param):
    r = httpx.post(f"{base_url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, json=body)
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400) and error["param"] == param, r.text
    assert "\n" not in error["message"]


def test_ollama_embed_and_the_legacy_route(base_url, client):
    oc = ollama.Client(host=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    out = oc.embed(model=MODEL, input=SENTENCES)
    ours = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float"))
    assert np.array_equal(np.array(out.embeddings), ours) and out.prompt_eval_count > 0
    alone = _vectors(client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float"))[0]
    assert np.array_equal(np.array(oc.embed(model=MODEL, input=SENTENCES[0]).embeddings[0]), alone)
    assert np.array_equal(np.array(oc.embeddings(model=MODEL, prompt=SENTENCES[0]).embedding), alone)
    # too long: cut to the context by default, refused with truncate false
    long = "word " * 400
    assert len(oc.embed(model=MODEL, input=long).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as refused:
        oc.embed(model=MODEL, input=long, truncate=False)
    assert refused.value.status_code == 400 and "256" in refused.value.error
    assert oc.embed(model=MODEL, input=[]).embeddings == []


def test_an_embedding_model_of_its_own(models_root, smollm2_path, engine):
    # --embedding-model: resolved as any model name or path is, in its own backend
    with Engine(EngineConfig(model=MODEL, n_ctx=256, embedding_model=str(smollm2_path), paths=models_root)) as eng:
        assert eng.embedder.backend is not eng.backend
        ours = eng.embed(SENTENCES).result(60)
        assert eng.kv_problems() == []
    assert all(float(a @ b) > 0.9999 for a, b in zip(ours, engine.embed(SENTENCES).result(60), strict=True))
