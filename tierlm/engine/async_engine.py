"""asyncio front of the engine: the model loop runs in its own thread, never on the event loop.

Requests and aborts are handed to the engine thread through a queue and applied between
steps, so only that thread ever mutates engine state while it runs (starting it and shutting it
down hold one lock, and a shutdown finishes off what is left once the thread is gone); deltas
come back to each request's asyncio.Queue via call_soon_threadsafe. Closing a `generate`
iterator early aborts the request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, InvalidStateError

import torch

from tierlm.config import EngineConfig
from tierlm.engine.engine import READ_POLL_S, EngineStats, LLMEngine
from tierlm.engine.heap import IdleTrimmer
from tierlm.engine.outputs import StreamDelta
from tierlm.errors import EngineDeadError, EngineStepError
from tierlm.sampling_params import PoolingParams, SamplingParams

log = logging.getLogger(__name__)


class _Closing:
    """The stream of a request whose consumer left before its final delta. What still comes for
    it is dropped, and a new stream under the same request id waits until the engine thread has
    taken this stream's own abort (`_Closed`): it got the old request's abort before, and ended
    at once while its own request ran on with nobody listening (holding KV blocks until
    max_tokens). Only that abort ends the wait, not any final delta or abort for the id: one
    left over from an earlier stream of the same id released a later one's wait too early."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()


class _Closed:
    """Delivered once the engine thread has aborted a `_Closing` stream's request: the inbox is
    first in, first out, so nothing of that request can come after it."""

    def __init__(self, closing: _Closing) -> None:
        self.closing = closing


class _Answer:
    """An `abort` caller's answer, delivered after the deltas before it: resolved on the engine
    thread, the caller woke (and reused the request id) before the request's final delta had
    reached its stream, which then still held the id."""

    def __init__(self, fut: Future, error: BaseException | None = None) -> None:
        self.fut, self.error = fut, error

    def give(self) -> None:
        try:
            if self.error is None:
                self.fut.set_result(None)
            else:
                self.fut.set_exception(self.error)
        except InvalidStateError:  # its caller gave up waiting, or the engine thread's fault answered it
            pass


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.engine.read_wait_s = READ_POLL_S  # between waits the loop takes new requests and aborts
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # What the engine thread sent while no open loop would take it (the loop it served was
        # closed without a shutdown): the next loop to use the engine delivers it (`_bind`), so
        # abort answers and closed streams' ends are not lost. `_send_lock` guards both.
        self._orphans: list = []
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None  # what stopped the engine thread for good
        # start() and shutdown() hold it: no thread starts while one shuts down. One per event loop
        # (an asyncio lock belongs to the loop that first waited on it; asyncio.run twice made two).
        self._lifecycle_lock: asyncio.Lock | None = None
        self._lifecycle_loop: asyncio.AbstractEventLoop | None = None
        self.heap = IdleTrimmer()

    @classmethod
    def from_model(cls, model: str | None = None, **kwargs) -> "AsyncEngine":
        return cls(EngineConfig(model=model, **kwargs))

    # -- pass-throughs ---------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict:
        """The model's recommended sampling settings (generation_config.json), for requests that
        leave them unset; empty with --generation-config vllm."""
        return self.engine.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, continue_final_message=False):
        return self.engine.apply_chat_template(messages, tools, add_generation_prompt, continue_final_message)

    def chat_text(self, messages, tools=None, add_generation_prompt=True, continue_final_message=False,
                  template_kwargs=None) -> str:
        return self.engine.chat_text(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)

    def encode_chat_text(self, text: str) -> list[int]:
        return self.engine.encode_chat_text(text)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter as `name` (read on a worker thread: the loop goes on)."""
        await asyncio.to_thread(self.engine.add_lora, name, path)

    def remove_lora(self, name: str) -> None:
        self.engine.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.engine.list_loras()

    def lora_path(self, name: str) -> str:
        return self.engine.lora_path(name)

    # -- lifecycle -------------------------------------------------------------------------
    def _lifecycle(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lifecycle_loop is not loop:
            self._lifecycle_lock, self._lifecycle_loop = asyncio.Lock(), loop
        return self._lifecycle_lock

    async def start(self) -> None:
        """Start the engine thread, unless it runs (a shut-down engine starts again on its next
        request; one whose shutdown is under way, once it is done)."""
        async with self._lifecycle():
            if self.dead is not None:
                raise self._dead_error()
            self._bind(asyncio.get_running_loop())
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=f"tierlm-engine-{self.model_name}", daemon=True)
            self._thread.start()

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve `loop` from now on (on that loop): a later asyncio.run after one that closed
        without a shutdown, whose deltas went to the closed loop while the new streams and
        aborts waited for ever. A loop still running elsewhere keeps the engine."""
        with self._send_lock:
            if self._loop is loop:
                return
            if self._loop is not None and self._loop.is_running():
                raise RuntimeError("this AsyncEngine serves another event loop that is still running; "
                                   "use it from that loop, or shut it down there first")
            self._loop = loop
        self._deliver_waiting()

    def _take_orphans(self) -> list:
        with self._send_lock:
            orphans, self._orphans = self._orphans, []
        return orphans

    def _dead_error(self) -> EngineDeadError:
        e = self.dead
        return EngineDeadError(f"the engine stopped after an internal error ({type(e).__name__}: {e}); "
                               "restart the server")

    async def shutdown(self) -> None:
        """Abort whatever is still running and stop the engine thread."""
        async with self._lifecycle():  # a second call waits for the first, then finds nothing to do
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._wake.set()
            await asyncio.to_thread(thread.join, 30)
            if thread.is_alive():  # a step outlived the wait: its blocks are not ours to move
                log.warning("engine thread of %s did not stop within 30 s; the KV cache is not written to disk",
                            self.model_name)
                return
            self._thread = None
            # What was posted after the thread's last look at its inbox (a request added as it
            # stopped waited for ever): the thread is gone and none starts before this lock is
            # free, so this loop (and `_drain`'s worker) may touch the engine.
            self._deliver(self._take_orphans() + self._drain_inbox() + [self.engine.abort(rid) for rid in list(self.engine.requests)])
            if self.engine.store is not None:  # the KV cache reaches disk, queued writes land
                drain = asyncio.ensure_future(asyncio.to_thread(self._drain))
                try:
                    await asyncio.shield(drain)
                except asyncio.CancelledError:  # the write goes on in its worker: hold the lock until it ends
                    await asyncio.wait([drain])
                    raise

    def _drain(self) -> None:
        """Persist and flush within the store's shutdown deadline (a slow Redis must not hold
        a shutdown up for as long as its backlog takes)."""
        store = self.engine.store
        with store.deadline():
            self.engine.persist_kv()
            if not store.flush():
                log.warning("KV tier writes of %s were still under way after %g s at shutdown (a slow disk or "
                            "Redis); they go on while this process lives, and what is unwritten when it exits is "
                            "recomputed when needed", self.model_name, store.close_timeout_s)

    # -- requests --------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0, tenant_id: str | None = None,
                       cache_salt: str | None = None, tenant_weight: float = 1.0,
                       kv_share: float | None = None, pooling: PoolingParams | None = None,
                       lora: str | None = None, kv_cache_share: float | None = None) -> AsyncIterator[StreamDelta]:
        """The request's deltas as the engine makes them; with `pooling`, one delta holding the
        prompt's embedding (see PoolingParams)."""
        await self.start()  # (a free lock is taken without waiting)
        if pooling is None and params is not None and params.structured_outputs is not None:
            # compiled (or found compiled) on a worker thread: a large schema, and the first
            # grammar's tokenizer conversion, take long enough to hold up every other stream
            await asyncio.to_thread(self.engine.grammars.grammar, params.structured_outputs)
        req = self.engine.make_request(prompt, params, request_id, priority=priority, tenant_id=tenant_id,
                                       cache_salt=cache_salt, tenant_weight=tenant_weight, kv_share=kv_share,
                                       pooling=pooling, lora=lora, kv_cache_share=kv_cache_share)
        rid = req.request_id
        while (old := self._streams.get(rid)) is not None:
            if not isinstance(old, _Closing):
                from tierlm.errors import InvalidRequestError
                raise InvalidRequestError(f"request id '{rid}' is already in use", param="request_id")
            await old.gone.wait()  # its abort is on its way through the engine thread
            await self.start()  # (a shutdown may have come in between)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self._post(("add", req, None))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(rid) is q:  # (else its end was delivered, and the id may be in use again)
                if finished:
                    del self._streams[rid]
                else:
                    closing = _Closing()
                    self._streams[rid] = closing
                    self._post(("close", rid, closing))

    async def abort(self, request_id: str) -> None:
        """Abort a request; returns once its KV blocks are free."""
        if self._thread is None or not self._thread.is_alive():
            async with self._lifecycle():  # not while a shutdown writes the cache down
                if self._thread is None or not self._thread.is_alive():
                    self.engine.abort(request_id)  # no thread running: nothing else touches the engine
                    return
        if self.dead is not None:
            raise self._dead_error()
        self._bind(asyncio.get_running_loop())
        fut: Future = Future()
        self._post(("abort", request_id, fut))
        if self.dead is not None:  # the loop faulted meanwhile: its last look at the inbox may have missed this
            try:
                fut.set_exception(self._dead_error())
            except InvalidStateError:  # it did not
                pass
        await asyncio.wrap_future(fut)

    def _post(self, msg) -> None:
        self._inbox.put(msg)
        self._wake.set()

    # -- the engine thread -----------------------------------------------------------------
    def _deliver(self, deltas: list) -> None:
        for d in deltas:
            rid, item = d if isinstance(d, tuple) else (d.request_id, d)
            if isinstance(item, _Answer):
                item.give()
                continue
            q = self._streams.get(rid)
            if isinstance(item, _Closed):
                if q is item.closing:
                    del self._streams[rid]
                item.closing.gone.set()
            elif q is not None and not isinstance(q, _Closing):
                q.put_nowait(item)
                if isinstance(item, BaseException) or item.finished:
                    # The request is over: its id is free from now, not once its reader gets here
                    # (`abort` returned and a new stream under the id was refused as in use).
                    del self._streams[rid]

    def _send(self, deltas: list) -> None:
        """Hand `deltas` to the loop. They wait in `_orphans` until the loop takes them: a
        callback scheduled on a loop that then stops (asyncio.run ending) never runs, and what
        it carried (a closed stream's end, so its id stayed taken) was lost; left in the list,
        the next loop's `_bind` delivers it, in order with everything sent later."""
        if not deltas:
            return
        with self._send_lock:
            self._orphans.extend(deltas)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._deliver_waiting)
                except RuntimeError:  # it closed just now: they wait for the next loop
                    pass

    def _deliver_waiting(self) -> None:
        """On the loop: deliver what `_send` left (nothing, if an earlier callback took it)."""
        self._deliver(self._take_orphans())

    def _drain_inbox(self) -> list:
        out = []
        while True:
            try:
                kind, arg, fut = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if kind == "close":  # `fut` is the stream's _Closing: its wait ends whatever happens
                try:
                    self.engine.abort(arg)
                except Exception:
                    log.exception("aborting request %s of a closed stream failed", arg)
                out.append((arg, _Closed(fut)))
                continue
            try:
                if kind == "add":
                    self.engine.add(arg)
                else:
                    d = self.engine.abort(arg)
                    if d is not None:
                        out.append(d)
                if fut is not None:
                    out.append((None, _Answer(fut)))
            except Exception as e:  # a bad add must fail that request only
                if kind == "add":
                    out.append((arg.request_id, e))
                if fut is not None:
                    out.append((None, _Answer(fut, e)))

    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except BaseException as e:  # a fault of the loop itself: every waiting caller is told, none hangs
            log.exception("the engine thread of %s stopped after an internal error", self.model_name)
            self.dead = e
            err = self._dead_error()
            self._free_all()
            while True:  # aborts waiting in the inbox are answered too (`abort()` waited for ever)
                try:
                    _, _, fut = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(fut, Future):
                    try:
                        fut.set_exception(err)
                    except InvalidStateError:  # done already, or its caller gave up
                        pass
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, err)

    def _free_all(self) -> None:
        """On the dying engine thread: let go of every request's KV blocks (they stayed taken
        until a shutdown). Best effort: the fault may have left the engine in a state that fails
        here too, and what cannot be freed is logged."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("freeing the KV blocks of request %s after the engine thread's fault failed", rid)

    def _fail_all(self, err: BaseException) -> None:
        """On the event loop: end every stream with `err`, and every wait for a closed one."""
        for rid, q in list(self._streams.items()):
            if isinstance(q, _Closing):
                del self._streams[rid]
                q.gone.set()
            else:
                q.put_nowait(err)

    def _loop_until_stopped(self) -> None:
        eng = self.engine
        if eng.device.type == "cuda" and eng.device.index is not None:
            torch.cuda.set_device(eng.device)  # per thread: a server's models may sit on different GPUs
        while not self._stopping:
            self._send(self._drain_inbox())
            if not eng.has_unfinished():
                self.heap.idle()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.heap.busy()
            try:
                self._send(eng.step())
            except Exception as e:  # fail the requests in flight, keep serving new ones
                log.exception("engine step failed; aborting the %d requests in flight", len(eng.requests))
                err = EngineStepError(f"internal engine error: {type(e).__name__}: {e}")
                failed = []
                for rid in list(eng.requests):
                    eng.abort(rid)
                    failed.append((rid, err))
                self._send(failed)
        # Shutting down: abort everything left so callers see a final delta.
        self._send(self._drain_inbox())
        self._send([eng.abort(rid) for rid in list(eng.requests)])
