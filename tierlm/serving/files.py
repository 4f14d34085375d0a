"""The Files APIs at /v1/files (upload, list, retrieve, delete, content): OpenAI's, as the `openai`
SDK's `client.files` calls it, and Anthropic's, as the `anthropic` SDK's `client.beta.files`
does (told apart by the anthropic-version header Anthropic's SDK always sends).

Why: OpenAI's Batch API (openai_batches.py) takes its requests as an uploaded JSONL file and
answers with output and error files; a client written for OpenAI uploads, creates the batch and
downloads the results through these routes, unchanged. Anthropic's lets a message name an
uploaded document instead of sending it again (anthropic.read_file_documents): a text file reads
as the same prompt as the text inline, so its cached prefix is shared.

Kept per API key, as stored responses and batches are (another key's file is not found), and per
API (ids file-... and file_...: each API sees its own). In memory, unless the server has a
batches directory (`--batches-dir DIR`): then each file is written to DIR/files as it is
uploaded or made, and a restarted server has them all. The files of one server hold at most
`max_bytes` (`--files-max-bytes`, default 1 GiB) in all; an upload past that is refused until
files are deleted. A file expires when its `expires_after` / `expires_in_seconds` says (OpenAI's
files for `batch` by default after 30 days, as OpenAI's), and is then gone.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import heapq
import json
import logging
import mimetypes
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tierlm.serving.errors import APIError, InvalidRequest, NotFound, RequestTooLarge
from tierlm.serving.paging import limit_param, page
from tierlm.serving.validation import read_body

logger = logging.getLogger("tierlm.serving")

router = APIRouter()

DEFAULT_MAX_FILE_BYTES = 1 << 30
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
ANTHROPIC_PREFIX = "file_"  # Anthropic's file ids; OpenAI's are file-...
ANTHROPIC_PURPOSE = "anthropic"  # (kept on Anthropic's uploads; its API has no purpose)
TEXT_MIME_TYPES = ("application/json", "application/x-ndjson", "application/xml", "application/x-yaml")
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
    mime_type: str = "application/octet-stream"

    @property
    def api(self) -> str:
        """Whose Files API made it: "anthropic" (ids file_...) or "openai" (file-...)."""
        return "anthropic" if self.id.startswith(ANTHROPIC_PREFIX) else "openai"

    def describe(self) -> dict[str, Any]:
        """OpenAI's File object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": self.expires_at, "status_details": None}

    def metadata(self) -> dict[str, Any]:
        """Anthropic's FileMetadata. Uploaded files are not downloadable, as in Anthropic's API."""
        return {"id": self.id, "type": "file", "filename": self.filename, "mime_type": self.mime_type,
                "size_bytes": self.bytes, "created_at": rfc3339(self.created_at), "downloadable": False,
                "expires_at": rfc3339(self.expires_at)}


def rfc3339(epoch: float | None) -> str | None:
    """A time as Anthropic's APIs write it (None stays None)."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class FileStore:
    """This server's files, oldest first; each owner sees only its own. With a `root` directory
    each is `ROOT/<id>` (the bytes) beside `ROOT/<id>.json` (the rest), and they outlive the
    process."""

    def __init__(self, root: str | Path | None = None, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self.root = Path(root) if root is not None else None
        self.max_bytes = max_bytes
        self._files: dict[str, StoredFile] = {}
        self._expiry: list[tuple[int, str]] = []  # (expires_at, id), a heap: what goes next is on top
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
        for meta in [*self.root.glob("file-*.json"), *self.root.glob(f"{ANTHROPIC_PREFIX}*.json")]:
            try:
                f = StoredFile(**json.loads(meta.read_text()))
                if (self.root / f.id).stat().st_size != f.bytes:
                    raise ValueError(f"holds {(self.root / f.id).stat().st_size} bytes, not {f.bytes}")
            except (OSError, ValueError, TypeError) as e:
                logger.warning("files directory %s: skipping %s (%s)", self.root, meta.name, e)
                continue
            found.append(f)
        for f in sorted(found, key=lambda f: (f.created_at, f.id)):
            self._keep(f)
            self.used += f.bytes

    async def add(self, owner: str, filename: str, purpose: str, data: bytes, ttl_s: int | None = None,
                  mime_type: str = "application/octet-stream", made_here: bool = False) -> StoredFile:
        """A new file (written through to disk where there is a root, on a worker thread):
        Anthropic's if `purpose` is ANTHROPIC_PURPOSE, else OpenAI's. An upload past `max_bytes` is
        a 413. A file the server made (`made_here`: a batch's results) is kept even past it, since
        losing finished answers would be worse (it counts, so uploads are refused until files are
        deleted), and in memory if the disk refuses it. The store's records change only on the
        event loop; the bytes are reserved first, so racing uploads cannot pass the cap."""
        f = self._reserve(owner, filename, purpose, data, ttl_s, mime_type, made_here)
        try:
            if self.root is not None:
                await asyncio.to_thread(self._persist, f, data, made_here)
            else:
                self._persist(f, data, made_here)
        except BaseException:
            self.used -= f.bytes
            raise
        self._keep(f)
        return f

    def _keep(self, f: StoredFile) -> None:
        self._files[f.id] = f
        if f.expires_at is not None:
            heapq.heappush(self._expiry, (f.expires_at, f.id))

    def _reserve(self, owner: str, filename: str, purpose: str, data: bytes, ttl_s: int | None, mime_type: str,
                 made_here: bool) -> StoredFile:
        """The new file's record, its bytes counted (a 413 past the cap, unless `made_here`)."""
        self._expire()
        if self.used + len(data) > self.max_bytes and not made_here:
            raise RequestTooLarge(f"this server's files hold {self.used:,} of {self.max_bytes:,} bytes, and this "
                                  f"one is {len(data):,}; delete files you no longer need (DELETE /v1/files/ID), "
                                  "or start the server with a larger --files-max-bytes")
        now = int(time.time())
        prefix = ANTHROPIC_PREFIX if purpose == ANTHROPIC_PURPOSE else "file-"
        self.used += len(data)
        return StoredFile(prefix + uuid.uuid4().hex[:24], owner, filename, purpose, len(data), now,
                          now + ttl_s if ttl_s is not None else None, mime_type)

    def _persist(self, f: StoredFile, data: bytes, made_here: bool) -> None:
        if self.root is None:
            self._data[f.id] = data
            return
        try:
            self._write(self.root / f.id, data)
            self._write(self.root / f"{f.id}.json", json.dumps(asdict(f)).encode())
        except OSError as e:
            if not made_here:
                raise APIError(f"cannot store the file: writing it to {self.root} failed ({e.strerror or e}); "
                               "the server's --batches-dir needs room and write access") from None
            logger.warning("files directory %s: cannot write %s (%s); it is kept in memory and lost at restart",
                           self.root, f.id, e.strerror or e)
            self._data[f.id] = data

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get(self, owner: str, file_id: str, param: str = "file_id", api: str | None = None) -> StoredFile:
        """The owner's file `file_id` (of `api`'s Files API, if given: the other's ids are not found)."""
        self._expire()
        f = self._files.get(file_id)
        if f is None or f.owner != owner or (api is not None and f.api != api):
            raise NotFound(f"file '{file_id}' not found. Files are kept per API key, by the server they were "
                           "uploaded to, until deleted or expired", param=param)
        return f

    def content(self, f: StoredFile) -> bytes:
        """The file's bytes (read from disk where it lives there: call off the event loop)."""
        if self.root is None or f.id in self._data:
            return self._data[f.id]
        return (self.root / f.id).read_bytes()

    def owned(self, owner: str, api: str, purpose: str | None = None) -> list[StoredFile]:
        """The owner's files of one API (and `purpose`), oldest first."""
        self._expire()
        return [f for f in self._files.values()
                if f.owner == owner and f.api == api and (purpose is None or f.purpose == purpose)]

    def delete(self, f: StoredFile) -> None:
        if self._files.pop(f.id, None) is None:
            return
        self.used -= f.bytes
        self._data.pop(f.id, None)
        self._drop_stale_expiries()
        if self.root is not None:
            for path in (self.root / f"{f.id}.json", self.root / f.id):  # (the record first: no record, no file)
                try:
                    path.unlink()
                except OSError:
                    pass

    def _drop_stale_expiries(self) -> None:
        """A deleted file's heap entry stays until its time (30 days for a batch input): a server
        uploading and deleting files held one per file it ever had. Rebuilt once the deleted
        outnumber the live, so the heap stays within twice the files kept."""
        if len(self._expiry) > 2 * len(self._files) + 16:
            self._expiry = [(at, i) for at, i in self._expiry if i in self._files]
            heapq.heapify(self._expiry)

    def _expire(self) -> None:
        """Delete the files whose time is up: only those (every lookup calls this)."""
        now = time.time()
        while self._expiry and self._expiry[0][0] <= now:
            _, file_id = heapq.heappop(self._expiry)
            f = self._files.get(file_id)
            if f is not None:  # (not deleted already)
                self.delete(f)


# ---- routes (each answers in the API its client speaks: Anthropic's SDK sends anthropic-version) --


def _files(request: Request) -> tuple[FileStore, str, str]:
    """(the server's files, the caller's owner key, "anthropic" or "openai")."""
    from tierlm.serving.batches import owner_of_key
    state = request.app.state.tierlm
    api = "anthropic" if "anthropic-version" in request.headers else "openai"
    return state.batches.files, owner_of_key(state.identify(request).api_key_id), api


async def _form(request: Request, body: bytes, fields: str) -> dict[str, Any]:
    """The multipart form of an upload: its fields, the file as an UploadFile."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequest(f"upload a file as multipart/form-data with {fields} (got content-type "
                             f"{request.headers.get('content-type')!r})", param="file")

    async def stream() -> AsyncIterator[bytes]:
        yield body

    try:
        form = await MultiPartParser(request.headers, stream(), max_files=1, max_fields=16,
                                     max_part_size=1 << 20).parse()
    except MultiPartException as e:
        raise InvalidRequest(f"the upload is not a readable multipart form ({e.message}); send {fields}",
                             param="file") from None
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
    return expiry_seconds(seconds, "expires_after.seconds", 30 * 24 * 3600, "30 days", form=True)


def expiry_seconds(value: Any, param: str, most: int, says: str, form: bool = False) -> int:
    """A lifetime in seconds, from 1 hour to `most`: a 400 naming `param` otherwise. `form`: the
    value is a form field's text; else it is JSON and must be an integer."""
    if form:
        try:
            ttl = int(value)
        except (TypeError, ValueError):
            ttl = 0
    else:
        ttl = value if isinstance(value, int) and not isinstance(value, bool) else 0
    if not 3600 <= ttl <= most:
        raise InvalidRequest(f"{param}: must be an integer from 3600 (1 hour) to {most} ({says}) (got {value!r})",
                             param=param)
    return ttl


def _mime_type(upload: UploadFile) -> str:
    """The part's own content type, else one guessed from its name."""
    given = (upload.content_type or "").split(";")[0].strip().lower()
    if given and given != "application/octet-stream":
        return given
    guessed, _ = mimetypes.guess_type(upload.filename or "")
    return guessed or "application/octet-stream"


@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    files, owner, api = _files(request)
    state = request.app.state.tierlm
    body = await read_body(request, state.max_body_bytes, state.request_read_timeout)
    fields = await _form(request, body, "the field 'file'" if api == "anthropic" else "the fields 'file' and 'purpose'")
    upload = fields.get("file")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("file: the form has no file; send it as the 'file' field", param="file")
    if api == "anthropic":
        purpose = ANTHROPIC_PURPOSE
        given = fields.get("expires_in_seconds")
        ttl = expiry_seconds(given, "expires_in_seconds", 7_776_000, "90 days", form=True) if given is not None else None
    else:
        purpose = fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(f"purpose: must be one of {', '.join(UPLOAD_PURPOSES)} (got {purpose!r})",
                                 param="purpose")
        ttl = _ttl(fields, purpose)
    data = await upload.read()
    await upload.close()
    name = (upload.filename or "").replace("\\", "/").rsplit("/", 1)[-1] or "upload"
    f = await files.add(owner, name, purpose, data, ttl, _mime_type(upload))
    logger.info("file %s: %d bytes for %s (%s)", f.id, f.bytes, purpose, f.filename)
    return JSONResponse(f.metadata() if api == "anthropic" else f.describe())


@router.get("/v1/files")
async def list_files(request: Request) -> Response:
    """The key's files, newest first. OpenAI: `purpose`, `order` (asc for oldest first), `limit`
    (1-10,000, all by default) after the file `after`. Anthropic: `limit` (1-1000, 20) and the
    cursor `page` (the `next_page` of the page before), or `after_id` / `before_id`."""
    files, owner, api = _files(request)
    query = request.query_params
    if api == "anthropic":
        found = list(reversed(files.owned(owner, api)))
        after = query.get("page") or query.get("after_id")
        start, end, has_more = page([f.id for f in found], limit_param(query.get("limit"), 20), after,
                                    query.get("before_id"), lambda param, fid: f"{param}: no file '{fid}' of this key")
        data = [f.metadata() for f in found[start:end]]
        return JSONResponse({"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None,
                             "next_page": data[-1]["id"] if data and has_more and query.get("before_id") is None
                             else None})
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: must be 'asc' or 'desc' (got {order!r})", param="order")
    found = files.owned(owner, api, query.get("purpose"))
    if order == "desc":
        found.reverse()
    limit = limit_param(query.get("limit"), 10_000, 10_000)
    start, end, has_more = page([f.id for f in found], limit, query.get("after"), None,
                                lambda param, fid: f"after: no file '{fid}' of this key", after_param="after")
    data = [f.describe() for f in found[start:end]]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": has_more})


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    files, owner, api = _files(request)
    f = files.get(owner, file_id, api=api)
    return JSONResponse(f.metadata() if api == "anthropic" else f.describe())


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    files, owner, api = _files(request)
    f = files.get(owner, file_id, api=api)
    files.delete(f)
    return JSONResponse({"id": f.id, "type": "file_deleted"} if api == "anthropic" else
                        {"id": f.id, "object": "file", "deleted": True})


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> Response:
    files, owner, api = _files(request)
    f = files.get(owner, file_id, api=api)
    if api == "anthropic":
        raise InvalidRequest(f"file '{file_id}' cannot be downloaded: files you upload are not downloadable (its "
                             "downloadable is false, as in Anthropic's API); use it in a message as a document "
                             "block's source", param="file_id")
    return Response(await read(files, f), media_type="application/octet-stream")


async def read(files: FileStore, f: StoredFile) -> bytes:
    """A file's bytes (a 404 if it was deleted meanwhile)."""
    try:
        return await asyncio.to_thread(files.content, f) if files.root is not None else files.content(f)
    except (OSError, KeyError):
        raise NotFound(f"file '{f.id}' not found: it was deleted", param="file_id") from None


async def file_text(files: FileStore, owner: str, file_id: str, where: str, api: str | None = None) -> str | None:
    """An uploaded file's text, for a message part naming it: a 400 naming `where` if the key
    has no such file (of `api`'s Files API, if given); None if it is not text: the model cannot
    read it."""
    try:
        f = files.get(owner, file_id, api=api)
    except NotFound:
        raise InvalidRequest(f"{where}: file '{file_id}' not found; upload it through the Files API (POST /v1/files) "
                             "with this API key first", param=where) from None
    return as_text(await read(files, f), f.mime_type)


async def part_text(files: FileStore, owner: str, file_id: str | None, file_data: str | None, filename: str | None,
                    where: str) -> str | None:
    """An OpenAI file part's text (chat's `file`, the Responses API's `input_file`): this key's
    upload `file_id`, or `file_data` inline; None if it is not text; a 400 naming `where` for a
    part that gives neither, a file that is not there or data that is not base64."""
    if file_id is not None:
        return await file_text(files, owner, file_id, f"{where}.file_id", api="openai")
    if file_data is not None:
        return inline_text(file_data, filename, f"{where}.file_data")
    raise InvalidRequest(f"{where}: give file_id (a file uploaded through /v1/files) or file_data (the file, "
                         "base64); file_url is not fetched", param=where)


def inline_text(data: str, filename: str | None, where: str) -> str | None:
    """A file sent inline (base64, or a data: URL naming its type) as text; None if it is not text;
    a 400 naming `where` if it is not base64."""
    mime = "application/octet-stream"
    if data.startswith("data:"):
        head, _, data = data.partition(",")
        mime = head[5:].split(";")[0] or mime
    elif filename:
        mime = mimetypes.guess_type(filename)[0] or mime
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: not base64; send the file's bytes base64-encoded (or as a data: URL)",
                             param=where) from None
    return as_text(raw, mime)


def as_text(data: bytes, mime_type: str) -> str | None:
    """`data` as text if it is a text file: a text type (text/*, JSON, XML, YAML) or an unknown
    one (application/octet-stream), and UTF-8. None for anything else (a PDF, an image)."""
    textual = mime_type.startswith("text/") or mime_type in TEXT_MIME_TYPES or mime_type == "application/octet-stream"
    if not textual:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
