"""Prefix affinity: the router's record of what it sent each replica, and how it picks one."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlm.dist.affinity import (
    CHUNK_BYTES,
    AffinityIndex,
    Replica,
    choose_replica,
    prefix_chain,
    prompt_prefix,
)
from tierlm.dist.ray_serve import per_replica_argv, replica_argv

SALT = b"key\0model"
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.text(min_size=0, max_size=300)}), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(system=st.one_of(st.none(), st.text(max_size=400)), first=messages, more=messages)
def test_a_conversation_grown_by_turns_extends_its_prompt_prefix(system, first, more):
    """What makes affinity work: a next turn's bytes start with the previous turn's, so every full
    chunk of the earlier request is a leading chunk of the later one."""
    body = {"model": "m", "system": system, "messages": first, "max_tokens": 5}
    later = dict(body, messages=first + more, max_tokens=99, temperature=0.3)
    a, b = prompt_prefix("/v1/messages", body), prompt_prefix("/v1/messages", later)
    assert b.startswith(a)
    ca, cb = prefix_chain(SALT, a), prefix_chain(SALT, b)
    assert cb[:len(ca)] == ca and len(ca) == len(a) // CHUNK_BYTES


def test_prompt_fields_per_route_and_what_is_not_a_prompt():
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 600}], "tools": [{"type": "function"}]}
    assert json.loads(prompt_prefix("/v1/chat/completions", chat) + b"]]") == [chat["tools"], chat["messages"]]
    assert prompt_prefix("/v1/completions", {"prompt": "abc"}) == b'["abc'
    assert prompt_prefix("/v1/completions", {"prompt": [1, 2]}) == b'[[1,2'
    assert prompt_prefix("/v1/responses", {"instructions": "be brief", "input": "hi"}) == b'["be brief","hi'
    # sampling settings do not change where a prompt is cached
    assert prompt_prefix("/v1/messages", {"messages": [], "temperature": 1}) == prompt_prefix(
        "/v1/messages", {"messages": [], "max_tokens": 3})
    assert prompt_prefix("/v1/models", {}) is None
    assert prompt_prefix("/v1/messages", ["not", "an", "object"]) is None


def test_equal_prompts_under_different_keys_or_models_share_no_chunk():
    data = b"s" * (CHUNK_BYTES * 4)
    a, b, c = prefix_chain(b"k1\0m", data), prefix_chain(b"k2\0m", data), prefix_chain(b"k1\0m2", data)
    assert len(a) == 4 and not set(a) & set(b) and not set(a) & set(c)
    index = AffinityIndex(100)
    index.insert(a)
    assert index.match(a) == 4 and index.match(b) == 0


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.text(alphabet="ab", min_size=0, max_size=8), min_size=1, max_size=12),
       probe=st.text(alphabet="ab", max_size=8))
def test_index_match_equals_the_longest_common_prefix_with_any_prompt_sent(prompts, probe):
    """Brute-force reference: with room for everything, a probe matches as many chunks as it
    shares, from the start, with the closest prompt sent (tiny chunks, so prefixes vary a lot)."""
    def chain(s: str) -> list[bytes]:
        return prefix_chain(SALT, s.encode(), chunk=1)

    index = AffinityIndex(10_000)
    for p in prompts:
        index.insert(chain(p))

    def common(x: str, y: str) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    assert index.match(chain(probe)) == max(common(probe, p) for p in prompts)


def test_the_index_forgets_least_recently_used_chains_from_their_tail():
    index = AffinityIndex(6)
    old = prefix_chain(SALT, b"o" * CHUNK_BYTES * 4)
    new = prefix_chain(SALT, b"n" * CHUNK_BYTES * 4)
    index.insert(old)
    index.insert(new)
    assert len(index) == 6
    assert index.match(new) == 4
    assert index.match(old) == 2  # its last two chunks went first, its root stays
    index.insert(old[:1])  # a request for the first chunk only: that chunk is kept longest
    index.insert(prefix_chain(SALT, b"x" * CHUNK_BYTES))
    assert index.match(old) == 1 and index.match(new) == 4  # old's second chunk was the least recent
    with pytest.raises(ValueError, match="at least one chunk"):
        AffinityIndex(0)


def _replicas(n: int, loads: list[int]) -> list[Replica]:
    return [Replica(url=f"http://r{i}", index=AffinityIndex(1000), name=str(i), in_flight=loads[i], pending=loads[i])
            for i in range(n)]


def test_cache_aware_goes_where_the_prompt_would_be_done_soonest():
    """Pending work plus the request's own uncached chunks there: a prefix draws the request to
    its replica until that replica's queue outweighs what the prefix saves."""
    rs = _replicas(3, [0, 0, 0])
    chain = prefix_chain(SALT, b"p" * CHUNK_BYTES * 8)
    rs[0].index.insert(chain[:6])
    rs[2].index.insert(chain[:3])
    c = choose_replica("cache_aware", rs, chain, 0)
    assert (c.replica.name, c.decision, c.matched, c.chunks, c.work) == ("0", "affinity", 6, 8, 3)
    # work there: replica 0 pending + 3, replica 1 pending + 9, replica 2 pending + 6
    rs[0].pending = 2
    assert choose_replica("cache_aware", rs, chain, 0).replica.name == "0"  # 5 < 6 < 9
    rs[0].pending = 3  # 6 = 6: a tie on work goes to fewer in flight, then the smaller record
    c = choose_replica("cache_aware", rs, chain, 0)
    assert (c.replica.name, c.decision, c.matched) == ("2", "balance", 3)
    rs[2].in_flight = 1
    assert choose_replica("cache_aware", rs, chain, 0).replica.name == "0"
    rs[2].pending = 4
    # nothing cached anywhere: least work
    fresh = prefix_chain(SALT, b"q" * CHUNK_BYTES * 8)
    assert choose_replica("cache_aware", rs, fresh, 0).decision == "least_load"
    assert choose_replica("cache_aware", rs, fresh, 0).replica.name == "1"
    assert choose_replica("cache_aware", [], chain, 0) is None


@settings(max_examples=200, deadline=None)
@given(pending=st.lists(st.integers(0, 30), min_size=1, max_size=5),
       held=st.lists(st.integers(0, 10), min_size=5, max_size=5), turn=st.integers(0, 10))
def test_cache_aware_minimises_pending_plus_uncached_work(pending, held, turn):
    chain = prefix_chain(SALT, b"z" * CHUNK_BYTES * 10)
    rs = []
    for i, p in enumerate(pending):
        r = Replica(url=f"http://r{i}", index=AffinityIndex(100), name=str(i), pending=p)
        r.index.insert(chain[:held[i]])
        rs.append(r)
    c = choose_replica("cache_aware", rs, chain, turn)
    cost = {r.name: r.pending + 1 + 10 - held[i] for i, r in enumerate(rs)}
    assert cost[c.replica.name] == min(cost.values())
    assert c.matched == held[int(c.replica.name)] and c.work == 11 - c.matched


def test_round_robin_and_least_load():
    rs = _replicas(3, [0, 0, 0])
    assert [choose_replica("round_robin", rs, [], t).replica.name for t in range(4)] == ["0", "1", "2", "0"]
    rs[0].in_flight = 1
    # ties in load go round the replicas, not always to the first
    assert {choose_replica("least_load", rs, [], t).replica.name for t in range(3)} == {"1", "2"}
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        choose_replica("nope", rs, [], 0)


def test_replica_command_line_drops_the_routers_own_options():
    argv = ["--log-level", "debug", "serve", "/m", "--replicas", "4", "--port=9000", "--host", "0.0.0.0",
            "--ray-address=auto", "--routing-policy", "round_robin", "--affinity-chunks", "10", "--api-keys", "k.txt"]
    assert replica_argv(argv) == ["--log-level", "debug", "serve", "/m", "--api-keys", "k.txt"]
    # a disk tier's directory serves one engine: each replica gets its own under it
    assert per_replica_argv(["serve", "--kv-disk-dir", "/c", "--kv-disk-dir=/d", "--batches-dir", "/b"], 1) == [
        "serve", "--kv-disk-dir", "/c/replica-1", "--kv-disk-dir=/d/replica-1", "--batches-dir", "/b/replica-1"]
    assert per_replica_argv(["serve", "/m"], 0) == ["serve", "/m"]


def test_router_command_line_refuses_bad_settings_in_one_line(capsys):
    from tierlm.cli import main

    assert main(["router"]) == 2
    assert "error: the router needs at least one replica URL (--replica http://HOST:PORT)" in capsys.readouterr().err
    assert main(["router", "--replica", "localhost:8000"]) == 2
    assert "replica 'localhost:8000' is not a server's base URL; give it as http://HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["router", "--replica", "http://a:1", "--routing-policy", "random"])
    assert e.value.code == 2 and "invalid choice: 'random'" in capsys.readouterr().err


def test_router_reads_the_replicas_keys_and_tenants_files(tmp_path):
    import argparse

    from tierlm.dist.cli import tenants_of
    from tierlm.serving.auth import hash_key

    keys = tmp_path / "keys.txt"
    keys.write_text(f"alice sha256:{hash_key('sk-a')}\nbob sha256:{hash_key('sk-b')}\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.acme]\nkeys = ["alice"]\nrequests_per_minute = 5\n')

    def ns(**kw):
        return argparse.Namespace(**{"api_keys": None, "tenants": None, **kw})

    assert tenants_of(ns()) == (None, None)
    with pytest.raises(ValueError, match="--tenants needs --api-keys"):
        tenants_of(ns(tenants=str(tenants)))
    auth, tenancy = tenants_of(ns(api_keys=str(keys), tenants=str(tenants)))
    acme = tenancy.tenant_of(auth.authenticate({"x-api-key": "sk-a"}))
    assert acme.id == "acme" and acme.limits.requests_per_minute == 5
    assert tenancy.tenant_of(auth.authenticate({"x-api-key": "sk-b"})).id == "bob"  # a tenant of its own
    auth, tenancy = tenants_of(ns(api_keys=str(keys)))  # keys alone: each key's own cache salt, no limits
    alice = tenancy.tenant_of(auth.authenticate({"x-api-key": "sk-a"}))
    assert alice.cache_salt and not alice.limits.any
