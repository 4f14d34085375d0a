"""Stored responses of the Responses API: what `previous_response_id`, GET /v1/responses/{id}
and its input_items read.

Kept in this process's memory (a restart, or another replica, does not have them: a client
then gets `previous_response_not_found` and sends the items itself), per owner (an API key, or
its tenant): another key's id is not found, as if it did not exist. Each entry holds its whole
conversation, so a chain of responses costs the sum of its conversations; entries are dropped
least recently used first once `max_bytes` (their JSON size) or `max_responses` is passed.
Used from the event loop only.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_RESPONSES = 10_000


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as it was returned
    input_items: list[dict[str, Any]]  # every item it read: its history's, then its own input's
    size: int  # bytes of JSON: what the store's bound counts

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a response that continues this one starts from: its input, then its output."""
        return self.input_items + list(self.response.get("output") or ())


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        self.max_bytes = max_bytes
        self.max_responses = max_responses
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, owner: str, response: dict[str, Any], input_items: list[dict[str, Any]]) -> bool:
        """Keep `response` for `owner`; False (nothing kept) if it alone is past the byte bound."""
        size = len(json.dumps(response, separators=(",", ":"))) + len(json.dumps(input_items, separators=(",", ":")))
        if size > self.max_bytes:
            return False
        key = (owner, response["id"])
        self.delete(owner, response["id"])
        self._entries[key] = StoredResponse(response, input_items, size)
        self.bytes += size
        while self.bytes > self.max_bytes or len(self._entries) > self.max_responses:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        entry = self._entries.get((owner, response_id))
        if entry is not None:
            self._entries.move_to_end((owner, response_id))
        return entry

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.pop((owner, response_id), None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
