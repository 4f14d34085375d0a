"""AsyncEngine: streaming, abort, early close, concurrency, and a free event loop."""
from __future__ import annotations

import asyncio
import time

import pytest

from tierlm import AsyncEngine, LLM, SamplingParams
from tierlm.errors import EngineDeadError, RequestTooLongError


@pytest.fixture
async def engine(llama_dir):
    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False)
    await eng.start()
    yield eng
    await eng.shutdown()


async def _collect(engine, prompt, params, **kw):
    return [d async for d in engine.generate(prompt, params, **kw)]


async def test_stream_matches_offline(engine, llama_dir):
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    deltas = await _collect(engine, "hello world", p)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert [t for d in deltas for t in d.token_ids] == LLM(str(llama_dir), dtype="float32", kv_cache_memory=1 << 20,
                                                          load_progress=False).generate("hello world", p)[0].outputs[0].token_ids
    assert deltas[-1].num_output_tokens == 10 and deltas[-1].num_prompt_tokens == len(engine.encode("hello world"))


async def test_abort_frees_blocks_at_once(engine):
    gen = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True), request_id="r1")
    first = await gen.__anext__()
    assert not first.finished and engine.stats().kv_blocks_used > 0
    await engine.abort("r1")
    assert engine.stats().kv_blocks_used == 0
    rest = [d async for d in gen]
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"


async def test_a_request_id_is_free_again_as_soon_as_abort_returns(engine):
    """README: a request id may be used again at once. After `abort` returned, a stream under the
    aborted id was refused as in use: the id left only once the old stream's reader ran (and
    the abort's answer could overtake the final delta on its way to the event loop)."""
    quick = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ref = [t for d in await _collect(engine, "hello again", quick) for t in d.token_ids]
    for _ in range(20):
        old = engine.generate("hello there", SamplingParams(max_tokens=400, ignore_eos=True), request_id="R")
        await old.__anext__()  # running; nobody reads it while the id is reused
        await engine.abort("R")
        new = await _collect(engine, "hello again", quick, request_id="R")
        assert [t for d in new for t in d.token_ids] == ref and new[-1].finish_reason == "length"
        rest = [d async for d in old]
        assert rest[-1].finish_reason == "abort"  # the old stream got its own end, not the new one's
    assert engine.stats().kv_blocks_used == 0 and not engine._streams


def test_a_delivery_scheduled_on_a_loop_that_stops_reaches_the_next_loop(llama_dir):
    """The engine thread hands deltas to its loop with call_soon_threadsafe; a loop that stops
    before running the callback (asyncio.run ending) dropped them. One such loss, a closed
    stream's end, kept its request id taken: a new stream under it waited for ever (CI, once)."""
    from tierlm.engine.async_engine import _Closed, _Closing
    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False)
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(eng.start())  # the engine serves `loop`, which now stands still
    closing = _Closing()
    eng._streams["R"] = closing  # a stream under "R" whose reader left: "R" is taken until its end
    eng._send([("R", _Closed(closing))])  # its end, scheduled on `loop`, which never runs again
    loop.close()
    out = asyncio.run(asyncio.wait_for(_collect(eng, "hello", p, request_id="R"), 30))
    assert out[-1].finish_reason == "length" and closing.gone.is_set()
    asyncio.run(eng.shutdown())
    assert not eng._streams and not eng._orphans


def test_an_engine_left_running_by_one_event_loop_serves_the_next(llama_dir):
    """asyncio.run without a shutdown, then asyncio.run again: the engine thread went on sending
    deltas to the first, closed loop, and the second loop's streams waited for ever."""
    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False)
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def run() -> list:
        return [t for d in await asyncio.wait_for(_collect(eng, "hello", p), 30) for t in d.token_ids]

    first = asyncio.run(run())
    assert eng._thread.is_alive()  # no shutdown
    assert asyncio.run(run()) == first

    async def abort_only() -> None:  # its answer went to the closed loop: abort() never returned
        await asyncio.wait_for(eng.abort("never-seen"), 30)

    async def leave_open() -> None:  # a stream still open when its loop closes: its end reaches no loop
        gen = eng.generate("hello", SamplingParams(max_tokens=400, ignore_eos=True), request_id="R")
        await gen.__anext__()

    asyncio.run(run())
    asyncio.run(abort_only())
    asyncio.run(leave_open())
    time.sleep(0.2)  # the engine thread takes the close, and its answer finds the loop closed
    assert asyncio.run(run()) == first  # the closed stream's end delivered, not lost
    assert asyncio.run(asyncio.wait_for(_collect(eng, "hello", p, request_id="R"), 30))[-1].finish_reason == "length"
    asyncio.run(eng.shutdown())
    assert eng.engine.pool.num_used == 0 and not eng._streams and not eng._orphans


async def test_an_engine_serving_a_running_event_loop_refuses_another(engine):
    other = asyncio.new_event_loop()
    try:
        def in_other_loop():
            return other.run_until_complete(engine.start())
        with pytest.raises(RuntimeError, match="serves another event loop that is still running"):
            await asyncio.to_thread(in_other_loop)
    finally:
        other.close()


async def test_closing_the_stream_aborts(engine):
    gen = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True))
    await gen.__anext__()
    await gen.aclose()
    for _ in range(100):
        if engine.stats().kv_blocks_used == 0 and engine.stats().num_running == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats().kv_blocks_used == 0


async def test_a_request_id_reused_right_after_its_stream_was_closed_gets_its_own_stream(engine):
    """The closed stream's abort was still on its way through the engine thread: it reached the
    new stream, which ended at once ('abort', the old prompt's length), while the new request ran
    on with nobody listening. Now the new stream waits for it and gets its own tokens."""
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    for _ in range(3):
        gen = engine.generate({"prompt_token_ids": [5, 6, 7, 8]}, long, request_id="r1")
        async for d in gen:
            if d.num_output_tokens >= 3:
                break
        await gen.aclose()
        deltas = await _collect(engine, {"prompt_token_ids": [9, 10, 11]},
                                SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), request_id="r1")
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_prompt_tokens == 3
        assert sum(len(d.token_ids) for d in deltas) == 5
    assert not engine.engine.requests and not engine._streams and engine.stats().kv_blocks_used == 0


async def test_only_a_streams_own_abort_ends_the_wait_of_the_next_stream_under_its_id(llama_dir):
    """The engine thread is played by hand to get this order: stream 1 ends as it is closed (its
    final delta arrives after the close, so the abort posted on close finds nothing); stream 2
    under the same id is added, then closed before its first delta; only then does what the
    thread did for stream 1's abort arrive. That used to end stream 2's wait, and stream 3 got
    request 2's abort while request 3 ran on unobserved."""
    class Running:
        def is_alive(self) -> bool:
            return True

    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False)
    eng._loop, eng._thread = asyncio.get_running_loop(), Running()
    params = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    g1 = eng.generate({"prompt_token_ids": [5, 6, 7, 8]}, params(3), request_id="r")
    first = asyncio.ensure_future(g1.__anext__())
    await asyncio.sleep(0)
    eng._deliver(eng._drain_inbox())
    deltas = []
    while not any(d.finished for d in deltas):
        deltas += eng.engine.step()
    eng._deliver(deltas[:1])
    assert (await first).num_output_tokens == 1
    await g1.aclose()
    eng._deliver(deltas[1:])  # stream 1's final delta, after its close
    g2 = eng.generate({"prompt_token_ids": [1, 2]}, params(50), request_id="r")
    second = asyncio.ensure_future(g2.__anext__())
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # g2 waits for stream 1's abort
    out = eng._drain_inbox()  # stream 1's close
    eng._deliver(out)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    late = eng._drain_inbox()  # request 2 added
    assert "r" in eng.engine.requests and eng.engine.requests["r"].prompt_token_ids == [1, 2]
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await g2.aclose()
    eng._deliver(late + out)  # anything left over for the id (a repeated marker included) changes nothing
    assert type(eng._streams["r"]).__name__ == "_Closing"
    got = []

    async def third() -> None:
        async for d in eng.generate({"prompt_token_ids": [9, 10, 11]}, params(5), request_id="r"):
            got.append(d)

    task = asyncio.ensure_future(third())
    for _ in range(200):
        await asyncio.sleep(0)
        eng._deliver(eng._drain_inbox())
        await asyncio.sleep(0)
        if eng.engine.has_unfinished():
            eng._deliver(eng.engine.step())
        if task.done():
            break
    await task
    assert got[-1].finish_reason == "length" and got[-1].num_prompt_tokens == 3
    assert sum(len(d.token_ids) for d in got) == 5
    assert not eng.engine.requests and not eng._streams


async def test_concurrent_streams_and_event_loop_stays_free(engine):
    ticks = 0
    stop = False

    async def ticker():
        nonlocal ticks
        while not stop:
            await asyncio.sleep(0.005)
            ticks += 1

    t = asyncio.create_task(ticker())
    start = time.monotonic()
    results = await asyncio.gather(*[
        _collect(engine, f"prompt {i}", SamplingParams(max_tokens=20 + i, temperature=0, ignore_eos=True))
        for i in range(12)])
    elapsed = time.monotonic() - start
    stop = True
    await t
    assert [r[-1].num_output_tokens for r in results] == [20 + i for i in range(12)]
    # The loop kept ticking while the model ran (at least a quarter of the ideal tick count).
    assert ticks >= 0.25 * elapsed / 0.005


async def test_a_shut_down_engine_serves_again_on_the_next_request(engine):
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = await _collect(engine, "hello", p)
    await engine.shutdown()
    after = await asyncio.wait_for(_collect(engine, "hello", p), 60)
    assert after[-1].finished and [t for d in after for t in d.token_ids] == [t for d in before for t in d.token_ids]


async def test_a_request_posted_as_the_engine_thread_stops_ends_with_the_shutdown(engine):
    """Added after the thread's last look at its inbox, it waited for ever. Played with a
    stand-in for a thread that is still alive when the request is posted and gone once joined."""
    class Stopping:
        alive = True

        def is_alive(self) -> bool:
            return self.alive

        def join(self, timeout=None) -> None:
            self.alive = False

    engine._stopping = True
    engine._wake.set()
    await asyncio.to_thread(engine._thread.join, 30)  # the real thread is gone
    engine._thread = Stopping()
    late = asyncio.ensure_future(_collect(engine, "hello", SamplingParams(max_tokens=4)))
    await asyncio.sleep(0.05)
    assert not late.done()
    await engine.shutdown()
    deltas = await asyncio.wait_for(late, 10)
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert not engine.engine.requests and not engine._streams and engine.stats().kv_blocks_used == 0


async def test_a_thread_that_stopped_without_a_shutdown_is_started_again(engine):
    """A thread that outlived shutdown's wait and stopped later left the engine unable to serve:
    a new request neither started a thread nor got an answer."""
    engine._stopping = True
    engine._wake.set()
    await asyncio.to_thread(engine._thread.join, 30)
    deltas = await asyncio.wait_for(_collect(engine, "hello", SamplingParams(max_tokens=4, ignore_eos=True)), 30)
    assert deltas[-1].finish_reason == "length"


async def test_concurrent_shutdowns_and_a_request_during_one(engine):
    """A second shutdown failed (AttributeError on the thread the first had let go), and a
    request arriving while the cache was written down started a thread that stepped the pool
    under it."""
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    before = await _collect(engine, "hello", p)
    first, second = asyncio.ensure_future(engine.shutdown()), asyncio.ensure_future(engine.shutdown())
    await asyncio.sleep(0)
    after = await asyncio.wait_for(_collect(engine, "hello", p), 60)
    await asyncio.wait_for(asyncio.gather(first, second), 60)
    assert [t for d in after for t in d.token_ids] == [t for d in before for t in d.token_ids]


async def test_a_fault_of_the_engine_loop_itself_ends_every_stream_and_refuses_new_ones(engine, monkeypatch):
    """An abort whose caller had given up (its Future cancelled) raised InvalidStateError out of
    the loop: the thread died silently and every later request hung."""
    gen = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True))
    await gen.__anext__()
    monkeypatch.setattr(engine, "_drain_inbox", lambda: 1 / 0)  # a bug in the loop, not in a step
    engine._wake.set()
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    with pytest.raises(EngineDeadError):
        await _collect(engine, "abc", SamplingParams(max_tokens=2))
    assert not engine.engine.requests and engine.stats().kv_blocks_used == 0  # held until a shutdown before
    engine.dead = None  # let the fixture shut down


async def test_an_abort_waiting_in_the_inbox_when_the_loop_faults_is_answered(engine, monkeypatch):
    gen = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True), request_id="a")
    await gen.__anext__()
    monkeypatch.setattr(engine, "_drain_inbox", lambda: 1 / 0)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.abort("a"), 10)  # it waited for ever
    await gen.aclose()
    engine.dead = None


def test_one_engine_serves_several_event_loops_in_turn(llama_dir):
    """asyncio.run twice (a notebook, a sync wrapper): the start/shutdown lock belonged to the
    first loop that waited on it, and the second run failed with 'bound to a different loop'."""
    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False)
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def run() -> list:
        await eng.start()
        stopping = asyncio.ensure_future(eng.shutdown())
        await asyncio.sleep(0)
        deltas = await _collect(eng, "hello", p)  # waits for the shutdown, then starts again
        await stopping
        await eng.shutdown()
        return [t for d in deltas for t in d.token_ids]

    assert asyncio.run(run()) == asyncio.run(run())


async def test_a_cancelled_shutdown_still_holds_new_requests_until_the_cache_is_written(llama_dir, tmp_path):
    import threading

    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=512,
                                 load_progress=False, kv_disk_dir=str(tmp_path / "kv"))
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    await _collect(eng, "hello", p)
    gate, drain = threading.Event(), eng._drain
    eng._drain = lambda: (gate.wait(10), drain())
    stopping = asyncio.ensure_future(eng.shutdown())
    for _ in range(100):  # until the write has begun
        await asyncio.sleep(0.01)
        if eng._thread is None:
            break
    stopping.cancel()
    late = asyncio.ensure_future(_collect(eng, "hello", p))
    await asyncio.sleep(0.2)
    assert not late.done() and eng._thread is None  # no engine thread while the cache is written
    gate.set()
    assert (await asyncio.wait_for(late, 30))[-1].finish_reason == "length"
    with pytest.raises(asyncio.CancelledError):
        await stopping
    await eng.shutdown()


async def test_an_abort_its_caller_gave_up_on_does_not_stop_the_engine(engine):
    gen = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True), request_id="given-up")
    await gen.__anext__()
    from concurrent.futures import Future

    given_up = Future()
    given_up.cancel()  # what asyncio.wait_for(engine.abort(...), 10) leaves when it times out
    engine._post(("abort", "given-up", given_up))
    rest = [d async for d in gen]
    assert rest[-1].finish_reason == "abort" and engine._thread.is_alive() and engine.dead is None
    deltas = await _collect(engine, "abc", SamplingParams(max_tokens=2, ignore_eos=True))
    assert deltas[-1].finish_reason == "length"


async def test_too_long_raises_before_streaming(engine):
    with pytest.raises(RequestTooLongError):
        await _collect(engine, {"prompt_token_ids": [3] * 600}, SamplingParams(max_tokens=4))
    assert engine.stats().num_waiting == 0


async def test_free_heap_goes_back_to_the_os_once_per_idle_spell(engine):
    import sys

    from tierlm.engine.heap import release_free_heap

    if not sys.platform.startswith("linux"):
        pytest.skip("malloc_trim is glibc's")
    assert release_free_heap()
    engine.heap.quiet_s = 0.2
    await asyncio.sleep(0.5)
    assert engine.heap.trims == 0  # nothing ran yet: nothing to give back
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    await _collect(engine, "abc", p)
    await asyncio.sleep(0.1)
    assert engine.heap.trims == 0  # not while requests may still come
    await asyncio.sleep(0.6)
    assert engine.heap.trims == 1
    await asyncio.sleep(0.5)
    assert engine.heap.trims == 1  # once per idle spell, not at every wait
    await _collect(engine, "abc", p)
    await asyncio.sleep(0.8)
    assert engine.heap.trims == 2
