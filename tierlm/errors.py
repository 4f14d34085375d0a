"""Errors the engine raises; the serving layer maps them to each API's error shape."""
from __future__ import annotations


class TierlmError(Exception):
    """Base class: every tierlm error names the thing that went wrong and what to do."""


class InvalidRequestError(TierlmError, ValueError):
    """The request itself is wrong (bad parameter, too long): a client error, never retried.

    `param` names the offending field when there is one, so APIs can point at it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """Prompt + max_tokens can never fit in max_model_len or the whole KV pool."""


class ModelLoadError(TierlmError):
    """A checkpoint directory cannot be served (missing/corrupt files, unknown architecture)."""


class KVTierError(TierlmError):
    """A lower KV tier cannot be opened (its disk directory is in use or not writable)."""


class ChatTemplateError(InvalidRequestError):
    """Chat was asked for but the tokenizer has no chat template."""


class EngineDeadError(TierlmError):
    """The engine loop stopped after an internal error; requests cannot be served."""


class EngineStepError(TierlmError):
    """One engine step failed: the requests in it were failed, the engine serves on (retry)."""
