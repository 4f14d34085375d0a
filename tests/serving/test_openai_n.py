"""`n` choices on the OpenAI routes, as vLLM serves them: n engine requests (choice i seeded
with seed + i), choices indexed 0..n-1, usage counting the prompt once and summing the
completions, and a client that leaves aborting all of them. Real HTTP, real engines."""
from __future__ import annotations

import httpx
import pytest

from tests.serving.harness import API_KEY, parse_sse, sdk_clients, slow_steps, wait_until
from tests.serving.scripted_model import COMPLETION_PROMPT, COMPLETION_REPLY, LOOP_MODEL, REPLY, TEXT_MODEL

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def client(openai_client):
    return openai_client


def reply_len(scripted_models, text):
    return len(scripted_models[TEXT_MODEL].reply_tokens(text))


def stream_choices(client, path, body) -> tuple[dict[int, str], dict[int, str], list[dict]]:
    """(text per index, finish_reason per index, chunks) of a streamed answer."""
    frames = [d for _, d in parse_sse(client.post(path, json={**body, "stream": True}).text)]
    assert frames[-1] == "[DONE]"
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in frames[:-1]:
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            piece = (c["delta"].get("content") or "") if "delta" in c else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                assert c["index"] not in finishes
                finishes[c["index"]] = c["finish_reason"]
    return texts, finishes, frames[:-1]


def test_chat_n_choices(client, requests_to, scripted_models):
    asked = requests_to(TEXT_MODEL)
    body = {"model": TEXT_MODEL, "messages": HI, "n": 3, "seed": 5, "temperature": 0.5}
    data = client.post("/v1/chat/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == REPLY and c["finish_reason"] == "stop" for c in data["choices"])
    prompt = len(asked[-1].prompt_token_ids)
    each = reply_len(scripted_models, REPLY) + 1  # + EOS
    assert data["usage"]["prompt_tokens"] == prompt and data["usage"]["completion_tokens"] == 3 * each
    assert data["usage"]["total_tokens"] == prompt + 3 * each
    assert sorted(r.params.seed for r in asked) == [5, 6, 7]  # as vLLM: seed + index
    assert len({r.request_id for r in asked}) == 3

    texts, finishes, chunks = stream_choices(client, "/v1/chat/completions",
                                             {**body, "stream_options": {"include_usage": True}})
    assert texts == {0: REPLY, 1: REPLY, 2: REPLY} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3 * each
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt


def test_completion_n_choices_with_echo_and_logprobs(client, scripted_models):
    body = {"model": TEXT_MODEL, "prompt": COMPLETION_PROMPT, "n": 2, "echo": True, "max_tokens": 10}
    data = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in data["choices"]] == [(i, COMPLETION_PROMPT + COMPLETION_REPLY)
                                                                  for i in range(2)]
    assert data["usage"]["completion_tokens"] == 2 * (reply_len(scripted_models, COMPLETION_REPLY) + 1)
    texts, finishes, _ = stream_choices(client, "/v1/completions", body)
    assert texts == {0: "Hello world", 1: "Hello world"} and finishes == {0: "stop", 1: "stop"}
    body = {"model": TEXT_MODEL, "prompt": COMPLETION_PROMPT, "n": 2, "logprobs": 0}
    for choice in client.post("/v1/completions", json=body).json()["choices"]:
        assert "".join(choice["logprobs"]["tokens"]) == COMPLETION_REPLY


def test_n_choices_sample_as_n_seeded_requests(demo_server):
    """Choice i draws what a request seeded with seed + i draws: choice 0 is the n=1 answer."""
    with httpx.Client(base_url=demo_server.url, timeout=60, headers={"authorization": f"Bearer {API_KEY}"}) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Random words", "max_tokens": 8, "temperature": 1.0}
        alone = [c.post("/v1/completions", json={**body, "seed": s}).json()["choices"][0]["text"] for s in (41, 42)]
        together = [ch["text"] for ch in c.post("/v1/completions", json={**body, "seed": 41, "n": 2}).json()["choices"]]
    assert together == alone and alone[0] != alone[1]


def test_disconnect_aborts_every_choice(scripted_server, scripted_engines, requests_to, monkeypatch):
    engine = scripted_engines[LOOP_MODEL]
    asked = requests_to(LOOP_MODEL)
    slow_steps(engine, monkeypatch, 0.01)
    generated = engine.stats().generation_tokens
    body = {"model": LOOP_MODEL, "messages": HI, "max_tokens": 400, "n": 3, "stream": True}
    with httpx.Client(base_url=scripted_server.url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(12):
                next(lines)
            assert engine.stats().kv_blocks_used > 0
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=2)
    assert len(asked) == 3
    assert engine.stats().generation_tokens - generated < 3 * 400 // 4  # aborted, not run to the end


def test_disconnect_while_waiting_aborts_every_choice(scripted_server, scripted_engines, monkeypatch):
    engine = scripted_engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.01)
    generated = engine.stats().generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(scripted_server.url + "/v1/chat/completions", timeout=0.5,
                   headers={"authorization": f"Bearer {API_KEY}"},
                   json={"model": LOOP_MODEL, "messages": HI, "max_tokens": 400, "n": 4})
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=2)
    assert engine.stats().generation_tokens - generated < 4 * 400 // 2


def test_choices_the_engine_refuses_are_one_400(client, scripted_engines, monkeypatch):
    """The engine refuses each choice at its first delta (more KV blocks than its pool): one
    400, nothing left running."""
    engine = scripted_engines[TEXT_MODEL]
    monkeypatch.setattr(engine.engine.kv, "blocks_needed", lambda num_tokens: engine.engine.pool.num_blocks + 1)
    r = client.post("/v1/chat/completions", json={"model": TEXT_MODEL, "messages": HI, "n": 3, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=2)
    monkeypatch.undo()
    assert client.post("/v1/chat/completions", json={"model": TEXT_MODEL, "messages": HI, "n": 2}).status_code == 200


def test_openai_sdk_reads_n_choices(scripted_server):
    oai = sdk_clients(scripted_server.url)[1]
    r = oai.chat.completions.create(model=TEXT_MODEL, messages=HI, n=2, seed=1)
    assert [(c.index, c.message.content) for c in r.choices] == [(0, REPLY), (1, REPLY)]
    texts = {0: "", 1: ""}
    for chunk in oai.chat.completions.create(model=TEXT_MODEL, messages=HI, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: REPLY, 1: REPLY}
    r = oai.completions.create(model=TEXT_MODEL, prompt=COMPLETION_PROMPT, n=2)
    assert [c.text for c in r.choices] == [COMPLETION_REPLY] * 2


def test_the_request_log_counts_every_choices_tokens(client, scripted_models, caplog):
    """The n choices shared one telemetry record, each reporting its own running count: the log
    line and the generation-tokens histogram showed one choice's tokens, not the answer's."""
    import json
    import logging

    body = {"model": TEXT_MODEL, "messages": HI, "n": 3, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="tierlm.requests"):
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        wait_until(lambda: any(r.name == "tierlm.requests" for r in caplog.records))
    line = json.loads(next(r.getMessage() for r in caplog.records if r.name == "tierlm.requests"))
    each = reply_len(scripted_models, REPLY) + 1  # + EOS
    assert usage["completion_tokens"] == 3 * each
    assert line["output_tokens"] == 3 * each and line["prompt_tokens"] == usage["prompt_tokens"]  # `each` before


async def test_the_choices_ready_together_are_sent_as_one_piece():
    """A load tester's case: each step's n frames were n writes; into the socket of a client that
    had gone, asyncio logged "socket.send() raised exception" hundreds of times."""
    from tierlm.serving.openai import _interleaved

    async def choice(i):
        for k in range(3):
            yield f"{i}.{k};".encode()

    pieces = [p async for p in _interleaved([choice(i) for i in range(4)])]
    assert len(pieces) < 12  # 12 writes before
    got = b"".join(pieces).decode().split(";")[:-1]
    assert sorted(got) == sorted(f"{i}.{k}" for i in range(4) for k in range(3))
    for i in range(4):  # each choice's own frames in order
        assert [g for g in got if g.startswith(f"{i}.")] == [f"{i}.{k}" for k in range(3)]
