"""Lists of what the replicas keep (files, OpenAI batches, message batches), merged by the router.

Why: each such object lives on the replica that made it, so a list forwarded to one replica
showed that replica's alone. The router asks every replica that is up, at once, for the whole list (page
by page, in the replica's own cursor), merges them newest first by `created_at`, and pages the
result with the client's own `limit` and cursor, in the API's own list shape. A replica that
refuses the list (a bad key: every replica says the same) answers for all; one that cannot be
reached is left out, with a warning.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Mapping

import httpx

from tierlm.serving.errors import InvalidRequest
from tierlm.serving.paging import limit_param, page

logger = logging.getLogger("tierlm.router")


@dataclass(frozen=True)
class ListKind:
    """One list route: how to page a replica through it, and how the client pages the merge."""

    name: str
    fetch_limit: int  # the most per page a replica gives
    cursor: str  # the replica's cursor parameter
    default_limit: int | None  # the client's page size when it gives none (None: all)
    most: int  # the largest `limit` the client may give
    anthropic: bool  # Anthropic's list shape (first_id/last_id/has_more without "object")


OPENAI_FILES = ListKind("openai_files", 10_000, "after", 10_000, 10_000, False)
ANTHROPIC_FILES = ListKind("anthropic_files", 1000, "page", 20, 1000, True)
OPENAI_BATCHES = ListKind("openai_batches", 100, "after", 20, 100, False)
MESSAGE_BATCHES = ListKind("message_batches", 1000, "after_id", 20, 1000, True)


def list_kind(method: str, path: str, headers: Mapping[str, str]) -> ListKind | None:
    """The list a request asks for, or None (not a list of replicas' objects)."""
    if method != "GET":
        return None
    if path == "/v1/files":
        return ANTHROPIC_FILES if "anthropic-version" in headers else OPENAI_FILES
    return {"/v1/batches": OPENAI_BATCHES, "/v1/messages/batches": MESSAGE_BATCHES}.get(path)


def _created(item: dict[str, Any]) -> float:
    value = item.get("created_at")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


class ReplicaRefused(Exception):
    """A replica's own refusal of the list: passed to the client as it came."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def _all_of(client: httpx.AsyncClient, url: str, kind: ListKind, path: str, headers: dict[str, str],
                  filters: dict[str, str]) -> list[dict[str, Any]]:
    """Every item of the list at one replica (newest first)."""
    items: list[dict[str, Any]] = []
    params: dict[str, str] = {**filters, "limit": str(kind.fetch_limit)}
    while True:
        resp = await client.get(url + path, params=params, headers=headers)
        if resp.status_code != 200:
            raise ReplicaRefused(resp)
        doc = resp.json()
        items.extend(doc.get("data") or [])
        cursor = doc.get("next_page") if kind.cursor == "page" else doc.get("last_id")
        if not doc.get("has_more") or not cursor:
            return items
        params[kind.cursor] = cursor


async def merged_list(client: httpx.AsyncClient, urls: list[str], kind: ListKind, path: str,
                      headers: dict[str, str], query: Mapping[str, str],
                      on_down: Callable[[str, Exception], None]) -> tuple[int, bytes]:
    """(status, JSON body) of the merged list; InvalidRequest for a bad limit or cursor."""
    filters = {"purpose": query["purpose"]} if kind is OPENAI_FILES and "purpose" in query else {}
    if kind is OPENAI_FILES:
        filters["order"] = "desc"
    limit = limit_param(query.get("limit"), kind.default_limit, kind.most)
    order = query.get("order", "desc") if kind is OPENAI_FILES else "desc"
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order: must be 'asc' or 'desc' (got {order!r})", param="order")
    found: list[dict[str, Any]] = []
    answers = await asyncio.gather(*(_all_of(client, url, kind, path, headers, filters) for url in urls),
                                   return_exceptions=True)  # every replica at once
    for url, answer in zip(urls, answers):
        if isinstance(answer, ReplicaRefused):
            return answer.response.status_code, answer.response.content
        if isinstance(answer, (httpx.HTTPError, ValueError)):
            on_down(url, answer)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            found.extend(answer)
    found.sort(key=lambda item: (_created(item), str(item.get("id"))), reverse=order == "desc")
    ids = [str(item.get("id")) for item in found]
    after = query.get("page") or query.get("after_id") if kind.anthropic else query.get("after")
    before = query.get("before_id") if kind.anthropic else None
    cursor_param = ("page" if "page" in query else "after_id") if kind.anthropic else "after"
    start, end, has_more = page(ids, limit, after, before,
                                lambda param, oid: f"{cursor_param if param == 'after_id' else param}: no object "
                                                   f"'{oid}' of this key on any replica")
    data = found[start:end]
    doc: dict[str, Any] = {"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                           "last_id": data[-1]["id"] if data else None}
    if kind is ANTHROPIC_FILES:
        doc["next_page"] = data[-1]["id"] if data and has_more and before is None else None
    if not kind.anthropic:
        doc = {"object": "list", **doc}
    return 200, json.dumps(doc).encode()
