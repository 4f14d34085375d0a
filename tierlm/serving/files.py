"""OpenAI's Files API: /v1/files (upload, list, retrieve, delete, content), as the official SDK's
`client.files` calls it.

Why: OpenAI's Batch API (openai_batches.py) takes its requests as an uploaded JSONL file and
answers with output and error files; a client written for OpenAI uploads, creates the batch and
downloads the results through these routes, unchanged.

Kept per API key, as stored responses and batches are (another key's file is not found). In
memory, unless the server has a batches directory (`--batches-dir DIR`): then each file is
written to DIR/files as it is uploaded or made, and a restarted server has them all. The files
of one server hold at most `max_bytes` (`--files-max-bytes`, default 1 GiB) in all; an upload past
that is refused until files are deleted. A file expires when its `expires_after` says (files for
`batch` by default after 30 days, as OpenAI's), and is then gone.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.errors import InvalidRequest, NotFound, RequestTooLarge
from tierlm.serving.paging import limit_param, page
from tierlm.serving.validation import read_body

logger = logging.getLogger("tierlm.serving")

router = APIRouter()

DEFAULT_MAX_FILE_BYTES = 1 << 30
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
BATCH_FILE_TTL_S = 30 * 24 * 3600  # OpenAI's default for purpose=batch


@dataclass
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    expires_at: int | None = None

    def describe(self) -> dict[str, Any]:
        """The File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}


class FileStore:
    """This server's files, oldest first; each owner sees only its own. With a `root` directory
    each is `ROOT/<id>` (the bytes) beside `ROOT/<id>.json` (the rest), and they outlive the
    process."""

    def __init__(self, root: str | Path | None = None, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self.root = Path(root) if root is not None else None
        self.max_bytes = max_bytes
        self._files: dict[str, StoredFile] = {}
        self._data: dict[str, bytes] = {}  # in memory (no root)
        self.used = 0
        if self.root is not None:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"files directory {self.root}: cannot use it ({e.strerror or e}); give a writable "
                                 "--batches-dir") from None
            self._load()

    def _load(self) -> None:
        assert self.root is not None
        found = []
        for meta in self.root.glob("file-*.json"):
            try:
                f = StoredFile(**json.loads(meta.read_text()))
                if (self.root / f.id).stat().st_size != f.bytes:
                    raise ValueError(f"holds {(self.root / f.id).stat().st_size} bytes, not {f.bytes}")
            except (OSError, ValueError, TypeError) as e:
                logger.warning("files directory %s: skipping %s (%s)", self.root, meta.name, e)
                continue
            found.append(f)
        for f in sorted(found, key=lambda f: (f.created_at, f.id)):
            self._files[f.id] = f
            self.used += f.bytes

    def add(self, owner: str, filename: str, purpose: str, data: bytes, ttl_s: int | None = None) -> StoredFile:
        """A new file (written through to disk where there is a root). A 413 if the store would
        pass its `max_bytes`."""
        self._expire()
        if self.used + len(data) > self.max_bytes:
            raise RequestTooLarge(f"this server's files hold {self.used:,} of {self.max_bytes:,} bytes, and this "
                                  f"one is {len(data):,}; delete files you no longer need (DELETE /v1/files/ID), "
                                  "or start the server with a larger --files-max-bytes")
        now = int(time.time())
        f = StoredFile("file-" + uuid.uuid4().hex[:24], owner, filename, purpose, len(data), now,
                       now + ttl_s if ttl_s is not None else None)
        if self.root is None:
            self._data[f.id] = data
        else:
            self._write(self.root / f.id, data)
            self._write(self.root / f"{f.id}.json", json.dumps(asdict(f)).encode())
        self._files[f.id] = f
        self.used += f.bytes
        return f

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)

    def get(self, owner: str, file_id: str, param: str = "file_id") -> StoredFile:
        self._expire()
        f = self._files.get(file_id)
        if f is None or f.owner != owner:
            raise NotFound(f"file '{file_id}' not found. Files are kept per API key, by the server they were "
                           "uploaded to, until deleted or expired", param=param)
        return f

    def content(self, f: StoredFile) -> bytes:
        """The file's bytes (read from disk where it lives there: call off the event loop)."""
        if self.root is None:
            return self._data[f.id]
        return (self.root / f.id).read_bytes()

    def owned(self, owner: str, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files (of `purpose`), oldest first."""
        self._expire()
        return [f for f in self._files.values() if f.owner == owner and (purpose is None or f.purpose == purpose)]

    def delete(self, f: StoredFile) -> None:
        if self._files.pop(f.id, None) is None:
            return
        self.used -= f.bytes
        self._data.pop(f.id, None)
        if self.root is not None:
            for path in (self.root / f"{f.id}.json", self.root / f.id):  # (the record first: no record, no file)
                try:
                    path.unlink()
                except OSError:
                    pass

    def _expire(self) -> None:
        now = time.time()
        for f in [f for f in self._files.values() if f.expires_at is not None and f.expires_at <= now]:
            self.delete(f)


# ---- routes ---------------------------------------------------------------------------------


def _files(request: Request) -> tuple[FileStore, str]:
    """(the server's files, the caller's owner key)."""
    from tierlm.serving.batches import owner_of_key
    if "anthropic-version" in request.headers:  # (Anthropic's SDK: its Files API has another shape)
        raise NotFound(f"no such route: {request.method} {request.url.path} (this server's /v1/files is OpenAI's "
                       "Files API; Anthropic's Files API is not served)")
    state = request.app.state.tierlm
    return state.batches.files, owner_of_key(state.identify(request).api_key_id)


async def _form(request: Request, body: bytes) -> dict[str, Any]:
    """The multipart form of an upload: its fields, the file as an UploadFile."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest("upload a file as multipart/form-data with the fields 'file' and 'purpose' (got "
                             f"content-type {request.headers.get('content-type')!r})", param="file")

    async def stream() -> AsyncIterator[bytes]:
        yield body

    try:
        form = await MultiPartParser(request.headers, stream(), max_files=1, max_fields=16,
                                     max_part_size=1 << 20).parse()
    except MultiPartException as e:
        raise InvalidRequest(f"the upload is not a readable multipart form ({e.message}); send the fields 'file' "
                             "and 'purpose'", param="file") from None
    return dict(form.multi_items())


def _ttl(fields: dict[str, Any], purpose: str) -> int | None:
    """Seconds to keep the file: `expires_after[seconds]` (anchored at created_at), else OpenAI's
    default for the purpose."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return BATCH_FILE_TTL_S if purpose == "batch" else None
    if anchor != "created_at":
        raise InvalidRequest(f"expires_after.anchor: must be 'created_at' (got {anchor!r})",
                             param="expires_after.anchor")
    try:
        ttl = int(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        ttl = 0
    if not 3600 <= ttl <= 30 * 24 * 3600:
        raise InvalidRequest(f"expires_after.seconds: must be an integer from 3600 (1 hour) to 2592000 (30 days) "
                             f"(got {seconds!r})", param="expires_after.seconds")
    return ttl


@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    files, owner = _files(request)
    state = request.app.state.tierlm
    body = await read_body(request, state.max_body_bytes, state.request_read_timeout)
    fields = await _form(request, body)
    upload, purpose = fields.get("file"), fields.get("purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("file: the form has no file; send it as the 'file' field", param="file")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequest(f"purpose: must be one of {', '.join(UPLOAD_PURPOSES)} (got {purpose!r})",
                             param="purpose")
    ttl = _ttl(fields, purpose)
    data = await upload.read()
    await upload.close()
    f = await asyncio.to_thread(files.add, owner, upload.filename or "upload", purpose, data, ttl) \
        if files.root is not None else files.add(owner, upload.filename or "upload", purpose, data, ttl)
    logger.info("file %s: %d bytes for %s (%s)", f.id, f.bytes, purpose, f.filename)
    return JSONResponse(f.describe())


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    """The key's files: `purpose`, `order` (desc: newest first, the default; asc), `limit`
    (1-10,000, all by default) after the file `after`."""
    files, owner = _files(request)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: must be 'asc' or 'desc' (got {order!r})", param="order")
    found = files.owned(owner, query.get("purpose"))
    if order == "desc":
        found.reverse()
    limit = limit_param(query.get("limit"), 10_000, 10_000)
    start, end, has_more = page([f.id for f in found], limit, query.get("after"), None,
                                lambda param, fid: f"after: no file '{fid}' of this key")
    data = [f.describe() for f in found[start:end]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    files, owner = _files(request)
    return JSONResponse(files.get(owner, file_id).describe())


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    files, owner = _files(request)
    f = files.get(owner, file_id)
    files.delete(f)
    return JSONResponse({"id": f.id, "object": "file", "deleted": True})


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    files, owner = _files(request)
    f = files.get(owner, file_id)
    try:
        data = await asyncio.to_thread(files.content, f) if files.root is not None else files.content(f)
    except (OSError, KeyError):  # deleted meanwhile
        raise NotFound(f"file '{file_id}' not found: it was deleted", param="file_id") from None
    return Response(data, media_type="application/octet-stream")
