"""Pages of a list by id cursors, as Anthropic's list routes take them (`limit`, `after_id`,
`before_id`; `has_more` in the direction asked): the model list, the message batches, and
OpenAI's files and batches (`after` only)."""
from __future__ import annotations

from typing import Callable

from tierlm.serving.errors import InvalidRequest


def limit_param(value: str | None, default: int | None, most: int = 1000) -> int | None:
    """`limit`: an integer from 1 to `most`, or `default` when absent."""
    if value is None:
        return default
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit: must be an integer from 1 to {most:,} (got {value!r})", param="limit")
    return limit


def page(ids: list[str], limit: int | None, after: str | None, before: str | None,
         unknown: Callable[[str, str], str], after_param: str = "after_id") -> tuple[int, int, bool]:
    """(start, end, has_more) of the page of `ids` after `after` or before `before` (never both);
    `unknown(param, id)` says why a cursor that is not in `ids` is refused; `after_param` is the
    query parameter's name in errors (OpenAI's lists call it `after`)."""
    if after is not None and before is not None:
        raise InvalidRequest("after_id and before_id cannot be combined; send one of them", param="before_id")
    for param, cursor in ((after_param, after), ("before_id", before)):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(unknown(param, cursor), param=param)
    if before is not None:  # the page just before it
        end = ids.index(before)
        start = max(0, end - limit) if limit is not None else 0
        return start, end, start > 0
    start = ids.index(after) + 1 if after is not None else 0
    end = min(len(ids), start + limit) if limit is not None else len(ids)
    return start, end, end < len(ids)
