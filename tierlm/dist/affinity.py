"""Which replica should serve a request: the one that already holds its prompt's prefix, unless
that would pile work on one replica while another idles.

Why: each replica has its own KV cache, so a conversation's next turn, or a tenant's long system
prompt, is a prefix hit only on the replica that served it before. A router that spreads
requests blindly (round robin, least load) sends a follow-up to a replica that must prefill the
whole conversation again. The router cannot see the replicas' caches, so it keeps its own record
of what it sent where (as SGLang's router does): per replica, the chunk-chain hashes of the
prompts it routed there, forgotten least recently used first at about the replica's cache size.

A prompt's prefix is the request's fields that make up the model's input, in the order the chat
template reads them, serialized as JSON (`prompt_prefix`): a conversation that grows by a turn
serializes to a string that extends the previous one, up to the closing brackets. The bytes are
cut into fixed chunks and hashed as a chain (each chunk's hash covers everything before it), so a
match of k chunks means the first k × `CHUNK_BYTES` bytes are equal. The chain's root holds the
caller's key and the model, as the replicas' cache salts do: equal prompts of two tenants never
count as a shared prefix.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = [
    "CHUNK_BYTES",
    "ROUTING_POLICIES",
    "AffinityIndex",
    "Choice",
    "Replica",
    "choose_replica",
    "prefix_chain",
    "prompt_prefix",
    "request_work",
]

CHUNK_BYTES = 256
ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")

# The fields of each route's body that become the model's input, in prompt order.
_PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "/v1/messages": ("system", "tools", "messages"),
    "/v1/messages/count_tokens": ("system", "tools", "messages"),
    "/v1/chat/completions": ("tools", "messages"),
    "/v1/completions": ("prompt",),
    "/v1/responses": ("instructions", "tools", "input"),
    "/v1/embeddings": ("input",),
}


def prompt_prefix(path: str, body: Any) -> bytes | None:
    """The bytes whose prefix a replica's KV cache can reuse, for a request to `path` with the
    parsed JSON `body`; None for routes that generate nothing or bodies that are not an object
    (the replica answers those in its API's error shape; any replica will do)."""
    fields = _PROMPT_FIELDS.get(path)
    if fields is None or not isinstance(body, dict):
        return None
    parts = [json.dumps(p, ensure_ascii=False, separators=(",", ":"))
             for p in (body.get(name) for name in fields) if p is not None]
    if parts and parts[-1][-1] in '"]':
        # The conversation (or prompt text) last and left open: "[sys,[m1,m2" is a prefix of
        # "[sys,[m1,m2,m3" (a next turn), '["abc' of '["abcdef' (a longer prompt).
        parts[-1] = parts[-1][:-1]
    return ("[" + ",".join(parts)).encode()


def prefix_chain(salt: bytes, data: bytes, chunk: int = CHUNK_BYTES) -> list[bytes]:
    """Hashes of `data`'s full chunks, each chained to its parent's (BLAKE2b, 16 bytes: a routing
    hint, where a collision costs one misrouted request, not a wrong answer). `salt` (the
    caller's key, the model) is hashed into the root."""
    parent = hashlib.blake2b(salt, digest_size=16).digest()
    out = []
    for start in range(0, len(data) - chunk + 1, chunk):
        parent = hashlib.blake2b(parent + data[start:start + chunk], digest_size=16).digest()
        out.append(parent)
    return out


class AffinityIndex:
    """What the router sent one replica: chunk-chain hashes, least recently used forgotten first.

    A request's chain is touched leaf first, so its root ends most recent: the index forgets a
    chain from its tail, as the replica's cache evicts (a prefix's root outlives its leaves)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an affinity index needs room for at least one chunk, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def match(self, chain: Sequence[bytes]) -> int:
        """How many leading chunks of `chain` this replica was sent (and is thought to still hold)."""
        n = 0
        for h in chain:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[bytes]) -> None:
        for h in reversed(chain):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()


@dataclass
class Replica:
    """One backend server as the router sees it."""

    url: str
    index: AffinityIndex
    name: str = ""
    up: bool = True
    in_flight: int = 0
    #: The work of its requests in flight, in `request_work` units: their prompts until each
    #: starts answering, then one each until it ends. What a new request would queue behind.
    pending: int = 0
    last_error: str = ""  # why it is out of rotation
    probe_timeouts: int = 0  # /ready probes timed out in a row


@dataclass(frozen=True)
class Choice:
    replica: Replica
    #: Why: "affinity" (the longest cached prefix), "balance" (a replica with a longer prefix was
    #: too busy), "least_load" (no prefix anywhere, or policy least_load), "round_robin".
    decision: str
    matched: int  # leading chunks the chosen replica holds
    chunks: int  # full chunks in the prompt

    @property
    def work(self) -> int:
        return request_work(self.chunks, self.matched)


def request_work(chunks: int, matched: int) -> int:
    """A request's cost to a replica, in prompt chunks: those it must compute (not cached there),
    plus one for the request itself (a short prompt, the decoding): the router's unit of load."""
    return 1 + chunks - matched


def choose_replica(policy: str, replicas: Iterable[Replica], chain: Sequence[bytes], turn: int) -> Choice | None:
    """The replica for a request whose prompt hashes to `chain`, among `replicas` (the caller
    passes those that are up and not yet tried); None when there are none. `turn` counts the
    router's requests, for round robin and to break ties without always favouring the first.

    `cache_aware` picks the replica where the request would finish its prompt soonest: the
    least pending work plus the request's own work there (the chunks of its prompt that replica
    does not hold). A cached prefix draws a request to its replica until that replica's queue is
    longer than the prefix saves; with nothing cached anywhere it is plain least-work."""
    live = list(replicas)
    if not live:
        return None
    n = len(live)
    rotated = live[turn % n:] + live[:turn % n]
    if policy == "round_robin":
        r = rotated[0]
        return Choice(r, "round_robin", r.index.match(chain), len(chain))
    if policy == "least_load":  # fewest in flight, then the smallest record (room for new prefixes), then rotation
        r = min(rotated, key=lambda r: (r.in_flight, len(r.index)))
        return Choice(r, "least_load", r.index.match(chain), len(chain))
    if policy != "cache_aware":
        raise ValueError(f"unknown routing policy '{policy}'; choose one of {', '.join(ROUTING_POLICIES)}")
    matches = [r.index.match(chain) for r in rotated]
    best = min(range(n), key=lambda i: (rotated[i].pending + request_work(len(chain), matches[i]),
                                        rotated[i].in_flight, len(rotated[i].index)))
    longest = max(matches)
    decision = "least_load" if longest == 0 else ("affinity" if matches[best] == longest else "balance")
    return Choice(rotated[best], decision, matches[best], len(chain))
