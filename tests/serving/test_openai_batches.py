"""OpenAI's Files and Batch APIs (tierlm/serving/files.py, openai_batches.py) through the official
`openai` SDK against a real server on scripted models: an uploaded JSONL file of requests runs
to output and error files whose answers equal the routes' own, files and batches per key, the
input file checked whole when the batch is created, cancelling, the three endpoints, and both
outliving a restart with --batches-dir."""
from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.serving.harness import ServerThread, slow_steps, wait_until
from tests.serving.scripted_model import LOOP_MODEL, REPLY, TEXT_MODEL
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.tenancy import Tenancy

KEYS = {"a": "sk-obatch-a", "b": "sk-obatch-b"}
TENANTS = """
[tenants.acme]
tier = "gold"
keys = ["a"]
requests_per_minute = 2       # interactive requests only: a batch's are not charged
"""
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engines(scripted_models) -> dict:
    return {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(TEXT_MODEL),
            LOOP_MODEL: scripted_models[LOOP_MODEL].engine(LOOP_MODEL)}


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("obatches") / "tenants.toml"
    path.write_text(TENANTS)
    srv = ServerThread(build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=Tenancy.from_file(path, KEYS))).start()
    yield srv
    srv.stop()


def client(server: ServerThread, key: str = "a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[key], max_retries=0, timeout=60)


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def chat(cid: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": TEXT_MODEL, "messages": HI, **body}}


def finished(c: openai.OpenAI, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def lines(c: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A results file's lines by custom_id."""
    assert file_id is not None
    return {row["custom_id"]: row for row in map(json.loads, c.files.content(file_id).text.splitlines())}


def test_a_batch_answers_as_the_route_would_with_failures_in_the_error_file(server):
    c = client(server, "b")
    interactive = c.chat.completions.create(model=TEXT_MODEL, messages=HI, max_tokens=50)
    upload = c.files.create(file=("requests.jsonl", jsonl([
        chat("text", max_tokens=50),
        chat("loop-5", model=LOOP_MODEL, max_tokens=5),
        chat("unknown-model", model="no-such-model", max_tokens=5),
        chat("streamed", max_tokens=5, stream=True),
        chat("bad-temperature", max_tokens=5, temperature=-1),
    ])), purpose="batch")
    assert upload.id.startswith("file-") and upload.purpose == "batch" and upload.filename == "requests.jsonl"
    assert upload.expires_at == upload.created_at + 30 * 24 * 3600  # OpenAI's default for batch files
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"job": "nightly"},
                             output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert batch.id.startswith("batch_") and batch.object == "batch" and batch.status == "in_progress"
    assert batch.expires_at - batch.created_at == 24 * 3600 and batch.metadata == {"job": "nightly"}
    assert batch.request_counts.total == 5 and batch.model == TEXT_MODEL
    done = finished(c, batch.id)
    assert done.status == "completed" and done.completed_at >= done.finalizing_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
    out, err = lines(c, done.output_file_id), lines(c, done.error_file_id)
    assert set(out) == {"text", "loop-5"} and set(err) == {"unknown-model", "streamed", "bad-temperature"}
    text = out["text"]
    assert text["id"].startswith("batch_req_") and text["error"] is None
    assert text["response"]["status_code"] == 200 and text["response"]["request_id"]
    answer = text["response"]["body"]
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == REPLY
    assert answer["choices"][0]["message"]["content"] == interactive.choices[0].message.content
    assert answer["usage"]["completion_tokens"] == interactive.usage.completion_tokens
    loop = out["loop-5"]["response"]["body"]
    assert loop["choices"][0]["finish_reason"] == "length" and loop["usage"]["completion_tokens"] == 5
    assert done.usage.output_tokens == answer["usage"]["completion_tokens"] + 5
    assert done.usage.input_tokens == answer["usage"]["prompt_tokens"] + loop["usage"]["prompt_tokens"]
    for cid, status, says in (("unknown-model", 404, "no-such-model"), ("streamed", 400, "cannot stream"),
                              ("bad-temperature", 400, "temperature")):
        response = err[cid]["response"]
        assert response["status_code"] == status, cid
        assert response["body"]["error"]["type"] == "invalid_request_error" and says in \
            response["body"]["error"]["message"], (cid, response)
    outputs = {f.id: f for f in c.files.list(purpose="batch_output")}
    assert outputs[done.output_file_id].filename == f"{batch.id}_output.jsonl"
    assert all(outputs[f].expires_at == outputs[f].created_at + 7200 for f in (done.output_file_id, done.error_file_id))
    assert outputs[done.error_file_id].bytes == len(c.files.content(done.error_file_id).content)
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:batch_requests_total", tenant="b", result="succeeded") >= 2
    assert value(metrics, "tierlm:batch_requests_total", tenant="b", result="errored") >= 3


def test_completions_and_responses_endpoints_and_no_rate_limit_charge(server):
    """Tenant acme may send 2 requests a minute; its batches of 3 run whole, on both routes."""
    c = client(server, "a")
    prompt_file = c.files.create(file=("p.jsonl", jsonl([
        {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": LOOP_MODEL, "prompt": "Hello", "max_tokens": 3}} for i in range(3)])), purpose="batch")
    responses_file = c.files.create(file=("r.jsonl", jsonl([
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
         "body": {"model": TEXT_MODEL, "input": "Hi", "max_output_tokens": 50}} for i in range(3)])), purpose="batch")
    completions = c.batches.create(input_file_id=prompt_file.id, endpoint="/v1/completions", completion_window="24h")
    responses = c.batches.create(input_file_id=responses_file.id, endpoint="/v1/responses", completion_window="24h")
    for batch, kind, prefix in ((completions, "text_completion", "p"), (responses, "response", "r")):
        done = finished(c, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 3 and done.error_file_id is None
        rows = lines(c, done.output_file_id)
        assert sorted(rows) == [f"{prefix}{i}" for i in range(3)]
        assert all(r["response"]["body"]["object"] == kind for r in rows.values())
    interactive = c.completions.create(model=LOOP_MODEL, prompt="Hello", max_tokens=3)
    assert {(r["response"]["body"]["choices"][0]["text"], r["response"]["body"]["usage"]["completion_tokens"])
            for r in lines(c, c.batches.retrieve(completions.id).output_file_id).values()} == \
        {(interactive.choices[0].text, interactive.usage.completion_tokens)}
    assert {r["response"]["body"]["output_text"] if "output_text" in r["response"]["body"] else
            r["response"]["body"]["output"][-1]["content"][0]["text"]
            for r in lines(c, c.batches.retrieve(responses.id).output_file_id).values()} == {REPLY}


def test_an_embeddings_batch_gives_the_routes_vectors(server):
    """OpenAI's Batch API runs /v1/embeddings too: each line's vectors are the route's own."""
    c = client(server, "b")
    texts = ["Hi", "Hello there"]
    upload = c.files.create(file=("e.jsonl", jsonl([
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": TEXT_MODEL, "input": t, "encoding_format": "float"}} for i, t in enumerate(texts)])),
        purpose="batch")
    done = finished(c, c.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                        completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 2
    rows = lines(c, done.output_file_id)
    for i, text in enumerate(texts):
        body = rows[f"e{i}"]["response"]["body"]
        direct = c.embeddings.create(model=TEXT_MODEL, input=text, encoding_format="float")
        assert body["object"] == "list" and body["data"][0]["embedding"] == pytest.approx(direct.data[0].embedding)
        assert body["usage"]["prompt_tokens"] == direct.usage.prompt_tokens > 0


def test_score_and_rerank_batches_give_the_routes_answers(server):
    """vLLM's /v1/score and /v1/rerank run as batches too: each line's answer is the route's own."""
    import httpx
    c = client(server, "b")
    for url, body in (("/v1/rerank", {"model": TEXT_MODEL, "query": "Hi", "documents": ["Hello there", "Bye"]}),
                      ("/v1/score", {"model": TEXT_MODEL, "text_1": "Hi", "text_2": ["Hello there", "Bye"]})):
        upload = c.files.create(file=("s.jsonl", jsonl([{"custom_id": "s0", "method": "POST", "url": url,
                                                        "body": body}])), purpose="batch")
        done = finished(c, c.batches.create(input_file_id=upload.id, endpoint=url, completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 1
        got = lines(c, done.output_file_id)["s0"]["response"]["body"]
        direct = httpx.post(str(c.base_url).rstrip("/").removesuffix("/v1") + url, json=body,
                            headers={"Authorization": f"Bearer {c.api_key}"}).json()
        key, score = ("results", "relevance_score") if url == "/v1/rerank" else ("data", "score")
        assert [r["index"] for r in got[key]] == [r["index"] for r in direct[key]]
        tokens = direct["usage"]["total_tokens"]  # (rerank's usage holds total_tokens alone)
        assert tokens > 0 and (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == \
            (tokens, 0, tokens)
        assert [r[score] for r in got[key]] == pytest.approx([r[score] for r in direct[key]], abs=1e-6)


def test_files_are_a_keys_own_listed_and_deleted(server):
    a, b = client(server, "a"), client(server, "b")
    first = a.files.create(file=("one.txt", b"one"), purpose="user_data")
    second = a.files.create(file=("two.jsonl", b"{}\n"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 3600})
    assert first.expires_at is None and second.expires_at == second.created_at + 3600 and first.bytes == 3
    mine = [f.id for f in a.files.list()]
    assert mine.index(second.id) < mine.index(first.id)  # newest first
    assert [f.id for f in a.files.list(order="asc")][-2:] == [first.id, second.id]
    assert [f.id for f in a.files.list(purpose="user_data")] == [first.id]
    page = a.files.list(limit=1)
    assert [f.id for f in page.data] == [second.id] and page.has_more
    assert [f.id for f in a.files.list(limit=1, after=second.id).data] == [first.id]
    assert a.files.retrieve(first.id).filename == "one.txt" and a.files.content(first.id).content == b"one"
    assert first.id not in [f.id for f in b.files.list()]
    for call in (lambda: b.files.retrieve(first.id), lambda: b.files.content(first.id),
                 lambda: b.files.delete(first.id),
                 lambda: b.batches.create(input_file_id=second.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert "not found" in missing.value.body["message"]
    big = bytes(range(256)) * (12 << 10)  # 3 MiB of every byte value: spooled to disk by the form parser
    large = a.files.create(file=("big.bin", big), purpose="user_data")
    assert large.bytes == len(big) and a.files.content(large.id).content == big
    a.files.delete(large.id)
    deleted = a.files.delete(first.id)
    assert deleted.id == first.id and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(first.id)


@pytest.mark.parametrize("upload, says", [
    ({"files": {"file": ("x.jsonl", b"{}")}, "data": {"purpose": "nonsense"}}, "purpose: must be one of"),
    ({"data": {"purpose": "batch"}}, "upload a file as multipart/form-data"),
    ({"files": {"other": ("x.jsonl", b"{}")}, "data": {"purpose": "batch"}}, "file: the form has no file"),
    ({"files": {"file": ("x.jsonl", b"{}")}, "data": {"purpose": "batch", "expires_after[anchor]": "created_at",
                                                      "expires_after[seconds]": "60"}}, "expires_after.seconds"),
    ({"json": {"purpose": "batch"}}, "upload a file as multipart/form-data"),
])
def test_a_bad_upload_is_refused_in_openais_shape(server, upload, says):
    headers = {"authorization": f"Bearer {KEYS['b']}"}
    before = len(client(server, "b").files.list().data)
    r = httpx.post(server.url + "/v1/files", headers=headers, **upload)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"], r.json()
    assert len(client(server, "b").files.list().data) == before
    assert httpx.post(server.url + "/v1/files", **upload).status_code == 401


def test_a_bad_input_file_fails_the_batch_naming_each_line(server):
    c = client(server, "b")
    rows = [chat("ok"), chat("ok"), {**chat("x"), "url": "/v1/completions"}, {**chat("y"), "method": "GET"},
            {**chat("z"), "body": "text"}, {**chat("w"), "custom_id": ""}]
    bad = c.files.create(file=("bad.jsonl", jsonl(rows) + b"{not json\n\n[1]\n"), purpose="batch")
    batch = c.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.request_counts.total == 0
    got = [(e.code, e.line) for e in batch.errors.data]
    assert got == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3), ("invalid_method", 4),
                   ("invalid_body", 5), ("invalid_custom_id", 6), ("invalid_json_line", 7),
                   ("invalid_json_line", 9)]
    assert "'/v1/completions' is not the batch's endpoint" in batch.errors.data[1].message
    assert c.batches.retrieve(batch.id).status == "failed"  # nothing ran
    empty = c.files.create(file=("e.jsonl", b"\n"), purpose="batch")
    assert [e.code for e in c.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").errors.data] == ["empty_file"]


def test_lines_end_at_newlines_only_and_custom_ids_are_any_string(server):
    """JSON allows U+2028, U+2029 and U+0085 raw inside strings (json.dumps with ensure_ascii=False
    writes them): str.splitlines broke such a line in two and failed the batch. OpenAI's
    custom_id is any string unique in the batch (Anthropic's pattern was applied to it)."""
    c = client(server, "b")
    ids = ["task 1", "user:42/a", "req.1", "x" * 100]
    rows = [chat(cid, messages=[{"role": "user", "content": f"line one{sep}line two"}])
            for cid, sep in zip(ids, ["\u2028", "\u2029", "\u0085", "\r"])]
    data = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode()  # CRLF lines too
    f = c.files.create(file=("u.jsonl", data), purpose="batch")
    batch = finished(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.completed == 4
    out = [json.loads(line) for line in c.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ids and all(o["response"]["status_code"] == 200 for o in out)
    with pytest.raises(openai.BadRequestError) as refused:
        c.batches.list(after="batch_nope")
    assert refused.value.body["param"] == "after"  # the query parameter's own name (was after_id)


@pytest.mark.parametrize("body, status, says", [
    ({"endpoint": "/v1/moderations", "completion_window": "24h"}, 400, "endpoint: this server runs batches of"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "1h"}, 400, "completion_window: must be '24h'"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "metadata": {"k": 1}}, 400, "metadata"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "input_file_id": "file-nope"}, 404, "not found"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "model": "x"}, 400, "model: Extra inputs"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h",
      "output_expires_after": {"anchor": "created_at", "seconds": 60}}, 400, "output_expires_after.seconds"),
    ({"endpoint": "/v1/chat/completions", "completion_window": "24h", "input_file_id": "USER_DATA"}, 400,
     "was uploaded for 'user_data'"),
])
def test_a_bad_batch_request_is_refused_and_creates_nothing(server, body, status, says):
    c = client(server, "b")
    user_data = c.files.create(file=("u.jsonl", jsonl([chat("a")])), purpose="user_data")
    batch_file = c.files.create(file=("b.jsonl", jsonl([chat("a")])), purpose="batch")
    given = {"input_file_id": batch_file.id, **body}
    if given["input_file_id"] == "USER_DATA":
        given["input_file_id"] = user_data.id
    before = [x.id for x in c.batches.list()]
    r = httpx.post(server.url + "/v1/batches", json=given, headers={"authorization": f"Bearer {KEYS['b']}"})
    assert r.status_code == status and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"], r.json()
    assert [x.id for x in c.batches.list()] == before


def test_cancelling_aborts_what_runs_and_lists_the_rest_as_cancelled(server, engines, monkeypatch):
    c = client(server, "b")
    engine = engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.02)
    f = c.files.create(file=("long.jsonl", jsonl([chat(f"r{i}", model=LOOP_MODEL, max_tokens=300)
                                                  for i in range(30)])), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_until(lambda: engine.stats().num_running > 0, timeout=30)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = finished(c, batch.id, timeout=30)
    assert done.status == "cancelled" and done.cancelled_at is not None and done.output_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 30)
    err = lines(c, done.error_file_id)
    assert len(err) == 30 and all(r["response"] is None and r["error"]["code"] == "batch_cancelled"
                                  for r in err.values())
    assert wait_until(lambda: engine.stats().num_running == engine.stats().num_waiting == 0, timeout=10)
    with pytest.raises(openai.ConflictError, match="is cancelled: a batch can be cancelled only while"):
        c.batches.cancel(batch.id)  # an ended batch cannot be cancelled (OpenAI's 409), and is left as it was
    assert c.batches.retrieve(batch.id).status == "cancelled"


def test_at_expiry_unfinished_requests_are_aborted_and_the_finished_ones_kept(server, engines, monkeypatch):
    """As OpenAI's: a batch past its completion window (here 2 s) is `expired`, its unfinished
    requests aborted in the engine (their KV blocks freed) and in the error file as `batch_expired`,
    the answers that came before in the output file. (Those already running ran to the end.)"""
    from tierlm.serving import batches

    c = client(server, "b")
    engine = engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.02)
    monkeypatch.setattr(batches, "EXPIRES_AFTER_S", 2.0)
    f = c.files.create(file=("mixed.jsonl", jsonl([chat(f"r{i}", model=LOOP_MODEL, max_tokens=2 if i < 2 else 300)
                                                   for i in range(6)])), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = finished(c, batch.id, timeout=15)
    assert done.status == "expired" and done.expired_at is not None and done.completed_at is None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 4)
    assert sorted(lines(c, done.output_file_id)) == ["r0", "r1"]
    err = lines(c, done.error_file_id)
    assert sorted(err) == [f"r{i}" for i in range(2, 6)]
    assert all(r["response"] is None and r["error"]["code"] == "batch_expired" for r in err.values())
    assert wait_until(lambda: engine.stats().num_running == engine.stats().num_waiting == 0, timeout=10)
    assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=10)
    with pytest.raises(openai.ConflictError, match="is expired"):
        c.batches.cancel(batch.id)  # an ended batch cannot be cancelled
    assert c.batches.retrieve(batch.id).status == "expired"


def test_a_batch_cannot_be_cancelled_while_finalizing(server):
    """As OpenAI's: once every request has its answer and the files are being written
    (`finalizing`), a cancel is a 409 invalid_request_error naming the status, and the batch ends
    `completed` with every answer in its output file once (a cancel taken then had ended it
    `cancelled` with complete output)."""
    import asyncio
    import threading

    files = server.app.state.tierlm.batches.files
    add, writing, go = files.add, threading.Event(), threading.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:  # the output file is being written when the cancel comes
        writing.set()
        while not go.is_set():
            await asyncio.sleep(0.01)
        return await add(*args, **kwargs)

    c = client(server, "b")
    f = c.files.create(file=("two.jsonl", jsonl([chat(f"r{i}", max_tokens=2) for i in range(2)])), purpose="batch")
    files.add = held  # type: ignore[method-assign]
    try:
        batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert writing.wait(30)
        r = httpx.post(f"{server.url}/v1/batches/{batch.id}/cancel", headers={"authorization": f"Bearer {KEYS['b']}"})
        go.set()
    finally:
        go.set()
        files.add = add  # type: ignore[method-assign]
    assert r.status_code == 409 and r.json()["error"]["type"] == "invalid_request_error", r.json()
    assert f"batch '{batch.id}' is finalizing" in r.json()["error"]["message"]
    done = finished(c, batch.id)
    assert done.status == "completed" and done.cancelling_at is None and done.cancelled_at is None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 0) and done.error_file_id is None
    assert sorted(lines(c, done.output_file_id)) == ["r0", "r1"]
    assert len([x for x in c.files.list() if x.filename.startswith(batch.id)]) == 1  # one output file


def test_batches_are_a_keys_own_and_listed_newest_first(server):
    a, b = client(server, "a"), client(server, "b")
    f = a.files.create(file=("r.jsonl", jsonl([chat("one", max_tokens=2)])), purpose="batch")
    first = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    second = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert [x.id for x in a.batches.list(limit=2).data] == [second.id, first.id]
    page = a.batches.list(limit=1)
    assert [x.id for x in page.data] == [second.id] and page.has_more
    assert [x.id for x in a.batches.list(limit=1, after=second.id).data] == [first.id]
    assert second.id not in [x.id for x in b.batches.list()]
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.cancel(first.id)
    with pytest.raises(openai.BadRequestError, match="limit: must be an integer from 1 to 100"):
        a.batches.list(limit=101)
    assert finished(a, first.id).status == finished(a, second.id).status == "completed"


def test_files_and_batches_outlive_a_restart(scripted_models, tmp_path, monkeypatch):
    """With --batches-dir: the files and a finished batch are found again; a batch stopped
    halfway goes on and ends with every request answered once."""
    from tierlm.serving.batches import BatchJournal, BatchStore

    def start() -> tuple[ServerThread, Any]:
        engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
        app = build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                        batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
        return ServerThread(app, graceful_timeout=1).start(), engine

    one, engine = start()
    try:
        c = client(one, "b")
        short = c.files.create(file=("s.jsonl", jsonl([chat(f"d{i}", model=LOOP_MODEL, max_tokens=3)
                                                       for i in range(3)])), purpose="batch")
        done = finished(c, c.batches.create(input_file_id=short.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
        before = c.files.content(done.output_file_id).content
        import anthropic
        kept = anthropic.Anthropic(base_url=one.url, api_key=KEYS["b"], max_retries=0).beta.files.upload(
            file=("n.txt", b"notes", "text/plain"))  # Anthropic's files are kept the same way
        slow_steps(engine, monkeypatch, 0.03)
        mixed = c.files.create(file=("m.jsonl", jsonl([chat(f"h{i}", model=LOOP_MODEL,
                                                           max_tokens=2 if i < 16 else 300)
                                                      for i in range(20)])), purpose="batch")
        halfway = c.batches.create(input_file_id=mixed.id, endpoint="/v1/chat/completions", completion_window="24h")
        results = tmp_path / "batches" / halfway.id / "results.jsonl"
        assert wait_until(lambda: results.exists() and len(results.read_text().splitlines()) >= 16, timeout=30)
    finally:
        one.stop()
    assert len(results.read_text().splitlines()) == 16  # the 4 long ones were aborted: they run again
    two, _ = start()
    try:
        c = client(two, "b")
        assert c.files.content(done.output_file_id).content == before
        assert anthropic.Anthropic(base_url=two.url, api_key=KEYS["b"], max_retries=0).beta.files.retrieve_metadata(
            kept.id).size_bytes == 5
        assert c.batches.retrieve(done.id).status == "completed"
        assert {f.id for f in c.files.list()} >= {short.id, mixed.id, done.output_file_id}
        with pytest.raises(openai.NotFoundError):
            client(two, "a").files.retrieve(short.id)  # still the key's own
        after = finished(c, halfway.id)
        assert after.status == "completed" and after.request_counts.completed == 20
        rows = lines(c, after.output_file_id)
        assert all(rows[f"h{i}"]["response"]["body"]["usage"]["completion_tokens"] == (2 if i < 16 else 300)
                   for i in range(20))
        assert [x.id for x in c.batches.list()] == [halfway.id, done.id]
    finally:
        two.stop()



def test_a_server_stopping_as_a_batch_writes_its_files_ends_it_first(scripted_models, tmp_path, monkeypatch):
    """Stopped while a batch wrote its output file, the server waits for that step and ends the
    batch: cut off, the file was written but the batch not ended, and the next start wrote it
    again (the key listed two output files of one batch)."""
    from tierlm.serving.batches import BatchJournal, BatchStore
    from tierlm.serving.files import FileStore

    def start() -> ServerThread:
        engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
        app = build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                        batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
        return ServerThread(app, graceful_timeout=1).start()

    persist = FileStore._persist

    def slow_disk(self: FileStore, f: Any, data: bytes, made_here: bool) -> None:
        if made_here:  # (a batch's results)
            time.sleep(0.5)
        persist(self, f, data, made_here)

    monkeypatch.setattr(FileStore, "_persist", slow_disk)
    one = start()
    try:
        c = client(one, "b")
        upload = c.files.create(file=("s.jsonl", jsonl([chat(f"d{i}", model=LOOP_MODEL, max_tokens=3)
                                                        for i in range(3)])), purpose="batch")
        batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert wait_until(lambda: c.batches.retrieve(batch.id).status == "finalizing", timeout=30)
    finally:
        one.stop()
    two = start()
    try:
        c = client(two, "b")
        done = c.batches.retrieve(batch.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        assert [f.id for f in c.files.list() if f.filename.startswith(batch.id)] == [done.output_file_id]
    finally:
        two.stop()


def test_deleted_files_leave_no_expiry_behind():
    """A deleted file's expiry stayed in the heap until its time (30 days for a batch input),
    so a server uploading and deleting batch files held one entry per file it ever had."""
    import asyncio

    from tierlm.serving.files import FileStore

    store = FileStore(None)
    for n in range(1000):
        store.delete(asyncio.run(store.add("k", f"in-{n}.jsonl", "batch", b"{}", 30 * 86400)))
    assert store.owned("k", "openai") == [] and store.used == 0
    assert len(store._expiry) <= 16


def test_the_files_store_holds_at_most_its_bytes(tmp_path):
    import asyncio

    from tierlm.serving.errors import NotFound, RequestTooLarge
    from tierlm.serving.files import FileStore

    def add(store: FileStore, *args: Any, **kwargs: Any) -> Any:
        return asyncio.run(store.add(*args, **kwargs))

    for root in (None, tmp_path / "files"):
        store = FileStore(root, max_bytes=10)
        kept = add(store, "k", "a", "batch", b"123456")
        with pytest.raises(RequestTooLarge, match="hold 6 of 10 bytes, and this one is 5"):
            add(store, "k", "b", "batch", b"12345")
        assert [f.id for f in store.owned("k", "openai")] == [kept.id] and store.used == 6
        store.delete(kept)
        assert add(store, "k", "b", "batch", b"12345").bytes == 5 and store.used == 5
    gone = FileStore(None, max_bytes=10)  # a file whose time is up is gone at the next lookup, its bytes freed
    lapsed = add(gone, "k", "old", "batch", b"123", -1)
    assert gone.owned("k", "openai") == [] and gone.used == 0
    with pytest.raises(NotFound):
        gone.get("k", lapsed.id)
    again = FileStore(tmp_path / "files", max_bytes=10)  # written through: found again, counted
    assert again.used == 5 and store.content(store.owned("k", "openai")[0]) == b"12345"
    (tmp_path / "files" / again.owned("k", "openai")[0].id).write_bytes(b"1")  # cut short: not served
    assert FileStore(tmp_path / "files").owned("k", "openai") == []
    made = add(again, "k", "out", "batch_output", b"1234567890", made_here=True)  # a batch's results: kept past
    assert again.used == 15 and again.content(made) == b"1234567890"  # the cap, counted
    with pytest.raises(RequestTooLarge):
        add(again, "k", "c", "batch", b"1")
    import shutil
    from tierlm.serving.errors import APIError
    shutil.rmtree(tmp_path / "files")  # the disk refuses: results stay in memory, an upload is a clear error
    kept = add(again, "k", "out2", "batch_output", b"abc", made_here=True)
    assert again.content(kept) == b"abc"
    again.max_bytes = 100
    with pytest.raises(APIError, match="cannot store the file: writing it to .* failed"):
        add(again, "k", "c", "batch", b"1")


def test_a_batchs_results_are_kept_past_the_files_cap(scripted_models):
    """Room for the input file but not the results: the batch still completes with its output
    file, and the next upload is refused (413) until files are deleted."""
    from tierlm.serving.batches import BatchStore

    engine = scripted_models[TEXT_MODEL].engine(TEXT_MODEL)
    srv = ServerThread(build_app({TEXT_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                                 batch_store=BatchStore(max_file_bytes=400))).start()
    try:
        c = client(srv, "a")
        f = c.files.create(file=("r.jsonl", jsonl([chat("one", max_tokens=50)])), purpose="batch")
        done = finished(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h").id)
        assert done.status == "completed" and c.files.retrieve(done.output_file_id).bytes > 400
        assert lines(c, done.output_file_id)["one"]["response"]["body"]["choices"][0]["message"]["content"] == REPLY
        with pytest.raises(openai.APIStatusError) as full:
            c.files.create(file=("more.jsonl", b"{}"), purpose="batch")
        assert full.value.status_code == 413 and "delete files you no longer need" in full.value.body["message"]
        metrics = httpx.get(srv.url + "/metrics").text
        held = sum(x.bytes for x in c.files.list())
        assert value(metrics, "tierlm:files_bytes") == held > 400 and value(metrics, "tierlm:files_capacity_bytes") == 400
        c.files.delete(done.output_file_id)
        assert c.files.create(file=("more.jsonl", b"{}"), purpose="batch").bytes == 2
    finally:
        srv.stop()


def test_batches_created_at_once_with_a_batches_dir_are_held_to_the_tenants_cap(scripted_models, tmp_path,
                                                                              monkeypatch):
    """max_batch_requests 5 with --batches-dir: batches of 3 created at once, through both APIs,
    admit one, and the others get 429s. The cap was checked before the batch was written to the
    directory (in a thread) and counted only after, so batches created meanwhile all passed it
    (four of 3 requests each were taken against a cap of 5)."""
    import threading

    import anthropic

    from tierlm.serving.batches import BatchJournal, BatchStore

    (tmp_path / "t.toml").write_text('[tenants.acme]\nkeys = ["a"]\nmax_batch_requests = 5\n')
    engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
    slow_steps(engine, monkeypatch, 0.02)
    written = BatchJournal.created

    def slow_write(self, batch):  # a slow disk: the window every create waited in
        time.sleep(0.3)
        written(self, batch)

    monkeypatch.setattr(BatchJournal, "created", slow_write)
    srv = ServerThread(build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                                 tenancy=Tenancy.from_file(tmp_path / "t.toml", KEYS),
                                 batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))).start()
    try:
        o = client(srv, "a")
        a = anthropic.Anthropic(base_url=srv.url, api_key=KEYS["a"], max_retries=0, timeout=60)
        long = {"model": LOOP_MODEL, "max_tokens": 300, "messages": HI}
        three = o.files.create(file=("3.jsonl", jsonl([chat(f"c{i}", **long) for i in range(3)])), purpose="batch")
        outcomes: list[str] = []

        def anthropic_batch() -> None:
            try:
                a.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": long} for i in range(3)])
                outcomes.append("created")
            except anthropic.RateLimitError:
                outcomes.append("429")

        def openai_batch() -> None:
            try:
                o.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
                outcomes.append("created")
            except openai.RateLimitError:
                outcomes.append("429")

        threads = [threading.Thread(target=f) for f in (anthropic_batch, openai_batch) * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["429", "429", "429", "created"]
        made = [*a.messages.batches.list().data, *o.batches.list().data]
        assert len(made) == 1
        for b in a.messages.batches.list().data:
            a.messages.batches.cancel(b.id)
        for ob in o.batches.list().data:
            o.batches.cancel(ob.id)
    finally:
        srv.stop()


def test_a_tenants_unfinished_batch_requests_are_capped_across_both_apis(scripted_models, tmp_path, monkeypatch):
    """max_batch_requests 5 (silver's): a tenant with 3 batch requests unfinished may add 2, not
    3, through either API (a 429 in each SDK's shape, creating nothing); another tenant's own cap
    is its own; once a batch ends its requests no longer count."""
    import anthropic

    (tmp_path / "t.toml").write_text('[tiers.silver]\nmax_batch_requests = 5\n'
                                     '[tenants.acme]\ntier = "silver"\nkeys = ["a"]\n'
                                     '[tenants.big]\ntier = "silver"\nkeys = ["b"]\nmax_batch_requests = 100\n')
    engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
    slow_steps(engine, monkeypatch, 0.02)
    srv = ServerThread(build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                                 tenancy=Tenancy.from_file(tmp_path / "t.toml", KEYS))).start()
    try:
        o = client(srv, "a")
        a = anthropic.Anthropic(base_url=srv.url, api_key=KEYS["a"], max_retries=0, timeout=60)
        long = {"model": LOOP_MODEL, "max_tokens": 300, "messages": HI}
        first = a.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": long} for i in range(3)])
        three = o.files.create(file=("3.jsonl", jsonl([chat(f"c{i}", **long) for i in range(3)])), purpose="batch")
        with pytest.raises(openai.RateLimitError) as refused:
            o.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
        says = refused.value.body["message"]
        assert "tenant 'acme' has 3 requests of batches not yet finished and this batch would add 3" in says
        assert "allows 5 at once (max_batch_requests)" in says
        # Both retry headers, as on every other 429 (retry-after-ms was missing here).
        assert refused.value.response.headers["retry-after"] == "60"
        assert refused.value.response.headers["retry-after-ms"] == "60000"
        with pytest.raises(anthropic.RateLimitError, match="would add 3"):
            a.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": long} for i in range(3)])
        assert len(o.batches.list().data) == 0 and len(a.messages.batches.list().data) == 1
        two = o.files.create(file=("2.jsonl", jsonl([chat(f"c{i}", **long) for i in range(2)])), purpose="batch")
        second = o.batches.create(input_file_id=two.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = client(srv, "b")  # another tenant: its own cap
        theirs = b.files.create(file=("6.jsonl", jsonl([chat(f"c{i}", **long) for i in range(6)])), purpose="batch")
        b.batches.cancel(b.batches.create(input_file_id=theirs.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
        a.messages.batches.cancel(first.id)
        assert wait_until(lambda: a.messages.batches.retrieve(first.id).processing_status == "ended", timeout=30)
        third = o.batches.create(input_file_id=three.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert third.request_counts.total == 3  # 2 + 3: room again
        for batch in (second, third):
            o.batches.cancel(batch.id)
            assert finished(o, batch.id, timeout=30).status == "cancelled"
    finally:
        srv.stop()


def test_a_text_file_in_a_chat_message_reads_as_the_same_text_inline(server):
    """A file part (`{"type": "file", "file": {...}}`) uploaded (file_id) or inline (file_data:
    base64 or a data: URL) reads as exactly the prompt its text inline gives; a file that is not
    text, data that is not base64 or a file that is not there is a 400 naming the part."""
    import base64

    c = client(server, "b")
    notes = "Q3 numbers: revenue up, costs flat.\nAsk about margins.\n"
    b64 = base64.b64encode(notes.encode()).decode()
    uploaded = c.files.create(file=("notes.md", notes.encode()), purpose="user_data")
    theirs = client(server, "a").files.create(file=("notes.md", notes.encode()), purpose="user_data")

    def ask(part: dict) -> Any:
        return c.chat.completions.create(model=TEXT_MODEL, max_tokens=50, messages=[
            {"role": "user", "content": [part, {"type": "text", "text": "What should I ask about?"}]}])

    inline = ask({"type": "text", "text": notes})
    for part in ({"type": "file", "file": {"file_id": uploaded.id}},
                 {"type": "file", "file": {"file_data": b64, "filename": "notes.txt"}},
                 {"type": "file", "file": {"file_data": f"data:text/plain;base64,{b64}"}}):
        answer = ask(part)
        assert answer.choices[0].message.content == REPLY == inline.choices[0].message.content
        assert answer.usage.prompt_tokens == inline.usage.prompt_tokens, part  # the very same prompt
        assert answer.usage.prompt_tokens_details.cached_tokens >= inline.usage.prompt_tokens - 16
    pdf = base64.b64encode(b"%PDF-1.4 ...").decode()
    for part, says in (({"type": "file", "file": {"file_data": f"data:application/pdf;base64,{pdf}"}},
                        "messages.0.content.0: model 'scripted' is text-only and cannot read this file"),
                       ({"type": "file", "file": {"file_data": "not base64!"}},
                        "messages.0.content.0.file.file_data: not base64"),
                       ({"type": "file", "file": {"file_id": "file-nope"}},
                        "messages.0.content.0.file.file_id: file 'file-nope' not found"),
                       ({"type": "file", "file": {"filename": "x.txt"}}, "give file_id"),
                       ({"type": "file", "file": {"file_id": theirs.id}}, "not found")):  # another key's
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model=TEXT_MODEL, max_tokens=5,
                                        messages=[{"role": "user", "content": [part]}])
        assert says in refused.value.body["message"], refused.value.body
    rows = jsonl([{"custom_id": "doc", "method": "POST", "url": "/v1/chat/completions",
                   "body": {"model": TEXT_MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": [
                       {"type": "file", "file": {"file_id": uploaded.id}},
                       {"type": "text", "text": "What should I ask about?"}]}]}}])
    done = finished(c, c.batches.create(input_file_id=c.files.create(file=("b.jsonl", rows), purpose="batch").id,
                                        endpoint="/v1/chat/completions", completion_window="24h").id)
    body = lines(c, done.output_file_id)["doc"]["response"]["body"]
    assert body["usage"]["prompt_tokens"] == inline.usage.prompt_tokens  # run as its creator: its files


def test_an_input_file_in_the_responses_api_reads_as_its_text(server):
    """Responses `input_file` parts (uploaded or inline) read as the same prompt as the text in an
    input_text part, are kept in the conversation as sent, and are read again when it goes on
    (a file deleted since is a 400 naming previous_response_id)."""
    import base64

    c = client(server, "b")
    notes = "Meeting notes: ship on Friday.\nOwner: Dana.\n"
    uploaded = c.files.create(file=("notes.txt", notes.encode()), purpose="user_data")

    def ask(part: dict, **extra: Any) -> Any:
        return c.responses.create(model=TEXT_MODEL, max_output_tokens=50, input=[
            {"role": "user", "content": [part, {"type": "input_text", "text": "Who owns it?"}]}], **extra)

    inline = ask({"type": "input_text", "text": notes})
    by_id = ask({"type": "input_file", "file_id": uploaded.id})
    by_data = ask({"type": "input_file", "filename": "notes.txt",
                   "file_data": base64.b64encode(notes.encode()).decode()})
    for answer in (by_id, by_data):
        assert answer.output_text == REPLY and answer.usage.input_tokens == inline.usage.input_tokens
    kept = c.responses.input_items.list(by_id.id).data
    assert [p.type for p in kept[-1].content] == ["input_file", "input_text"]  # as sent
    assert kept[-1].content[0].file_id == uploaded.id
    follow = c.responses.create(model=TEXT_MODEL, max_output_tokens=50, previous_response_id=by_id.id,
                                input="And when?")
    assert follow.usage.input_tokens > inline.usage.input_tokens  # the file read again, with the new turn
    pdf = base64.b64encode(b"%PDF-1.4 ...").decode()
    for part, says in (({"type": "input_file", "file_data": f"data:application/pdf;base64,{pdf}"},
                        "input.0.content.0: tierlm's models read text only"),
                       ({"type": "input_file", "file_id": "file-nope"}, "input.0.content.0.file_id: file 'file-nope'"),
                       ({"type": "input_file", "file_url": "https://example.com/x.pdf"}, "file_url is not fetched")):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(part)
        assert says in refused.value.body["message"], refused.value.body
    c.files.delete(uploaded.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id.file_id: file .* not found"):
        c.responses.create(model=TEXT_MODEL, max_output_tokens=5, previous_response_id=by_id.id, input="Again?")
