"""API keys and the per-request context every route passes down to the engine.

Keys are never stored in clear: the keys file holds SHA-256 digests, one key per line,

    # key-id  sha256:<hex digest of the key>      (this one is the key "sk-example")
    alice     sha256:f2d4b279b82ad92867af5878fe7482caebdd7b75499868d0362a6e63ff51f046

and a presented key is hashed and compared with every stored digest in constant time, so
neither the file nor response timing reveals keys. Print a line for a new key with
`echo -n "$KEY" | python -m tierlm.serving.auth alice`.

Tenancy (tenancy.py) maps `api_key_id` to a tenant and fills `tenant_id`, `priority` and
`cache_salt`, which routes pass to `AsyncEngine.generate`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol

from tierlm.serving.errors import AuthenticationFailed

if TYPE_CHECKING:
    from tierlm.serving.breaker import BreakerSettings
    from tierlm.serving.safety import RequestSafety
    from tierlm.serving.sla import SlaGuard

logger = logging.getLogger("tierlm.serving")

_HASH_PREFIX = "sha256:"


@dataclass
class RequestContext:
    """Who is asking, decided once at admission and read by everything downstream."""

    request_id: str
    api_key_id: str | None = None
    tenant_id: str | None = None
    priority: int = 0
    tenant_weight: float = 1.0
    kv_share: float | None = None
    kv_cache_share: float | None = None  # its tenant's cache partition (kv/block_pool.py)
    tier: str | None = None
    ttft_target_s: float | None = None  # the tier's time-to-first-token target (sla.py)
    breaker: "BreakerSettings | bool | None" = None  # the tier's own breaker, False: none, None: the server's
    max_batch_requests: int | None = None  # the tenant's batches' unfinished requests, at most (batches.py)
    cache_salt: str | None = None
    safety: "RequestSafety | None" = None  # the policies its prompt and answer are checked against (safety.py)
    sla: "SlaGuard | None" = None  # the server's breakers and fallbacks (sla.py)
    models: frozenset[str] | None = None  # the models its tenant may use (None: every one); tenancy.py

    def salted(self, extra: str | None) -> "RequestContext":
        """This context with a client's own `cache_salt` (a request field, as in vLLM) mixed under
        the tenant's: a client can only narrow whom it shares cached prefixes with, never reach
        another tenant's blocks (the length prefix keeps the mix injective)."""
        if not extra:
            return self
        own = self.cache_salt or ""
        return replace(self, cache_salt=f"\x1e{len(own)}:{own}{extra}")


class Authenticator(Protocol):
    """Decides which key (if any) a request carries; raises `AuthenticationFailed` if none."""

    def authenticate(self, headers: Mapping[str, str]) -> str | None: ...


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from `x-api-key` (Anthropic) or `Authorization: Bearer` (OpenAI)."""
    key = headers.get("x-api-key")
    if key:
        return key.strip(_HTTP_SPACE)
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip(_HTTP_SPACE):
        return token.strip(_HTTP_SPACE)
    return None


# What HTTP trims around a header value. Not str.strip()'s whitespace: a header decoded as latin-1
# can end in U+0085 or U+00A0, the last byte of a UTF-8 "à" or "Å" in a key.
_HTTP_SPACE = " \t"


class NoAuth:
    """--no-auth: every request is accepted (local use only)."""

    def authenticate(self, headers: Mapping[str, str]) -> str | None:
        return None


class ApiKeyAuth:
    """Accepts requests whose key hashes to one of the stored digests."""

    def __init__(self, digests: Mapping[str, str]) -> None:
        """`digests` maps key id → hex SHA-256 of the key."""
        if not digests:
            raise ValueError("no API keys given; add keys to the keys file or use --no-auth")
        self._digests = [(key_id, bytes.fromhex(d)) for key_id, d in digests.items()]

    @property
    def key_ids(self) -> list[str]:
        return [key_id for key_id, _ in self._digests]

    @classmethod
    def from_keys(cls, keys: Mapping[str, str]) -> "ApiKeyAuth":
        """Key id → clear-text key (for tests and programmatic use)."""
        return cls({key_id: hash_key(key) for key_id, key in keys.items()})

    @classmethod
    def from_file(cls, path: str | Path) -> "ApiKeyAuth":
        return cls(load_keys_file(path))

    def authenticate(self, headers: Mapping[str, str]) -> str | None:
        key = presented_key(headers)
        if key is None:
            raise AuthenticationFailed(
                "no API key: send it in the x-api-key header or as 'Authorization: Bearer <key>'",
                code="missing_api_key",
            )
        # Starlette decodes header bytes as latin-1, so encoding back gives the bytes the client
        # sent. Clients differ in what they send for a non-ASCII key: curl and httpx (the SDKs)
        # its UTF-8, which is what `hash_key` and the keys tool hash; Python's requests and Node's
        # fetch its latin-1, one byte per character, whose text is the key itself. Both are
        # tried, each against every stored digest. (Headers not from Starlette may hold any text:
        # that is hashed as the keys tool hashes it.)
        try:
            candidates = {key.encode("latin-1"), key.encode()}
        except UnicodeEncodeError:
            candidates = {key.encode()}
        match: str | None = None
        for raw in sorted(candidates):
            digest = hashlib.sha256(raw).digest()
            for key_id, stored in self._digests:  # no early exit: timing must not depend on position
                if hmac.compare_digest(digest, stored):
                    match = key_id
        if match is None:
            raise AuthenticationFailed("invalid API key")
        return match


def load_keys_file(path: str | Path) -> dict[str, str]:
    """Parse a keys file into key id → hex digest, naming the line of any mistake."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from None
    digests: dict[str, str] = {}
    seen: dict[str, tuple[str, int]] = {}  # digest → (key id, line): a key under two ids runs as the last
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].startswith(_HASH_PREFIX):
            raise ValueError(
                f"{path}:{lineno}: expected '<key-id> sha256:<hex digest>'; make a line with "
                f"`echo -n \"$KEY\" | python -m tierlm.serving.auth <key-id>`"
            )
        key_id, digest = fields[0], fields[1][len(_HASH_PREFIX):].lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{path}:{lineno}: '{fields[1]}' is not a SHA-256 hex digest (64 hex digits)")
        if key_id in digests:
            first_line = next(n for k, n in seen.values() if k == key_id)
            raise ValueError(f"{path}:{lineno}: key id '{key_id}' appears twice (lines {first_line} and {lineno}); "
                             "ids must be unique: remove one line, or rename one of the ids")
        if digest in seen:
            first, first_line = seen[digest]
            raise ValueError(f"{path}:{lineno}: key id '{key_id}' has the same key as '{first}' (line {first_line}); "
                             f"a key has one id: remove one of the lines, or give {key_id} a key of its own")
        digests[key_id] = digest
        seen[digest] = (key_id, lineno)
    if not digests:
        raise ValueError(f"{path}: no API keys found; add '<key-id> sha256:<hex digest>' lines")
    return digests


def keys_file_line(key_id: str, key: str) -> str:
    return f"{key_id} {_HASH_PREFIX}{hash_key(key)}"


if __name__ == "__main__":
    usage = ("usage: echo -n \"$KEY\" | python -m tierlm.serving.auth KEY_ID\n"
             "prints the keys-file line (KEY_ID sha256:<digest>) for the key read from standard input")
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(usage, file=sys.stdout if len(sys.argv) == 2 else sys.stderr)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    key = sys.stdin.read()
    if not key.strip():
        sys.exit("error: no key on standard input; pipe the key in: echo -n \"$KEY\" | python -m "
                 "tierlm.serving.auth KEY_ID")
    print(keys_file_line(sys.argv[1], key))
