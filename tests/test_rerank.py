"""Reranking (`/rerank`, `/v1/rerank`) on a tiny BERT cross-encoder the test writes
(tests/tiny_reranker.py), served beside SmolLM2 as its --embedding-model, against llama-server."""

from __future__ import annotations

import httpx
import pytest
from serving import serving
from tiny_reranker import write_tiny_reranker

from edgechat.engine import Engine, EngineConfig
from edgechat.models.planner import default_threads
from edgechat.server import ServerSettings, create_app

pytestmark = pytest.mark.slow

QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat on the mat", "dog", "what city is paris"]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return write_tiny_reranker(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf")


@pytest.fixture(scope="module")
def engine(models_root, reranker):
    eng = Engine(EngineConfig(model="smollm2-135m-instruct", n_ctx=512, embedding_model=str(reranker), paths=models_root))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def http(engine):
    with serving(create_app(ServerSettings(model_id="smol", degrade_queue_wait=None), engine)) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client


def test_rerank_orders_documents_by_the_models_scores(http, engine):
    scores = [float(v[0]) for v in engine.rerank(QUERY, DOCUMENTS).result(30)]
    answer = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}).json()
    results = answer["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    assert [r["relevance_score"] for r in results] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
    assert answer["object"] == "list" and answer["usage"]["prompt_tokens"] > len(DOCUMENTS) * 2
    top = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()["results"]
    assert top == results[:2]
    assert engine.kv_problems() == []


def test_a_reranker_is_not_an_embedding_model_and_bad_bodies_are_refused(http):
    r = http.post("/v1/embeddings", json={"input": "the cat"})
    assert r.status_code == 400 and "reranker" in r.json()["error"]["message"]
    for body in ({"documents": DOCUMENTS}, {"query": QUERY}, {"query": QUERY, "documents": []},
                 {"query": QUERY, "documents": ["a", 3]}, {"query": QUERY, "documents": DOCUMENTS, "top_n": 0}):
        r = http.post("/v1/rerank", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)


def test_a_model_that_is_not_a_reranker_is_refused_in_one_line(models_root):
    with Engine(EngineConfig(model="smollm2-135m-instruct", n_ctx=512, paths=models_root)) as eng:
        with serving(create_app(ServerSettings(model_id="smol", degrade_queue_wait=None), eng)) as url:
            r = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=30)
            message = r.json()["error"]["message"]
            assert r.status_code == 400 and "is not a reranker" in message and "\n" not in message


def test_scores_and_order_equal_llama_servers(http, llama_tools, reranker, tmp_path_factory):
    from bench.bench_serve import _free_port, _server
    from quantize.llm import use_extra_buffers

    port = _free_port()
    cmd = [str(llama_tools / "llama-server"), "-m", str(reranker), "--rerank", "-c", "512", "-np", "1", "-t", str(default_threads()),
           "--no-webui", "--host", "127.0.0.1", "--port", str(port), *([] if use_extra_buffers() else ["--no-repack"])]
    body = {"query": QUERY, "documents": DOCUMENTS}
    with _server(cmd, port, "llama-server", tmp_path_factory.mktemp("llama-server-rerank")) as url:
        theirs = httpx.post(url + "/v1/rerank", json=body, timeout=60).json()["results"]
    ours = http.post("/v1/rerank", json=body).json()["results"]
    assert [r["index"] for r in ours] == [r["index"] for r in theirs]
    assert [r["relevance_score"] for r in ours] == pytest.approx([r["relevance_score"] for r in theirs], abs=1e-4)
