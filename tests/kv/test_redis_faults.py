"""The Redis tier when Redis misbehaves without going away: replies that trickle in, values
whose header was changed, a server that is not Redis, credentials changed under it, two engines
asking for different sizes, and writes that cannot finish by shutdown. Real redis-servers."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time

import pytest
import redis
import torch

from tierlm import AsyncEngine, SamplingParams
from tierlm.bench.netdelay import DelayProxy
from tierlm.kv.store import TieredStore
from tierlm.kv.tiers import DiskTier, HostTier, KVTierError, RedisTier, decode_entry, encode_block

from .test_prefix_and_tiers import GREEDY, _chain, _llm, _prompt, _run, _SlowDisk, cold_reference  # noqa: F401 (a fixture)

ENGINE = dict(dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=64, load_progress=False)


async def _timed(engine, prompt, t0, params=GREEDY, request_id=None):
    deltas = [d async for d in engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id)]
    return deltas, time.monotonic() - t0


async def test_a_trickling_redis_delays_only_its_own_readers_and_at_most_the_read_timeout(
        llama_dir, cold_reference, redis_server):
    """Replies arrive 64 bytes every 0.2 s: every socket read returns well within the client's
    timeout, so no error is ever raised, and one prefix read takes minutes. The request reading it
    starts without it after kv_read_timeout (recomputing, same tokens); a request arriving
    meanwhile that needs nothing from Redis, and an abort of another reading request, are served
    at once (they waited out the whole read: the step that admitted the reader waited for it,
    and the engine's loop took no new request or abort meanwhile)."""
    shared, ref = cold_reference
    writer = _llm(llama_dir, kv_remote=redis_server.url)
    _run(writer, shared + _prompt(2, 9))
    writer.close()  # the shared prefix is in Redis
    proxy = DelayProxy("127.0.0.1", redis_server.port, delay_s=0.0)
    with proxy as port:
        engine = AsyncEngine.from_model(str(llama_dir), kv_remote=f"redis://127.0.0.1:{port}/0", kv_read_timeout=2.0,
                                        **ENGINE)
        await engine.start()
        remote = engine.engine.store.tiers[-1]
        try:
            proxy.trickle = (64, 0.2)
            t0 = time.monotonic()
            late = asyncio.create_task(_timed(engine, shared + _prompt(3, 9), t0))
            gone = asyncio.create_task(_timed(engine, shared + _prompt(2, 9), t0, request_id="gone"))
            await asyncio.sleep(0.3)
            await engine.abort("gone")
            # Shorter than a block: nothing to look up (a longer one reads Redis, through the trickle, too).
            free = asyncio.create_task(_timed(engine, _prompt(4, 6), t0,
                                              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
            (gone_out, gone_s), (free_out, free_s) = await gone, await free
            # Well before the read timeout (minutes, without the fix); loose bounds for a loaded machine.
            assert gone_out[-1].finish_reason == "abort" and gone_s < 1.8
            assert free_out[-1].num_output_tokens == 3 and free_s < 1.8
            late_out, late_s = await late
            assert [t for d in late_out for t in d.token_ids] == ref[3] and 2.0 <= late_s < 10.0
            assert remote.stats.errors >= 1  # a read that slow was an outage (over by now, maybe: no backoff check)
        finally:
            # Still trickling: the write-through of what it computed (a reply per SET) is slow too.
            engine.engine.store.close_timeout_s = 1.0
            t1 = time.monotonic()
            await engine.shutdown()
            engine.engine.close()
        assert time.monotonic() - t1 < 5  # without the bound, minutes: the backlog at a reply per 0.2 s
        assert engine.engine.pool.num_used == 0


def _retagged(raw: bytes, **changes) -> bytes:
    """An entry with header fields changed and nothing else (payload and checksum as they were)."""
    (n,) = struct.unpack("<I", raw[5:9])
    header = json.loads(raw[9:9 + n])
    header.update(changes)
    new = json.dumps(header).encode()
    return raw[:5] + struct.pack("<I", len(new)) + new + raw[9 + n:]


def test_a_header_whose_dtype_or_shape_was_changed_is_never_served():
    (h, parent, data), = _chain(1)
    data = torch.randn(2, 2, 8, 2, 16)
    raw = encode_block(data, parent, key=h)
    got, _ = decode_entry(raw, h)
    assert torch.equal(got, data)
    for changes in ({"dtype": "int32"}, {"shape": [2, 2, 8, 16, 2]}, {"shape": [4, 2, 8, 2, 8]}):
        assert decode_entry(_retagged(raw, **changes), h) is None  # the checksum covers them
    layout = (torch.float32, (2, 2, 8, 2, 16))
    assert decode_entry(raw, h, layout) is not None
    other = encode_block(torch.randn(2, 2, 8, 2, 8), parent, key=h)  # intact, but not this engine's layout
    assert decode_entry(other, h) is not None and decode_entry(other, h, layout) is None
    assert decode_entry(encode_block(data.to(torch.bfloat16), parent, key=h), h, layout) is None


def test_an_engine_never_serves_a_redis_value_of_another_layout_and_deletes_it(llama_dir, cold_reference,
                                                                              redis_server, caplog):
    shared, ref = cold_reference
    writer = _llm(llama_dir, kv_remote=redis_server.url)
    _run(writer, shared + _prompt(2, 9))
    writer.close()
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys("tierlm:kv:*"))
    assert keys
    raw = client.get(keys[0])
    (n,) = struct.unpack("<I", raw[5:9])
    shape = json.loads(raw[9:9 + n])["shape"]
    h = bytes.fromhex(keys[0].decode().rsplit(":", 1)[1])
    parent = json.loads(raw[9:9 + n])["parent"]
    foreign = encode_block(torch.zeros(*shape[:-1], shape[-1] // 2, 2), bytes.fromhex(parent) if parent else None,
                           key=h)  # intact and checksummed, but of another shape
    for bad in (_retagged(raw, dtype="int32"), foreign):
        client.set(keys[0], bad)
        reader = _llm(llama_dir, kv_remote=redis_server.url, kv_remote_write_through=False)
        with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
            tokens, _, _ = _run(reader, shared + _prompt(2, 9))
        remote = reader.engine.store.tiers[-1]
        assert tokens == ref[2] and remote.stats.corrupt >= 1
        assert client.get(keys[0]) is None  # deleted: not read and counted again on every request
        assert any("damaged or foreign value" in r.message for r in caplog.records)
        assert reader.engine.stats().kv_staged_bytes == 0
        reader.close()
        client.set(keys[0], raw)


class _NotRedis:
    """A TCP server that answers `reply` (+OK) to everything: what sits at a port that is not Redis's."""

    def __init__(self, reply: bytes = b"+OK\r\n") -> None:
        self.reply = reply
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            while conn.recv(65536):
                conn.sendall(self.reply)
        except OSError:
            pass

    def close(self) -> None:
        self.server.close()


def test_an_answer_sent_before_an_outage_was_called_does_not_end_it(redis_server):
    """Readers and the writer ask Redis concurrently: one's answer to a request sent before
    another's failure called the outage ended it at once, and the next failure started a new
    outage with its back-off reset (1 s) instead of doubled."""
    tier = RedisTier(redis_server.url, retry_after_s=4.0)
    (h, parent, data), = _chain(1)
    sent = time.monotonic()
    tier._failed(ConnectionError("another thread's request failed"))
    tier._answered(sent)  # the answer to the earlier request
    assert tier.backoff == 4.0 and not tier._available()
    tier.down_until = 0.0  # the back-off is over: the next request is a retry
    tier._failed(ConnectionError("the retry failed too"))
    assert tier.backoff == 8.0  # doubled: the same outage
    tier.down_until = 0.0
    tier.put(h, parent, data)  # sent after the outage was called: it is over
    assert tier.backoff == 0.0 and torch.equal(tier.get(h), data)
    tier.close()


def test_a_server_that_is_not_redis_is_refused_at_start_and_a_miss_later(redis_server):
    fake = _NotRedis()
    try:
        with pytest.raises(KVTierError, match="does not answer like a Redis server"):
            RedisTier(f"redis://127.0.0.1:{fake.port}/0")
        (h0, p0, d0), = _chain(1)
        tier = RedisTier(redis_server.url)
        tier.put(h0, p0, d0)
        tier.client = redis.Redis.from_url(f"redis://127.0.0.1:{fake.port}/0", socket_timeout=0.5)  # swapped under it
        assert tier.fetch_run([h0]) == [] and h0 not in tier  # misses, never an exception
        tier.down_until = 0.0
        assert tier.put(h0, p0, d0) == [] and tier.stats.errors >= 1
        tier.close()
    finally:
        fake.close()


@pytest.mark.parametrize("reply", [b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
                                   b"SSH-2.0-OpenSSH_9.6\r\n"])
def test_another_protocol_at_the_address_is_refused_at_start_not_taken_for_an_outage(reply):
    """An HTTP or SSH server answers in its own protocol: that is the wrong address, which
    retrying cannot fix (it was an outage, retried for the whole run)."""
    fake = _NotRedis(reply)
    try:
        with pytest.raises(KVTierError, match="does not answer like a Redis server .*another service"):
            RedisTier(f"redis://127.0.0.1:{fake.port}/0")
    finally:
        fake.close()


def test_an_unknown_url_parameter_is_named_not_blamed_on_the_server(redis_server):
    with pytest.raises(KVTierError, match="the URL parameter 'foo' is not a connection setting") as info:
        RedisTier(redis_server.url + "?foo=bar")
    assert "host and port" not in str(info.value)


def test_credentials_changed_while_running_are_named_as_such(redis_server, caplog):
    (h0, p0, d0), = _chain(1)
    tier = RedisTier(redis_server.url)
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("requirepass", "n3w-pw")
    try:
        tier.client.connection_pool.disconnect()  # new connections must now authenticate
        with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
            assert tier.fetch_run([h0]) == []
        said = " ".join(r.message for r in caplog.records)
        assert "wants other credentials than the URL gives" in said and "redis://:PASSWORD@" in said
    finally:
        redis.Redis(host="127.0.0.1", port=redis_server.port, password="n3w-pw").config_set("requirepass", "")
        tier.close()


def test_engines_asking_for_different_remote_capacities_are_warned_about(redis_server, caplog):
    """kv_remote_capacity sets the server's maxmemory: two engines asking for different sizes
    overwrite each other's. The one that lowers it says so (it did silently)."""
    big = RedisTier(redis_server.url, capacity_bytes=10 << 20)
    admin = redis.Redis.from_url(redis_server.url)
    assert int(admin.config_get("maxmemory")["maxmemory"]) >= 10 << 20
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
        small = RedisTier(redis_server.url, capacity_bytes=1 << 20)
    assert int(admin.config_get("maxmemory")["maxmemory"]) < 4 << 20  # what it asked for, as documented
    assert any("the last one to start wins: give them all the same" in r.message for r in caplog.records)
    for t in (big, small):
        t.close()


def test_values_of_another_entry_format_are_left_alone(redis_server):
    """During a rolling upgrade two tierlm versions share one Redis: each reads and writes only
    keys of its own entry format, so neither deletes the other's values as damaged."""
    (h0, p0, d0), = _chain(1)
    admin = redis.Redis.from_url(redis_server.url)
    old_key = "tierlm:kv:" + h0.hex()  # where the previous format (TLKV2) kept this block
    admin.set(old_key, b"TLKV2 an entry of the previous format")
    tier = RedisTier(redis_server.url)
    assert tier.fetch_run([h0]) == [] and tier.stats.corrupt == 0 and admin.get(old_key) is not None
    tier.put(h0, p0, d0)
    assert torch.equal(tier.fetch_run([h0])[0][0], d0) and admin.get(old_key).startswith(b"TLKV2")
    tier.close()


def test_time_queued_for_a_reader_is_not_blamed_on_redis(redis_server):
    """With one reader, a job waits behind another's reads: admitted past the read timeout, it
    was reported as Redis being too slow, and Redis was skipped by everyone for the back-off."""
    (h0, p0, d0), (h1, p1, d1) = _chain(2)
    tier = RedisTier(redis_server.url)
    tier.put(h0, p0, d0)
    fetch_run = tier.fetch_run

    def slow_first(hashes):
        if h0 in hashes:
            time.sleep(0.4)  # within the timeout, round trip by round trip
        return fetch_run(hashes)

    tier.fetch_run = slow_first
    store = TieredStore([tier], readers=1, read_timeout_s=0.3)
    first = store.prefetch([h0])
    queued = store.prefetch([h1])
    assert first.done.wait(5)
    time.sleep(0.05)
    assert store.overdue(queued) or queued.done.is_set()  # past the timeout since it was made
    store.settle(queued)
    assert tier.backoff == 0 and tier.stats.errors == 0  # not an outage: it had only just started
    store.close()


def test_a_read_overdue_with_most_of_it_on_redis_is_blamed_though_its_reader_started_late(redis_server):
    """The loop admits a request the moment its read is overdue, so a read whose reader started
    a little after the job was made never had a full timeout on Redis by then: a trickling
    Redis went unblamed (a flaky CI run). Half the timeout on Redis itself is enough."""
    (h0, p0, d0), (h1, p1, d1) = _chain(2)
    tier = RedisTier(redis_server.url)
    tier.put(h0, p0, d0)
    tier.put(h1, p1, d1)
    fetch_run, release = tier.fetch_run, threading.Event()

    def slow(hashes):
        release.wait(0.05 if h0 in hashes else 5)  # the first read is quick; the second hangs
        return fetch_run(hashes)

    tier.fetch_run = slow
    store = TieredStore([tier], readers=1, read_timeout_s=0.3)
    first, late = store.prefetch([h0]), store.prefetch([h1])
    assert first.done.wait(5)
    time.sleep(max(0.0, late.created + 0.31 - time.monotonic()))
    assert store.overdue(late)
    store.settle(late)
    release.set()
    assert tier.stats.errors == 1 and tier.backoff > 0
    store.close()


def test_a_read_stuck_on_a_trickle_frees_its_reader_once_redis_counts_as_down(redis_server):
    """All readers stuck on replies that trickle in held up every read queued behind them (even
    of blocks on the local disk): each later request waited the whole read timeout and then
    started cold. Once a stuck read makes Redis count as down, its connections are closed, the
    reader is free, and the queued read finds Redis skipped at once."""
    blocks = _chain(3)
    proxy = DelayProxy("127.0.0.1", redis_server.port, delay_s=0.0)
    with proxy as port:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0")
        for block in blocks:
            tier.put(*block)
        store = TieredStore([tier], readers=1, read_timeout_s=0.5)
        proxy.trickle = (16, 0.2)  # ~1 KB of reply: minutes
        stuck = store.prefetch([h for h, _, _ in blocks])
        queued = store.prefetch([blocks[0][0]])
        time.sleep(0.7)
        assert not stuck.done.is_set() and not queued.started
        store.settle(stuck)  # its request starts without it: Redis counts as down
        assert tier.backoff > 0
        assert queued.done.wait(2) and queued.found == 0  # the reader was freed; Redis skipped while down
        proxy.trickle = None
        store.close()


def test_disk_writes_never_queue_behind_a_slow_redis(redis_server, tmp_path):
    """One writer thread served both: at shutdown, blocks bound for the fast local disk were lost
    behind Redis writes crawling at a reply per 0.2 s (a restart found 50 of 380 entries)."""
    blocks = _chain(6)
    proxy = DelayProxy("127.0.0.1", redis_server.port, delay_s=0.0)
    with proxy as port:
        disk = DiskTier(tmp_path / "kv", 64, index_in_background=False)
        disk.index()
        remote = RedisTier(f"redis://127.0.0.1:{port}/0")
        store = TieredStore([disk, remote], close_timeout_s=1.0)
        proxy.trickle = (1, 0.2)  # "+OK\r\n" takes a second
        for h, parent, data in blocks:
            store.write_through_block(h, parent, data)  # to Redis: crawling
        for h, parent, data in blocks:
            store.demote(h, parent, data)  # to disk
        t0 = time.monotonic()
        with store.deadline():
            assert store.flush() is False  # Redis's writes did not all land
        assert time.monotonic() - t0 < 4 and len(disk) == 6  # the disk's did
        proxy.trickle = None
        store.close()


def test_blocks_the_disk_evicts_reach_redis_however_full_the_backlog(redis_server, tmp_path):
    """A host spill (as persisting does) keeps the writers' backlog full by design; what the full
    disk evicts on the way goes on to Redis's writer, and was dropped there as "Redis cannot keep
    up" (written inline before, it never was)."""
    blocks, parent = [], None
    for i in range(12):
        h = bytes([0x20 + i]) * 32
        blocks.append((h, parent, torch.full((2, 2, 64), float(i))))
        parent = h
    size = blocks[0][2].numel() * 4
    disk = DiskTier(tmp_path / "kv", 4, index_in_background=False)
    disk.index()
    remote = RedisTier(redis_server.url)
    store = TieredStore([HostTier(12), disk, remote], write_through_remote=False, backlog_bytes=4 * size)
    for block in blocks:
        store.demote(*block)
    assert store.spill(0) == 12
    store.flush()
    assert len(disk) == 4 and remote.stats.stores == 8 and remote.stats.dropped == 0
    assert store.backlog == 0 and not store.pending
    store.close()


def test_close_does_not_wait_for_reads_nobody_will_use(tmp_path, caplog):
    gate = threading.Event()
    disk = DiskTier(tmp_path / "kv", 8)
    (h0, p0, d0), = _chain(1)
    disk.put(h0, p0, d0)
    read = disk._read
    disk._read = lambda h: read(h) if gate.wait(10) else None  # a hung read
    store = TieredStore([disk], close_timeout_s=2.0)
    job = store.prefetch([h0])
    time.sleep(0.1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.store"):
        store.close()
    assert time.monotonic() - t0 < 1.5 and job.cancelled
    assert not any("writes were still under way" in r.message for r in caplog.records)
    gate.set()


def test_close_gives_up_on_writes_a_stuck_tier_cannot_finish(tmp_path, caplog):
    gate = threading.Event()
    store = TieredStore([_SlowDisk(tmp_path / "kv", 64, gate=gate)], close_timeout_s=0.3)
    for h, parent, data in _chain(5):
        store.demote(h, parent, data)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.store"):
        store.close()
    assert time.monotonic() - t0 < 3
    assert any("dropped those still queued (4 for disk)" in r.message for r in caplog.records)  # one was being written
    gate.set()
    store._threads[0].join(5)  # the write under way lands
    # What was dropped is no longer counted as queued, nor kept (4 blocks' backlog and their K/V before)
    assert store.backlog == 0 and not store.pending and store.tiers[0].stats.dropped == 4


class _IndexingBehindAHungWrite(DiskTier):
    """Reads an earlier run's headers only once a write has hung (holding the tier's lock), so
    the indexer then waits for that lock to swap its index in."""

    def __init__(self, *args, writing, gate, **kw):
        self.writing, self.gate, self.indexing = writing, gate, threading.Event()
        self.listed = threading.Event()
        super().__init__(*args, **kw)

    def list_earlier(self):
        # The listing takes the lock too: the write must hang only after it (else the indexer
        # waits there, before the headers, and the order the test sets up never happens).
        super().list_earlier()
        self.listed.set()

    def _read_headers(self):
        assert self.writing.wait(10)
        self.indexing.set()  # what it does first is take the lock the hung write holds
        return super()._read_headers()

    def _write(self, h, parent, data, hint):
        self.writing.set()
        assert self.gate.wait(10)
        super()._write(h, parent, data, hint)


def test_close_does_not_wait_for_an_indexer_stuck_behind_a_hung_write(tmp_path, caplog):
    earlier = DiskTier(tmp_path / "kv", 64, index_in_background=False)
    for h, parent, data in _chain(5):
        earlier.put(h, parent, data)
    earlier.close()
    writing, gate = threading.Event(), threading.Event()
    disk = _IndexingBehindAHungWrite(tmp_path / "kv", 64, writing=writing, gate=gate)
    store = TieredStore([disk], close_timeout_s=0.3)
    assert disk.listed.wait(10)
    store.demote(b"\x77" * 32, None, torch.ones(2, 2, 4))
    assert writing.wait(10) and disk.indexing.wait(10)
    time.sleep(0.2)  # the indexer waits for the lock
    closing = threading.Thread(target=store.close, daemon=True)
    with caplog.at_level(logging.WARNING, logger="tierlm.kv.tiers"):
        closing.start()
        closing.join(8)
    stuck = closing.is_alive()
    gate.set()
    assert not stuck, "close() waited for the hung write through the indexer"
    assert any("still indexing at shutdown" in r.message for r in caplog.records)
    again = DiskTier(tmp_path / "kv", 64, index_in_background=False)  # the directory's lock was released
    again.close()


class _BrokenDisk(DiskTier):
    def _write(self, h, parent, data, hint):
        raise RuntimeError("a bug, not an OSError")


def test_a_write_that_raises_leaves_nothing_queued_behind(tmp_path):
    """The block stays servable while queued; once its write has failed it is a miss, and its
    K/V is not kept in memory for good."""
    store = TieredStore([_BrokenDisk(tmp_path / "kv", 64)])
    (h0, p0, d0), = _chain(1)
    store.demote(h0, p0, d0)
    store.flush()
    assert not store.pending and store.backlog == 0 and store.fetch(h0) is None
    store.close()
