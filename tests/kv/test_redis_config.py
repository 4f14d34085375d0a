"""The Redis tier against how managed Redis servers are really set up (from a tester's attack):
passwords in every URL form never shown, URLs redis-py would misread refused before the weights
load, a kv_remote_capacity that would evict another application's keys refused, and refusals
that are configuration (a replica, a missing ACL permission) named as such."""
from __future__ import annotations

import logging

import pytest
import torch

from tierlm import LLM
from tierlm.config import check_redis_url
from tierlm.errors import KVTierError
from tierlm.kv.tiers import RedisTier, redact_url

BLOCK = torch.randn(64, 256)


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://alice:s3cret@h:6379/0", "redis://alice:***@h:6379/0"),
    ("redis://h:6379/0?password=s3cret&db=1", "redis://h:6379/0?password=***&db=1"),
    ("unix:///run/redis.sock?db=0&password=s3cret", "unix:///run/redis.sock?db=0&password=***"),
    ("redis://:Ab/s3cret+Q==@h:6379/0", "redis://***@h:6379/0"),  # an unencoded / cuts the URL short
    ("redis://:Ab#s3cret@h:6379/0", "redis://***@h:6379/0"),
    ("redis://:Ab?s3cret@h:6379/0", "redis://***@h:6379/0"),
    ("redis://h:6379/0?password=Srv@s3cret", "redis://h:6379/0?password=***"),  # an @ in a query password
    ("unix:///s.sock?password=Xy@s3cret&db=3", "unix:///s.sock?password=***&db=3"),
    ("redis://h:6379/0;password=s3cret", "redis://h:6379/0;password=***"),
    ("redis://h:6379/0?password=ab;cds3cret", "redis://h:6379/0?password=***"),  # redis-py reads past the ;
    ("redis://:p@ss/w@s3cret@h:6379/0", "redis://***@h:6379/0"),  # @ and / unencoded: cut short first
    ("redis://h:6379/0?x=a@b", "redis://h:6379/0?x=a@b"),  # no password: host and query shown as given
    ("redis://s3cret@h:6379/0", "redis://***@h:6379/0"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_passwords_are_hidden_in_every_url_form(url, shown):
    assert redact_url(url) == shown


@pytest.mark.parametrize("url, says", [
    ("redis://:Ab/s3cret+Q==@h:6379/0", "percent-encode the password"),
    ("redis://:Ab#s3cret@h:6379/0", "percent-encode the password"),
    ("redis://:Ab?s3cret@h:6379/0", "percent-encode the password"),
    ("redis://:p@ss/w@s3cret@h:6379/0", "percent-encode the password"),
    ("redis://h:99999/0", "cannot read the port"),
    ("redis://h:6379/abc", "the path names the database and must be a number"),
    ("redis://h:6379/0?ssl_ca_certs=/no/such/ca.pem", "ssl_ca_certs names '/no/such/ca.pem', which does not exist"),
    ("http://u:s3cret@h", "is not a Redis URL"),
    ("redis://:s3cret@h:6379/0?db=abc", "give the database in the path"),
    ("redis://:s3cret@h:6379/0?db=3", "give the database in the path"),  # redis-py took 3, logs said 0
    ("redis://h:0/0", "port 0 is no server's port"),
    ("redis://host name:6379/0", "the host name 'host name' holds spaces"),
    ("redis://h:6379/\u0663", "the path names the database and must be a number"),  # an Arabic-Indic 3
    ("redis://:s3cret@h:6379/0?socket_timeout=60", "tierlm sets socket_timeout itself"),
    ("redis://h:6379/0?socket_connect_timeout=60", "tierlm sets socket_connect_timeout itself"),
    ("unix:///run/redis.sock?db=x&password=s3cret", "Invalid value for 'db'"),
    ("redis://:s3cret@[::1:6379/0", "cannot read it"),
    ("redis://:s3cret@h:6379/2147483648", "database 2147483648 is out of Redis's range"),  # the tier started
    ("redis://:s3cret@h:6379/99999999999999999999", "is out of Redis's range"),  # as down, blaming memory
    ("redis://:s3cret@h:6379/" + "9" * 5000, "is out of Redis's range"),  # past what int() reads
    ("unix:///run/redis.sock?db=2147483648&password=s3cret", "is out of Redis's range"),
])
def test_urls_redis_py_would_misread_are_refused_before_loading(url, says, tmp_path):
    with pytest.raises(ValueError, match=says) as err:
        LLM(str(tmp_path / "no-model-here"), kv_remote=url)
    assert "s3cret" not in str(err.value) and "kv_remote" in str(err.value)


def test_good_urls_pass_whatever_their_scheme_case(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    for url in ("REDIS://h:6379/0", "rediss://h:6380/2?ssl_ca_certs=" + str(ca), "unix:///run/r.sock?db=0",
                "redis://:p%2Fq%23r@h:6379/0"):
        check_redis_url(url)


def test_with_a_capacity_only_tierlms_keys_can_be_evicted(redis_server):
    """kv_remote_capacity makes the server evict volatile-lru and gives every tierlm key a TTL:
    another application's keys without one survive even where the check at start missed them
    (here they arrive after it)."""
    import redis

    server = redis.Redis.from_url(redis_server.url)
    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000)  # about 15 blocks
    assert server.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    for i in range(20):
        server.set(f"app:user:{i}", "x" * 100)
    for i in range(1, 41):
        tier.put(bytes([i]) * 32, None, BLOCK)
    assert all(server.get(f"app:user:{i}") for i in range(20))  # none evicted
    ours = server.keys("tierlm:kv:*")
    ttls = [server.ttl(k) for k in ours]  # -2: evicted meanwhile (Redis evicts on any command when full)
    assert 0 < len(ours) < 40 and -1 not in ttls and all(t <= 7 * 86400 for t in ttls) and max(ttls) > 0
    tier.close()


@pytest.mark.parametrize("first", ["with a capacity", "without"])
def test_an_engine_without_a_capacity_leaves_the_server_evictable_for_one_with_it(redis_server, first):
    """Two models on one server, one with kv_remote_capacity (volatile-lru: only keys with a TTL
    are evicted), started in either order. The other wrote keys without a TTL, which nothing
    could evict: they filled the server and the first model's every write was refused (0 of 20
    stored). Every tierlm key now has a TTL (kv_remote_ttl, else 7 days), so both keep storing."""
    import redis

    server = redis.Redis.from_url(redis_server.url)
    make = {"with a capacity": lambda: RedisTier(redis_server.url, capacity_bytes=1_000_000),
            "without": lambda: RedisTier(redis_server.url)}
    tiers = {name: make[name]() for name in (first, *(n for n in make if n != first))}
    capped, other = tiers["with a capacity"], tiers["without"]
    for i in range(60):
        other.put(bytes([1, i]) * 16, None, BLOCK)
    for i in range(20):
        capped.put(bytes([2, i]) * 16, None, BLOCK)
    assert capped.stats.stores == 20 and capped.stats.errors == 0 and other.stats.errors == 0
    assert all(server.get(capped.key(bytes([2, i]) * 16)) for i in range(17, 20))  # the newest are there
    assert -1 not in [server.ttl(k) for k in server.keys("tierlm:kv:*")]
    for tier in tiers.values():
        tier.close()


def test_two_models_on_one_redis_read_only_their_own_blocks_and_evict_each_other(redis_server, tmp_path):
    """kv_remote_capacity is the whole server's size, shared by every model on it: one model's
    writes evict another's entries (Redis's LRU), and that model then recomputes what is gone
    and answers as before. Neither reads the other's blocks, for the same prompt either (keys
    hold the weights' fingerprint), and nothing of one is taken for a damaged entry of the other."""
    import redis

    from tests.conftest import build_checkpoint
    from tierlm import SamplingParams

    a, b = (str(build_checkpoint("llama", tmp_path / name, seed=seed)) for name, seed in (("a", 0), ("b", 1)))
    kw = dict(dtype="float32", block_size=8, load_progress=False, kv_remote=redis_server.url, kv_remote_capacity="1MiB")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompt, *flood = ({"prompt_token_ids": torch.randint(3, 500, (81,), generator=g).tolist()} for _ in range(81))
    server = redis.Redis.from_url(redis_server.url)
    with LLM(a, **kw) as llm:
        want = llm.generate(prompt, params)[0].outputs[0].token_ids
        llm.engine.store.flush()
    a_keys = server.keys("tierlm:kv:*")
    assert len(a_keys) == 10
    with LLM(b, **kw) as other:
        assert other.generate(prompt, params)[0].num_cached_tokens == 0  # a's blocks are not b's
        other.generate(flood, SamplingParams(max_tokens=1))  # 800 blocks into room for about 300
        other.engine.store.flush()
        assert other.engine.stats().kv_tiers["redis"]["corrupt"] == 0
    gone = sum(not server.exists(k) for k in a_keys)
    assert gone > 0 and server.info("stats")["evicted_keys"] > 400
    with LLM(a, **kw) as again:  # a fresh engine: only Redis could give it a's blocks
        out = again.generate(prompt, params)[0]
        assert out.outputs[0].token_ids == want and out.num_cached_tokens <= 8 * (10 - gone)
        assert again.engine.stats().kv_tiers["redis"]["corrupt"] == 0


def test_a_capacity_that_would_evict_other_data_is_refused_and_evicts_nothing(redis_server):
    import redis

    other_db = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    other_db.set("app:session:1", "keep me")
    with pytest.raises(KVTierError, match=r"^Redis KV tier \S+ holds data that is not tierlm's \(keys such as "
                                          r"b'app:session:1' in db1\).*evict"):
        RedisTier(redis_server.url, capacity_bytes=1_000_000)
    own_db = redis.Redis.from_url(redis_server.url)
    assert int(own_db.config_get("maxmemory")["maxmemory"]) == 0  # nothing was set
    other_db.delete("app:session:1")
    own_db.set("app:cart:7", "keep me too")  # in tierlm's own database
    with pytest.raises(KVTierError, match="keys such as b'app:cart:7' in db0"):
        RedisTier(redis_server.url, capacity_bytes=1_000_000)
    own_db.delete("app:cart:7")
    other_db.set("tierlm:kv:" + "ab" * 32, b"another engine's block")  # tierlm's, in another database
    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000)  # only tierlm's data: applied
    assert int(own_db.config_get("maxmemory")["maxmemory"]) > 1_000_000
    tier.put(b"\x01" * 32, None, BLOCK)
    tier.close()


def test_other_data_found_after_an_outage_leaves_the_limit_unset_and_the_tier_serving(redis_server, caplog):
    import redis

    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000, retry_after_s=0.01)
    redis_server.stop()
    assert tier.fetch(b"\x02" * 32) is None and tier.backoff > 0
    redis_server.start()
    redis.Redis.from_url(redis_server.url).set("app:session:2", "keep me")  # another app moved in meanwhile
    import time
    time.sleep(0.03)
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
        tier.put(b"\x03" * 32, None, BLOCK)
    server = redis.Redis.from_url(redis_server.url)
    assert "the limit is not set again" in caplog.text and int(server.config_get("maxmemory")["maxmemory"]) == 0
    assert server.get("app:session:2") == b"keep me"
    assert tier.get(b"\x03" * 32) is not None  # still serving
    tier.close()


def test_a_server_restarted_between_two_calls_gets_its_limit_again(redis_server, caplog):
    """redis-py reconnects on the next call, so a quick restart (`systemctl restart`) was never an
    outage, and the restarted server kept no maxmemory: a tester saw 970 keys in Redis against a
    capacity of 100 blocks. Its run id tells."""
    import redis

    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000)
    tier.restart_check_s = 0.0  # look at every call (10 s apart by default)
    tier.put(b"\x04" * 32, None, BLOCK)
    redis_server.stop()
    redis_server.start()
    server = redis.Redis.from_url(redis_server.url)
    assert int(server.config_get("maxmemory")["maxmemory"]) == 0  # forgotten
    with caplog.at_level(logging.INFO, logger="tierlm.kv.tiers"):
        tier.put(b"\x05" * 32, None, BLOCK)
        tier.put(b"\x06" * 32, None, BLOCK)
    assert tier.stats.errors == 0 and tier.backoff == 0  # never an outage
    assert "was restarted" in caplog.text and caplog.text.count("was restarted") == 1
    assert int(server.config_get("maxmemory")["maxmemory"]) > 1_000_000
    assert server.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    assert tier.get(b"\x06" * 32) is not None
    tier.close()


def test_a_server_that_stops_answering_info_is_not_an_outage(redis_server):
    """Where INFO is refused (an ACL, a renamed command on a managed service), the restart check
    gives up; it must not turn every 10 s into an outage."""
    import redis

    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000)
    tier.restart_check_s = 0.0
    redis.Redis.from_url(redis_server.url).execute_command("ACL", "SETUSER", "default", "-info")
    for i in range(3):
        tier.put(bytes([7 + i]) * 32, None, BLOCK)
    assert tier.backoff == 0 and tier.stats.errors == 0 and tier.stats.stores == 3
    assert tier.get(b"\x09" * 32) is not None
    tier.close()


def test_a_read_only_replica_is_named_as_such_and_reads_go_on(redis_server, caplog):
    import redis

    server = redis.Redis.from_url(redis_server.url)
    tier = RedisTier(redis_server.url)
    tier.put(b"\x04" * 32, None, BLOCK)
    server.execute_command("REPLICAOF", "127.0.0.1", "1")  # a replica (of nothing reachable): writes refused
    try:
        with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
            tier.put(b"\x05" * 32, None, BLOCK)
            tier.put(b"\x06" * 32, None, BLOCK)
        said = [r.message for r in caplog.records if "refused a write" in r.message]
        assert len(said) == 1 and "read-only replica: point kv_remote at the primary" in said[0]
        assert "raise maxmemory" not in said[0]
        assert tier.stats.errors == 2 and tier._available()
        assert tier.get(b"\x04" * 32) is not None  # reads go on
    finally:
        server.execute_command("REPLICAOF", "NO", "ONE")
        tier.close()


def test_a_user_without_a_permission_the_tier_needs_is_told_which(redis_server, caplog):
    import redis

    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("kvreader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-mget"])
    url = redis_server.url.replace("redis://", "redis://kvreader:pw@")
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
        tier = RedisTier(url)
        assert tier.fetch_run([b"\x07" * 32]) == []  # a miss, not an error raised
    said = [r.message for r in caplog.records if "refused" in r.message]
    assert len(said) == 1 and "lacks a permission tierlm needs" in said[0] and ":pw@" not in said[0]
    tier.close()


def test_cluster_refusals_are_named_whatever_redis_py_leaves_of_the_message():
    """redis-py turns MOVED/ASK/CLUSTERDOWN replies into exception classes and drops the word:
    str(MovedError) is just "3999 127.0.0.1:6381"."""
    import redis.exceptions as rx

    from tierlm.kv.tiers import _refusal_advice
    for e in (rx.MovedError("3999 127.0.0.1:6381"), rx.AskError("3999 127.0.0.1:6381"),
              rx.ClusterDownError("The cluster is down"),
              rx.ResponseError("CROSSSLOT Keys in request don't hash to the same slot")):
        assert "Redis Cluster" in (_refusal_advice(e) or ""), e
    assert _refusal_advice(rx.ResponseError("OOM command not allowed")) is None


def test_sampling_other_databases_leaves_no_connection_open(redis_server):
    import redis

    admin = redis.Redis.from_url(redis_server.url)
    for db in (2, 3):
        other = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + f"/{db}")
        other.set("tierlm:kv:" + "cd" * 32, b"x")
        other.close()
    for _ in range(3):
        RedisTier(redis_server.url, capacity_bytes=1_000_000).close()
    assert [c for c in admin.client_list() if c["db"] in ("2", "3")] == []  # the samplers' connections
