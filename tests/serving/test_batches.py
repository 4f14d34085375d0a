"""Anthropic's Message Batches API (tierlm/serving/batches.py) through the official SDK against a
real server on scripted models: results equal /v1/messages' own answers, per-request errors in
Anthropic's shapes, batches per key, listing and deleting, cancelling that frees the engine,
batch work waiting behind interactive requests, and tenants' rate limits not charged."""
from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest

from tests.serving.harness import ServerThread, slow_steps, wait_until
from tests.serving.scripted_model import ENGINE_OPTIONS, LOOP_MODEL, REPLY, TEXT_MODEL
from tests.serving.test_telemetry import value
from tierlm.serving.app import build_app
from tierlm.serving.auth import ApiKeyAuth
from tierlm.serving.tenancy import Tenancy

KEYS = {"a": "sk-batch-a", "b": "sk-batch-b"}
TENANTS = """
[tenants.acme]
tier = "gold"
keys = ["a"]
requests_per_minute = 2       # interactive requests only: a batch's are not charged
"""
ONE_SEQ = "loop-one-at-a-time"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engines(scripted_models) -> dict:
    from tierlm.engine.async_engine import AsyncEngine

    loop = scripted_models[LOOP_MODEL]
    return {TEXT_MODEL: scripted_models[TEXT_MODEL].engine(TEXT_MODEL), LOOP_MODEL: loop.engine(LOOP_MODEL),
            ONE_SEQ: AsyncEngine.from_model(str(loop.path), served_model_name=ONE_SEQ,
                                            **{**ENGINE_OPTIONS, "max_num_seqs": 1})}


@pytest.fixture(scope="module")
def server(engines, tmp_path_factory):
    path = tmp_path_factory.mktemp("batches") / "tenants.toml"
    path.write_text(TENANTS)
    srv = ServerThread(build_app(engines, ApiKeyAuth.from_keys(KEYS), tenancy=Tenancy.from_file(path, KEYS))).start()
    yield srv
    srv.stop()


def client(server: ServerThread, key: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEYS[key], max_retries=0, timeout=60)


def ended(c: anthropic.Anthropic, batch_id: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = c.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def test_a_batchs_results_are_what_messages_answers_and_its_errors_anthropics(server):
    c = client(server, "b")
    interactive = c.messages.create(model=TEXT_MODEL, max_tokens=50, messages=HI)
    batch = c.messages.batches.create(requests=[
        {"custom_id": "text", "params": {"model": TEXT_MODEL, "max_tokens": 50, "messages": HI}},
        {"custom_id": "loop-5", "params": {"model": LOOP_MODEL, "max_tokens": 5, "messages": HI,
                                           "stop_sequences": ["never"]}},
        {"custom_id": "no-max-tokens", "params": {"model": TEXT_MODEL, "messages": HI}},
        {"custom_id": "unknown-model", "params": {"model": "no-such-model", "max_tokens": 5, "messages": HI}},
        {"custom_id": "streamed", "params": {"model": TEXT_MODEL, "max_tokens": 5, "messages": HI, "stream": True}},
    ])
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None  # (answered as it is made)
    assert (batch.expires_at - batch.created_at).total_seconds() == pytest.approx(24 * 3600, abs=1)
    done = ended(c, batch.id)
    counts = done.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 3, 0, 0)
    assert done.results_url == f"/v1/messages/batches/{batch.id}/results" and done.ended_at >= done.created_at
    results = {r.custom_id: r.result for r in c.messages.batches.results(batch.id)}
    assert set(results) == {"text", "loop-5", "no-max-tokens", "unknown-model", "streamed"}
    text = results["text"]
    assert text.type == "succeeded" and text.message.content[0].text == REPLY
    assert text.message.content == interactive.content and text.message.usage.output_tokens == \
        interactive.usage.output_tokens
    loop = results["loop-5"]
    assert loop.type == "succeeded" and loop.message.stop_reason == "max_tokens" and loop.message.usage.output_tokens == 5
    metrics = httpx.get(server.url + "/metrics").text
    assert value(metrics, "tierlm:batch_requests_total", tenant="b", result="succeeded") == 2
    assert value(metrics, "tierlm:batch_requests_total", tenant="b", result="errored") == 3
    assert value(metrics, "tierlm:batches_in_progress") == 0
    for cid, kind, says in (("no-max-tokens", "invalid_request_error", "max_tokens"),
                            ("unknown-model", "not_found_error", "no-such-model"),
                            ("streamed", "invalid_request_error", "cannot stream")):
        assert results[cid].type == "errored" and results[cid].error.type == "error", cid
        assert results[cid].error.error.type == kind and says in results[cid].error.error.message, cid


def test_batches_are_a_keys_own_listed_newest_first_and_deleted_once_ended(server, engines, monkeypatch):
    a, b = client(server, "a"), client(server, "b")
    slow_steps(engines[LOOP_MODEL], monkeypatch, 0.02)
    long = {"model": LOOP_MODEL, "max_tokens": 200, "messages": HI}  # 4 s at least
    first = a.messages.batches.create(requests=[{"custom_id": "one", "params": {**long, "max_tokens": 2}}])
    second = a.messages.batches.create(requests=[{"custom_id": "x", "params": long}])
    mine = [x.id for x in a.messages.batches.list(limit=20).data]
    assert mine[:2] == [second.id, first.id]  # newest first
    page = a.messages.batches.list(limit=1)
    assert [x.id for x in page.data] == [second.id] and page.has_more and page.last_id == second.id
    assert [x.id for x in a.messages.batches.list(limit=1, after_id=second.id).data] == [first.id]
    assert second.id not in [x.id for x in b.messages.batches.list().data]
    with pytest.raises(anthropic.NotFoundError) as missing:
        b.messages.batches.retrieve(second.id)  # another key's batch is not found, as if it did not exist
    assert "not found" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as refused:
        a.messages.batches.delete(second.id)
    assert "still in_progress" in refused.value.body["error"]["message"] and "cancel it first" in \
        refused.value.body["error"]["message"]
    with pytest.raises(anthropic.AnthropicError, match="No `results_url`"):
        a.messages.batches.results(second.id)  # the SDK asks for results once results_url is set
    raw = httpx.get(f"{server.url}/v1/messages/batches/{second.id}/results", headers={"x-api-key": KEYS["a"]})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    a.messages.batches.cancel(second.id)
    ended(a, second.id)
    ended(a, first.id)
    deleted = a.messages.batches.delete(second.id)
    assert deleted.id == second.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        a.messages.batches.retrieve(second.id)


@pytest.mark.parametrize("requests, says", [
    ([], "requests: give a non-empty list"),
    ([{"custom_id": "a b", "params": {}}], "requests.0.custom_id: must be 1-64 letters"),
    ([{"custom_id": "x", "params": {}}, {"custom_id": "x", "params": {}}], "requests.1.custom_id: 'x' is used twice"),
    ([{"custom_id": "x", "params": []}], "requests.0.params: must be an object"),
    ([{"custom_id": "x", "params": {}, "extra": 1}], "requests.0.extra: Extra inputs are not permitted"),
    ("nope", "requests: give a non-empty list"),
])
def test_a_bad_batch_is_refused_whole_naming_the_request(server, requests, says):
    r = httpx.post(server.url + "/v1/messages/batches", json={"requests": requests},
                   headers={"x-api-key": KEYS["b"]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and says in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/messages/batches", content=b"{",
                      headers={"x-api-key": KEYS["b"]}).status_code == 400
    assert httpx.post(server.url + "/v1/messages/batches", json={"requests": requests}).status_code == 401


def test_cancelling_aborts_what_runs_and_skips_the_rest(server, engines, monkeypatch):
    c = client(server, "b")
    engine = engines[LOOP_MODEL]
    slow_steps(engine, monkeypatch, 0.02)
    batch = c.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": {"model": LOOP_MODEL, "max_tokens": 300, "messages": HI}} for i in range(40)])
    assert wait_until(lambda: engine.stats().num_running > 0, timeout=30)
    canceling = c.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    done = ended(c, batch.id, timeout=30)
    assert done.request_counts.canceled == 40 and done.request_counts.succeeded == 0
    assert all(r.result.type == "canceled" for r in c.messages.batches.results(batch.id))
    assert wait_until(lambda: engine.stats().num_running == engine.stats().num_waiting == 0, timeout=10)
    with pytest.raises(anthropic.BadRequestError, match="is ended: a batch can be cancelled only while"):
        c.messages.batches.cancel(batch.id)  # as Anthropic's: an ended batch cannot be cancelled



def test_an_error_answered_as_the_batch_is_cancelled_is_the_requests_result(server, monkeypatch):
    """A request the route answered with an error while its batch was being cancelled keeps that
    answer (it was counted in tierlm:requests as a 404), not `canceled` as if it never ran."""
    import asyncio
    import threading

    state = server.app.state.tierlm
    admit, entered, go = state.admit, threading.Event(), threading.Event()

    async def held(request: Any) -> Any:  # the request is under way when the cancel comes
        entered.set()
        while not go.is_set():
            await asyncio.sleep(0.01)
        return await admit(request)

    monkeypatch.setattr(state, "admit", held)
    c = client(server, "b")
    batch = c.messages.batches.create(requests=[
        {"custom_id": "gone", "params": {"model": "no-such-model", "max_tokens": 5, "messages": HI}}])
    assert entered.wait(30)
    c.messages.batches.cancel(batch.id)
    go.set()
    done = ended(c, batch.id)
    assert (done.request_counts.errored, done.request_counts.canceled) == (1, 0)
    [result] = [r.result for r in c.messages.batches.results(batch.id)]
    assert result.type == "errored" and result.error.error.type == "not_found_error"


def test_at_expiry_the_requests_in_the_engine_are_aborted_and_expired(scripted_models, tmp_path, monkeypatch):
    """24 hours after its creation (here 3 s) a batch's processing ends: its requests in the
    engine, the one running and those waiting in its queue (no token computed yet), are aborted,
    their KV blocks freed, and `expired` in its counts, results, metric and batches directory, as
    a cancel's would be `canceled`. (They had been sent to the engine, so they ran to the end.)"""
    import json

    from tierlm.engine.async_engine import AsyncEngine
    from tierlm.serving import batches
    from tierlm.serving.batches import BatchJournal, BatchStore
    from tests.serving.scripted_model import ENGINE_OPTIONS

    engine = AsyncEngine.from_model(str(scripted_models[LOOP_MODEL].path), served_model_name=ONE_SEQ,
                                    **{**ENGINE_OPTIONS, "max_num_seqs": 1})  # one runs, the others wait
    app = build_app({ONE_SEQ: engine}, ApiKeyAuth.from_keys(KEYS),
                    batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
    srv = ServerThread(app).start()
    try:
        slow_steps(engine, monkeypatch, 0.02)  # each answer takes 8 s
        monkeypatch.setattr(batches, "EXPIRES_AFTER_S", 3.0)
        c = client(srv, "b")
        batch = c.messages.batches.create(requests=[
            {"custom_id": f"r{i}", "params": {"model": ONE_SEQ, "max_tokens": 400, "messages": HI}} for i in range(4)])
        assert wait_until(lambda: (engine.stats().num_running, engine.stats().num_waiting) == (1, 3), timeout=2.5)
        done = ended(c, batch.id, timeout=15)
        assert (done.ended_at - done.created_at).total_seconds() < 8
        counts = done.request_counts
        assert (counts.expired, counts.succeeded, counts.canceled, counts.errored) == (4, 0, 0, 0)
        assert [r.result.type for r in c.messages.batches.results(batch.id)] == ["expired"] * 4
        assert wait_until(lambda: engine.stats().num_running == engine.stats().num_waiting == 0, timeout=10)
        assert wait_until(lambda: engine.stats().kv_blocks_used == 0, timeout=10)
        assert value(httpx.get(srv.url + "/metrics").text, "tierlm:batch_requests_total", result="expired") == 4
        written = tmp_path / "batches" / batch.id
        assert sorted((row["custom_id"], row["result"]["type"]) for row in
                      map(json.loads, (written / "results.jsonl").read_text().splitlines())) == \
            [(f"r{i}", "expired") for i in range(4)]
        assert json.loads((written / "state.json").read_text())["ended_at"] is not None
    finally:
        srv.stop()


def test_batch_work_waits_behind_interactive_requests_and_skips_rate_limits(server, engines, monkeypatch):
    """On an engine that runs one request at a time: a batch of 4 long answers has started; an
    interactive request sent then is answered before the batch's second request starts, not
    after all four. The tenant may send 2 requests a minute; its batch of 4 runs whole."""
    c = client(server, "a")
    engine = engines[ONE_SEQ]
    slow_steps(engine, monkeypatch, 0.02)
    batch = c.messages.batches.create(requests=[
        {"custom_id": f"r{i}", "params": {"model": ONE_SEQ, "max_tokens": 40, "messages": HI}} for i in range(4)])
    assert wait_until(lambda: engine.stats().num_running == 1, timeout=30)
    started = time.monotonic()
    answer = c.messages.create(model=ONE_SEQ, max_tokens=2, messages=HI)
    waited = time.monotonic() - started
    assert answer.usage.output_tokens == 2
    done = ended(c, batch.id)
    assert done.request_counts.succeeded == 4
    total = (done.ended_at - done.created_at).total_seconds()
    assert waited < total / 2, (waited, total)  # at most the one running batch answer before it
    assert all(r.result.message.usage.output_tokens == 40 for r in c.messages.batches.results(batch.id))


# ---- a batches directory: batches outlive the server -------------------------------------------


def test_batches_outlive_a_restart_and_the_unfinished_requests_run_again(scripted_models, tmp_path, monkeypatch,
                                                                        caplog):
    """With --batches-dir: a finished batch is found again after a restart, with its results; one
    stopped halfway goes on from the requests that had not finished, keeping those that had; a
    deleted one stays deleted; a second server cannot use the same directory."""
    from tierlm.serving.batches import BatchJournal, BatchStore

    def start() -> tuple[ServerThread, Any]:
        engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
        app = build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(KEYS),
                        batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
        return ServerThread(app).start(), engine

    one, engine = start()
    try:
        c = client(one, "b")
        done = c.messages.batches.create(requests=[
            {"custom_id": f"d{i}", "params": {"model": LOOP_MODEL, "max_tokens": 3, "messages": HI}} for i in range(3)])
        gone = c.messages.batches.create(requests=[
            {"custom_id": "g", "params": {"model": LOOP_MODEL, "max_tokens": 2, "messages": HI}}])
        ended(c, done.id)
        ended(c, gone.id)
        c.messages.batches.delete(gone.id)
        before = {r.custom_id: r.result.message.content for r in c.messages.batches.results(done.id)}
        with pytest.raises(ValueError, match="is in use by another tierlm server"):
            BatchJournal(tmp_path / "batches")
        slow_steps(engine, monkeypatch, 0.03)  # the long ones outlast the server's 5 s to stop: aborted
        halfway = c.messages.batches.create(requests=[  # 16 at a time: the first 16 finish, the rest wait
            {"custom_id": f"h{i}", "params": {"model": LOOP_MODEL, "max_tokens": 2 if i < 16 else 400,
                                              "messages": HI}} for i in range(20)])
        lines = tmp_path / "batches" / halfway.id / "results.jsonl"
        assert wait_until(lambda: lines.exists() and len(lines.read_text().splitlines()) >= 16, timeout=30)

        def interactive() -> None:  # a client streaming as the server stops: it drains for 5 s, then aborts
            with httpx.stream("POST", one.url + "/v1/messages", headers={"x-api-key": KEYS["b"]}, timeout=60,
                              json={"model": LOOP_MODEL, "max_tokens": 400, "messages": HI, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass

        import threading
        streaming = threading.Thread(target=interactive)
        streaming.start()
        assert wait_until(lambda: engine.stats().num_running >= 5, timeout=10)
    finally:
        one.stop()
    streaming.join(30)
    # the 4 long ones were aborted by the shutdown: not finished, not written (they run again)
    assert sorted(line.split('"')[3] for line in lines.read_text().splitlines()) == sorted(f"h{i}" for i in range(16))
    with open(lines, "a") as f:
        f.write('{"custom_id": "h19", "res')  # a crash's torn last line: ignored, h19 runs again
    (tmp_path / "batches" / "msgbatch_broken").mkdir()
    (tmp_path / "batches" / "msgbatch_broken" / "batch.json").write_text("{not json")
    import logging
    caplog.set_level(logging.WARNING, logger="tierlm.serving")
    two, _ = start()
    assert any("skipping msgbatch_broken, whose batch.json cannot be read" in r.getMessage() for r in caplog.records)
    try:
        c = client(two, "b")
        again = c.messages.batches.retrieve(done.id)
        assert again.processing_status == "ended" and again.request_counts.succeeded == 3
        assert {r.custom_id: r.result.message.content for r in c.messages.batches.results(done.id)} == before
        with pytest.raises(anthropic.NotFoundError):
            c.messages.batches.retrieve(gone.id)
        with pytest.raises(anthropic.NotFoundError):
            client(two, "a").messages.batches.retrieve(done.id)  # still the key's own
        finished = ended(c, halfway.id)
        assert finished.request_counts.succeeded == 20
        results = {r.custom_id: r.result for r in c.messages.batches.results(halfway.id)}
        assert all(results[f"h{i}"].message.usage.output_tokens == (2 if i < 16 else 400) for i in range(20))
        assert [x.id for x in c.messages.batches.list().data] == [halfway.id, done.id]
    finally:
        two.stop()
    import json
    rows = [json.loads(line) for line in lines.read_text().splitlines()]  # the torn line was cut off
    assert sorted(r["custom_id"] for r in rows) == sorted(f"h{i}" for i in range(20))



def test_a_batch_whose_key_left_the_keys_file_ends_under_the_tenant_that_sent_it(scripted_models, tmp_path,
                                                                                monkeypatch):
    """A restart without the batch's key errs what had not run (authentication_error), and the
    batch's requests, the one done before the restart among them, count once each under the tenant
    that sent it: the key is gone, not the tenant's work (it counted as `default`)."""
    from tierlm.serving.batches import BatchJournal, BatchStore

    def start(keys: dict[str, str], tenancy: Tenancy | None) -> tuple[ServerThread, Any, Any]:
        engine = scripted_models[LOOP_MODEL].engine(LOOP_MODEL)
        app = build_app({LOOP_MODEL: engine}, ApiKeyAuth.from_keys(keys), tenancy=tenancy,
                        batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
        return ServerThread(app, graceful_timeout=0.2).start(), app, engine

    (tmp_path / "tenants.toml").write_text(TENANTS)
    one, _, engine = start(KEYS, Tenancy.from_file(tmp_path / "tenants.toml", KEYS))
    try:
        slow_steps(engine, monkeypatch, 0.02)
        batch = client(one, "a").messages.batches.create(requests=[
            {"custom_id": cid, "params": {"model": LOOP_MODEL, "max_tokens": n, "messages": HI}}
            for cid, n in (("quick", 2), ("long", 400))])
        lines = tmp_path / "batches" / batch.id / "results.jsonl"
        assert wait_until(lambda: lines.exists() and '"quick"' in lines.read_text(), timeout=30)
    finally:
        one.stop()  # "long" is aborted by the shutdown: not finished, it would run again
    two, app, _ = start({"b": KEYS["b"]}, None)
    try:
        restored = app.state.tierlm.batches._batches[batch.id]
        assert wait_until(lambda: restored.ended_at is not None, timeout=30)
        results = {i.custom_id: i.result for i in restored.items}
        assert results["quick"]["type"] == "succeeded"
        assert results["long"]["error"]["error"]["type"] == "authentication_error"
        metrics = httpx.get(two.url + "/metrics").text
        assert value(metrics, "tierlm:batch_requests_total", tenant="acme", result="succeeded") == 1
        assert value(metrics, "tierlm:batch_requests_total", tenant="acme", result="errored") == 1
        assert value(metrics, "tierlm:batch_requests_total", tenant="default") == 0
    finally:
        two.stop()



def test_an_ended_batchs_result_the_directory_lost_reads_as_canceled(scripted_models, tmp_path):
    """An ended batch whose result line was never written (the disk refused it) counts that
    request `canceled`, and its results say so too (they held `result: null`, which the SDK reads
    as no result at all)."""
    import json
    from tierlm.serving.batches import BatchJournal, BatchStore

    d = tmp_path / "batches" / "msgbatch_lost"
    d.mkdir(parents=True)
    now = time.time()
    (d / "batch.json").write_text(json.dumps({"id": d.name, "kind": "message_batch", "api_key_id": "b",
                                              "created_at": now, "requests": [{"custom_id": "kept", "params": {}},
                                                                              {"custom_id": "lost", "params": {}}]}))
    (d / "results.jsonl").write_text(json.dumps({"custom_id": "kept", "result": {"type": "expired"}}) + "\n")
    (d / "state.json").write_text(json.dumps({"ended_at": now}))
    app = build_app({LOOP_MODEL: scripted_models[LOOP_MODEL].engine(LOOP_MODEL)}, ApiKeyAuth.from_keys(KEYS),
                    batch_store=BatchStore(journal=BatchJournal(tmp_path / "batches")))
    srv = ServerThread(app).start()
    try:
        c = client(srv, "b")
        counts = c.messages.batches.retrieve(d.name).request_counts
        assert (counts.expired, counts.canceled) == (1, 1)
        assert [(r.custom_id, r.result.type) for r in c.messages.batches.results(d.name)] == [("kept", "expired"),
                                                                                           ("lost", "canceled")]
    finally:
        srv.stop()


def test_serve_refuses_a_batches_dir_another_server_holds(tmp_path):
    from tests.serving.test_cli import free_port, serve
    from tierlm.serving.batches import BatchJournal

    held = BatchJournal(tmp_path / "b")
    try:
        proc = serve("--port", str(free_port()), "--batches-dir", str(tmp_path / "b"))
        out, _ = proc.communicate(timeout=120)
    finally:
        held.close()
    assert proc.returncode == 2 and f"error: --batches-dir {tmp_path / 'b'} is in use by another tierlm server" in out
    assert "Traceback" not in out
