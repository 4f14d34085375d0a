"""OpenAI's Batch API: /v1/batches (create, list, retrieve, cancel), as the official SDK's
`client.batches` calls it, with the requests in a file uploaded through /v1/files and the
answers in output and error files made when the batch ends.

Why: the same as Anthropic's message batches (batches.py), for OpenAI clients: work that can
wait runs behind every interactive request, at its tenant's priority lowered by BATCH_PRIORITY,
outside the tenant's request-rate and concurrency limits, and no SLA guard sheds it. It shares
their machinery: each request runs in process through this server's own route
(/v1/chat/completions, /v1/completions, /v1/responses or /v1/embeddings), as its creator; batches are kept per
API key, and with `--batches-dir` written as they run and taken up again after a restart.

As in OpenAI's API, the input file is checked when the batch is created: a line that is not a
JSON object with a unique `custom_id`, `method` POST, the batch's `url` and a `body` object
makes the batch `failed`, with every such line in `errors` (up to MAX_REPORTED_ERRORS). A
request's body is checked when it runs. Each request's answer goes to the output file (2xx) or
the error file (every other status, and requests cancelled or expired before they finished), one
JSON line each in the input's order: {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.batches import (BATCH_KINDS, MAX_BATCH_REQUESTS, Batch, BatchItem, BatchStore,
                                    batch_context, owner_of_key, run_batch)
from tierlm.serving.errors import InvalidRequest
from tierlm.serving.files import expiry_seconds, read
from tierlm.serving.protocol_responses import metadata_problem
from tierlm.serving.paging import limit_param, page
from tierlm.serving.validation import parse_json_object, read_body

logger = logging.getLogger("tierlm.serving")

router = APIRouter()

# What this server can run in a batch
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
             "/v1/score", "/v1/rerank")  # (the last two vLLM's, which its batch runner takes too)
MAX_REPORTED_ERRORS = 100
_STATUS_OF_ERROR = {"invalid_request_error": 400, "authentication_error": 401, "api_error": 500}


@dataclass
class OpenAIBatch(Batch):
    """OpenAI's batch: the requests of an uploaded JSONL file, to one endpoint."""

    endpoint: str = "/v1/chat/completions"
    input_file_id: str = ""
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_ttl_s: int | None = None  # output_expires_after: its files' lifetime (None: kept until deleted)
    errors: list[dict[str, Any]] = field(default_factory=list)  # the input file's faults: the batch failed
    output_file_id: str | None = None
    error_file_id: str | None = None
    _usage: dict[str, Any] | None = None

    kind = "openai_batch"
    body_name = "body"
    CANCELLABLE = ("validating", "in_progress", "cancelling")  # OpenAI's: not once finalizing

    @property  # type: ignore[override]
    def path(self) -> str:
        return self.endpoint

    # -- results ---------------------------------------------------------------------------
    def result_of(self, status: int, data: Any, request_id: str | None) -> dict[str, Any]:
        if not isinstance(data, dict):
            return self.errored("api_error", f"the request ended with HTTP {status} and no JSON body")
        return {"id": _request_id(), "response": {"status_code": status, "request_id": request_id, "body": data},
                "error": None}

    def errored(self, kind: str, message: str) -> dict[str, Any]:
        return {"id": _request_id(), "error": None,
                "response": {"status_code": _STATUS_OF_ERROR.get(kind, 500), "request_id": None,
                             "body": {"error": {"message": message, "type": kind, "param": None, "code": None}}}}

    def unrun(self, why: str) -> dict[str, Any]:
        message = ("the batch was cancelled before this request ran" if why == "canceled" else
                   "this request did not finish before the batch's completion window ended")
        return {"id": _request_id(), "response": None,
                "error": {"code": "batch_cancelled" if why == "canceled" else "batch_expired", "message": message}}

    def outcome(self, result: dict[str, Any]) -> str:
        return _outcome(result)

    # -- the journal -----------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "input_file_id": self.input_file_id, "metadata": self.metadata,
                "completion_window": self.completion_window, "errors": self.errors, "output_ttl_s": self.output_ttl_s}

    def restored(self, record: dict[str, Any]) -> None:
        self.endpoint = record.get("endpoint") if record.get("endpoint") in ENDPOINTS else ENDPOINTS[0]
        self.input_file_id = str(record.get("input_file_id", ""))
        self.metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else None
        self.errors = record.get("errors") if isinstance(record.get("errors"), list) else []
        ttl = record.get("output_ttl_s")
        self.output_ttl_s = ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else None
        state = record["state"]
        self.finalizing_at = state.get("finalizing_at")
        self.output_file_id = state.get("output_file_id")
        self.error_file_id = state.get("error_file_id")

    def state(self) -> dict[str, Any]:
        return {**super().state(), "finalizing_at": self.finalizing_at, "output_file_id": self.output_file_id,
                "error_file_id": self.error_file_id}

    async def on_end(self, store: BatchStore) -> None:
        """The output and error files, each made only when it has a line."""
        out: list[bytes] = []
        err: list[bytes] = []
        for item in self.items:
            r = item.result or self.unrun("canceled")
            line = json.dumps({"id": r["id"], "custom_id": item.custom_id, "response": r.get("response"),
                               "error": r.get("error")}, separators=(",", ":")).encode() + b"\n"
            (out if _outcome(r) == "succeeded" else err).append(line)
        for lines, name, attr in ((out, "output", "output_file_id"), (err, "error", "error_file_id")):
            if lines:
                f = await store.files.add(self.owner, f"{self.id}_{name}.jsonl", "batch_output", b"".join(lines),
                                                self.output_ttl_s, mime_type="application/jsonl", made_here=True)
                setattr(self, attr, f.id)

    # -- the Batch object ------------------------------------------------------------------
    @property
    def status(self) -> str:
        if self.errors:
            return "failed"
        if self.ended_at is None:
            if self.finalizing_at is not None:
                return "finalizing"
            return "cancelling" if self.cancel_initiated_at is not None else "in_progress"
        if self.cancel_initiated_at is not None:
            return "cancelled"
        return "expired" if self._done.get("expired") else "completed"

    @property
    def usage(self) -> dict[str, Any] | None:
        """Tokens of the requests that succeeded, once the batch has ended."""
        if self.ended_at is None or self.errors:
            return None
        if self._usage is None:
            inp = out = cached = reasoning = 0
            for item in self.items:
                r = item.result
                u = r["response"]["body"].get("usage") if r and _outcome(r) == "succeeded" else None
                if isinstance(u, dict):
                    # (vLLM's rerank answers with total_tokens alone: its tokens are all input)
                    answered = int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0)
                    read = u.get("prompt_tokens", u.get("input_tokens", int(u.get("total_tokens", 0) or 0) - answered))
                    inp += int(read or 0)
                    out += answered
                    details = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
                    cached += int(details.get("cached_tokens", 0) or 0) if isinstance(details, dict) else 0
                    details = u.get("completion_tokens_details") or u.get("output_tokens_details") or {}
                    reasoning += int(details.get("reasoning_tokens", 0) or 0) if isinstance(details, dict) else 0
            self._usage = {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached},
                           "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning},
                           "total_tokens": inp + out}
        return self._usage

    def describe(self) -> dict[str, Any]:
        """The Batch object. Request counts are live: `completed` (2xx answers) and `failed`
        (every other finished request) of `total`."""
        counts = self.result_counts()
        status = self.status
        ended = int(self.ended_at) if self.ended_at is not None else None
        model = next((i.params.get("model") for i in self.items if isinstance(i.params.get("model"), str)), None)
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "model": model,
                "errors": {"object": "list", "data": self.errors} if self.errors else None,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": int(self.created_at),
                "in_progress_at": int(self.created_at) if not self.errors else None,
                "expires_at": int(self.expires_at),
                "finalizing_at": int(self.finalizing_at) if self.finalizing_at is not None else None,
                "completed_at": ended if status == "completed" else None,
                "failed_at": ended if status == "failed" else None,
                "expired_at": ended if status == "expired" else None,
                "cancelling_at": int(self.cancel_initiated_at) if self.cancel_initiated_at is not None else None,
                "cancelled_at": ended if status == "cancelled" else None,
                "request_counts": {"total": len(self.items), "completed": counts["succeeded"],
                                   "failed": counts["errored"] + counts["canceled"] + counts["expired"]},
                "usage": self.usage, "metadata": self.metadata}


BATCH_KINDS[OpenAIBatch.kind] = OpenAIBatch


def _request_id() -> str:
    return "batch_req_" + uuid.uuid4().hex[:24]


def _outcome(result: dict[str, Any]) -> str:
    """succeeded (a 2xx answer), errored (any other answer), canceled or expired."""
    response = result.get("response")
    if response is None:
        return "expired" if (result.get("error") or {}).get("code") == "batch_expired" else "canceled"
    return "succeeded" if 200 <= int(response.get("status_code", 500)) < 300 else "errored"


# ---- the input file -------------------------------------------------------------------------


def parse_input(data: bytes, endpoint: str) -> tuple[list[BatchItem], list[dict[str, Any]]]:
    """(the file's requests, its faults as OpenAI's batch errors: code, message, param, line)."""
    items: list[BatchItem] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def fault(code: str, message: str, line: int | None, param: str | None = None) -> None:
        errors.append({"code": code, "message": message, "param": param, "line": line})

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        fault("invalid_file", f"the input file is not UTF-8 text (byte {e.start}); upload JSONL", None)
        return [], errors
    # Lines end at "\n" (and "\r\n") only: str.splitlines also breaks at U+2028, U+2029, U+0085 and
    # others, which JSON allows raw inside strings (json.dumps(..., ensure_ascii=False) writes them).
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        fault("empty_file", "the input file has no requests; give one JSON object per line", None)
    if len(lines) > MAX_BATCH_REQUESTS:
        fault("too_many_requests", f"the input file has {len(lines):,} requests; a batch holds at most "
                                   f"{MAX_BATCH_REQUESTS:,}: split it", None)
        return [], errors
    for n, line in lines:
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
        try:
            row = json.loads(line)
        except ValueError as e:
            fault("invalid_json_line", f"line {n} is not valid JSON ({e})", n)
            continue
        if not isinstance(row, dict):
            fault("invalid_json_line", f"line {n} must be a JSON object with custom_id, method, url and body", n)
            continue
        cid, method, url, body = row.get("custom_id"), row.get("method"), row.get("url"), row.get("body")
        if not isinstance(cid, str) or not cid:  # OpenAI's rule: any string, unique in the batch
            fault("invalid_custom_id", f"line {n}: custom_id must be a non-empty string (got {cid!r})", n, "custom_id")
        elif cid in seen:
            fault("duplicate_custom_id", f"line {n}: custom_id '{cid}' is used twice; each request needs its own",
                  n, "custom_id")
        elif method != "POST":
            fault("invalid_method", f"line {n}: method must be 'POST' (got {method!r})", n, "method")
        elif url != endpoint:
            fault("mismatched_endpoint", f"line {n}: url {url!r} is not the batch's endpoint {endpoint!r}; a batch's "
                                         "requests all go to one endpoint", n, "url")
        elif not isinstance(body, dict):
            fault("invalid_body", f"line {n}: body must be a JSON object: the request to {endpoint}", n, "body")
        else:
            seen.add(cid)
            items.append(BatchItem(cid, body))
    return items, errors


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidRequest("metadata: must be an object of string keys and string values", param="metadata")
    if (problem := metadata_problem(value)) is not None:
        raise InvalidRequest(f"metadata: {problem}", param="metadata")
    return value


def _output_ttl(value: Any) -> int | None:
    """output_expires_after ({"anchor": "created_at", "seconds": 3600 to 2592000}): how long the
    output and error files are kept from when they are made."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("anchor") != "created_at" or set(value) - {"anchor", "seconds"}:
        raise InvalidRequest("output_expires_after: give {\"anchor\": \"created_at\", \"seconds\": N}",
                             param="output_expires_after")
    return expiry_seconds(value.get("seconds"), "output_expires_after.seconds", 2_592_000, "30 days")


# ---- routes ---------------------------------------------------------------------------------


@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    state = request.app.state.tierlm
    context = state.identify(request)
    owner = owner_of_key(context.api_key_id)
    data = parse_json_object(await read_body(request, state.max_body_bytes, state.request_read_timeout))
    extra = sorted(set(data) - {"input_file_id", "endpoint", "completion_window", "metadata",
                                "output_expires_after"})
    if extra:
        raise InvalidRequest(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
    endpoint = data.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(f"endpoint: this server runs batches of {', '.join(ENDPOINTS)} (got {endpoint!r})",
                             param="endpoint")
    if data.get("completion_window") != "24h":
        raise InvalidRequest(f"completion_window: must be '24h' (got {data.get('completion_window')!r})",
                             param="completion_window")
    metadata = _metadata(data.get("metadata"))
    output_ttl = _output_ttl(data.get("output_expires_after"))
    file_id = data.get("input_file_id")
    if not isinstance(file_id, str):
        raise InvalidRequest("input_file_id: give the id of a file uploaded with purpose 'batch'",
                             param="input_file_id")
    files = state.batches.files
    f = files.get(owner, file_id, param="input_file_id", api="openai")
    if f.purpose != "batch":
        raise InvalidRequest(f"input_file_id: file '{file_id}' was uploaded for '{f.purpose}'; upload the requests "
                             "with purpose 'batch'", param="input_file_id")
    content = await read(files, f)
    items, errors = await asyncio.to_thread(parse_input, content, endpoint)
    batch = OpenAIBatch("batch_" + uuid.uuid4().hex[:24], owner, batch_context(context), items if not errors else [],
                        endpoint=endpoint, input_file_id=file_id, metadata=metadata, output_ttl_s=output_ttl,
                        errors=errors)
    if errors:
        batch.ended_at = batch.created_at
    await state.batches.create(batch, context, 0 if errors else len(items))
    if errors:
        logger.info("batch %s failed: its input file %s has %d fault(s), the first: %s", batch.id, file_id,
                    len(errors), errors[0]["message"])
    else:
        batch.task = asyncio.get_running_loop().create_task(run_batch(request.app, batch))
        logger.info("batch %s: %d requests to %s (tenant %s)", batch.id, len(items), endpoint, context.tenant_id)
    return JSONResponse(batch.describe())


@router.get("/v1/batches")
async def list_batches(request: Request) -> Response:
    """The key's batches, newest first: `limit` (1-100, 20) after the batch `after`."""
    state = request.app.state.tierlm
    batches = cast(list[OpenAIBatch], state.batches.owned(owner_of_key(state.identify(request).api_key_id),
                                                          OpenAIBatch))
    query = request.query_params
    start, end, has_more = page([b.id for b in batches], limit_param(query.get("limit"), 20, 100), query.get("after"),
                                None, lambda param, bid: f"after: no batch '{bid}' of this key", after_param="after")
    found = [b.describe() for b in batches[start:end]]
    return JSONResponse({"object": "list", "data": found, "first_id": found[0]["id"] if found else None,
                         "last_id": found[-1]["id"] if found else None, "has_more": has_more})


def _batch(request: Request, batch_id: str) -> tuple[Any, OpenAIBatch]:
    state = request.app.state.tierlm
    batch = state.batches.get(owner_of_key(state.identify(request).api_key_id), batch_id, OpenAIBatch, "batch_id")
    return state, cast(OpenAIBatch, batch)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    return JSONResponse(_batch(request, batch_id)[1].describe())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    state, batch = _batch(request, batch_id)
    state.batches.cancel(batch)
    return JSONResponse(batch.describe())
