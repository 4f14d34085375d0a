"""Anthropic's Message Batches API: /v1/messages/batches (create, list, retrieve, cancel, delete,
results), as the official SDK's `client.messages.batches` calls it.

Why: many tenants have work that needs no answer within seconds (evaluations, labelling,
summaries overnight). Sent as a batch it runs when interactive requests leave the engine room:
each request of a batch runs at its tenant's priority lowered by BATCH_PRIORITY, so the
scheduler serves every waiting interactive request of any tier first, and preempts batch work
first when KV blocks run out. No SLA guard sheds it (it has no time-to-first-token target), and
the tenant's request rate and concurrency limits are not charged (Anthropic's batches have
limits of their own).

Each request runs through this server's own /v1/messages route, in process (an ASGI call, not a
socket), as its creator: the same rendering, validation, safety policies, fallback models and
telemetry as an interactive request, so its result is what /v1/messages would have answered
(`succeeded` with the message, or `errored` with the error body). As in Anthropic's API, a
request's params are checked when it runs, not when the batch is created; the batch itself
(its list of custom_id + params) is checked at once. Up to BATCH_CONCURRENCY requests of one
batch are in the engine at a time.

Kept per API key as stored responses are (another key's batch is not found). In memory only,
unless the server has a batches directory (`--batches-dir`, BatchJournal): then each batch, each
finished request's result and each change of state is written there as it happens, and a
restarted server finds its batches again and goes on with the requests that had not finished.
Cancelling stops what has not started and aborts what is running (its engine request freed at
once); what finished is kept. A batch expires 24 hours after it was created, and its processing
ends then as a cancel's does: every request not finished by then, those waiting in the engine's
queue and those running included, is aborted and `expired` (Anthropic's batch ends processing at
`expires_at`; OpenAI's cancels the unfinished requests of a batch that expires).
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ClassVar, cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import ClientDisconnected, Conflict, InvalidRequest, NotFound, RateLimited
from tierlm.serving.files import DEFAULT_MAX_FILE_BYTES, FileStore, rfc3339
from tierlm.serving.paging import limit_param, page
from tierlm.serving.telemetry import DEFAULT_TENANT
from tierlm.serving.validation import parse_json_object, read_body

logger = logging.getLogger("tierlm.serving")

router = APIRouter()

BATCH_CONTEXT = "tierlm_batch_context"  # ASGI scope state: a batch's request, admitted as its creator
BATCH_PRIORITY = 1_000_000  # added to the tenant's priority: after every interactive request
BATCH_CONCURRENCY = 16  # requests of one batch in the engine at once
MAX_BATCH_REQUESTS = 100_000  # Anthropic's limit
EXPIRES_AFTER_S = 24 * 3600
DEFAULT_MAX_BATCHES = 10_000  # kept per server; past it the oldest ended batch goes first
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass
class BatchItem:
    custom_id: str
    params: dict[str, Any]  # the request body
    result: dict[str, Any] | None = None  # in the batch kind's own shape; None until it finished


@dataclass
class Batch:
    """A batch of requests run in process through one of this server's routes. The machinery
    (store, journal, runner) is shared; each API's batch (MessageBatch here, OpenAIBatch in
    openai_batches.py) says which route, how a result is written and how the batch is described."""

    id: str
    owner: str
    context: RequestContext  # its creator's, at batch priority
    items: list[BatchItem]
    created_at: float = field(default_factory=time.time)
    cancel_initiated_at: float | None = None
    # Every request has its result and the batch's end is being made (OpenAI's output files): for
    # OpenAI's batch (`finalizing`) too late to cancel, or it would end `cancelled` with every answer.
    finalizing_at: float | None = None
    ended_at: float | None = None
    task: asyncio.Task | None = None
    # Set when the batch stops early, cancelled or expired (`halt_reason`): its requests in the
    # engine are aborted and the rest never start.
    halted: asyncio.Event = field(default_factory=asyncio.Event)
    # Finished requests by outcome, kept as they finish: a retrieve of a large batch counts nothing.
    _done: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    kind = "batch"  # in batch.json: which class restores it
    noun = "batch"  # in errors
    CANCELLABLE: ClassVar[tuple[str, ...]] = ()  # the statuses a cancel is taken in (a repeated one too)
    OUTCOMES: ClassVar[tuple[str, ...]] = ("succeeded", "errored", "canceled", "expired")
    path = "/v1/messages"  # the route each request runs through
    headers: ClassVar[tuple[tuple[bytes, bytes], ...]] = ()  # sent with each request beside its body
    body_name = "params"  # what the batch's API calls a request's body, in error messages

    def __post_init__(self) -> None:
        for item in self.items:  # (restored with the results that had been written)
            if item.result is not None:
                self._count(item.result)

    @property
    def status(self) -> str:
        """The batch's status in its API's words."""
        raise NotImplementedError

    @property
    def expires_at(self) -> float:
        return self.created_at + EXPIRES_AFTER_S

    @property
    def halt_reason(self) -> str:
        """What an unfinished request of a halted batch is: "canceled", or "expired"."""
        return "canceled" if self.cancel_initiated_at is not None else "expired"

    def expire(self) -> None:
        """Past `expires_at`: what has not finished stops, as for a cancel, but `expired`
        (nothing if the batch ended or was cancelled first)."""
        if self.ended_at is None and not self.halted.is_set():
            self.halted.set()
            logger.info("batch %s: expired with %d of %d requests unfinished", self.id,
                        sum(i.result is None for i in self.items), len(self.items))

    def settle(self, item: BatchItem, result: dict[str, Any]) -> None:
        """`item` finished with `result`."""
        item.result = result
        self._count(result)

    def _count(self, result: dict[str, Any]) -> None:
        kind = self.outcome(result)
        self._done[kind] = self._done.get(kind, 0) + 1

    def outcome(self, result: dict[str, Any]) -> str:
        """Which of OUTCOMES a finished request's result is."""
        raise NotImplementedError

    def result_counts(self) -> dict[str, int]:
        """Finished requests by outcome (the tierlm:batch_requests metric's `result`)."""
        return {**dict.fromkeys(self.OUTCOMES, 0), **self._done}

    def result_of(self, status: int, data: Any, request_id: str | None) -> dict[str, Any]:
        """A request's result from its route's answer (status and parsed JSON body, or None)."""
        raise NotImplementedError

    def errored(self, kind: str, message: str) -> dict[str, Any]:
        """A request's result when it errs without reaching the route (`kind`: an error type)."""
        raise NotImplementedError

    def unrun(self, why: str) -> dict[str, Any]:
        """A request's result when it never ran: `why` is "canceled" or "expired"."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What batch.json keeps beyond the requests (restored by `restored`)."""
        return {}

    def restored(self, record: dict[str, Any]) -> None:
        """Back from a journal `record` (its batch.json and state.json)."""

    def state(self) -> dict[str, Any]:
        """What state.json keeps: when it was cancelled and when it ended (numbers and strings only)."""
        return {"cancel_initiated_at": self.cancel_initiated_at, "ended_at": self.ended_at}

    async def on_end(self, store: "BatchStore") -> None:
        """Called once every request has a result, before the batch is marked ended."""


@dataclass
class MessageBatch(Batch):
    """Anthropic's message batch: requests to /v1/messages."""

    kind = "message_batch"
    noun = "message batch"
    CANCELLABLE = ("in_progress", "canceling")  # (Anthropic's has no finalizing: it ends as its last request does)
    path = "/v1/messages"
    headers = ((b"anthropic-version", b"2023-06-01"),)

    @property
    def status(self) -> str:
        if self.ended_at is not None:
            return "ended"
        return "canceling" if self.cancel_initiated_at is not None else "in_progress"

    def result_of(self, status: int, data: Any, request_id: str | None) -> dict[str, Any]:
        if status == 200 and isinstance(data, dict):
            return {"type": "succeeded", "message": data}
        if isinstance(data, dict) and data.get("type") == "error":
            return {"type": "errored", "error": data}
        return self.errored("api_error", f"the request ended with HTTP {status} and no error body")

    def errored(self, kind: str, message: str) -> dict[str, Any]:
        return {"type": "errored", "error": {"type": "error", "error": {"type": kind, "message": message}}}

    def unrun(self, why: str) -> dict[str, Any]:
        return {"type": why}

    OUTCOMES = ("processing", "succeeded", "errored", "canceled", "expired")

    def outcome(self, result: dict[str, Any]) -> str:
        return str(result["type"])

    def result_counts(self) -> dict[str, int]:
        counts = super().result_counts()
        counts["canceled"] += len(self.items) - sum(self._done.values())  # (an ended batch's lost results)
        return counts

    def describe(self) -> dict[str, Any]:
        """The MessageBatch object. As in Anthropic's API, requests count as `processing` until
        the whole batch has ended."""
        if self.ended_at is None:
            counts = {"processing": len(self.items), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        else:
            counts = self.result_counts()
        return {"id": self.id, "type": "message_batch", "processing_status": self.status,
                "request_counts": counts, "created_at": rfc3339(self.created_at),
                "expires_at": rfc3339(self.expires_at), "ended_at": rfc3339(self.ended_at),
                "cancel_initiated_at": rfc3339(self.cancel_initiated_at), "archived_at": None,
                "results_url": f"/v1/messages/batches/{self.id}/results" if self.ended_at is not None else None}


BATCH_KINDS: dict[str, type[Batch]] = {"message_batch": MessageBatch}  # kind -> class (openai_batches adds its own)


class BatchJournal:
    """A batches directory: one subdirectory per batch holding `batch.json` (who sent it, when,
    its requests), `results.jsonl` (a line per finished request, appended as it finishes) and
    `state.json` (when cancelled, when ended). One server at a time: it holds `DIR/.lock`."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / ".lock", "a")
        except OSError as e:
            raise ValueError(f"--batches-dir {self.root}: cannot use it ({e.strerror or e}); give a writable "
                             "directory") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"--batches-dir {self.root} is in use by another tierlm server; give each server "
                             "its own directory") from None

    def close(self) -> None:
        self._lock.close()  # (releases the lock)

    def _dir(self, batch_id: str) -> Path:
        return self.root / batch_id

    @staticmethod
    def _write(path: Path, data: Any) -> None:
        """`path` replaced whole (a crash leaves the old file or the new one, never half)."""
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def created(self, batch: Batch) -> None:
        d = self._dir(batch.id)
        d.mkdir()
        self._write(d / "batch.json", {**batch.record(), "id": batch.id, "kind": batch.kind,
                                       "api_key_id": batch.context.api_key_id, "tenant_id": batch.context.tenant_id,
                                       "created_at": batch.created_at,
                                       "requests": [{"custom_id": i.custom_id, "params": i.params}
                                                    for i in batch.items]})

    def finished(self, batch: Batch, item: BatchItem) -> None:
        line = json.dumps({"custom_id": item.custom_id, "result": item.result}, separators=(",", ":")) + "\n"
        try:
            with open(self._dir(batch.id) / "results.jsonl", "a") as f:
                f.write(line)
        except OSError as e:  # the batch goes on in memory; after a restart this request runs again
            self._failed(batch, e)

    def state(self, batch: Batch) -> None:
        try:
            self._write(self._dir(batch.id) / "state.json", batch.state())
        except OSError as e:
            self._failed(batch, e)

    def _failed(self, batch: Batch, error: OSError) -> None:
        logger.warning("batches directory %s: cannot write batch %s (%s); it goes on in memory, and a restart "
                       "would run its unwritten requests again", self.root, batch.id, error.strerror or error)

    def deleted(self, batch: Batch) -> None:
        shutil.rmtree(self._dir(batch.id), ignore_errors=True)

    def load(self) -> list[dict[str, Any]]:
        """Every batch written here, oldest first: its batch.json with `results` (custom_id →
        result) and `state`. A batch whose batch.json cannot be read is skipped, with a warning;
        a results line cut short by a crash is left out (that request runs again)."""
        found = []
        for d in (p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(("msgbatch_", "batch_"))):
            try:
                record = json.loads((d / "batch.json").read_text())
                record["requests"] = [(r["custom_id"], r["params"]) for r in record["requests"]]
                float(record["created_at"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("batches directory %s: skipping %s, whose batch.json cannot be read (%s)", self.root,
                               d.name, e)
                continue
            results: dict[str, Any] = {}
            try:
                with open(d / "results.jsonl", "rb+") as f:
                    data = f.read()
                    whole = data.rfind(b"\n") + 1
                    if whole < len(data):  # a line cut short by a crash: cut off, or the next one would join it
                        f.truncate(whole)
                for line in data[:whole].splitlines():
                    try:
                        row = json.loads(line)
                        results[row["custom_id"]] = row["result"]
                    except (ValueError, KeyError, TypeError):
                        continue
            except FileNotFoundError:
                pass
            try:
                state = json.loads((d / "state.json").read_text())
            except (OSError, ValueError):
                state = {}
            state = state if isinstance(state, dict) else {}
            state = {k: v for k, v in state.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
            found.append({**record, "results": results, "state": state})
        return sorted(found, key=lambda r: float(r["created_at"]))  # (a directory's mtime moves as it is written)


class BatchStore:
    """This server's batches, oldest first; each owner sees only its own. With a `journal`
    (a batches directory) they outlive the process."""

    def __init__(self, max_batches: int = DEFAULT_MAX_BATCHES, journal: BatchJournal | None = None,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self.max_batches = max_batches
        self.journal = journal
        #: OpenAI's files (files.py): batches' input, output and error files; beside the journal
        self.files = FileStore(journal.root / "files" if journal is not None else None, max_file_bytes)
        self._batches: OrderedDict[str, Batch] = OrderedDict()
        self._creating = asyncio.Lock()  # (see `create`)

    async def create(self, batch: Batch, context: RequestContext, n: int) -> None:
        """Check the tenant's room for `n` more batch requests (`check_room`; n 0: none), write
        `batch` to the journal and add it, as one step: the journal is written in a thread, and a
        batch created meanwhile would otherwise be checked against a count without this one."""
        async with self._creating:
            if n:
                self.check_room(context, n)
            if self.journal is not None:
                await asyncio.to_thread(self.journal.created, batch)
                if batch.ended_at is not None:  # (failed at once: its state is written too)
                    self.journal.state(batch)
            self.add(batch)

    def add(self, batch: Batch) -> None:
        self._batches[batch.id] = batch
        while len(self._batches) > self.max_batches:
            oldest = next((b for b in self._batches.values() if b.ended_at is not None), None)
            if oldest is None:
                break  # every batch is running: none is dropped
            self.delete(oldest)

    def restore(self, app: Any, context_of: Callable[[str | None], RequestContext | None]) -> int:
        """The journal's batches back in the store, those not ended running again from the
        requests that had not finished; how many. `context_of(api_key_id)`: what its requests run
        as now (None: the key is gone, and what had not run errs)."""
        if self.journal is None:
            return 0
        for record in self.journal.load():
            context = context_of(record.get("api_key_id"))
            # A gone key's batch still counts under the tenant that sent it (tierlm:batch_requests)
            tenant = record.get("tenant_id") if isinstance(record.get("tenant_id"), str) else None
            runs_as = (batch_context(context) if context is not None else
                       RequestContext(request_id="", api_key_id=record.get("api_key_id"), tenant_id=tenant))
            items = [BatchItem(cid, params, record["results"].get(cid)) for cid, params in record["requests"]]
            state = record["state"]
            kind = BATCH_KINDS.get(record.get("kind", "message_batch"))
            if kind is None:
                logger.warning("batches directory: skipping %s, a batch of unknown kind %r", record["id"],
                               record.get("kind"))
                continue
            batch = kind(record["id"], owner_of_key(record.get("api_key_id")), runs_as, items,
                         created_at=float(record["created_at"]), cancel_initiated_at=state.get("cancel_initiated_at"),
                         ended_at=state.get("ended_at"))
            batch.restored(record)
            self._batches[batch.id] = batch
            if batch.ended_at is not None:
                continue
            if context is None:
                for item in items:
                    if item.result is None:
                        batch.settle(item, batch.errored("authentication_error", "the API key that created this "
                                                                                 "batch is no longer in the server's "
                                                                                 "keys file"))
                        self.journal.finished(batch, item)
            if batch.cancel_initiated_at is not None:
                batch.halted.set()
            batch.task = asyncio.get_running_loop().create_task(run_batch(app, batch))
            logger.info("batch %s: going on after a restart (%d of %d requests had finished)", batch.id,
                        sum(i.result is not None for i in items), len(items))
        return len(self._batches)

    def get(self, owner: str, batch_id: str, kind: type[Batch] = MessageBatch, param: str = "message_batch_id") -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None or batch.owner != owner or not isinstance(batch, kind):
            raise NotFound(f"{kind.noun} '{batch_id}' not found. Batches are kept per API key, by the server that "
                           "took them (in memory, or in its --batches-dir), until deleted or the server needs the "
                           "room", param=param)
        return batch

    def owned(self, owner: str, kind: type[Batch] = MessageBatch) -> list[Batch]:
        """The owner's batches of `kind`, newest first."""
        return [b for b in reversed(self._batches.values()) if b.owner == owner and isinstance(b, kind)]

    def check_room(self, context: RequestContext, n: int) -> None:
        """A 429 if `n` more batch requests would put the tenant past its max_batch_requests
        (its batches' requests not yet finished, on this server)."""
        cap = context.max_batch_requests
        if cap is None or context.tenant_id is None:
            return
        queued = sum(1 for b in self._batches.values() if b.ended_at is None and b.context.tenant_id == context.tenant_id
                     for item in b.items if item.result is None)
        if queued + n > cap:
            raise RateLimited(f"tenant '{context.tenant_id}' has {queued:,} requests of batches not yet finished and "
                              f"this batch would add {n:,}; its tenants file allows {cap:,} at once "
                              "(max_batch_requests). Wait for its batches to finish, send a smaller batch, or cancel "
                              "one", retry_after=60)

    def cancel(self, batch: Batch) -> None:
        """Stop what has not started and abort what runs (nothing more if it is cancelling or has
        expired). A batch past its CANCELLABLE statuses (finalizing or ended) is a Conflict, as in
        both APIs: a cancel then would only relabel finished work."""
        if batch.status not in batch.CANCELLABLE:
            raise Conflict(f"{batch.noun} '{batch.id}' is {batch.status}: a batch can be cancelled only while "
                           f"its requests run ({', '.join(batch.CANCELLABLE)})")
        if batch.ended_at is None and not batch.halted.is_set():
            batch.cancel_initiated_at = time.time()
            batch.halted.set()
            if self.journal is not None:
                self.journal.state(batch)
            logger.info("batch %s: cancel asked", batch.id)

    def delete(self, batch: Batch) -> None:
        self._batches.pop(batch.id, None)
        if self.journal is not None:
            self.journal.deleted(batch)

    async def close(self) -> None:
        """Stop every batch still running (at shutdown: with a journal, the next start goes on
        with them; without one they are lost)."""
        tasks = [b.task for b in self._batches.values() if b.task is not None and not b.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.journal is not None:
            self.journal.close()


# ---- running a batch ------------------------------------------------------------------------


async def _call(app: Any, batch: Batch, body: bytes) -> tuple[int | None, bytes, str | None]:
    """POST `body` to the batch's route in `app`, in process, admitted as the batch's creator:
    (status, body, request id); status None if the batch's cancel or expiry aborted it (as a client
    leaving would); an answer the route gave meanwhile, an error too, is the request's result."""
    path = batch.path.encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": batch.path, "raw_path": path,
             "query_string": b"", "root_path": "", "client": ("batch", 0), "server": ("tierlm", 0),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *batch.headers],
             "state": {BATCH_CONTEXT: batch.context}}
    sent = False
    status: int | None = None
    request_id: str | None = None
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await batch.halted.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status, request_id
        if message["type"] == "http.response.start":
            status = message["status"]
            request_id = next((v.decode() for k, v in message.get("headers", ()) if k.lower() == b"request-id"), None)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    if batch.halted.is_set() and status in (None, ClientDisconnected.status):  # (not an answer the route gave)
        return None, b"", request_id
    return status, b"".join(chunks), request_id


def _stopping(app: Any) -> bool:
    state = getattr(app.state, "tierlm", None)
    return bool(getattr(state, "draining", False))


async def _run_item(app: Any, batch: Batch, item: BatchItem) -> dict[str, Any] | None:
    """The item's result; None if the server began stopping under it (it did not finish: with
    a batches directory, the next start runs it again)."""
    if item.params.get("stream") is True:
        return batch.errored("invalid_request_error",
                             f"{batch.body_name}.stream: a batch's requests cannot stream; leave stream out")
    try:
        body = json.dumps(item.params).encode()
    except (TypeError, ValueError) as e:  # (parsed from JSON: cannot happen, but never crash a batch)
        return batch.errored("invalid_request_error", f"{batch.body_name}: {e}")
    status, answer, request_id = await _call(app, batch, body)
    if status is None:
        return batch.unrun(batch.halt_reason)
    if status != 200 and _stopping(app):  # refused or aborted by the shutdown, not by its params
        return None
    try:
        data = json.loads(answer)
    except ValueError:
        data = None
    return batch.result_of(status, data, request_id)


async def run_batch(app: Any, batch: Batch) -> None:
    """Run every request of `batch`, BATCH_CONCURRENCY at a time, then mark it ended (counted in
    the app's metrics where it has them)."""
    pending = iter(batch.items)
    telemetry = getattr(app.state, "telemetry", None)
    metrics = telemetry.metrics if telemetry is not None else None
    if metrics is not None:
        metrics.batches_in_progress.inc()

    store = getattr(getattr(app.state, "tierlm", None), "batches", None)
    journal = store.journal if store is not None else None

    async def worker() -> None:
        for item in pending:
            if item.result is not None:  # (finished before a restart)
                continue
            if _stopping(app):
                return  # what has not started waits for the next start
            if time.time() >= batch.expires_at:
                batch.expire()
            if batch.halted.is_set():
                batch.settle(item, batch.unrun(batch.halt_reason))
            else:
                try:
                    result = await _run_item(app, batch, item)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a fault of ours: this request errs, the batch goes on
                    logger.exception("batch %s, request %s failed", batch.id, item.custom_id)
                    result = batch.errored("api_error", "internal error running this request; the cause is in "
                                                        "the server's log")
                if result is None:
                    return
                batch.settle(item, result)
            if journal is not None:
                journal.finished(batch, item)

    # At expiry the requests in the engine are aborted, waiting or running, not only those not yet sent
    expiry = asyncio.get_running_loop().call_later(max(0.0, batch.expires_at - time.time()), batch.expire)
    try:
        await asyncio.gather(*(worker() for _ in range(min(BATCH_CONCURRENCY, len(batch.items)))))
    except asyncio.CancelledError:  # the server is stopping: with a journal, the next start goes on
        if metrics is not None:
            metrics.batches_in_progress.dec()
        raise
    finally:
        expiry.cancel()
    if any(item.result is None for item in batch.items):  # stopped by the shutdown, likewise
        logger.info("batch %s: stopped with the server, %d of %d requests finished", batch.id,
                    sum(i.result is not None for i in batch.items), len(batch.items))
        if metrics is not None:
            metrics.batches_in_progress.dec()
        return
    stopped = False
    batch.finalizing_at = time.time()  # (before on_end runs: a cancel from now on is refused)
    if store is not None:
        # A server stopping meanwhile waits for this step: cut off, its files were written but the
        # batch not ended, and the next start made them again (two output files listed).
        ending = asyncio.ensure_future(batch.on_end(store))
        while not ending.done():
            try:
                await asyncio.shield(ending)
            except asyncio.CancelledError:
                stopped = True
            except Exception:
                break
        failure = ending.exception()
        if failure is not None:  # a fault of ours: the batch still ends (it must not stay unfinished for ever)
            logger.error("batch %s: finishing it failed; it ends without what that step makes", batch.id,
                         exc_info=failure)
    batch.ended_at = time.time()
    if journal is not None:
        journal.state(batch)
    counts = batch.result_counts()
    if metrics is not None:
        metrics.batches_in_progress.dec()
        for result, n in counts.items():
            if n:
                metrics.batch_requests.labels(batch.context.tenant_id or DEFAULT_TENANT, result).inc(n)
    logger.info("batch %s ended: %s", batch.id, ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if stopped:
        raise asyncio.CancelledError


# ---- routes ---------------------------------------------------------------------------------


def _state(request: Request) -> Any:
    return request.app.state.tierlm


def _owner(context: RequestContext) -> str:
    return owner_of_key(context.api_key_id)


def batch_context(context: RequestContext) -> RequestContext:
    """What a batch's requests run as: its creator, after every interactive request, with no
    time-to-first-token target."""
    return replace(context, priority=context.priority + BATCH_PRIORITY, ttft_target_s=None)


def owner_of_key(api_key_id: str | None) -> str:
    from tierlm.serving.openai_responses import owner_of  # (one rule for what a key may read back)
    return owner_of(RequestContext(request_id="", api_key_id=api_key_id))


def parse_batch(data: dict[str, Any]) -> list[BatchItem]:
    """The batch's requests, or a 400 naming the first thing wrong with its list."""
    extra = sorted(set(data) - {"requests"})
    if extra:
        raise InvalidRequest(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
    requests = data.get("requests")
    if not isinstance(requests, list) or not requests:
        raise InvalidRequest("requests: give a non-empty list of {custom_id, params} objects", param="requests")
    if len(requests) > MAX_BATCH_REQUESTS:
        raise InvalidRequest(f"requests: a batch holds at most {MAX_BATCH_REQUESTS:,} requests (got "
                             f"{len(requests):,}); split it", param="requests")
    items: list[BatchItem] = []
    seen: set[str] = set()
    for i, r in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(r, dict):
            raise InvalidRequest(f"{where}: must be an object with custom_id and params", param=where)
        extra = sorted(set(r) - {"custom_id", "params"})
        if extra:
            raise InvalidRequest(f"{where}.{extra[0]}: Extra inputs are not permitted", param=f"{where}.{extra[0]}")
        cid = r.get("custom_id")
        if not isinstance(cid, str) or not _CUSTOM_ID.match(cid):
            raise InvalidRequest(f"{where}.custom_id: must be 1-64 letters, digits, '-' or '_' (got {cid!r})",
                                 param=f"{where}.custom_id")
        if cid in seen:
            raise InvalidRequest(f"{where}.custom_id: '{cid}' is used twice; each request of a batch needs its "
                                 "own custom_id", param=f"{where}.custom_id")
        seen.add(cid)
        params = r.get("params")
        if not isinstance(params, dict):
            raise InvalidRequest(f"{where}.params: must be an object: a /v1/messages request body",
                                 param=f"{where}.params")
        items.append(BatchItem(cid, params))
    return items


@router.post("/v1/messages/batches")
async def create_batch(request: Request) -> Response:
    state = _state(request)
    context = state.identify(request)
    raw = await read_body(request, state.max_body_bytes, state.request_read_timeout)
    data = await asyncio.to_thread(parse_json_object, raw) if len(raw) > 1 << 20 else parse_json_object(raw)
    items = parse_batch(data)
    batch = MessageBatch("msgbatch_" + uuid.uuid4().hex[:24], _owner(context), batch_context(context), items)
    await state.batches.create(batch, context, len(items))
    batch.task = asyncio.get_running_loop().create_task(run_batch(request.app, batch))
    logger.info("message batch %s: %d requests (tenant %s)", batch.id, len(items), context.tenant_id)
    return JSONResponse(batch.describe())


@router.get("/v1/messages/batches")
async def list_batches(request: Request) -> Response:
    """The key's batches, newest first: `limit` (1-1000, 20) after `after_id` or before `before_id`."""
    state = _state(request)
    batches = cast(list[MessageBatch], state.batches.owned(_owner(state.identify(request))))
    query = request.query_params
    start, end, has_more = page([b.id for b in batches], limit_param(query.get("limit"), 20), query.get("after_id"),
                                query.get("before_id"), lambda param, bid: f"{param}: no batch '{bid}' of this key")
    found = [b.describe() for b in batches[start:end]]
    return JSONResponse({"data": found, "has_more": has_more, "first_id": found[0]["id"] if found else None,
                         "last_id": found[-1]["id"] if found else None})


def _batch(request: Request, batch_id: str) -> tuple[Any, MessageBatch]:
    """(the server's state, the caller's batch `batch_id`): a 404 for another key's."""
    state = _state(request)
    batch = state.batches.get(_owner(state.identify(request)), batch_id)
    assert isinstance(batch, MessageBatch)
    return state, batch


@router.get("/v1/messages/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    return JSONResponse(_batch(request, batch_id)[1].describe())


@router.post("/v1/messages/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    state, batch = _batch(request, batch_id)
    state.batches.cancel(batch)
    return JSONResponse(batch.describe())


def _ended(batch: MessageBatch, then: str) -> None:
    if batch.ended_at is None:
        raise InvalidRequest(f"message batch '{batch.id}' is still {batch.status}; {then}", param="message_batch_id")


@router.delete("/v1/messages/batches/{batch_id}")
async def delete_batch(request: Request, batch_id: str) -> Response:
    state, batch = _batch(request, batch_id)
    _ended(batch, "a batch can be deleted once it has ended: cancel it first")
    state.batches.delete(batch)
    return JSONResponse({"id": batch.id, "type": "message_batch_deleted"})


@router.get("/v1/messages/batches/{batch_id}/results")
async def batch_results(request: Request, batch_id: str) -> Response:
    _, batch = _batch(request, batch_id)
    _ended(batch, "its results come once it has ended (results_url is set then)")

    async def lines() -> AsyncIterator[bytes]:
        for item in batch.items:  # (a result the batches directory lost is `canceled`, as request_counts say)
            result = item.result if item.result is not None else batch.unrun("canceled")
            yield (json.dumps({"custom_id": item.custom_id, "result": result}, separators=(",", ":")) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-jsonl")
