"""Stored responses of the Responses API: what `previous_response_id`, GET /v1/responses/{id}
and its input_items read.

Kept in this process's memory (a restart, or another replica, does not have them: a client
then gets `previous_response_not_found` and sends the items itself), per owner (an API key):
another key's id is not found, as if it did not exist. Each entry holds its whole conversation,
so a chain of responses costs the sum of its conversations. The bound counts the entries' JSON
size (Python holds them in a few times that, and a chain's entries share their early turns'
objects, so a chain is counted as more than it holds); past it, or past `max_responses`, the
owner holding the most bytes (or entries) loses its least recently used entry first, never the
one just stored, so one busy key cannot flush every other key's responses. Used from the event loop only (sizes are measured beforehand, off it).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_RESPONSES = 10_000


def stored_size(response: dict[str, Any], input_items: list[dict[str, Any]]) -> int:
    """What an entry counts against the bound: its JSON size (seconds for a 30 MB conversation:
    measured in a worker thread)."""
    return len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(input_items, separators=(",", ":")))


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    input_items: list[dict[str, Any]]  # every item it read: its history's, then its own input's
    size: int  # bytes of JSON: what the store's bound counts

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues this one starts from: its input, then its output."""
        return self.input_items + list(self.response.get("output") or ())


class _Owned:
    """One owner's entries, least recently used first."""

    def __init__(self) -> None:
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self.max_bytes = max_bytes
        self.max_responses = max_responses
        self._owners: dict[str, _Owned] = {}
        self.bytes = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            size: int | None = None) -> bool:
        """Keep `response` for `owner` (`size`: its stored_size, if measured already); False
        (nothing kept) if it alone is past the byte bound."""
        size = stored_size(response, input_items) if size is None else size
        if size > self.max_bytes or self.max_responses < 1:
            return False
        self.delete(owner, response["id"])
        owned = self._owners.setdefault(owner, _Owned())
        owned.entries[response["id"]] = StoredResponse(response, input_items, size)
        owned.bytes += size
        self.bytes += size
        self._count += 1
        while self.bytes > self.max_bytes or self._count > self.max_responses:
            if not self._evict(owner, response["id"], by_count=self._count > self.max_responses):
                self.delete(owner, response["id"])  # (only the new entry is left to drop)
                return False
        return True

    def _evict(self, owner: str, response_id: str, by_count: bool) -> bool:
        """Drop the least recently used entry of the owner holding the most (entries when over
        the count bound, bytes when over the byte bound), never the entry just stored (`owner`'s
        `response_id`: its client is about to continue it); False if there is no other."""
        def weight(o: str) -> int:
            return len(self._owners[o].entries) if by_count else self._owners[o].bytes

        heaviest = max(self._owners, key=weight)  # (one pass: 10,000 keys sorted per drop took 0.8 s)
        if next(iter(self._owners[heaviest].entries)) == response_id and heaviest == owner:
            others = [o for o in self._owners if o != owner]  # (its only entry is the new one)
            if not others:
                return False
            heaviest = max(others, key=weight)
        self.delete(heaviest, next(iter(self._owners[heaviest].entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        owned = self._owners.get(owner)
        entry = owned.entries.get(response_id) if owned is not None else None
        if entry is not None:
            owned.entries.move_to_end(response_id)
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        owned = self._owners.get(owner)
        entry = owned.entries.pop(response_id, None) if owned is not None else None
        if entry is None:
            return False
        owned.bytes -= entry.size
        self.bytes -= entry.size
        self._count -= 1
        if not owned.entries:
            del self._owners[owner]
        return True
