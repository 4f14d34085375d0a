"""vLLM's /score and /rerank (and /v1/score, /v1/rerank, /v2/rerank) on the real server with the
demo model: every score is the cosine similarity of transformers' normalised last hidden states
of the two texts; rerank orders by it; each distinct text is embedded once; bad bodies are
refused in OpenAI's shape before anything runs."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.serving.harness import API_KEY, record_requests
from tests.serving.test_telemetry import value

QUERY = "How does a tiered KV cache work?"
DOCS = ["A tiered cache keeps hot blocks close to the device.", "The quick brown fox jumps over the lazy dog.",
        "Bananas are yellow.", "A tiered cache keeps hot blocks close to the device."]  # the last: a repeat


@pytest.fixture
def http(demo_server):
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def unit(demo_engine):
    """transformers' normalised last hidden state of a text (the base model's output)."""
    from transformers import AutoModel

    base = AutoModel.from_pretrained(str(demo_engine.engine.model_dir), dtype=torch.float32).eval()

    def embed(text: str) -> torch.Tensor:
        with torch.no_grad():
            h = base(torch.tensor([demo_engine.encode(text)])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(h, dim=0)

    return embed


def test_scores_are_cosine_similarities_one_to_many_and_pairwise(http, demo_engine, unit):
    model = demo_engine.model_name
    one_to_many = http.post("/v1/score", json={"model": model, "text_1": QUERY, "text_2": DOCS}).json()
    want = [float(unit(QUERY) @ unit(d)) for d in DOCS]
    assert one_to_many["object"] == "list" and one_to_many["model"] == model
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want, abs=1e-4)
    distinct = [QUERY] + DOCS[:3]  # the repeated document is embedded once
    tokens = sum(len(demo_engine.encode(t)) for t in distinct)
    assert one_to_many["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    pairwise = http.post("/score", json={"model": model, "text_1": DOCS[:2], "text_2": [QUERY, DOCS[2]]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [float(unit(DOCS[0]) @ unit(QUERY)), float(unit(DOCS[1]) @ unit(DOCS[2]))], abs=1e-4)
    assert one_to_many["data"][3]["score"] == pytest.approx(one_to_many["data"][0]["score"], abs=1e-6)


def test_rerank_orders_documents_by_score_in_every_route_shape(http, demo_engine, unit, demo_server):
    model = demo_engine.model_name
    want = [float(unit(QUERY) @ unit(d)) for d in DOCS]
    before = value(http.get("/metrics").text, "tierlm:requests_total", route="/v1/rerank", model=model)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = http.post(path, json={"model": model, "query": QUERY, "documents": DOCS}).json()
        assert sorted(r["index"] for r in got["results"]) == list(range(len(DOCS)))
        scores = [r["relevance_score"] for r in got["results"]]
        assert scores == sorted(scores, reverse=True)
        assert {r["index"]: r["relevance_score"] for r in got["results"]} == pytest.approx(dict(enumerate(want)),
                                                                                        abs=1e-4)
        assert all(r["document"]["text"] == DOCS[r["index"]] for r in got["results"])
        assert got["model"] == model and got["usage"]["total_tokens"] > 0
    top = http.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCS, "top_n": 2,
                                        "return_documents": False}).json()
    assert len(top["results"]) == 2 and "document" not in top["results"][0]
    after = value(http.get("/metrics").text, "tierlm:requests_total", route="/v1/rerank", model=model)
    assert after - before == 2  # a generation route: counted, and held to the tenant's limits


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, 400, "text_2"),  # N:1, as vLLM refuses it
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, 400, "text_1"),
    ("/v1/score", {"text_1": "fine", "text_2": ["ok", ""]}, 400, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["x " * 5000]}, 400, "documents.0"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 2049}, 400, "documents"),
])
def test_bad_bodies_are_refused_in_openais_shape_and_run_nothing(http, demo_engine, monkeypatch, path, body, status,
                                                                 param):
    admitted = record_requests(demo_engine, monkeypatch)
    r = http.post(path, json={"model": demo_engine.model_name, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param), err
    assert admitted == []


def test_an_unknown_model_is_a_404(http):
    r = http.post("/v1/rerank", json={"model": "no-such-model", "query": "q", "documents": ["a"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
