"""Turning raw request bodies into pydantic models, with 400s that name the field.

Bodies are read and parsed here rather than by FastAPI so that every failure mode (too big,
not JSON, not an object, wrong types) ends up as one of our error shapes with a message that
points at the exact JSON path, e.g. `messages.0.content: must not be empty`.
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from tierlm.serving.client_waits import client_wait, waits_of
from tierlm.serving.errors import ClientDisconnected, InvalidRequest, Overloaded, RequestTimeout, RequestTooLarge

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # Anthropic's own Messages API limit
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a request's head, and for each gap in its body

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `limit` bytes, and (408,
    closing the connection) if no part of it arrives for `timeout` seconds: a client that sends
    less than its Content-Length and waits would otherwise hold the request for ever. A gap, not
    the whole upload: a slow but steady one (a large image over an ordinary uplink) is served.

    The Content-Length header is checked first so a huge upload is refused without reading
    it; chunked bodies are counted as they arrive.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequest(f"invalid content-length header: {declared!r}") from None
        if size > limit:
            raise _too_large(size, limit)
    chunks: list[bytes] = []
    received = 0
    parts = request.stream().__aiter__()
    waits = waits_of(request.scope)  # a shutdown cuts these waits short (client_waits.py)
    try:
        while True:
            with client_wait(waits, timeout) as deadline:
                try:
                    chunk = await parts.__anext__()
                except StopAsyncIteration:
                    break
            if deadline.cancelled_caught and waits is not None and waits.cut_short:
                raise Overloaded(f"the server is shutting down and the request body was still arriving ({received} "
                                 "bytes received); send the request again (to another replica)",
                                 headers={"connection": "close"})
            if deadline.cancelled_caught:
                expected = f"{declared} declared" if declared is not None else "a chunked body"
                raise RequestTimeout(
                    f"no part of the request body arrived for {timeout:g} s ({received} bytes received of "
                    f"{expected}); send the rest of the body (or start the server with a larger "
                    "--request-read-timeout)",
                    headers={"connection": "close"},
                )
            received += len(chunk)
            if received > limit:
                raise _too_large(received, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientDisconnected("client disconnected while sending the request body") from None
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"request body is {size} bytes, over this server's limit of {limit} bytes; "
        "send a shorter request (or start the server with a larger --max-body-bytes)"
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: Python reads it as inf, which a prompt shows as Infinity
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def loads_strict(text: str) -> Any:
    """JSON as the standard has it: no NaN or Infinity, spelled out or overflowing (1e400)."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN/Infinity), and the top level must be an object."""
    if not body.strip():
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("request body is not valid UTF-8") from None
    try:
        data = loads_strict(text)
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own limit, worded for Python programmers
            raise InvalidRequest(f"request body holds a number with too many digits (limit "
                                 f"{sys.get_int_max_str_digits()}); send a smaller number") from None
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"request body must be a JSON object, got {_json_type(data)}"
        )
    if _SURROGATE_ESCAPE.search(body):  # no \uD800-\uDFFF escape, no lone surrogate: skip the walk
        _refuse_lone_surrogates(data)
    return data


# A lone surrogate can only come from a JSON escape (strict UTF-8 cannot carry one: the decode
# above refuses it); an escaped pair decodes to one character and passes.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _refuse_lone_surrogates(data: dict[str, Any]) -> None:
    """A 400 naming the first string (key or value) holding a lone UTF-16 surrogate: tokenizers,
    stop-string matching and UTF-8 encoding downstream all fail on one."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:  # iterative: the body may be nested as deep as json.loads allows
        path, value = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, f"the string at {path or '<body>'}", path)
        elif isinstance(value, (dict, list)):
            for key, child in value.items() if isinstance(value, dict) else enumerate(value):
                if isinstance(key, str):
                    _check_unicode(key, f"a key in {path or 'the body'}", path)
                stack.append((f"{path}.{key}" if path else str(key), child))


def _check_unicode(text: str, what: str, path: str) -> None:
    found = None if text.isascii() else _SURROGATE.search(text)
    if found:
        raise InvalidRequest(
            f"invalid JSON body: {what} holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}); "
            "send valid Unicode text",
            param=path or None,
        )


def validate_body(model: type[M], data: dict[str, Any]) -> M:
    """Validate parsed JSON against `model` (strict types: "5" is not an integer)."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error_to_api(exc, data) from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None


# Bodies this large are parsed and validated in a worker thread: a 30 MB prompt takes ~0.4 s to
# parse, long enough to stall every other request if done on the event loop. The thread still
# holds the GIL while json.loads runs (1.3 s for 31 MB of a million small objects), so the event
# loop waits that long; validation, which took 7-15 s for a million content blocks, is spared
# such bodies by the count before it (`first_part_past`).
PARSE_OFF_LOOP_BYTES = 1 << 20


async def parse_request(request: Request, model: type[M], limit: int,
                        on_json: Callable[[dict], None] | None = None, timeout: float | None = None) -> M:
    """The body as `model`; `on_json` sees the decoded object before it is validated (telemetry
    reads its "model" there, so a request refused for a bad field still counts under it).
    `timeout`: seconds the body may take to arrive (`read_body`)."""
    body = await read_body(request, limit, timeout)
    if len(body) >= PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(_parse_body, model, body, on_json)
    return _parse_body(model, body, on_json)


def _parse_body(model: type[M], body: bytes, on_json: Callable[[dict], None] | None = None) -> M:
    data = parse_json_object(body)
    if on_json is not None:
        on_json(data)
    return validate_body(model, data)


def first_part_past(data: dict[str, Any], limit: int, items: str = "messages") -> tuple[str, int] | None:
    """Where the count of tools, messages and content blocks (system blocks, blocks, tool calls,
    blocks in a tool result or a document, at any depth) first passes `limit`, and the count
    there; None if it never does. `items` names the body's list of messages: "input" for the
    Responses API's items (elsewhere an `input` is something else: an embeddings batch, whose
    items are whole prompts, not parts of one). Read from the raw JSON before it is validated: each renders to
    a token at least, and validating a million one-letter blocks held the GIL for 7-15 s,
    stalling every other client."""
    total = 0
    tools = data.get("tools")  # rendered into the prompt, a token each at least (700,000 took 36 s)
    if isinstance(tools, list):
        total += len(tools)
        if total > limit:
            return "tools", total
    system = data.get("system")
    if isinstance(system, list):
        total += len(system)
        if total > limit:
            return "system", total
    messages = data.get(items)
    if not isinstance(messages, list):
        return None
    total += len(messages)
    if total > limit:
        return items, total
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for field in ("content", "tool_calls", "output", "summary"):
            parts = message.get(field)
            if not isinstance(parts, list):
                continue
            total += len(parts)
            if total > limit:
                return f"{items}.{i}.{field}", total
            for where, nested in _inner_lists(parts, f"{items}.{i}.{field}"):
                total += len(nested)
                if total > limit:
                    return where, total
    return None


_HOLDERS = ("tool_result", "search_result", "document")  # block types that hold blocks


def _inner_lists(parts: list[Any], path: str) -> Iterator[tuple[str, list[Any]]]:
    """The lists of blocks inside content blocks, at any depth and in document order, with their
    JSON paths: a tool result's or a search result's content, a document's source.content, and
    those inside them (a document in a tool result). Lists in fields no block of its type has
    are not counted: they are ignored unvalidated. Iterative: nesting depth is the client's."""
    stack = _holders(parts, path)
    while stack:
        part, parent, j = stack.pop()
        if part["type"] == "document":
            source = part.get("source")
            key, inner = "source.content", source.get("content") if isinstance(source, dict) else None
        else:
            key, inner = "content", part.get("content")
        if isinstance(inner, list):
            where = f"{parent}.{j}.{key}"
            yield where, inner
            stack.extend(_holders(inner, where))


def _holders(parts: list[Any], path: str) -> list[tuple[dict[str, Any], str, int]]:
    """The blocks of `parts` that hold blocks, last first (a stack pops them in order)."""
    return [(p, path, j) for j in range(len(parts) - 1, -1, -1)
            if isinstance(p := parts[j], dict) and p.get("type") in _HOLDERS]


def validation_error_to_api(exc: ValidationError, data: Any) -> InvalidRequest:
    """The most specific pydantic error, as a 400 naming its JSON path in the request."""
    errors = exc.errors(include_url=False)
    # Smart unions (str | list[...]) report one error per member; the deepest one is the
    # member the client evidently meant.
    best = max(errors, key=lambda e: len(e["loc"]))
    path = json_path(best["loc"], data)
    if best["type"] in ("union_tag_invalid", "union_tag_not_found"):
        path = f"{path}.type" if path else "type"
    message = _clean_message(best)
    # Union members repeat one mistake at the enclosing field; mention only other places.
    others = sorted(
        p for p in {json_path(e["loc"], data) for e in errors}
        if p != path and not _is_ancestor(p, path)
    )
    if others:
        message += f" (also check: {', '.join(p or '<body>' for p in others[:5])})"
    return InvalidRequest(f"{path}: {message}" if path else message, param=path or None)


def _is_ancestor(candidate: str, path: str) -> bool:
    return candidate == "" or path.startswith(candidate + ".")


def json_path(loc: tuple[Any, ...], data: Any) -> str:
    """Map a pydantic error location onto the client's JSON, dropping union/tag labels.

    Pydantic locations contain labels that are not in the JSON (`'str'`, `'list[...]'`,
    discriminator values like `'text'`). Walking the actual input tells them apart: a label
    is kept only if it indexes the current object, or names a missing field at the end.
    """
    parts: list[str] = []
    current: Any = data
    for i, item in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(current, list) and isinstance(item, int):
            parts.append(str(item))
            current = current[item] if 0 <= item < len(current) else None
        elif isinstance(current, dict) and isinstance(item, str):
            tag_values = {v for v in (current.get("type"), current.get("role")) if isinstance(v, str)}
            if item in tag_values and not last and not _is_field_path(loc, i, current):
                continue  # a discriminator label, not a key
            if item in current:
                parts.append(item)
                current = current[item]
            elif last and not _is_type_label(item):
                parts.append(item)  # a required field that is missing
                current = None
        # anything else is a union-member label: skip it
    return ".".join(parts)


_TYPE_LABELS = {"str", "int", "float", "bool", "none", "bytes", "list", "dict"}


def _is_type_label(item: str) -> bool:
    """Union-member labels: builtin type names, `list[...]`-style names, model class names."""
    return item in _TYPE_LABELS or "[" in item or item[:1].isupper()


def _is_field_path(loc: tuple[Any, ...], i: int, current: dict[str, Any]) -> bool:
    """Whether loc[i] (equal to a tag value) is really the key of that name.

    When a block `{"type": "text", "text": ...}` fails, pydantic reports `(..., 'text', 'text')`:
    the tag label followed by the field. The label comes first exactly when the next item is
    also a key of the same object (or the same name again).
    """
    nxt = loc[i + 1] if i + 1 < len(loc) else None
    return not (isinstance(nxt, str) and (nxt in current or nxt == loc[i]))


def _clean_message(error: Any) -> str:
    msg = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    if error["type"] == "missing":
        return "field required"
    if error["type"] == "extra_forbidden":
        return "unknown field; remove it"
    return msg[:1].lower() + msg[1:]


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return type(value).__name__
