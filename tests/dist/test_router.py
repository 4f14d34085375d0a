"""The router in front of real tierlm servers on 127.0.0.1 (two demo-model replicas, each its own
engine and KV cache), driven through the official SDKs."""
from __future__ import annotations

import json
import socket
from typing import Iterator

import httpx
import pytest

from tests.serving.harness import API_KEY, ServerThread, parse_sse, slow_steps, wait_until
from tierlm.dist import router as router_module
from tierlm.dist.router import Router, RouterConfig
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth

KEYS = {"alice": API_KEY, "bob": "sk-bob-key"}  # the replicas' keys (no tenants: no limits of their own)
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes it as an argument
SYSTEM = "You are a careful assistant. " * 20  # 580 bytes: two full routing chunks, ~370 demo tokens


class RouterThread(router_module.RouterThread):
    """The router's own thread runner, built from replica URLs and config fields (probing every
    0.2 s unless told), with the SDK clients of it."""

    def __init__(self, replicas: list[str], **kwargs) -> None:
        super().__init__(Router(RouterConfig(replicas=replicas, **{"health_interval": 0.2, **kwargs})))

    def clients(self):
        import anthropic
        import openai
        return (anthropic.Anthropic(base_url=self.url, api_key=API_KEY, max_retries=0, timeout=60),
                openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60))


def _free_url() -> str:
    """A URL nothing listens on (a port just released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def engines():
    from tierlm.engine.async_engine import AsyncEngine
    return [AsyncEngine.from_model(None, device="cpu", max_model_len=1024, kv_cache_memory=32 << 20,
                                   max_num_seqs=16, load_progress=False) for _ in range(2)]


@pytest.fixture(scope="module")
def replicas(engines) -> Iterator[list[ServerThread]]:
    servers = [ServerThread(build_app({e.model_name: e}, ApiKeyAuth.from_keys(KEYS))).start() for e in engines]
    yield servers
    for s in servers:
        s.stop()


def _conversation(client, model: str, turns: int, tag: str) -> list[tuple[str, int, int]]:
    """`turns` turns of one conversation with a long system prompt: per turn, the replica that
    answered and the prompt tokens computed and read from the cache."""
    messages: list[dict] = []
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{tag} question {t}"})
        raw = client.messages.with_raw_response.create(model=model, max_tokens=4, system=SYSTEM, messages=messages)
        msg = raw.parse()
        out.append((raw.headers["x-tierlm-replica"], msg.usage.input_tokens, msg.usage.cache_read_input_tokens))
        messages.append({"role": "assistant", "content": msg.content[0].text if msg.content else "."})
    return out


def test_a_conversation_stays_where_its_prefix_is_cached(replicas, engines):
    """Affinity against round robin, on the same two replicas: every follow-up turn lands where
    the conversation is cached and reads its prefix from the cache; round robin sends each turn
    to the other replica, which computes the whole conversation again."""
    model = engines[0].model_name
    urls = [s.url for s in replicas]
    with RouterThread(urls, policy="cache_aware") as router:
        anthropic_client, _ = router.clients()
        turns = _conversation(anthropic_client, model, 4, "affinity")
    assert len({replica for replica, _, _ in turns}) == 1
    assert all(cached > 0 for _, _, cached in turns[1:])
    with RouterThread(urls, policy="round_robin") as router:
        anthropic_client, _ = router.clients()
        rr = _conversation(anthropic_client, model, 4, "round robin")
    assert [r for r, _, _ in rr] in (["0", "1", "0", "1"], ["1", "0", "1", "0"])
    # each turn's replica saw the conversation two turns ago at best: less of it is cached
    assert sum(c for _, _, c in turns[1:]) > sum(c for _, _, c in rr[1:])
    assert sum(i for _, i, _ in turns[1:]) < sum(i for _, i, _ in rr[1:])


def test_one_key_in_either_header_is_one_caller_for_affinity(replicas, engines):
    """Without a keys file the router keys affinity by the caller's key: "x-api-key: K" and
    "Authorization: Bearer K" are the same caller, whose prefix is cached on one replica (the
    raw header values were hashed, so the second form went to the other, cold replica)."""
    model = engines[0].model_name
    with RouterThread([s.url for s in replicas], policy="cache_aware") as router:
        seen = []
        for tag, headers in (("a", {"x-api-key": API_KEY}), ("b", {"authorization": f"Bearer {API_KEY}"}),
                             ("c", {"x-api-key": API_KEY}), ("d", {"authorization": f"bearer  {API_KEY}"})):
            r = httpx.post(router.url + "/v1/messages", headers={**headers, "anthropic-version": "2023-06-01"},
                           json={"model": model, "max_tokens": 2, "system": SYSTEM + " header forms",
                                 "messages": [{"role": "user", "content": f"question {tag}"}]}, timeout=60)
            assert r.status_code == 200, r.text
            seen.append((r.headers["x-tierlm-replica"], r.json()["usage"]["cache_read_input_tokens"]))
    assert len({replica for replica, _ in seen}) == 1
    assert all(cached > 0 for _, cached in seen[1:])


def test_answers_through_the_router_equal_the_replicas_own(replicas, engines):
    """Greedy answers, streamed and not, through both SDKs: byte for byte what a replica gives
    when asked directly (the router passes bodies and event streams through unchanged)."""
    import anthropic
    model = engines[0].model_name
    direct = anthropic.Anthropic(base_url=replicas[1].url, api_key=API_KEY, max_retries=0)
    want = direct.messages.create(model=model, max_tokens=12, messages=[{"role": "user", "content": "same words"}],
                                 extra_body=GREEDY)
    with RouterThread([s.url for s in replicas]) as router:
        a, o = router.clients()
        got = a.messages.create(model=model, max_tokens=12, messages=[{"role": "user", "content": "same words"}],
                                 extra_body=GREEDY)
        assert got.content[0].text == want.content[0].text and got.stop_reason == want.stop_reason
        with a.messages.stream(model=model, max_tokens=12, messages=[{"role": "user", "content": "same words"}],
                               extra_body=GREEDY) as stream:
            streamed = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert streamed == want.content[0].text and final.usage.output_tokens == want.usage.output_tokens
        chat = dict(model=model, max_tokens=12, temperature=0, messages=[{"role": "user", "content": "same words"}])
        direct_chat = httpx.post(replicas[0].url + "/v1/chat/completions", json=chat,
                                 headers={"authorization": f"Bearer {API_KEY}"}).json()
        pieces = [c.choices[0].delta.content or "" for c in o.chat.completions.create(**chat, stream=True)
                  if c.choices]
        assert "".join(pieces) == direct_chat["choices"][0]["message"]["content"]
        assert [m.id for m in o.models.list()] == [model]


def test_a_replica_that_cannot_be_reached_is_skipped(replicas, engines):
    model = engines[0].model_name
    dead = _free_url()
    with RouterThread([dead, replicas[0].url], policy="round_robin") as router:
        a, _ = router.clients()
        for i in range(4):
            raw = a.messages.with_raw_response.create(model=model, max_tokens=2,
                                                      messages=[{"role": "user", "content": f"q{i}"}])
            assert raw.headers["x-tierlm-replica"] == "1"
        ready = httpx.get(router.url + "/ready").json()
        assert [r["up"] for r in ready["replicas"]] == [False, True]
        assert "ConnectError" in ready["replicas"][0]["error"]
        metrics = httpx.get(router.url + "/metrics").text
        assert 'tierlm:router_replica_up{replica="0"} 0.0' in metrics
        assert 'tierlm:router_requests_total{decision="round_robin",replica="1"}' in metrics


def test_no_replica_left_is_an_overload_error_in_each_apis_shape():
    import anthropic
    import openai
    with RouterThread([_free_url(), _free_url()]) as router:
        a, o = router.clients()
        with pytest.raises(anthropic.APIStatusError) as e:
            a.messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 529 and e.value.body["error"]["type"] == "overloaded_error"
        assert "no replica" in e.value.body["error"]["message"] and e.value.response.headers["retry-after"] == "2"
        with pytest.raises(openai.APIStatusError) as e2:
            o.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert e2.value.status_code == 503 and e2.value.body["code"] == "overloaded"
        assert httpx.get(router.url + "/ready").status_code == 503
        assert httpx.get(router.url + "/health").status_code == 200  # the router itself is alive


def test_a_replica_that_sheds_the_request_passes_it_on(replicas, engines):
    """A replica that refuses before any work (529: its SLA guard, or draining for a restart)
    sends the request on to the next one. When every replica refuses, the client gets the last
    refusal as its replica gave it. A draining replica also fails its /ready probe: out of
    rotation until it is back."""
    import openai
    model = engines[0].model_name
    states = [s.app.state.tierlm for s in replicas]
    try:
        # probes far apart: the router still thinks replica 0 is up when it starts refusing
        with RouterThread([s.url for s in replicas], policy="round_robin", health_interval=60) as router:
            a, o = router.clients()
            states[0].draining = True
            for i in range(3):
                raw = a.messages.with_raw_response.create(model=model, max_tokens=2,
                                                          messages=[{"role": "user", "content": f"d{i}"}])
                assert raw.headers["x-tierlm-replica"] == "1"
            assert 'tierlm:router_retries_total{reason="overloaded",replica="0"}' in httpx.get(router.url + "/metrics").text
            states[1].draining = True
            with pytest.raises(openai.APIStatusError) as e:
                o.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            assert e.value.status_code == 503 and "shutting down" in e.value.body["message"]
            assert all(r.in_flight == 0 and r.pending == 0 for r in router.router.replicas)
        states[1].draining = False
        with RouterThread([s.url for s in replicas], policy="round_robin") as router:
            assert [r["up"] for r in httpx.get(router.url + "/ready").json()["replicas"]] == [False, True]
            states[0].draining = False
            assert wait_until(lambda: router.router.replicas[0].up, timeout=5)
    finally:
        for st in states:
            st.draining = False


def test_a_client_that_leaves_mid_stream_frees_the_replicas_kv_blocks(replicas, engines, monkeypatch):
    model = engines[0].model_name
    with RouterThread([s.url for s in replicas]) as router:
        for e in engines:
            slow_steps(e, monkeypatch, 0.02)
        body = {"model": model, "max_tokens": 200, "stream": True,
                "messages": [{"role": "user", "content": "go " * 200}]}  # two routing chunks: work 3 until it answers
        before = sum(e.stats().generation_tokens for e in engines)
        with httpx.stream("POST", router.url + "/v1/messages", json=body, timeout=30,
                          headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
            assert sum(e.stats().kv_blocks_used for e in engines) > 0
            # answering: its prompt no longer counts as work queued there, only the request itself
            (busy,) = [rep for rep in router.router.replicas if rep.in_flight]
            assert busy.in_flight == 1 and busy.pending == 1
        assert wait_until(lambda: sum(e.stats().kv_blocks_used for e in engines) == 0, timeout=5)
        assert sum(e.stats().generation_tokens for e in engines) - before < 100  # aborted, not run to the end
        assert wait_until(lambda: all(r.in_flight == 0 and r.pending == 0 for r in router.router.replicas), timeout=5)
        # and one waiting for a non-streamed answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/messages", json={**body, "stream": False}, timeout=0.5,
                       headers={"x-api-key": API_KEY})
        assert wait_until(lambda: sum(e.stats().kv_blocks_used for e in engines) == 0, timeout=5)
        assert wait_until(lambda: all(r.in_flight == 0 and r.pending == 0 for r in router.router.replicas), timeout=5)


def test_stored_responses_are_found_on_the_replica_that_made_them(replicas, engines):
    """Responses-API objects live on one replica: the router remembers which, and when it does not
    (it was restarted), asks each replica in turn."""
    model = engines[0].model_name
    urls = [s.url for s in replicas]
    with RouterThread(urls, policy="round_robin") as router:
        _, o = router.clients()
        first = o.responses.create(model=model, input="remember me", max_output_tokens=3)
        for _ in range(3):  # round robin would send these elsewhere half the time
            follow = o.responses.create(model=model, input="and then", previous_response_id=first.id,
                                        max_output_tokens=3)
            assert follow.previous_response_id == first.id
            assert o.responses.retrieve(first.id).id == first.id
        streamed = [e for e in o.responses.create(model=model, input="streamed", max_output_tokens=3, stream=True)]
        sid = streamed[-1].response.id
    with RouterThread(list(reversed(urls)), policy="round_robin") as fresh:  # knows no owners
        _, o = fresh.clients()
        for rid in (first.id, sid, first.id):
            assert o.responses.retrieve(rid).id == rid
        o.responses.create(model=model, input="later", previous_response_id=sid, max_output_tokens=2)
        import openai
        with pytest.raises(openai.BadRequestError) as e:
            o.responses.create(model=model, input="x", previous_response_id="resp_nowhere", max_output_tokens=2)
        assert e.value.body["code"] == "previous_response_not_found"
        with pytest.raises(openai.NotFoundError):
            o.responses.retrieve("resp_nowhere")


def test_message_batches_are_found_on_the_replica_that_runs_them(replicas, engines):
    """A batch lives on the replica that took it: retrieve, results, cancel and delete through
    the router reach it (remembered from the answer, or searched for by a fresh router)."""
    import time

    import anthropic

    model = engines[0].model_name
    urls = [s.url for s in replicas]
    with RouterThread(urls, policy="round_robin") as router:
        c, _ = router.clients()
        batch = c.messages.batches.create(requests=[
            {"custom_id": f"r{i}", "params": {"model": model, "max_tokens": 2, "messages": [
                {"role": "user", "content": f"batch {i}"}]}} for i in range(3)])
        deadline = time.monotonic() + 60
        while c.messages.batches.retrieve(batch.id).processing_status != "ended":  # each retrieve: its replica
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert sorted(r.custom_id for r in c.messages.batches.results(batch.id)) == ["r0", "r1", "r2"]
    with RouterThread(list(reversed(urls)), policy="round_robin") as fresh:  # knows no owners
        c, _ = fresh.clients()
        for _ in range(2):
            assert c.messages.batches.retrieve(batch.id).request_counts.succeeded == 3
        assert all(r.result.type == "succeeded" for r in c.messages.batches.results(batch.id))
        assert c.messages.batches.delete(batch.id).type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            c.messages.batches.retrieve(batch.id)  # every replica said 404: the last one's answer


def test_openai_files_and_batches_are_found_on_the_replica_that_holds_them(replicas, engines):
    """A file lives on the replica it was uploaded to: a batch made from it runs there, and the
    batch, its output file and the file itself are reached through the router (remembered from
    the answers, or searched for by a fresh router)."""
    import time

    import openai

    model = engines[0].model_name
    urls = [s.url for s in replicas]
    rows = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": 2, "messages": [
                                   {"role": "user", "content": f"batch {i}"}]}}) + "\n" for i in range(3))
    with RouterThread(urls, policy="round_robin") as router:
        _, o = router.clients()
        uploads = [o.files.create(file=("r.jsonl", rows.encode()), purpose="batch") for _ in range(2)]
        batches = [o.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
                   for f in uploads]  # round robin would send one of them to the wrong replica
        for batch in batches:
            deadline = time.monotonic() + 60
            while o.batches.retrieve(batch.id).status != "completed":
                assert time.monotonic() < deadline
                time.sleep(0.05)
    with RouterThread(list(reversed(urls)), policy="round_robin") as fresh:  # knows no owners
        _, o = fresh.clients()
        for batch, upload in zip(batches, uploads):
            done = o.batches.retrieve(batch.id)
            assert done.request_counts.completed == 3
            out = [json.loads(line) for line in o.files.content(done.output_file_id).text.splitlines()]
            assert sorted(r["custom_id"] for r in out) == ["r0", "r1", "r2"]
            again = o.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")  # found where the file is
            assert again.request_counts.total == 3
            assert o.files.delete(upload.id).deleted
        with pytest.raises(openai.NotFoundError):
            o.files.retrieve(uploads[0].id)  # every replica said 404: the last one's answer


def test_a_message_naming_an_uploaded_file_goes_where_the_file_is(replicas, engines):
    """Anthropic's files live on the replica they were uploaded to: a message (or count_tokens)
    whose document names one is sent there, by a router that saw the upload or, fresh, by asking
    each replica; a file no replica has is the replica's own 400."""
    import anthropic

    model = engines[0].model_name
    urls = [s.url for s in replicas]

    def ask(file_id: str) -> dict:
        return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "file", "file_id": file_id}},
            {"type": "text", "text": "Summarise"}]}]}

    with RouterThread(urls, policy="round_robin") as router:
        c, _ = router.clients()
        files = [c.beta.files.upload(file=(f"n{i}.txt", f"notes number {i}".encode(), "text/plain"))
                 for i in range(2)]  # one on each replica
        for f in files * 2:  # round robin alone would send half of these to the other replica
            assert c.messages.create(**ask(f.id)).usage.output_tokens >= 1
    with RouterThread(list(reversed(urls)), policy="round_robin") as fresh:  # knows no owners
        c, _ = fresh.clients()
        for f in files:
            assert c.messages.count_tokens(**{k: v for k, v in ask(f.id).items() if k != "max_tokens"}).input_tokens
            assert c.messages.create(**ask(f.id)).usage.output_tokens >= 1
        with pytest.raises(anthropic.BadRequestError, match="file 'file_nowhere' not found"):
            c.messages.create(**ask("file_nowhere"))


def test_openai_file_parts_go_where_the_file_is(replicas, engines):
    """A Chat Completions file part or a Responses input_file naming an uploaded file (OpenAI's
    `file-...` ids) is sent to the replica holding it, as an Anthropic document is: round robin
    alone sent every other one to the replica without it, a 400 'file not found'."""
    model = engines[0].model_name
    urls = [s.url for s in replicas]

    def chat(o, file_id: str):
        return o.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "file", "file": {"file_id": file_id}}, {"type": "text", "text": "Summarise"}]}])

    def respond(o, file_id: str):
        return o.responses.create(model=model, max_output_tokens=16, input=[{"role": "user", "content": [
            {"type": "input_file", "file_id": file_id}, {"type": "input_text", "text": "Summarise"}]}])

    with RouterThread(urls, policy="round_robin") as router:
        _, o = router.clients()
        files = [o.files.create(file=(f"n{i}.txt", f"notes number {i}".encode()), purpose="user_data")
                 for i in range(2)]  # one on each replica
        for f in files * 2:
            assert chat(o, f.id).usage.completion_tokens >= 1
            assert respond(o, f.id).usage.output_tokens >= 1
    with RouterThread(list(reversed(urls)), policy="round_robin") as fresh:  # knows no owners: asks each
        _, o = fresh.clients()
        for f in files * 2:
            assert chat(o, f.id).usage.completion_tokens >= 1


def test_lists_of_files_and_batches_merge_every_replicas(replicas, engines):
    """Files and batches live on their replicas; a list through the router has them all, newest
    first, paged by the client's own limit and cursor in each API's shape."""
    import anthropic
    import openai

    model = engines[0].model_name
    urls = [s.url for s in replicas]
    bob = KEYS["bob"]
    rows = json.dumps({"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}})
    with RouterThread(urls, policy="round_robin") as router:
        o = openai.OpenAI(base_url=router.url + "/v1", api_key=bob, max_retries=0, timeout=60)
        c = anthropic.Anthropic(base_url=router.url, api_key=bob, max_retries=0, timeout=60)
        files = [o.files.create(file=(f"f{i}.jsonl", rows.encode()), purpose="batch") for i in range(4)]
        docs = [c.beta.files.upload(file=(f"d{i}.txt", b"notes", "text/plain")) for i in range(3)]
        batches = [o.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
                   for f in files[:3]]
        messages = [c.messages.batches.create(requests=[{"custom_id": "r", "params": {
            "model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}]) for _ in range(3)]
        held = [len(httpx.get(u + "/v1/files", params={"purpose": "batch"},
                              headers={"authorization": f"Bearer {bob}"}).json()["data"]) for u in urls]
        assert held == [2, 2]  # round robin: each replica holds half; alone, a list showed half
        for listed, made in (([f.id for f in o.files.list(purpose="batch")], files),
                             ([f.id for f in c.beta.files.list()], docs),
                             ([b.id for b in o.batches.list()], batches),
                             ([b.id for b in c.messages.batches.list()], messages)):
            assert sorted(listed) == sorted(x.id for x in made)
        whole = o.files.list(purpose="batch").data
        assert [f.created_at for f in whole] == sorted((f.created_at for f in whole), reverse=True)
        assert [f.id for f in o.files.list(purpose="batch", order="asc")] == [f.id for f in reversed(whole)]
        # paged one at a time by the SDKs' own cursors: the same lists
        assert [f.id for f in o.files.list(purpose="batch", limit=1)] == [f.id for f in whole]
        assert [f.id for f in c.beta.files.list(limit=1)] == [f.id for f in c.beta.files.list()]
        assert [b.id for b in o.batches.list(limit=1)] == [b.id for b in o.batches.list()]
        assert [b.id for b in c.messages.batches.list(limit=1)] == [b.id for b in c.messages.batches.list()]
        first = c.messages.batches.list(limit=1)
        assert first.has_more and first.last_id == first.data[0].id
        with pytest.raises(openai.BadRequestError, match="after: no object 'batch_nope'"):
            o.batches.list(after="batch_nope")
        mine = {f.id for f in router.clients()[1].files.list()}  # another key: none of bob's
        assert mine.isdisjoint(f.id for f in files)
        with pytest.raises(openai.AuthenticationError):  # a replica's refusal answers for all
            openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0).files.list()
    with RouterThread([urls[0], _free_url()]) as half:  # a replica that is down: the list leaves it out
        o = openai.OpenAI(base_url=half.url + "/v1", api_key=bob, max_retries=0, timeout=60)
        assert len(o.files.list(purpose="batch").data) == held[0]


def test_bad_requests_get_the_replicas_own_errors_and_the_router_its_limits(replicas, engines):
    with RouterThread([s.url for s in replicas], max_body_bytes=1000) as router:
        r = httpx.post(router.url + "/v1/messages", content=b"{not json", headers={"x-api-key": API_KEY})
        assert r.status_code == 400 and r.json()["type"] == "error"  # the replica's own answer, in its shape
        r = httpx.post(router.url + "/v1/messages", json={"model": "m", "messages": []}, headers={"x-api-key": "bad"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(router.url + "/v1/chat/completions", content=b"x" * 2000, headers={"x-api-key": API_KEY})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["request-id"].startswith("req_")  # the router's own answer has an id too
        assert all(rep.in_flight == 0 and rep.pending == 0 for rep in router.router.replicas)


def test_router_settings_are_checked():
    with pytest.raises(ValueError, match="at least one replica"):
        RouterConfig(replicas=[])
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        RouterConfig(replicas=["localhost:8000"])
    with pytest.raises(ValueError, match="given twice"):
        RouterConfig(replicas=["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(replicas=["http://a:1"], policy="random")


@pytest.mark.slow
def test_a_replica_killed_mid_answer_ends_the_stream_with_an_error_event(tmp_path):
    """A replica process killed while it streams: the client's stream ends with an `error` event
    in its API's shape (not a cut connection), and the next request finds the replica gone."""
    import os
    import signal

    from tierlm.dist.ray_serve import ServerProcess

    server = ServerProcess(["--log-level", "warning", "serve", "--device", "cpu", "--max-model-len", "1024",
                            "--kv-cache-memory", "16MiB", "--no-request-log"], "127.0.0.1",
                           log=str(tmp_path / "replica.log"))
    server.start(ready_timeout=120)
    try:
        with RouterThread([server.url]) as router:
            model = httpx.get(router.url + "/v1/models").json()["data"][0]["id"]
            for path, body, headers in [
                ("/v1/messages", {"model": model, "max_tokens": 900, "stream": True, "ignore_eos": True,
                                  "messages": [{"role": "user", "content": "go on"}]},
                 {"anthropic-version": "2023-06-01"}),
                ("/v1/chat/completions", {"model": model, "max_tokens": 900, "stream": True, "ignore_eos": True,
                                          "messages": [{"role": "user", "content": "go on"}]}, {}),
            ]:
                assert wait_until(lambda: router.router.replicas[0].up and server.ready(), timeout=60)
                with httpx.stream("POST", router.url + path, json=body, headers=headers, timeout=60) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    for _ in range(10):
                        next(lines)
                    os.kill(server.pid(), signal.SIGKILL)
                    rest = "\n".join(lines)
                events = parse_sse(rest)
                name, data = events[-1]
                if path == "/v1/messages":
                    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
                else:
                    assert data["error"]["type"] == "server_error"
                assert "failed mid-answer" in json.dumps(data)
    finally:
        server.stop()


def _tenancy(toml: str):
    import tomllib

    from tierlm.serving.tenancy import Tenancy, TenantsConfig
    return Tenancy(TenantsConfig.parse(tomllib.loads(toml), list(KEYS), source="t.toml"))


def _router_made_request_id(error) -> None:
    """The router's own 401/429 carries a request id, as a replica's answers do (it had none:
    no header, and `"request_id": null` in the Anthropic body)."""
    rid = error.response.headers.get("request-id")
    assert rid is not None and rid.startswith("req_") and error.response.headers["x-request-id"] == rid
    assert error.body.get("request_id", rid) == rid and error.request_id == rid  # the SDK reads it from the header


def test_tenant_limits_hold_across_replicas_at_the_router(replicas, engines):
    """The replicas have no limits of their own here (as if each allowed the tenant all it may
    have, alone); with the tenants file the router holds the tenant to 3 requests a minute
    across both (round robin spreads them), and its headers count for both. Another tenant is
    not held back; a bad key fails as at a replica."""
    import anthropic

    toml = '[tenants.acme]\ntier = "gold"\nkeys = ["alice"]\nrequests_per_minute = 3\n[tenants.other]\nkeys = ["bob"]\n'
    model = engines[0].model_name
    with RouterThread([s.url for s in replicas], policy="round_robin", auth=ApiKeyAuth.from_keys(KEYS),
                      tenancy=_tenancy(toml)) as router:
        a, _ = router.clients()
        bob = anthropic.Anthropic(base_url=router.url, api_key=KEYS["bob"], max_retries=0)
        seen = set()
        for i in range(3):
            raw = a.messages.with_raw_response.create(model=model, max_tokens=2,
                                                      messages=[{"role": "user", "content": f"t{i}"}])
            seen.add(raw.headers["x-tierlm-replica"])
            assert raw.headers["anthropic-ratelimit-requests-remaining"] == str(2 - i)  # the router's count
        assert seen == {"0", "1"}
        with pytest.raises(anthropic.RateLimitError) as e:
            a.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "t3"}])
        assert "tenant 'acme'" in e.value.body["error"]["message"] and int(e.value.response.headers["retry-after"]) > 0
        _router_made_request_id(e.value)
        bob.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "other tenant"}])
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=router.url, api_key="sk-wrong", max_retries=0).messages.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        _router_made_request_id(e.value)
        assert all(rep.in_flight == 0 and rep.pending == 0 for rep in router.router.replicas)
        assert router.router.config.tenancy.in_flight("acme") == 0


def test_two_routers_sharing_a_limits_store_hold_a_tenant_to_one_limit(replicas, engines, redis_server):
    """Two routers in front of the same replicas (`tierlm router --limits-store`): a tenant's 3
    requests a minute hold across both routers; a router without the store alone would have
    let 3 through each."""
    import anthropic

    from tierlm.serving.limit_store import LimitStore

    toml = '[tenants.acme]\nkeys = ["alice"]\nrequests_per_minute = 3\n'
    model = engines[0].model_name
    routers = []
    for _ in range(2):
        tenancy = _tenancy(toml)
        tenancy.store = LimitStore(redis_server.url, role="router")
        routers.append(RouterThread([s.url for s in replicas], auth=ApiKeyAuth.from_keys(KEYS), tenancy=tenancy))
    with routers[0] as one, routers[1] as two:
        remaining = []
        for router in (one, two, one):
            raw = router.clients()[0].messages.with_raw_response.create(
                model=model, max_tokens=2, messages=[{"role": "user", "content": "shared"}])
            remaining.append(raw.headers["anthropic-ratelimit-requests-remaining"])
        assert remaining == ["2", "1", "0"]
        with pytest.raises(anthropic.RateLimitError) as refused:
            two.clients()[0].messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert "3 requests per minute" in refused.value.body["error"]["message"]


def test_requests_every_replica_sheds_give_the_router_their_request_back(replicas, engines):
    """A request every replica refuses before any work (503 / 529: draining, the SLA guard) ran
    nowhere: the router gives its requests_per_minute unit back, as a replica does for one it
    sheds. It kept it, so an SDK retrying the refusals spent the tenant's minute on them and
    met 429s once the replicas took requests again."""
    import openai

    toml = '[tenants.acme]\nkeys = ["alice"]\nrequests_per_minute = 2\n'
    model = engines[0].model_name
    states = [s.app.state.tierlm for s in replicas]
    tenancy = _tenancy(toml)
    try:
        with RouterThread([s.url for s in replicas], auth=ApiKeyAuth.from_keys(KEYS), tenancy=tenancy,
                          health_interval=60) as router:
            _, o = router.clients()
            for st in states:
                st.draining = True
            for _ in range(3):
                with pytest.raises(openai.APIStatusError) as e:
                    o.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}])
                assert e.value.status_code == 503
            for st in states:
                st.draining = False
            for i in range(2):
                raw = o.chat.completions.with_raw_response.create(model=model, max_tokens=2,
                                                                  messages=[{"role": "user", "content": f"y{i}"}])
                assert raw.headers["x-ratelimit-remaining-requests"] == str(1 - i)
            with pytest.raises(openai.RateLimitError):  # and the limit still holds
                o.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "z"}])
        assert tenancy.in_flight("acme") == 0
    finally:
        for st in states:
            st.draining = False


def test_the_routers_429_claims_nothing_of_the_tokens_the_replicas_count(replicas, engines):
    """tokens_per_minute is counted where requests run (the replicas): the router's 429 names
    its request limit and carries no token headers. It carried its own never-charged bucket's,
    "600 remaining" of 600, whatever the replicas had counted."""
    import anthropic

    toml = '[tenants.acme]\nkeys = ["alice"]\nrequests_per_minute = 1\ntokens_per_minute = 600\n'
    model = engines[0].model_name
    with RouterThread([s.url for s in replicas], auth=ApiKeyAuth.from_keys(KEYS), tenancy=_tenancy(toml)) as router:
        a, _ = router.clients()
        a.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "one"}])
        with pytest.raises(anthropic.RateLimitError) as e:
            a.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "two"}])
    headers = e.value.response.headers
    assert headers["anthropic-ratelimit-requests-remaining"] == "0" and int(headers["retry-after"]) > 0
    assert not [h for h in headers if h.startswith("anthropic-ratelimit-tokens")]


def test_a_tenants_concurrency_limit_holds_across_replicas(replicas, engines, monkeypatch):
    tenancy = _tenancy('[tenants.acme]\nkeys = ["alice"]\nmax_concurrent = 1\n')
    model = engines[0].model_name
    with RouterThread([s.url for s in replicas], auth=ApiKeyAuth.from_keys(KEYS), tenancy=tenancy) as router:
        for e in engines:
            slow_steps(e, monkeypatch, 0.02)
        body = {"model": model, "max_tokens": 100, "stream": True, "ignore_eos": True,  # ~2 s
                "messages": [{"role": "user", "content": "a"}]}
        headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
        with httpx.stream("POST", router.url + "/v1/messages", json=body, headers=headers, timeout=30) as r:
            lines = r.iter_lines()  # kept: a generator dropped closes the response (a disconnect)
            next(lines)
            assert tenancy.in_flight("acme") == 1
            second = httpx.post(router.url + "/v1/messages", json={**body, "stream": False}, headers=headers)
            assert second.status_code == 429 and second.json()["error"]["type"] == "rate_limit_error"
            assert "1 requests at a time" in second.json()["error"]["message"]
        assert wait_until(lambda: tenancy.in_flight("acme") == 0, timeout=5)
        ok = httpx.post(router.url + "/v1/messages", json={**body, "stream": False, "max_tokens": 2}, headers=headers)
        assert ok.status_code == 200


def test_refused_requests_are_not_recorded_and_router_faults_are_api_errors(replicas, engines, monkeypatch):
    long = [{"role": "user", "content": "hello world " * 60}]  # 750 bytes as the router serializes it: 2 chunks
    with RouterThread([s.url for s in replicas]) as router:
        r = httpx.post(router.url + "/v1/messages", json={"model": "no-such-model", "max_tokens": 2, "messages": long},
                       headers={"x-api-key": API_KEY})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"  # the replica's answer
        assert all(len(rep.index) == 0 for rep in router.router.replicas)  # nothing was cached there
        ok = httpx.post(router.url + "/v1/messages", json={"model": engines[0].model_name, "max_tokens": 2,
                                                           "messages": long}, headers={"x-api-key": API_KEY})
        assert ok.status_code == 200 and sum(len(rep.index) for rep in router.router.replicas) == 2

        def broken(*args, **kwargs):
            raise RuntimeError("a bug in the router")

        monkeypatch.setattr("tierlm.dist.router.prompt_prefix", broken)
        r = httpx.post(router.url + "/v1/chat/completions", json={"model": "m", "messages": long},
                       headers={"authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "a bug" not in r.text and "Traceback" not in r.text
        assert all(rep.in_flight == 0 and rep.pending == 0 for rep in router.router.replicas)


def test_a_replica_process_that_cannot_start_says_why(tmp_path):
    from tierlm.dist.ray_serve import ServerProcess

    server = ServerProcess(["serve", "--model", "not-a-spec"], "127.0.0.1", log=str(tmp_path / "r.log"))
    with pytest.raises(RuntimeError, match=r"exited with status 2 before it was ready; the end of its log:\n"
                                           r"error: --model expects NAME=DIR, got 'not-a-spec'"):
        server.start(ready_timeout=60)


def test_lora_adapters_loaded_through_the_router_reach_every_replica(llama_dir, tmp_path):
    """vLLM's runtime LoRA routes go to every replica that is up (not where affinity points),
    so an adapter loaded through the router is a model on each; a refusal is the replicas'
    own; a replica down at the time is left out and named in the log."""
    from tests.lora_adapters import standard_adapters
    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving.lora_admin import LoRAUpdates
    ads = standard_adapters(llama_dir, "llama", tmp_path)
    engines = [AsyncEngine.from_model(str(llama_dir), dtype="float32", load_progress=False, enable_lora=True,
                                      served_model_name="base") for _ in range(2)]
    servers = [ServerThread(build_app({"base": e}, ApiKeyAuth.from_keys(KEYS),
                                      lora_updates=LoRAUpdates(frozenset({"alice"})))).start() for e in engines]
    auth = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with RouterThread([s.url for s in servers] + [_free_url()], policy="round_robin") as router:
            assert wait_until(lambda: not httpx.get(router.url + "/ready").json()["replicas"][2]["up"])
            ok = httpx.post(router.url + "/v1/load_lora_adapter", headers=auth,
                            json={"lora_name": "a1", "lora_path": str(ads["a1"])})
            assert ok.status_code == 200 and ok.headers["x-tierlm-replicas"] == "0,1" and "a1" in ok.text
            for s in servers:
                models = httpx.get(s.url + "/v1/models", headers=auth).json()["data"]
                assert [m["id"] for m in models] == ["base", "a1"]
            _, oai = router.clients()
            answers = {oai.completions.with_raw_response.create(model="a1", prompt=[5, 6, 7], max_tokens=3,
                                                                temperature=0).headers["x-tierlm-replica"]
                       for _ in range(2)}
            assert answers == {"0", "1"}  # each replica serves it
            bad = httpx.post(router.url + "/v1/load_lora_adapter", headers=auth,
                             json={"lora_name": "a3", "lora_path": str(tmp_path / "nowhere")})
            assert bad.status_code == 400 and bad.headers["x-tierlm-replicas"] == ""
            assert "not a directory" in bad.json()["error"]["message"]
            denied = httpx.post(router.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"},
                                headers={"Authorization": "Bearer sk-bob-key"})
            assert denied.status_code == 403
            gone = httpx.post(router.url + "/v1/unload_lora_adapter", headers=auth, json={"lora_name": "a1"})
            assert gone.status_code == 200 and gone.headers["x-tierlm-replicas"] == "0,1"
            assert all(e.list_loras() == [] for e in engines)
            metrics = httpx.get(router.url + "/metrics").text
            assert 'tierlm:router_requests_total{decision="broadcast",replica="1"} 4.0' in metrics
    finally:
        for s in servers:
            s.stop()
