"""Prefix caching and the tiered KV cache against cold runs on a real tiny model."""
from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import re
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tierlm import LLM, SamplingParams
from tierlm.engine.request import RequestStatus
from tierlm.engine.runner import kv_bytes_per_block
from tierlm.kv.prefix_cache import chain_hashes, extra_key
from tierlm.config import EngineConfig
from tierlm.errors import KVTierError
from tierlm.kv.policies import DuelPolicy, LFUPolicy, LRUPolicy
from tierlm.kv.store import TieredStore, nbytes
from tierlm.kv.tiers import DiskTier, HostTier, RedisTier, decode_block, decode_entry, encode_block, patch_hint

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory=kw.pop("kv_cache_memory", 4 << 20), block_size=8,
               max_num_batched_tokens=64, load_progress=False, **kw)


def _run(llm: LLM, prompt: list[int], params=GREEDY, **kw):
    before = llm.engine.stats().prompt_tokens
    out = llm.generate([{"prompt_token_ids": prompt}], params, **kw)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens, llm.engine.stats().prompt_tokens - before


def _prefix_on_disk(path, tmp_path, shared: list[int], **kw) -> LLM:
    """An engine with a disk tier that holds `shared`'s blocks (written down from the device)."""
    llm = _llm(path, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", **kw)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.persist_kv()
    return llm


def _hog(eng, n: int):
    """A long request, running: it holds most of a small pool for its 40 decode steps."""
    hog = eng.add_request({"prompt_token_ids": _prompt(9, n)}, SamplingParams(max_tokens=40, temperature=0,
                                                                               ignore_eos=True))
    eng.step()
    eng.step()
    return hog


@given(st.lists(st.integers(0, 2**40), max_size=80), st.sampled_from([1, 2, 8, 16]), st.binary(max_size=12),
       st.integers(0, 80))
@settings(max_examples=60, deadline=None)
def test_block_hashes_chain_sha256_of_parent_int64_tokens_and_extra(tokens, block_size, extra, known_len):
    """The key format disk and Redis entries are stored under (so a tier an earlier version
    wrote still hits): SHA-256 of the parent's hash (32 zero bytes for the first block), the
    block's ids as little-endian int64 and the extra key; extending a known prefix's hashes
    gives the hashes of the whole."""
    want, parent = [], b"\x00" * 32
    for start in range(0, len(tokens) - block_size + 1, block_size):
        ids = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[start:start + block_size])
        parent = hashlib.sha256(parent + ids + extra).digest()
        want.append(parent)
    assert chain_hashes(tokens, block_size, extra) == want
    known = chain_hashes(tokens[:known_len], block_size, extra)
    assert chain_hashes(tokens, block_size, extra, known) == want


@pytest.fixture(scope="module")
def cold_reference(llama_dir):
    llm = _llm(llama_dir, enable_prefix_caching=False)
    shared = _prompt(1, 70)
    return shared, {k: _run(llm, shared + _prompt(k, 9))[0] for k in (2, 3)}


def test_prefix_hit_same_tokens_fewer_computed(llama_dir, cold_reference):
    shared, ref = cold_reference
    llm = _llm(llama_dir)
    t1, cached1, computed1 = _run(llm, shared + _prompt(2, 9))
    t2, cached2, computed2 = _run(llm, shared + _prompt(3, 9))
    assert t1 == ref[2] and t2 == ref[3]
    assert cached1 == 0 and cached2 == 64  # 8 full blocks of the shared 70 tokens
    assert computed2 == 79 - 64 < computed1
    assert llm.engine.stats().prefix_cache_hits == 64
    assert llm.engine.stats().kv_device_hit_blocks == 8



def test_an_engine_without_prefix_caching_counts_no_lookups(llama_dir):
    """Nothing is looked up, so nothing is a miss: its hit rate is no 0 % to alert on."""
    llm = _llm(llama_dir, enable_prefix_caching=False)
    _run(llm, _prompt(1, 20))
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0) and stats.prompt_tokens == 20

@pytest.mark.parametrize("tier", ["host", "disk", "redis"])
def test_prefix_demoted_and_promoted_back(tier, llama_dir, cold_reference, tmp_path, request):
    shared, ref = cold_reference
    kw = {"host": dict(kv_host_capacity="64 blocks"),
          "disk": dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks"),
          "redis": {}}[tier]
    if tier == "redis":
        kw = dict(kv_remote=request.getfixturevalue("redis_server").url)
    llm = _llm(llama_dir, **kw)
    _run(llm, shared + _prompt(2, 9))
    assert llm.engine.offload_prefix_cache() > 0  # nothing cached on the device any more
    assert llm.engine.pool.cached == {}
    tokens, cached, computed = _run(llm, shared + _prompt(3, 9))
    assert tokens == ref[3]
    assert cached == 64 and computed == 15
    stats = llm.engine.stats()
    assert stats.kv_tiers[tier]["hits"] == 8 and stats.kv_promoted_blocks == 8


def test_host_eviction_demotes_to_disk(llama_dir, cold_reference, tmp_path):
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="3 blocks", kv_disk_dir=str(tmp_path / "kv"))
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    tiers = llm.engine.stats().kv_tiers
    assert tiers["host"]["evictions"] > 0 and tiers["disk"]["stores"] > 0
    tokens, cached, _ = _run(llm, shared + _prompt(3, 9))
    assert tokens == ref[3] and cached == 64
    tiers = llm.engine.stats().kv_tiers
    assert tiers["disk"]["hits"] > 0 and tiers["host"]["hits"] > 0


def test_eviction_policy_is_chosen_per_tier(llama_dir, tmp_path):
    llm = _llm(llama_dir, eviction_policy="lru", kv_host_capacity="4 blocks", kv_host_policy="lfu",
               kv_disk_dir=str(tmp_path / "kv"))
    host, disk = llm.engine.store.tiers
    assert type(llm.engine.pool.policy) is LRUPolicy
    assert type(host.policy) is LFUPolicy and type(disk.policy) is DuelPolicy  # disk: kv_tier_policy
    assert llm.engine.kv.prefetching == (llm.engine.device.type == "cuda")  # kv_prefetch=None, no Redis
    cfg = EngineConfig(kv_tier_policy="lru", kv_disk_policy="arc")
    assert (cfg.tier_policy("host"), cfg.tier_policy("disk")) == ("lru", "arc")


def test_policy_history_reaches_every_tier_and_the_disk_tiers_rebuilt_policy(llama_dir, cold_reference, tmp_path):
    """`kv_policy_history` bounds what each learning policy remembers (85 MiB each at the default),
    including the policy the disk tier builds anew once it has indexed an earlier run."""
    shared, ref = cold_reference
    kw = dict(kv_host_capacity="4 blocks", kv_host_policy="lru", kv_disk_dir=str(tmp_path / "kv"),
              kv_policy_history=2048)
    llm = _llm(llama_dir, **kw)
    _run(llm, shared + _prompt(2, 9))
    llm.close()  # its blocks go down to disk, for the next engine to index
    llm = _llm(llama_dir, **kw)
    host, disk = llm.engine.store.tiers
    assert disk.wait_indexed(30) and len(disk) > 0
    assert llm.engine.pool.policy.history == 2048 and disk.policy.history == 2048
    assert not hasattr(host.policy, "history")  # LRU keeps none
    assert _run(llm, shared + _prompt(3, 9))[:2] == (ref[3], 64)
    llm.close()
    with pytest.raises(ValueError, match="kv_policy_history must be .* at least 1024"):
        LLM(str(tmp_path / "no-model-here"), kv_policy_history=10)


@pytest.mark.parametrize("knob, name, says", [("kv_host_policy", "mru", "unknown eviction policy"),
                                              ("eviction_policy", "belady", "offline reference"),
                                              ("kv_tier_policy", "oracle_pop", "offline reference")])
def test_bad_policy_names_are_refused_before_loading(knob, name, says, tmp_path):
    missing = tmp_path / "no-model-here"  # validation must fail before the checkpoint is read
    with pytest.raises(ValueError, match=says) as err:
        LLM(str(missing), **{knob: name})
    assert knob in str(err.value) and "lru" in str(err.value)


@pytest.mark.parametrize("bad, says", [
    (dict(kv_disk_dir="d", kv_disk_capacity="abc"), "kv_disk_capacity: cannot read"),
    (dict(kv_host_capacity=-5), "kv_host_capacity: cannot read"),
    (dict(kv_host_capacity="-1GiB"), "kv_host_capacity: cannot read"),
    (dict(kv_host_capacity="inf GiB"), "kv_host_capacity: cannot read"),
    (dict(kv_remote="redis://h/0", kv_remote_capacity="lots"), "kv_remote_capacity: cannot read"),
    (dict(kv_remote="http://127.0.0.1:6379"), "not a Redis URL"),
    (dict(kv_remote="http://u:hunter2@h"), r"'http://u:\*\*\*@h' is not a Redis URL"),  # no password echoed
    (dict(kv_disk_capacity="8GiB"), "kv_disk_capacity is set but kv_disk_dir is not"),
    (dict(kv_disk_write_through=True), "kv_disk_write_through is set but kv_disk_dir is not"),
    (dict(kv_remote_ttl=60), "kv_remote_ttl is set but kv_remote is not"),
    (dict(kv_remote_capacity="1GiB"), "kv_remote_capacity is set but kv_remote is not"),
    (dict(enable_prefix_caching=False, kv_host_capacity="64 blocks"),
     r"kv_host_capacity given with enable_prefix_caching off .*they would stay empty"),
    (dict(enable_prefix_caching=False, kv_disk_dir="d", kv_remote="redis://h/0"),
     "kv_disk_dir, kv_remote given with enable_prefix_caching off"),
])
def test_bad_tier_settings_are_refused_before_loading(bad, says, tmp_path):
    with pytest.raises(ValueError, match=says):
        LLM(str(tmp_path / "no-model-here"), **bad)
    assert not (tmp_path / "d").exists()  # nothing created either


def test_unusable_disk_dirs_and_pools_larger_than_the_machine_are_refused_before_loading(tmp_path):
    from tierlm.config import host_memory
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "not-mounted-yet")
    for bad, says in [
        (dict(kv_disk_dir=str(tmp_path / "a-file")), "exists and is not a directory"),
        (dict(kv_disk_dir=str(tmp_path / "a-file" / "kv")), "is not a writable directory"),
        (dict(kv_disk_dir=str(tmp_path / "dangling" / "kv")), "is a symbolic link to nothing"),
        (dict(kv_cache_memory=host_memory()[0] + (1 << 30)), r"kv_cache_memory is .* GiB but this machine has .* GiB in all"),
    ]:
        with pytest.raises(ValueError, match=says):
            LLM(str(tmp_path / "no-model-here"), device="cpu", **bad)


def test_a_pool_larger_than_the_free_memory_is_refused_after_loading(llama_dir, monkeypatch):
    """Past the machine's total it is refused before loading (above); past what is free once the
    weights are in, here, before a byte of it is allocated."""
    from tierlm import config
    total = config.host_memory()[0]
    monkeypatch.setattr(config, "host_memory", lambda: (total, 3 << 20))
    with pytest.raises(ValueError, match=r"kv_cache_memory is 4.0 MiB but this machine has 3.0 MiB free now"):
        _llm(llama_dir, kv_cache_memory=4 << 20, device="cpu")  # host memory: the pool's on the CPU


def test_a_disk_capacity_of_zero_turns_the_tier_off_and_leaves_its_directory_alone(llama_dir, tmp_path):
    root = tmp_path / "kv"
    with _llm(llama_dir, kv_host_capacity=0, kv_disk_dir=str(root)) as llm:
        _run(llm, _prompt(4, 60))
    files = sorted(root.rglob("*"))
    assert any(f.suffix == ".kv" for f in files)
    off = _llm(llama_dir, kv_disk_dir=str(root), kv_disk_capacity="0 blocks")
    assert off.engine.store is None
    assert _llm(llama_dir, kv_disk_dir=str(root), kv_disk_capacity=0).engine.store is None  # 0 as a number too
    _run(off, _prompt(5, 60))
    assert sorted(root.rglob("*")) == files  # nothing trimmed, written or locked
    with _llm(llama_dir, kv_disk_dir=str(root)) as again:  # the directory is free for another engine
        assert _run(again, _prompt(4, 60))[1] > 0
    off.close()


def test_a_relative_disk_dir_stays_where_it_was_when_the_process_moves(llama_dir, cold_reference, tmp_path,
                                                                      monkeypatch):
    """A library user's chdir after start moved the tier to a second, unlocked directory, and
    every block stored before it missed."""
    shared, ref = cold_reference
    monkeypatch.chdir(tmp_path)
    llm = _llm(llama_dir, kv_disk_dir="kv", kv_disk_capacity="64 blocks")
    _run(llm, shared + _prompt(2, 9))
    llm.engine.persist_kv()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tokens, cached, _ = _run(llm, shared + _prompt(3, 9))
    assert tokens == ref[3] and cached == 64
    assert not (tmp_path / "elsewhere" / "kv").exists()
    llm.close()


def test_a_disk_dir_under_home_is_expanded_not_made_in_a_folder_named_tilde(llama_dir, tmp_path, monkeypatch):
    """A disk tester's case: `kv_disk_dir="~/kv"` from a config dict (no shell to expand it)
    made a folder named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    llm = _llm(llama_dir, kv_disk_dir="~/kv", kv_disk_capacity="64 blocks")
    llm.close()
    assert (tmp_path / "home" / "kv").is_dir() and not (tmp_path / "~").exists()


def test_lower_tiers_policies_tick_once_per_request_like_the_device_pool(llama_dir, cold_reference, tmp_path):
    """Their constants (TLP's alpha, Gittins' half-life, chain's same-request segments) are per
    request; the host and disk tiers ticked once per block stored or read, so a Gittins
    half-life of 2,000 requests forgot within some 20."""
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    eng = llm.engine
    host, disk = eng.store.tiers
    for i in (2, 3, 2):
        assert _run(llm, shared + _prompt(i, 9))[0] == ref[i]
        eng.offload_prefix_cache()  # ten blocks or so through the host tier, most on to disk
    assert host.stats.stores > 10 and disk.stats.stores > 5
    assert host.clock == disk.clock == eng.pool._clock == 3
    llm.close()


def test_capacities_read_blocks_and_byte_units():
    from tierlm.kv.tiers import parse_capacity
    mib = 1 << 20
    assert parse_capacity("1000 blocks", mib) == parse_capacity("1000block", mib) == 1000
    assert parse_capacity("4194304B", mib) == parse_capacity("4194304 b", mib) == 4  # B is bytes
    for small in (4000, "4000", "4000B", "0.5MiB", "0.5B", "0.0000001kb"):  # not 0, under one block: refused, not "off"
        with pytest.raises(ValueError, match="less than one KV block"):
            parse_capacity(small, mib)
    assert parse_capacity("2TiB", mib) == parse_capacity("2Ti", mib) == 2 << 20
    assert parse_capacity("1.5 GB", mib) == 1_500_000_000 // mib and parse_capacity("512MiB", mib) == 512
    assert parse_capacity(3 * mib + 5, mib) == 3 and parse_capacity("0", mib) == 0 and parse_capacity(None, mib) == 0
    for bad in ("abc", "-5", -5, "nan GiB", "1e400GiB", "GiB", True, "2 kilobytes", "²", "²GiB"):
        with pytest.raises(ValueError, match="cannot read KV tier capacity"):
            parse_capacity(bad, mib)


def test_a_disk_capacity_in_bytes_counts_each_entry_file_whole(tmp_path):
    from tierlm.engine.engine import build_tiers
    from tierlm.kv.tiers import ENTRY_HEADER_BYTES

    block_bytes = 64 << 10
    for size, fits in [(10 * (block_bytes + ENTRY_HEADER_BYTES), 10), (10 * block_bytes, 9)]:
        store = build_tiers(EngineConfig(kv_disk_dir=str(tmp_path / str(size)), kv_disk_capacity=size),
                            block_bytes, torch.device("cpu"), "id")
        disk, = store.tiers
        assert disk.capacity == fits
        data = torch.zeros(block_bytes // 4)
        h = b"\x07" * 32
        disk.put(h, None, data)
        assert disk.path(h).stat().st_size <= block_bytes + ENTRY_HEADER_BYTES  # the header bound holds
        store.close()


def test_a_host_capacity_in_bytes_counts_pinned_blocks_at_their_rounded_size():
    """On CUDA each host block is pinned, and torch's pinned allocator rounds it up to a power of
    two: a byte budget buys fewer blocks there, so the tier stays within what it was given."""
    from tierlm.engine.engine import tier_capacities
    from tierlm.kv.tiers import host_block_bytes

    qwen_05b = 196_608  # 24 layers x 2 x 16 tokens x 2 KV heads x 64 x 2 bytes
    assert host_block_bytes(qwen_05b, pinned=True) == 262_144 and host_block_bytes(qwen_05b, pinned=False) == qwen_05b
    assert host_block_bytes(1 << 20, pinned=True) == 1 << 20 and host_block_bytes(5 << 20, pinned=True) == 8 << 20
    cfg = EngineConfig(kv_host_capacity="1GiB", kv_remote_capacity="1GiB")
    host_cpu, _, remote_cpu = tier_capacities(cfg, qwen_05b, torch.device("cpu"))
    host_cuda, _, remote_cuda = tier_capacities(cfg, qwen_05b, torch.device("cuda"))
    assert (host_cpu, host_cuda) == ((1 << 30) // qwen_05b, (1 << 30) // 262_144)
    assert remote_cpu == remote_cuda == (1 << 30) // qwen_05b  # Redis stores the bytes themselves
    blocks = EngineConfig(kv_host_capacity="100 blocks")
    assert tier_capacities(blocks, qwen_05b, torch.device("cuda"))[0] == 100  # a count is a count


@pytest.mark.parametrize("bad, says", [
    (dict(kv_host_capacity="1000"), "kv_host_capacity: KV tier capacity '1000' is less than one KV block"),
    (dict(kv_disk_dir="DIR", kv_disk_capacity="2KiB"), "kv_disk_capacity: .* less than one KV block"),
    (dict(kv_cache_memory=10), "kv_cache_memory=10 holds no KV block"),
    (dict(kv_cache_memory="1KiB"), "kv_cache_memory='1KiB' holds no KV block"),
    (dict(kv_cache_memory="10**12 blocks"), "cannot read kv_cache_memory"),
    (dict(kv_cache_memory="0 blocks"), "kv_cache_memory must be positive"),
    (dict(kv_cache_memory="4000000000 blocks"), r"kv_cache_memory is .* but this machine has .* in all"),
])
def test_sizes_under_one_block_are_refused_before_the_weights_load(llama_dir, tmp_path, monkeypatch, bad, says):
    import tierlm.engine.engine as engine_mod

    def no_load(*args, **kw):
        raise AssertionError("the weights were loaded before the sizes were checked")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    bad = {k: str(tmp_path / "kv") if v == "DIR" else v for k, v in bad.items()}
    with pytest.raises(ValueError, match=says):
        _llm(llama_dir, device="cpu", **bad)  # "this machine has": the device pool's on the CPU


def test_device_pool_given_as_a_size_or_a_block_count(llama_dir):
    """kv_cache_memory takes what the tier capacities take: a byte count, a size, or blocks."""
    assert _llm(llama_dir, kv_cache_memory="24 blocks").engine.pool.num_blocks == 24
    by_size = _llm(llama_dir, kv_cache_memory="1MiB")
    by_bytes = _llm(llama_dir, kv_cache_memory=1 << 20)
    assert by_size.engine.pool.num_blocks == by_bytes.engine.pool.num_blocks > 24


def test_host_tier_larger_than_the_machine_is_refused(llama_dir, tmp_path):
    from tierlm.config import host_memory
    total = host_memory()[0]
    with pytest.raises(ValueError, match=r"kv_host_capacity is .* GiB but this machine has"):
        _llm(llama_dir, kv_host_capacity=total + (1 << 30), kv_disk_dir=str(tmp_path / "kv"))
    assert not (tmp_path / "kv").exists()  # refused before the disk tier claimed its directory


def test_host_tiers_of_several_models_in_one_process_must_fit_the_machine_together(llama_dir, monkeypatch, caplog):
    """kv_host_capacity is each model's own and a host tier fills lazily, so two models of one
    server each given 60% of the machine were both let in (the OOM killer came once both had
    filled). This process's open host tiers count too: the second is refused, naming them; once
    the first is closed, it fits."""
    from tierlm.engine import engine as engine_module
    monkeypatch.setattr(engine_module, "host_memory", lambda: (1 << 30, 1 << 30))
    first = _llm(llama_dir, kv_host_capacity="600MiB")
    with pytest.raises(ValueError, match=r"kv_host_capacity is 0.6 GiB and this process's other models' host tiers "
                                         r"may take 0.6 GiB .* but this machine has 1.0 GiB"):
        _llm(llama_dir, kv_host_capacity="600MiB")
    first.close()
    with caplog.at_level(logging.WARNING, logger="tierlm.engine.engine"):
        _llm(llama_dir, kv_host_capacity="600MiB").close()
    assert not [r for r in caplog.records if "kv_host_capacity" in r.getMessage()]


def test_tier_round_trips_are_bitwise_equal(tmp_path, redis_server, redis_server_on_a_unix_socket):
    data = torch.randn(3, 2, 8, 2, 16).to(torch.bfloat16)
    h = b"\x01" * 32
    assert torch.equal(decode_block(encode_block(data)).view(torch.uint8), data.view(torch.uint8))
    entry = io.BytesIO(encode_block(data, h))
    assert patch_hint(entry, 4321)  # the hint slot, rewritten in place: same length, payload intact
    got, hint = decode_entry(entry.getvalue())
    assert hint == 4321 and torch.equal(got.view(torch.uint8), data.view(torch.uint8))
    assert not patch_hint(io.BytesIO(b"not an entry"), 1)
    for tier in (HostTier(4), DiskTier(tmp_path / "d", 4), RedisTier(redis_server.url),
                 RedisTier(redis_server_on_a_unix_socket.url)):  # unix:///path?db=0
        tier.put(h, None, data)
        got = tier.get(h)
        assert got is not None and got.dtype == data.dtype
        assert torch.equal(got.view(torch.uint8), data.view(torch.uint8)), tier.name


def test_device_blocks_move_in_batches_bitwise_and_each_in_its_own_memory(llama_dir):
    """The runner's batched copies (one gather per layer, one copy per block): blocks read out
    in any order come back exactly, into other blocks, and every block owns its host memory (a
    tier that drops one block must free its bytes, not keep a whole batch alive)."""
    llm = _llm(llama_dir)
    runner = llm.engine.runner
    torch.manual_seed(0)
    for c in runner.kv_caches:
        c.copy_(torch.randn_like(c))
    src = [7, 2, 11, 3]
    def device_block(b):
        return torch.stack([c[:, b] for c in runner.kv_caches]).cpu()
    got = runner.read_blocks(src)
    runner.copies_done()
    assert len(got) == len(src)
    for b, data in zip(src, got):
        assert data.device.type == "cpu" and data.is_contiguous() and data.dtype == torch.float32
        assert data.untyped_storage().nbytes() == data.numel() * data.element_size()  # its own memory
        assert torch.equal(data.view(torch.int32), device_block(b).view(torch.int32))
    before = [device_block(b) for b in (1, 5)]
    dst = [20, 9, 4, 30]
    runner.write_blocks(dst, got)
    for b, data in zip(dst, got):
        assert torch.equal(device_block(b).view(torch.int32), data.view(torch.int32))
    for b, old in zip((1, 5), before):  # blocks not named are untouched
        assert torch.equal(device_block(b).view(torch.int32), old.view(torch.int32))
    runner.write_blocks([6], [got[0].double()])  # a tier holding another dtype: converted on the way in
    assert torch.equal(device_block(6).view(torch.int32), got[0].view(torch.int32))
    assert runner.read_blocks([]) == [] and runner.write_blocks([], []) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works here; the fallback needs it to fail")
def test_host_tier_that_cannot_pin_memory_keeps_blocks_in_ordinary_memory(caplog):
    """Page-locked memory runs out (a container's limit) on CUDA machines; here, without a
    device, pinning fails the same way: the tier must store the block anyway, not fail the step."""
    tier = HostTier(4, pin=True)
    (h, parent, data), (h2, _, data2) = _chain(2)
    with caplog.at_level("WARNING"):
        assert tier.put(h, parent, data) == [] and tier.put(h2, h, data2) == []
    assert torch.equal(tier.get(h), data) and torch.equal(tier.get(h2), data2) and tier.stats.errors == 0
    assert caplog.text.count("cannot pin memory") == 1 and not tier.pin


def test_writer_fences_device_copies_before_reading_a_block(tmp_path):
    """Demoted K/V may still be in flight from the device (CUDA copy stream): the writer thread
    must wait on the fence before it encodes a block for disk, every time."""
    disk_dir = tmp_path / "kv"
    on_disk_at_fence: list[int] = []
    store = TieredStore([HostTier(1), DiskTier(disk_dir, 8)],
                        fence=lambda: on_disk_at_fence.append(len(list(disk_dir.rglob("*.kv")))))
    blocks = [(bytes([i]) * 32, torch.full((2, 2, 4), float(i))) for i in range(4)]
    for h, data in blocks:
        store.demote(h, None, data)  # host holds one block: each new one pushes the last to disk
    store.flush()
    assert on_disk_at_fence == [0, 1, 2]  # fenced before each of the three disk writes
    for h, data in blocks:
        assert torch.equal(store.fetch(h)[1], data)
    store.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_lower_tier_prefix_is_prefetched_on_arrival_and_read_once(tier, llama_dir, cold_reference, tmp_path,
                                                                  request):
    shared, ref = cold_reference
    where = (dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks") if tier == "disk" else
             dict(kv_remote=request.getfixturevalue("redis_server").url, kv_remote_write_through=False))
    llm = _llm(llama_dir, kv_prefetch=True, **where)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    eng, store = llm.engine, llm.engine.store
    misses = store.stats()[tier]["misses"]
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    store.flush()  # the reader thread has staged the prefix before the request is scheduled
    assert store.stats()[tier]["hits"] == 8 and len(store.staged) == 8
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64
    stats = store.stats()[tier]
    assert stats["hits"] == 8 and stats["promotions"] == 8  # admission read staging, not the tier
    assert stats["misses"] == misses + 1  # the block past the run: probed by the reader, not again
    assert not store.staged and store.staged_bytes == 0


def test_a_request_waiting_for_room_keeps_its_lower_tier_hit(llama_dir, cold_reference, tmp_path):
    """Admission that fails for want of device blocks keeps what the lower tiers gave: the next
    try neither counts the host hits again nor probes disk past the run (it did, every step)."""
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_prefetch=False)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()  # 4 blocks on the host, the rest on disk
    eng = llm.engine
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(req)  # driven by hand below
    hit = eng.kv.find_cached_prefix(req)
    assert hit.num_blocks == 8 and not hit.device
    before = eng.store.stats()
    assert not eng.kv.allocate(req, eng.pool.num_blocks * 8, hit)  # no room: it waits
    for _ in range(3):  # later steps try again
        again = eng.kv.find_cached_prefix(req)
        assert again.lower == hit.lower and all(a[2] is b[2] for a, b in zip(again.lower, hit.lower))
    assert eng.store.stats() == before  # no hit counted twice, no disk probe
    _run(llm, shared + _prompt(5, 9))  # meanwhile another request brings the prefix to the device
    before = eng.store.stats()
    moved = eng.kv.find_cached_prefix(req)
    assert len(moved.device) == 8 and moved.lower == [] and eng.store.stats() == before
    assert eng.kv.allocate(req, 9, moved)
    assert not eng.kv._held
    eng.kv.free(req)
    req2 = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    while eng.has_unfinished():
        eng.step()
    assert req2.output_token_ids == ref[3] and req2.num_cached_tokens == 64


@pytest.mark.parametrize("prefetch, write_through", [(False, False), (True, False), (False, True)])
def test_a_request_waiting_for_room_with_no_lower_tier_prefix_is_looked_up_once(prefetch, write_through, llama_dir,
                                                                                tmp_path):
    """A waiting request whose lookup found nothing below the device was looked up again at
    every step it waited (the disk probed on the model loop each time, without prefetching), so
    each tier's misses grew with the time it queued, not with what it looked up. Others' blocks
    stored meanwhile (written through, demoted) do not make it look again: only its own."""
    llm = _llm(llama_dir, kv_cache_memory="6 blocks", kv_host_capacity="4 blocks",
               kv_disk_dir=str(tmp_path / "kv"), kv_prefetch=prefetch, kv_disk_write_through=write_through)
    eng = llm.engine
    hog = eng.add_request({"prompt_token_ids": _prompt(11, 30)}, SamplingParams(max_tokens=16, temperature=0,
                                                                                 ignore_eos=True))
    for _ in range(2):
        eng.step()
    before = {k: v["misses"] for k, v in eng.store.stats().items()}
    waiter = eng.add_request({"prompt_token_ids": _prompt(12, 30)}, SamplingParams(max_tokens=2, temperature=0,
                                                                                    ignore_eos=True))
    waited = 0
    while hog.request_id in eng.requests:
        eng.step()
        waited += waiter.num_computed_tokens == 0
    while eng.has_unfinished():
        eng.step()
    added = {k: v["misses"] - before[k] for k, v in eng.store.stats().items()}
    assert waited >= 5 and len(waiter.output_token_ids) == 2
    # were 15 and 15; with prefetching 13 and 1, then 0 and 1 (its reader counted no host miss)
    assert added == {"host": 1, "disk": 1}, added
    assert not eng.kv._held and eng.pool.num_used == 0


def test_a_request_waiting_for_room_finds_its_prefix_stored_below_while_it_waited(llama_dir, cold_reference):
    """Held with nothing found, a request does not look the tiers up again at every step; but a
    burst sharing its prefix may push that prefix off the device meanwhile. Once anything was
    stored below, its next try looks past the run it holds, and takes the prefix from the host."""
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="64 blocks", kv_prefetch=False)
    eng = llm.engine
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(req)  # driven by hand below
    hit = eng.kv.find_cached_prefix(req)
    assert hit.num_blocks == 0
    assert not eng.kv.allocate(req, (eng.pool.num_blocks + 1) * 8, hit)  # no room: it waits
    before = eng.store.stats()
    assert eng.kv.find_cached_prefix(req).num_blocks == 0 and eng.store.stats() == before  # not looked up
    _run(llm, shared + _prompt(2, 9))
    eng.offload_prefix_cache()  # the shared prefix leaves the device for the host
    again = eng.kv.find_cached_prefix(req)
    assert again.num_blocks == 8 and not again.device and {e[1] for e in again.lower} == {"host"}
    assert not eng.kv.allocate(req, (eng.pool.num_blocks + 1) * 8, again)  # held again, now with the run
    eng.scheduler.waiting.append(req)
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64
    assert not eng.kv._held and eng.kv.held_bytes == 0 and eng.pool.num_used == 0
    llm.close()


def test_what_requests_waiting_for_room_keep_is_bounded_and_each_block_counted_once(llama_dir, cold_reference,
                                                                                    tmp_path):
    """Requests held for device room kept every lower-tier run they read, without limit. Past
    the bound a request keeps the head of its run (still a valid prefix) and recomputes the rest;
    a block kept by two requests counts once; letting go of both frees the ledger."""
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_prefetch=False)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    eng = llm.engine
    first, second = (eng.add_request({"prompt_token_ids": shared + _prompt(k, 9)}, GREEDY) for k in (3, 4))
    for req in (first, second):
        eng.scheduler.waiting.remove(req)  # driven by hand below
    hit = eng.kv.find_cached_prefix(first)
    block = hit.lower[0][2].numel() * hit.lower[0][2].element_size()
    assert hit.num_blocks == 8 and eng.kv.held_bytes_limit == 1 << 30
    eng.kv.held_bytes_limit = 5 * block + block // 2
    assert not eng.kv.allocate(first, eng.pool.num_blocks * 8, hit)
    assert len(eng.kv._held[first.request_id][1]) == 5 and eng.kv.held_bytes == 5 * block
    assert eng.stats().kv_held_bytes == 5 * block
    assert not eng.kv.allocate(second, eng.pool.num_blocks * 8, eng.kv.find_cached_prefix(second))
    assert len(eng.kv._held[second.request_id][1]) == 5 and eng.kv.held_bytes == 5 * block  # the same 5
    before = eng.store.stats()
    again = eng.kv.find_cached_prefix(first)  # its next try: the head it kept
    assert [e[0] for e in again.lower] == [e[0] for e in hit.lower[:5]]
    assert eng.store.stats() == before  # the tail it let go is not read again past the head
    eng.kv.free(first)
    assert eng.kv.held_bytes == 5 * block  # still kept by the second
    eng.kv.free(second)
    assert eng.kv.held_bytes == 0 and not eng.kv._held_refs and not eng.kv._held
    out = _run(llm, shared + _prompt(3, 9))
    assert out[0] == ref[3] and out[1] == 64  # nothing lost: the blocks are still in their tiers


def test_a_request_that_could_keep_nothing_does_not_read_its_prefix_again_while_it_waits(llama_dir, cold_reference,
                                                                                          tmp_path):
    """With the bound used up it kept nothing and had no hold, so each later try looked the whole
    prefix up again: read from disk on the model loop, staged, dropped, every step (232 disk hits
    over 29 steps). Held with nothing kept, it recomputes its prefix once admitted instead."""
    shared, ref = cold_reference
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="24 blocks", kv_prefetch=False)
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    eng.kv.held_bytes_limit = 1  # less than a block
    hog = _hog(eng, 140)
    waiting = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.step()
    assert eng.kv._held[waiting.request_id][1] == [] and eng.kv.held_bytes == 0
    hits, steps = disk.stats.hits, 0
    while waiting.num_computed_tokens == 0 and eng.has_unfinished():  # (no room even for a first chunk)
        eng.step()
        steps += 1
    assert steps > 10 and disk.stats.hits == hits  # no read while it waited
    assert eng.kv._held == {}  # admitted
    while eng.has_unfinished():
        eng.step()
    assert waiting.output_token_ids == ref[3] and not eng.kv._held and eng.store.staged_bytes == 0
    assert hog.finish_reason == "length"
    llm.close()


def test_a_held_request_does_not_retry_an_unreadable_block_past_its_run_at_every_step(llama_dir, cold_reference,
                                                                                     tmp_path):
    """A disk entry whose reads fail (EIO) stays indexed; a held request that found nothing saw it
    there past its (empty) run at every step and read it again on the model loop each time."""
    import errno

    shared, ref = cold_reference
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="24 blocks", kv_prefetch=False)
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    reads = []

    def failing(h):
        reads.append(h)
        raise OSError(errno.EIO, "Input/output error")

    disk._read = failing
    hog = _hog(eng, 140)
    waiting = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.step()
    assert eng.kv._held[waiting.request_id][1] == [] and reads
    tried, steps = len(reads), 0
    while waiting.num_computed_tokens == 0 and eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps > 10 and len(reads) == tried  # not once more, let alone once a step
    while eng.has_unfinished():
        eng.step()
    assert waiting.output_token_ids == ref[3] and hog.finish_reason == "length"
    assert not eng.kv._held and not eng.kv._looked_past and eng.pool.num_used == 0
    llm.close()


def test_an_unreadable_block_that_cuts_a_read_past_the_run_is_not_read_again(llama_dir, tmp_path):
    """A held request's read past its run stopped at a disk entry failing its reads, after some
    good blocks; on the next step that entry was the first block past the longer run and was
    read (and failed) once more before it was remembered."""
    from tierlm.kv.tiers import DiskTier

    llm = _llm(llama_dir, kv_cache_memory="12 blocks", kv_host_capacity="1 blocks", kv_disk_dir=str(tmp_path / "kv"),
               kv_disk_capacity="200 blocks", kv_prefetch=False, max_model_len=512)
    eng, shared = llm.engine, _prompt(1, 72)
    _run(llm, shared + [5], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    hs = eng.kv._hashes(eng.make_request({"prompt_token_ids": shared + [7, 8, 9]}, GREEDY, "probe"))
    tail = {i: eng.kv.io.read([eng.pool.lookup(hs[i]).block_id])[0] for i in range(4, 9)}
    eng.persist_kv()
    disk = next(t for t in eng.store.tiers if isinstance(t, DiskTier))
    with disk.lock:
        for i in range(4, 9):
            disk.take(hs[i])  # its run below the device ends at block 4 for now
    eng.add_request({"prompt_token_ids": _prompt(2, 80)}, SamplingParams(max_tokens=14, temperature=0,
                                                                         ignore_eos=True))
    eng.step()
    eng.step()
    held = eng.add_request({"prompt_token_ids": shared + [7, 8, 9]}, SamplingParams(max_tokens=4, temperature=0,
                                                                                     ignore_eos=True))
    eng.step()
    assert len(eng.kv._held[held.request_id][1]) == 4  # blocks 0-3, read from disk
    for i in range(4, 9):  # blocks 4-8 come back to disk while it waits; block 6 cannot be read
        eng.store.demote(hs[i], hs[i - 1], tail[i], start=eng.store.tiers.index(disk))
    eng.store.flush()
    read, reads = disk._read, []

    def failing(h):
        if h == hs[6]:
            reads.append(eng.steps)
            raise OSError(5, "Input/output error")
        return read(h)

    disk._read = failing
    for _ in range(6):
        eng.step()
    assert len(eng.kv._held[held.request_id][1]) == 6  # read on to block 5, stopped at block 6
    assert len(reads) == 1  # was 2: block 6 once more on the next step, as the first past the run
    while eng.has_unfinished():
        eng.step()
    assert held.finish_reason == "length" and not eng.kv._held and not eng.kv._looked_past and eng.pool.num_used == 0
    llm.close()


def test_a_held_request_reads_a_prefix_stored_on_disk_past_its_run_while_it_waits(llama_dir, cold_reference,
                                                                                   tmp_path):
    """Held for room with nothing of its prefix cached; while it waited, the prefix reached disk
    (another process's write, a sibling's blocks moved down). With prefetching the model loop
    reads no disk, so the request recomputed all of it. Its readiness check now starts a
    background read past its run when the disk tier's index holds the next block."""
    from tierlm.kv.tiers import DiskTier

    shared, ref = cold_reference
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="24 blocks", kv_prefetch=True)
    eng = llm.engine
    disk = next(t for t in eng.store.tiers if isinstance(t, DiskTier))
    hs = eng.kv._hashes(eng.make_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY, "probe"))
    with disk.lock:
        away = [disk.take(hs[i]) for i in range(8)]  # nothing of the prefix cached anywhere for now
    assert all(away) and not eng.pool.lookup(hs[0])
    hog = _hog(eng, 140)
    held = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    job = eng.kv._prefetches.get(held.request_id)
    assert job is None or job.done.wait(5)
    eng.step()
    assert eng.kv._held[held.request_id][1] == []  # held, its run empty
    for h, parent, data, hint in away:  # the prefix reaches disk while it waits
        eng.store.demote(h, parent, data, start=eng.store.tiers.index(disk), hint=hint)
    eng.store.flush()
    reads, hits = [], disk.stats.hits
    prefetch = eng.store.prefetch
    eng.store.prefetch = lambda hashes: reads.append(len(hashes)) or prefetch(hashes)
    while eng.has_unfinished():
        eng.step()
    assert reads == [9]  # one background read past its (empty) run, up to the last token, not one per step
    assert disk.stats.hits == hits + 8
    assert held.output_token_ids == ref[3] and held.num_cached_tokens == 64  # 0 before
    assert hog.finish_reason == "length"
    assert eng.store.staged_bytes == 0 and not eng.kv._held and eng.kv.held_bytes == 0 and not eng.kv._rereads
    assert eng.pool.num_used == 0
    llm.close()


def test_a_held_run_whose_device_part_left_for_disk_lets_go_of_what_it_read(llama_dir, tmp_path):
    """Held with 5 blocks on the device and 3 read from disk; the device blocks then went down to
    disk, so the next try's run breaks at its first block and the 3 read are no longer taken.
    They stayed staged (12 KB here, up to staging's 1 GiB) after the request was gone."""
    llm = _llm(llama_dir, kv_cache_memory="24 blocks", kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"),
               kv_prefetch=True)
    eng, shared = llm.engine, _prompt(1, 70)
    _run(llm, shared + _prompt(2, 9))
    eng.persist_kv()
    _run(llm, shared[:40] + _prompt(4, 9))  # the first 5 blocks back on the device
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(req)  # driven by hand below
    assert eng.kv._prefetches[req.request_id].done.wait(10)
    hit = eng.kv.find_cached_prefix(req)
    assert len(hit.device) == 5 and [entry[1] for entry in hit.lower] == ["disk"] * 3
    assert not eng.kv.allocate(req, eng.pool.num_blocks * 8, hit) and eng.store.staged_bytes > 0
    eng.persist_kv()  # the device part goes down to disk too; with prefetching, the loop reads no disk
    again = eng.kv.find_cached_prefix(req)
    assert not again.device and not again.lower and len(again.spare) == 3
    assert not eng.kv.allocate(req, eng.pool.num_blocks * 8 + 8, again)
    eng.kv.free(req)
    assert eng.store.staged_bytes == 0 and not eng.store.staged and eng.kv.held_bytes == 0
    llm.close()


def _held_while_its_device_part_goes_to_disk(llama_dir, shared: list[int], tmp_path):
    """An engine (prefetching) and a request held for room with 5 prefix blocks on the device and
    3 read from disk, whose device part has since gone down to disk; driven by hand."""
    llm = _llm(llama_dir, kv_cache_memory="24 blocks", kv_host_capacity="4 blocks", kv_disk_dir=str(tmp_path / "kv"),
               kv_prefetch=True)
    eng = llm.engine
    _run(llm, shared + _prompt(2, 9))
    eng.persist_kv()
    _run(llm, shared[:40] + _prompt(4, 9))  # the first 5 blocks back on the device
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(req)
    assert eng.kv._prefetches[req.request_id].done.wait(10)
    hit = eng.kv.find_cached_prefix(req)
    assert len(hit.device) == 5 and not eng.kv.allocate(req, eng.pool.num_blocks * 8, hit)  # held for room
    eng.persist_kv()  # its device part goes down to disk while it waits
    return llm, req


def test_a_held_run_whose_device_part_left_for_disk_reads_it_back_off_the_loop(llama_dir, cold_reference, tmp_path):
    """The same, end to end: the part that went down to disk while the request waited was
    recomputed once admitted (the model loop reads no disk). Now the scheduler's readiness check
    starts a background read of it, and the request starts with its whole prefix cached."""
    shared, ref = cold_reference
    llm, req = _held_while_its_device_part_goes_to_disk(llama_dir, shared, tmp_path)
    eng, disk = llm.engine, llm.engine.store.tiers[1]
    eng.kv.prefix_ready(req)  # the scheduler's check, before it tries the request again
    job = eng.kv._prefetches[req.request_id]  # a read of the 5 blocks that left
    assert job.done.wait(10) and job.found == 5
    assert eng.kv.prefix_ready(req) and eng.kv._prefetches[req.request_id] is job  # one read, not one per try
    hits = disk.stats.hits
    eng.scheduler.waiting.append(req)
    while eng.has_unfinished():
        eng.step()
    assert disk.stats.hits == hits  # the model loop read no disk
    assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64  # recomputed from 0 before
    assert eng.store.staged_bytes == 0 and not eng.kv._held and eng.kv.held_bytes == 0
    llm.close()


def test_the_end_of_a_held_requests_read_back_is_not_looked_up_again(llama_dir, cold_reference, tmp_path):
    """The background read of a held request's lost device part stopped at a block no tier has
    (its file deleted); the next try read that block's place again on the model loop, and its
    host-tier miss, counted once by the reader, was counted twice."""
    from tierlm.kv.prefix_cache import chain_hashes, extra_key

    shared, _ = cold_reference
    llm, req = _held_while_its_device_part_goes_to_disk(llama_dir, shared, tmp_path)
    eng, host, disk = llm.engine, llm.engine.store.tiers[0], llm.engine.store.tiers[1]
    hashes = chain_hashes(shared + _prompt(3, 9), 8, extra_key(eng.kv.model_id, None), [])
    disk.path(hashes[2]).unlink()
    misses = host.stats.misses
    eng.kv.prefix_ready(req)  # starts the read of the 5 blocks that left
    job = eng.kv._prefetches[req.request_id]
    assert job.done.wait(10) and job.found == 2
    assert host.stats.misses == misses + 3  # blocks 0-2, by the reader
    again = eng.kv.find_cached_prefix(req)
    assert host.stats.misses == misses + 3  # not block 2 once more
    assert len(again.lower) == 2 and not again.device
    assert not eng.kv.allocate(req, eng.pool.num_blocks * 8 + 8, again)  # still no room
    eng.kv.free(req)
    assert eng.store.staged_bytes == 0 and not eng.kv._held and eng.kv.held_bytes == 0
    llm.close()


def test_a_read_back_that_stopped_at_a_block_now_on_the_device_again_does_not_cut_the_run(llama_dir, cold_reference,
                                                                                           tmp_path):
    """Held with 6 device blocks and 2 host blocks; its device part left for the host, and the
    read-back of that part stopped at block 2 (gone from the host). A sibling then brought blocks
    0-3 back to the device: block 2 is no longer the run's end, but the next try cut the run
    there all the same and recomputed the 4 blocks the host still had past the device."""
    from tierlm.kv.prefix_cache import chain_hashes, extra_key

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_host_capacity="64 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_prefetch=True)
    eng, host = llm.engine, llm.engine.store.tiers[0]
    _run(llm, shared + _prompt(2, 9))
    eng.offload_prefix_cache()  # all 8 blocks to the host
    _run(llm, shared[:48] + _prompt(4, 9))  # blocks 0-5 back on the device
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(req)  # driven by hand below
    hit = eng.kv.find_cached_prefix(req)
    assert len(hit.device) == 6 and len(hit.lower) == 2
    assert not eng.kv.allocate(req, (eng.pool.num_blocks + 1) * 8, hit)  # held for room
    eng.offload_prefix_cache()  # its device part leaves for the host
    hashes = chain_hashes(shared + _prompt(3, 9), 8, extra_key(eng.kv.model_id, None), [])
    with host.lock:
        host.take(hashes[2])
    eng.kv.prefix_ready(req)  # the read-back of blocks 0-5: it stops at block 2
    job = eng.kv._prefetches[req.request_id]
    assert job.done.wait(10) and (job.start, job.found) == (0, 2)
    _run(llm, shared[:32] + _prompt(5, 9))  # a sibling: blocks 0-3 on the device again
    again = eng.kv.find_cached_prefix(req)
    assert len(again.device) == 4 and again.num_blocks == 8  # was 4: the host's 4-7 let go
    assert not eng.kv.allocate(req, (eng.pool.num_blocks + 1) * 8, again)
    eng.scheduler.waiting.append(req)
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64
    assert eng.store.staged_bytes == 0 and not eng.kv._held and eng.kv.held_bytes == 0
    llm.close()


def test_blocks_kept_staged_for_another_requests_read_are_dropped_when_that_read_is_done(llama_dir, tmp_path):
    """X's read lists the whole prefix but finds only its first block (the second's entry was
    deleted); Y's read stages all 8 and Y is aborted. Unstaging Y's blocks skipped those X's
    read listed, and nothing looked at them again: they stayed staged after X finished."""
    from tierlm.kv.prefix_cache import chain_hashes, extra_key

    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True)
    eng, store, shared = llm.engine, llm.engine.store, _prompt(1, 70)
    _run(llm, shared + _prompt(2, 9))
    eng.persist_kv()
    hashes = chain_hashes(shared + _prompt(3, 9), 8, extra_key(eng.kv.model_id, None), [])
    store.tiers[0].path(hashes[1]).unlink()
    x = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(x)  # it waits (behind a full batch, say)
    assert eng.kv._prefetches[x.request_id].done.wait(10) and eng.kv._prefetches[x.request_id].found == 1
    _run(llm, shared + _prompt(4, 9))  # computed again, and down to disk
    eng.persist_kv()
    y = eng.add_request({"prompt_token_ids": shared + _prompt(5, 9)}, GREEDY)
    assert eng.kv._prefetches[y.request_id].done.wait(10) and len(store.staged) == 8
    eng.abort(y.request_id)
    assert len(store.staged) == 8  # X's read may still want them
    eng.scheduler.waiting.append(x)
    while eng.has_unfinished():
        eng.step()
    assert x.num_cached_tokens == 8 and store.staged_bytes == 0 and not store.staged
    llm.close()


def test_a_prefix_the_reader_finds_on_its_way_to_disk_is_still_taken_once_written(llama_dir, cold_reference,
                                                                                 tmp_path):
    """The reader found the prefix in the writer's queue and did not stage it; the writes landed
    before admission, which reads no disk with prefetching, so the whole prefix was recomputed
    (and, still queued at admission, each block's hit was counted twice)."""
    import threading

    shared, ref = cold_reference
    for land_first in (True, False):
        llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / f"kv{land_first}"), kv_disk_capacity="64 blocks",
                   kv_prefetch=True)
        eng, store = llm.engine, llm.engine.store
        _run(llm, shared + _prompt(2, 9))
        gate = threading.Event()
        store.fence = lambda: gate.wait(10)  # the writer waits before it writes (as for a CUDA copy)
        eng.pool.evict_all()
        assert len(store.pending) >= 8
        req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
        assert eng.kv._prefetches[req.request_id].done.wait(10)
        if land_first:
            gate.set()
            assert store.flush()
        while eng.has_unfinished():
            eng.step()
        gate.set()
        disk = store.stats()["disk"]
        assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64, land_first
        assert disk["hits"] == disk["promotions"] == 8, land_first
        assert store.staged_bytes == 0
        llm.close()


def test_a_preempted_request_whose_prefix_left_for_disk_reads_it_back_off_the_loop(llama_dir, tmp_path):
    """Preempted, its blocks were all still on the device, so no read started; they then went
    down to disk while it waited, and with prefetching (the loop reads no disk) it recomputed
    them. A read now starts once fewer of them are on the device than when it was preempted."""
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    prompt = _prompt(1, 70) + _prompt(3, 9)
    ref = _run(_llm(llama_dir, enable_prefix_caching=False), prompt, params)[0]
    llm = _llm(llama_dir, kv_cache_memory="24 blocks", kv_prefetch=True, kv_disk_dir=str(tmp_path / "kv"),
               kv_disk_capacity="64 blocks")
    eng = llm.engine
    eng.add_request({"prompt_token_ids": _prompt(9, 100)}, params)
    victim = eng.add_request({"prompt_token_ids": prompt}, params)
    recomputed = None
    while eng.has_unfinished():
        eng.step()
        if recomputed is None and victim.num_preemptions:
            assert victim.request_id not in eng.kv._prefetches  # nothing to read: all on the device
            recomputed = eng.stats().prompt_tokens
            eng.offload_prefix_cache()  # another request's demand takes its blocks off the device
    assert recomputed is not None
    assert victim.output_token_ids == ref
    assert eng.stats().prompt_tokens - recomputed == 0  # 63 before
    assert eng.store.staged_bytes == 0 and not eng.kv._device_then
    llm.close()


@pytest.mark.parametrize("found_in", ["host", "device"])
def test_a_waiting_request_whose_prefix_left_memory_for_disk_reads_it_back_off_the_loop(found_in, llama_dir,
                                                                                    cold_reference, tmp_path):
    """A load tester's case: on arrival the prefix was on the device, or in the host tier, which
    a read only checks (the model loop reads host memory itself); while the request queued,
    other traffic pushed those blocks down to disk, which the loop does not read with
    prefetching, so the request recomputed its whole prefix. The read now starts again when
    part of the run has left memory, and the request is admitted once that read is done."""
    shared, refs = cold_reference
    llm = _llm(llama_dir, kv_prefetch=True, max_num_seqs=1, kv_host_capacity="64 blocks",
               kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    eng = llm.engine
    _run(llm, shared + _prompt(2, 9))
    host = next(t for t in eng.store.tiers if isinstance(t, HostTier))
    if found_in == "host":
        eng.offload_prefix_cache()
        assert len(host) == 11 and not eng.pool.cached  # 79 prompt + 9 output tokens
    hog = _hog(eng, 20)  # takes the one sequence slot: the newcomer queues
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.step()
    assert req.status == RequestStatus.WAITING and eng.kv._prefetches[req.request_id].done.wait(5)
    assert eng.store.staged_bytes == 0  # on the device, or checked in host memory: nothing copied
    eng.offload_prefix_cache()  # other traffic pushes the prefix down to disk
    eng.store.spill(0)
    eng.store.flush()
    assert len(host) == 0 and not eng.pool.lookup(req.block_hashes[0])
    before = eng.stats().prompt_tokens
    while eng.has_unfinished():
        eng.step()
    assert hog.finish_reason == "length"
    assert req.output_token_ids == refs[3]
    assert req.num_cached_tokens == 64 and eng.stats().prompt_tokens - before == 79 - 64  # 79 before
    assert eng.store.staged_bytes == 0 and not eng.kv._prefetches
    llm.close()


@pytest.mark.parametrize("moved_to", ["host", "disk"])
def test_a_queued_request_takes_a_prefix_computed_and_moved_down_after_its_read(moved_to, llama_dir, cold_reference,
                                                                               tmp_path):
    """A fuzzer's case, a burst sharing a system prompt: the second request's read ran before the
    first had computed the prefix and found nothing; the prefix then went down to host memory
    or disk while the second waited, and it recomputed all of it, though the loop reads host
    memory and disk can be read in the background."""
    shared, refs = cold_reference
    llm = _llm(llama_dir, kv_prefetch=True, max_num_seqs=1, kv_host_capacity="64 blocks",
               kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    eng = llm.engine
    first = eng.add_request({"prompt_token_ids": shared + _prompt(2, 9)}, GREEDY)
    second = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)  # queued: one sequence at a time
    eng.step()
    job = eng.kv._prefetches[second.request_id]
    assert job.done.wait(5) and job.finished and job.found == 0  # nothing to read yet
    while first.finish_reason is None:
        eng.step()
    eng.offload_prefix_cache()
    if moved_to == "disk":
        eng.store.spill(0)
        eng.store.flush()
    while eng.has_unfinished():
        eng.step()
    assert first.output_token_ids == refs[2] and second.output_token_ids == refs[3]
    assert second.num_cached_tokens == 64  # 0 before
    assert eng.store.staged_bytes == 0 and not eng.kv._prefetches and not eng.kv._rereads
    llm.close()


def test_a_queued_request_reads_its_prefix_again_each_time_host_memory_lets_part_of_it_go(llama_dir, tmp_path):
    """A fuzzer's case: a re-read found part of the prefix in the host tier (checked, not copied);
    while the request then waited for a seat, those blocks went down to disk too. A second
    re-read from the same split was refused as if staging had overflowed, and the request
    recomputed its whole prefix though all of it was on disk or staged."""
    llm = LLM(str(llama_dir), dtype="float32", block_size=8, max_num_batched_tokens=64, max_num_seqs=2,
              kv_cache_memory="32 blocks", kv_prefetch=True, kv_host_capacity="2 blocks",
              kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", load_progress=False)
    eng, kv, store = llm.engine, llm.engine.kv, llm.engine.store
    prefix = _prompt(1, 32)
    ref = _run(_llm(llama_dir, enable_prefix_caching=False), prefix + _prompt(3, 9), GREEDY)[0]
    _run(llm, prefix + [1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    hog = eng.add_request({"prompt_token_ids": _prompt(9, 10)}, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # one seat taken for long
    req = eng.add_request({"prompt_token_ids": prefix + _prompt(3, 9)}, GREEDY)
    kv._prefetches[req.request_id].done.wait(5)
    eng.offload_prefix_cache()  # the prefix leaves the device: 2 blocks in host memory, 2 on disk
    other = eng.add_request({"prompt_token_ids": _prompt(4, 10)}, SamplingParams(max_tokens=6, ignore_eos=True))
    if other.request_id in kv._prefetches:
        kv._prefetches[other.request_id].done.wait(5)
    eng.step()  # the request's re-read starts and it is passed over: the other takes the last seat
    assert req.status == RequestStatus.WAITING and other.status == RequestStatus.RUNNING
    kv._prefetches[req.request_id].done.wait(5)
    eng.step()
    store.spill(0)  # host pressure while it waits: the blocks the re-read only checked go to disk
    store.flush()
    while req.num_cached_tokens < 0 and eng.has_unfinished():
        eng.step()
    assert req.num_cached_tokens == 32  # 0 before
    eng.abort(hog.request_id)
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == ref
    assert store.staged_bytes == 0 and not kv._prefetches and not kv._rereads
    llm.close()


def test_a_prefix_larger_than_staging_is_read_again_once_not_for_ever(llama_dir, cold_reference, tmp_path):
    """A reviewer's case: staging (1 GiB by default) smaller than a queued request's prefix
    keeps only the run's last blocks, so the run never stayed in memory and the re-read of a
    lost run started again at every step: the request was never admitted."""
    shared, refs = cold_reference
    llm = _llm(llama_dir, kv_prefetch=True, max_num_seqs=1, kv_host_capacity="64 blocks",
               kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    eng = llm.engine
    _run(llm, shared + _prompt(2, 9))
    eng.offload_prefix_cache()
    eng.store.spill(0)
    eng.store.flush()  # the prefix is on disk only
    eng.store.staging_bytes = 3 * kv_bytes_per_block(eng.args, torch.float32, 8)  # room for 3 of its 8 blocks
    reads = []
    prefetch = eng.store.prefetch
    eng.store.prefetch = lambda hashes: reads.append(len(hashes)) or prefetch(hashes)
    _hog(eng, 20)
    reads.clear()  # (the hog's own)
    req = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
    assert req.finish_reason == "length" and req.output_token_ids == refs[3]
    assert len(reads) == 2  # on arrival, and once again
    assert eng.store.staged_bytes == 0 and not eng.kv._prefetches and not eng.kv._rereads
    llm.close()


def test_an_overdue_read_still_takes_the_blocks_kept_staged_for_it(llama_dir, tmp_path):
    """A reviewer's case: blocks kept staged for a live read were dropped at that read's own
    settle when it was overdue (it counts what it found only once it ends), right before its
    admission would take them: the prefix was recomputed."""
    import threading
    import time

    from tierlm.kv.prefix_cache import chain_hashes, extra_key
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True,
               kv_read_timeout=0.5)
    eng, store = llm.engine, llm.engine.store
    disk = store.tiers[0]
    shared = _prompt(1, 64)            # 8 blocks
    more = _prompt(7, 16)              # 2 more blocks, A only
    _run(llm, shared + more + _prompt(2, 9))
    eng.persist_kv()                   # everything on disk, nothing on the device
    y = eng.add_request({"prompt_token_ids": shared + _prompt(5, 9)}, GREEDY)
    eng.scheduler.waiting.remove(y)
    assert eng.kv._prefetches[y.request_id].done.wait(10)
    assert len(store.staged) == 8
    hashes = chain_hashes(shared + more + _prompt(3, 9), 8, extra_key(eng.kv.model_id, None), [])
    gate = threading.Event()
    orig = disk.fetch
    def slow(h):
        if h == hashes[8]:
            gate.wait(20)
        return orig(h)
    disk.fetch = slow
    a = eng.add_request({"prompt_token_ids": shared + more + _prompt(3, 9)}, GREEDY)
    eng.scheduler.waiting.remove(a)
    time.sleep(0.2)                    # A's reader found 0..7 in staging and hangs on block 8
    eng.abort(y.request_id)            # Y's 8 blocks: kept, A's read wants them
    assert len(store.staged) == 8
    time.sleep(0.6)                    # A's read is overdue
    eng.scheduler.waiting.append(a)
    job = eng.kv._prefetches[a.request_id]
    eng.step()
    gate.set()
    while eng.has_unfinished():
        eng.step()
    assert a.num_cached_tokens == 64
    assert job.done.wait(10) and eng.kv._prefetches == {} and store.staged_bytes == 0
    llm.close()


def test_a_request_that_kept_only_the_head_of_its_run_matches_a_cold_run(llama_dir, cold_reference, tmp_path):
    """End to end, with the bound at 3 blocks: two requests wait for room behind a long one,
    keep 3 blocks of their 8-block disk prefix, and recompute the rest once admitted."""
    shared, ref = cold_reference
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="24 blocks", kv_prefetch=True)
    eng = llm.engine
    hog = _hog(eng, 120)
    waiting = [eng.add_request({"prompt_token_ids": shared + _prompt(k, 9)}, GREEDY) for k in (3, 2)]
    eng.store.flush()
    eng.step()
    held = eng.kv._held[waiting[0].request_id][1]
    block = held[0][2].numel() * held[0][2].element_size()
    assert eng.kv.held_bytes == 8 * block  # the shared 8 blocks, once
    eng.kv.held_bytes_limit = 3 * block
    eng.step()
    assert 0 < eng.kv.held_bytes <= 3 * block
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in waiting] == [ref[3], ref[2]]
    assert eng.kv.held_bytes == 0 and not eng.kv._held and eng.pool.num_used == 0
    assert hog.finish_reason == "length"
    llm.close()


def test_steps_go_on_while_a_prefix_is_read_from_disk(llama_dir, cold_reference, tmp_path):
    """A request whose prefix is being read from disk waits while other requests decode; it is
    admitted when the read is done, with the same tokens as a cold run."""
    import threading

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    gate, read = threading.Event(), disk._read
    disk._read = lambda h: read(h) if gate.wait(10) else None  # hold the reader thread
    other = eng.add_request({"prompt_token_ids": _prompt(4, 12)}, SamplingParams(max_tokens=30, temperature=0,
                                                                                  ignore_eos=True))
    eng.step()  # `other` is running
    late = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    for _ in range(3):
        eng.step()
    assert late in eng.scheduler.waiting and len(other.output_token_ids) == 4  # decoding went on
    gate.set()
    eng.store.flush()
    while eng.has_unfinished():
        eng.step()
    assert late.output_token_ids == ref[3] and late.num_cached_tokens == 64
    assert eng.store.stats()["disk"]["hits"] == 8
    assert eng.pool.num_used == 0


def test_a_read_past_the_timeout_starts_its_request_even_while_others_run(llama_dir, cold_reference, tmp_path):
    """A read that never ends (a hung disk or Redis) must not keep its request waiting for as
    long as other requests keep the engine busy: past kv_read_timeout it starts, recomputing."""
    import threading

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True,
               kv_read_timeout=0.3)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    gate, read = threading.Event(), disk._read
    disk._read = lambda h: read(h) if gate.wait(30) else None  # this read hangs
    busy = eng.add_request({"prompt_token_ids": _prompt(4, 12)}, SamplingParams(max_tokens=400, temperature=0,
                                                                                 ignore_eos=True))
    late = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    t0 = time.monotonic()
    while late in eng.scheduler.waiting and time.monotonic() - t0 < 10:
        eng.step()
        time.sleep(0.002)  # busy's 400 steps outlast the 0.3 s timeout on a fast CPU too (AVX-512: < 0.3 s)
    assert late.status.name == "RUNNING" and busy.status.name == "RUNNING"  # started beside it, busy or not
    assert 0.3 <= time.monotonic() - t0 < 5 and late.num_cached_tokens == 0
    while late.request_id in eng.requests:
        eng.step()
    assert late.output_token_ids == ref[3]
    gate.set()
    eng.abort(busy.request_id)
    eng.store.flush()
    assert eng.pool.num_used == 0 and not eng.kv._held and not eng.kv._prefetches
    assert eng.stats().kv_staged_bytes == 0  # what the hung read staged once it ended was dropped
    llm.close()


def test_a_request_needing_no_read_does_not_wait_behind_one_being_read(llama_dir, cold_reference, tmp_path):
    """With nothing running, the first waiting request's prefix is still being read: the one
    behind it, whose prefix needs no read, starts at once (it waited out the read, up to a
    Redis timeout, when the step waited for the first)."""
    import threading

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    _run(llm, _prompt(4, 12))  # its one full block is now on the device: it needs no read
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    gate, read = threading.Event(), disk._read
    disk._read = lambda h: read(h) if gate.wait(10) else None  # hold the reader thread
    reading = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    free = eng.add_request({"prompt_token_ids": _prompt(4, 12)}, SamplingParams(max_tokens=3, temperature=0,
                                                                                 ignore_eos=True))
    t0 = time.monotonic()
    eng.step()
    assert time.monotonic() - t0 < 5 and free.status.name == "RUNNING" and reading in eng.scheduler.waiting
    gate.set()
    while eng.has_unfinished():
        eng.step()
    assert reading.output_token_ids == ref[3] and reading.num_cached_tokens == 64
    assert len(free.output_token_ids) == 3 and eng.pool.num_used == 0


def test_blocks_read_ahead_for_a_request_aborted_before_it_starts_are_dropped(llama_dir, cold_reference, tmp_path):
    """A request's background read stages its disk prefix in memory; aborted before admission,
    what it staged must go (it stayed until staging overflowed at 1 GiB), except what another
    waiting request's read needs too."""
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True)
    eng = llm.engine
    _run(llm, shared + _prompt(2, 9))
    eng.persist_kv()  # the prefix is on disk only
    first = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.store.flush()  # its read is done: the shared prefix is staged
    assert eng.stats().kv_staged_bytes > 0
    second = eng.add_request({"prompt_token_ids": shared + _prompt(4, 9)}, GREEDY)
    eng.store.flush()
    eng.abort(first.request_id)
    assert eng.stats().kv_staged_bytes > 0  # the second request's read holds the same blocks
    eng.abort(second.request_id)
    assert eng.stats().kv_staged_bytes == 0 and not eng.store.staged
    assert _run(llm, shared + _prompt(3, 9))[0] == ref[3]  # read from disk again, as before
    llm.close()


def test_blocks_read_for_a_request_held_for_room_and_then_aborted_are_dropped(llama_dir, tmp_path):
    """Its prefix was read (staged) at admission, the pool had no room, and it was aborted while
    held: what it read stayed staged until staging overflowed."""
    shared = _prompt(1, 70)
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="24 blocks", kv_prefetch=True)
    eng = llm.engine
    hog = _hog(eng, 120)
    held = eng.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    eng.store.flush()
    eng.step()
    assert list(eng.kv._held) == [held.request_id]  # read, but no room
    assert eng.stats().kv_staged_bytes > 0
    eng.abort(held.request_id)
    assert eng.stats().kv_staged_bytes == 0
    eng.abort(hog.request_id)
    assert eng.pool.num_used == 0
    llm.close()


def test_every_request_held_for_room_keeps_and_drops_its_own_reads(llama_dir, tmp_path):
    """Two requests held for room in turn (each step tries the first waiting request that is
    ready): only the last one's reads were remembered, so the other's stayed staged for good
    when its client went away (a tester saw 139 KB held at idle, up to staging's 1 GiB)."""
    import threading

    llm = _llm(llama_dir, kv_cache_memory="24 blocks", kv_disk_dir=str(tmp_path / "kv"),
               kv_disk_capacity="64 blocks", kv_prefetch=True)
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    p, q = _prompt(1, 70), _prompt(5, 70)
    _run(llm, p + _prompt(2, 9))
    eng.persist_kv()
    on_disk = set(disk.parents)
    _run(llm, q + _prompt(2, 9))
    eng.persist_kv()
    slow, gate, read = set(disk.parents) - on_disk, threading.Event(), disk._read
    disk._read = lambda h: read(h) if h not in slow or gate.wait(10) else None  # q's reads wait
    hog = _hog(eng, 120)
    first = eng.add_request({"prompt_token_ids": q + _prompt(3, 9)}, GREEDY)  # reading
    second = eng.add_request({"prompt_token_ids": p + _prompt(3, 9)}, GREEDY)
    time.sleep(0.2)
    eng.step()
    assert list(eng.kv._held) == [second.request_id]  # first was still reading: passed over
    gate.set()
    eng.store.flush()
    eng.step()
    assert set(eng.kv._held) == {first.request_id, second.request_id}  # first came first this time
    staged_both = eng.stats().kv_staged_bytes
    eng.abort(second.request_id)
    assert 0 < eng.stats().kv_staged_bytes < staged_both  # first's reads stay, second's go
    eng.abort(first.request_id)
    assert eng.stats().kv_staged_bytes == 0 and not eng.store.staged
    eng.abort(hog.request_id)
    assert eng.pool.num_used == 0
    llm.close()


def test_a_new_disk_entry_is_read_in_place_and_an_older_layout_still_reads(tmp_path):
    """A new entry's payload starts at a multiple of 64 bytes and a disk read's block is the
    read buffer itself (no copy); an entry without that padding (written before it) decodes the
    same, and so do bytes (Redis), copied."""
    from tierlm.kv.tiers import _header

    data = torch.randn(3, 2, 8, 2, 16).to(torch.bfloat16)
    h, parent = b"\x02" * 32, b"\x01" * 32
    raw = encode_block(data, parent, 7, key=h)
    header, start = _header(raw)
    assert start % 64 == 0 and header["output_tokens"] == 7
    buf = bytearray(raw)
    got, hint = decode_entry(buf, h)
    assert hint == 7 and torch.equal(got, data)
    assert got.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + start  # in place
    # An entry as written before the padding: the header without the spaces, payload right after.
    compact = re.sub(r"\s+,", ",", raw[9:start].decode())
    old = raw[:5] + struct.pack("<I", len(compact)) + compact.encode() + raw[start:]
    assert _header(old)[1] % 64 != 0
    for form in (bytearray(old), old, raw):
        got, hint = decode_entry(form, h)
        assert hint == 7 and torch.equal(got, data)
    disk = DiskTier(tmp_path / "d", 4)
    disk.put(h, parent, data)
    disk.path(h).write_bytes(old)
    assert torch.equal(disk.get(h), data) and disk.stats.corrupt == 0


def test_read_regular_into_a_buffer_reads_the_whole_file(tmp_path):
    from tierlm.files import read_regular

    p = tmp_path / "f"
    for size in (0, 1, 4096, 300_001):
        body = os.urandom(size)
        p.write_bytes(body)
        got = read_regular(p, 1 << 20, mutable=True)
        assert isinstance(got, bytearray) and got == body
    assert read_regular(p, 1000, mutable=True) is None  # longer than the limit: not read
    assert read_regular(p, 1000, whole=False, mutable=True) == body[:1000]


def test_disk_reads_run_side_by_side_and_a_raced_read_is_not_called_corrupt(tmp_path):
    import threading

    (h0, p0, d0), (h1, p1, d1) = _chain(2)
    gate = threading.Event()

    class SlowFirst(DiskTier):
        def _read(self, h):
            if h == h0:
                assert gate.wait(10)
            return super()._read(h)

    disk = SlowFirst(tmp_path / "d", 8)
    disk.put(h0, p0, d0)
    disk.put(h1, p1, d1)
    got = []
    slow = threading.Thread(target=lambda: got.append(disk.get(h0)))
    slow.start()
    assert torch.equal(disk.get(h1), d1)  # while h0's read is under way (it held the tier's lock)
    gate.set()
    slow.join(10)
    assert torch.equal(got[0], d0) and disk.stats.corrupt == 0
    flaky = {"left": 1}

    class RacedOnce(DiskTier):  # as if a hint were being patched in place during the read
        def _read(self, h):
            if flaky["left"]:
                flaky["left"] -= 1
                return None
            return super()._read(h)

    disk.close()
    raced = RacedOnce(tmp_path / "d", 8, index_in_background=False)
    raced.index()
    assert torch.equal(raced.get(h1), d1) and raced.stats.corrupt == 0 and h1 in raced
    raced.close()


def test_one_slow_prefix_read_does_not_hold_up_the_next_requests_reads(redis_server):
    import threading

    (h0, p0, d0), (h1, p1, d1) = _chain(2)
    tier = RedisTier(redis_server.url)
    tier.put(h0, p0, d0)
    tier.put(h1, p1, d1)
    gate, fetch_run = threading.Event(), tier.fetch_run
    tier.fetch_run = lambda hashes: fetch_run(hashes) if h0 not in hashes or gate.wait(10) else []
    store = TieredStore([tier])
    slow = store.prefetch([h0])  # a Redis that answers late, for this one
    fast = store.prefetch([h1])
    assert fast.done.wait(5) and fast.found == 1 and not slow.done.is_set()
    gate.set()
    assert slow.done.wait(5) and slow.found == 1
    store.close()


def test_without_prefetch_the_admitting_step_reads_the_disk(llama_dir, cold_reference, tmp_path):
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=False)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    req = llm.engine.add_request({"prompt_token_ids": shared + _prompt(3, 9)}, GREEDY)
    llm.engine.store.flush()
    assert llm.engine.store.stats()["disk"]["hits"] == 0 and not llm.engine.store.staged
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert req.output_token_ids == ref[3] and req.num_cached_tokens == 64
    assert llm.engine.store.stats()["disk"]["hits"] == 8


class _GatedDisk(DiskTier):
    """A disk tier whose reads wait for a gate, to hold the reader thread at a known point."""

    def __init__(self, *args, gate, **kw):
        super().__init__(*args, **kw)
        self.gate = gate

    def _read(self, h):
        assert self.gate.wait(10)
        return super()._read(h)


def test_prefetch_jobs_settle_cancel_and_stay_within_staging_bytes(tmp_path):
    import threading

    gate = threading.Event()
    disk = _GatedDisk(tmp_path / "kv", 8, gate=gate)
    blocks = [(bytes([i]) * 32, torch.full((4, 4), float(i))) for i in range(3)]
    for h, data in blocks:
        gate.set()
        disk.put(h, None, data)
    gate.clear()
    block_bytes = 4 * 4 * 4
    store = TieredStore([disk], staging_bytes=2 * block_bytes, readers=1)
    (h0, d0), (h1, _), (h2, _) = blocks
    first = store.prefetch([h0])
    assert first.done.wait(0.05) is False  # the reader is inside disk.get(h0), held by the gate
    queued = store.prefetch([h1, h2])
    store.settle(queued)  # not started: dropped at once, the caller reads for itself
    assert queued.cancelled
    gate.set()
    store.flush()
    assert first.found == 1 and queued.found == 0 and list(store.staged) == [h0]
    assert disk.stats.hits == 1
    source, data, _ = store.fetch(h0)
    assert source == "disk" and torch.equal(data, d0) and disk.stats.hits == 1  # served from staging
    store.settle(first)  # its request admitted (another live read would keep h0 staged for its own)
    store.promoted(h0, "disk")
    assert not store.staged and disk.stats.promotions == 1
    whole = store.prefetch([h0, h1, h2])
    store.flush()
    assert whole.found == 3 and list(store.staged) == [h1, h2]  # the oldest dropped past the bound
    assert store.staged_bytes == 2 * block_bytes
    store.settle(whole)  # finished already: returns at once
    store.close()


def test_a_read_that_ends_just_after_its_request_is_admitted_leaves_it_what_it_found(tmp_path):
    """A reviewer's case: an overdue read is stopped when its request is admitted (`settle`),
    which then takes what was staged; a reader that ended just then unstaged all it had found,
    as if the request were gone, and the whole prefix was recomputed."""
    import threading

    store = TieredStore([DiskTier(tmp_path / "kv", 100)], read_timeout_s=0.2)
    blocks = _chain(8)
    for h, parent, data in blocks:
        store.demote(h, parent, data)
    store.flush()
    found, go = threading.Event(), threading.Event()
    find_run = store._find_run

    def paused_at_its_end(*a, **kw):  # the reader descheduled between its run and its clean-up
        run = find_run(*a, **kw)
        found.set()
        assert go.wait(5)
        return run

    store._find_run = paused_at_its_end
    hashes = [h for h, _, _ in blocks]
    job = store.prefetch(hashes)
    assert found.wait(5)
    store.settle(job)  # admitted with what was staged, which the model loop reads just after
    go.set()
    assert job.done.wait(5)
    run = store.fetch_run(hashes, slow=False)
    assert [torch.equal(data, b[2]) for (_, data, _), b in zip(run, blocks)] == [True] * 8  # none before
    for h in hashes:
        store.promoted(h, "disk")
    assert not store.staged and store.staged_bytes == 0
    store.close()


def test_readers_of_a_burst_sharing_a_prefix_read_each_block_once(tmp_path):
    """A disk tester's case: four readers, one per request of a burst sharing a prefix on disk,
    each read (and checksummed, and counted as a disk hit) the same files: 6 hits for 2 blocks.
    A reader now waits for the one already reading a block and takes what it staged."""
    disk = DiskTier(tmp_path / "kv", 100)
    read = disk._read
    disk._read = lambda h: (time.sleep(0.05), read(h))[1]  # a disk slow enough for the reads to overlap
    store = TieredStore([disk], readers=4)
    blocks = _chain(3)
    for h, parent, data in blocks:
        store.demote(h, parent, data)
    store.flush()
    hashes = [h for h, _, _ in blocks]
    jobs = [store.prefetch(hashes) for _ in range(4)]
    assert all(job.done.wait(10) and job.found == 3 for job in jobs)
    assert disk.stats.hits == 3 and disk.stats.bytes_out == sum(nbytes(b[2]) for b in blocks)  # 12 hits at worst before
    run = store.fetch_run(hashes, slow=False)
    assert [torch.equal(data, b[2]) for (_, data, _), b in zip(run, blocks)] == [True] * 3
    store.close()


def test_a_block_staged_just_before_its_read_is_settled_stays_for_the_admission(tmp_path):
    """A reviewer's case, one step earlier than the last: the reader had staged block 2 but not
    yet added it to its run when the request was admitted; the reader's clean-up then unstaged
    it, and the admission took 2 blocks of 3 found."""
    import threading

    store = TieredStore([DiskTier(tmp_path / "kv", 100)], read_timeout_s=0.2)
    blocks = _chain(4)
    for h, parent, data in blocks:
        store.demote(h, parent, data)
    store.flush()
    hashes = [h for h, _, _ in blocks]
    staged, go, find = threading.Event(), threading.Event(), store._find

    def paused_after_block_2(h, *a, **kw):  # staged by `_find`, not yet in the job's run
        found = find(h, *a, **kw)
        if h == hashes[2]:
            staged.set()
            assert go.wait(5)
        return found

    store._find = paused_after_block_2
    job = store.prefetch(hashes)
    assert staged.wait(5)
    store.settle(job)  # admitted now
    go.set()
    assert job.done.wait(5)
    assert len(store.fetch_run(hashes, slow=False)) == 3  # 2 before
    store.close()


def test_a_block_one_request_takes_stays_staged_for_another_whose_read_found_it(tmp_path):
    """A fuzzer's case: a held request's read found its prefix staged by a sibling's read; the
    sibling was admitted and took the blocks out of staging, they then left the device for disk,
    and the held request recomputed its whole prefix."""
    store = TieredStore([DiskTier(tmp_path / "kv", 100)])
    blocks = _chain(4)
    for h, parent, data in blocks:
        store.demote(h, parent, data)
    store.flush()
    hashes = [h for h, _, _ in blocks]
    first = store.prefetch(hashes)
    assert first.done.wait(10) and first.found == 4
    second = store.prefetch(hashes)  # finds them all staged
    assert second.done.wait(10) and second.found == 4
    store.settle(first)
    for h, (source, _, _) in zip(hashes, store.fetch_run(hashes, slow=False)):
        store.promoted(h, source)  # the first request takes them to the device
    assert len(store.staged) == 4  # 0 before: the second's read had counted them found
    store.settle(second)
    taken = store.fetch_run(hashes, slow=False)
    assert [torch.equal(data, b[2]) for (_, data, _), b in zip(taken, blocks)] == [True] * 4
    for h, (source, _, _) in zip(hashes, taken):
        store.promoted(h, source)
    assert not store.staged and store.staged_bytes == 0
    store.close()


def test_a_reader_waits_for_a_slow_read_of_the_same_block_rather_than_reading_alongside(tmp_path):
    """A fuzzer's case: with disk reads slower than the read timeout, a second reader gave up
    waiting for the first and read the same block too, loading a slow disk all the more (14
    reads of 5 blocks in a burst of 8)."""
    import threading

    disk = DiskTier(tmp_path / "kv", 100)
    store = TieredStore([disk], read_timeout_s=0.05)
    (h, parent, data), = _chain(1)
    store.demote(h, parent, data)
    store.flush()
    read, started = disk._read, threading.Event()
    disk._read = lambda key: (started.set(), time.sleep(0.4), read(key))[2]
    first = store.prefetch([h])
    assert started.wait(5)
    second = store.prefetch([h])
    assert first.done.wait(5) and second.done.wait(5)
    assert first.found == second.found == 1 and disk.stats.hits == 1  # 2 before
    started.clear()
    store.cancel(first)
    store.cancel(second)  # their requests gone: what they staged goes
    assert not store.staged
    third = store.prefetch([h])
    assert started.wait(5)
    fourth = store.prefetch([h])
    time.sleep(0.1)
    store.cancel(fourth)  # its request gone: it stops waiting
    assert fourth.done.wait(0.3) and fourth.found == 0
    assert third.done.wait(5) and third.found == 1
    store.close()


class _SlowDisk(DiskTier):
    """A disk tier whose writes wait for a gate: a disk that cannot keep up."""

    def __init__(self, *args, gate, **kw):
        super().__init__(*args, **kw)
        self.gate = gate

    def _write(self, h, parent, data, hint):
        assert self.gate.wait(10)
        super()._write(h, parent, data, hint)


def test_writer_backlog_is_bounded_and_a_drain_waits_instead_of_dropping(tmp_path, caplog):
    import threading
    gate = threading.Event()
    blocks = [(bytes([i]) * 32, torch.full((4, 4), float(i))) for i in range(12)]
    block_bytes = 4 * 4 * 4
    disk = _SlowDisk(tmp_path / "kv", 64, gate=gate)
    store = TieredStore([HostTier(1), disk], backlog_bytes=3 * block_bytes)
    with caplog.at_level("WARNING"):
        for h, data in blocks[:7]:
            store.demote(h, None, data)  # the host keeps the newest; each one evicted goes to the writer
    assert store.backlog == 3 * block_bytes  # the write under way and two queued; three more dropped
    assert disk.stats.dropped == 3
    assert sum("cannot keep up" in r.message for r in caplog.records) == 1
    gate.set()
    store.flush()
    assert store.backlog == 0 and len(disk) == 3
    for h, data in blocks[:3]:
        assert torch.equal(store.fetch(h)[1], data)  # the first three reached the disk
    assert store.fetch(blocks[3][0]) is None  # a dropped write is a miss, nothing worse
    host = HostTier(8)
    drain = TieredStore([host, disk], backlog_bytes=3 * block_bytes)
    for h, data in blocks[4:]:
        drain.demote(h, None, data)
    gate.clear()
    threading.Timer(0.2, gate.set).start()  # the disk stalls, then catches up
    assert drain.spill(0) == 8 and disk.stats.dropped == 3  # waited for room, dropped nothing
    assert len(disk) == 3 + 8
    store.close()
    drain.close()


def test_a_block_served_from_the_writers_queue_is_a_hit_of_the_tier_it_is_going_to(tmp_path):
    import threading
    gate = threading.Event()
    disk = _SlowDisk(tmp_path / "kv", 64, gate=gate)
    store = TieredStore([HostTier(1), disk])
    (h0, d0), (h1, d1) = [(bytes([i]) * 32, torch.full((4, 4), float(i))) for i in range(2)]
    store.demote(h0, None, d0)
    store.demote(h1, None, d1)  # the host evicts h0 to the writer, which waits on the disk
    source, data, _ = store.fetch(h0)
    assert source == "disk" and data is d0 and disk.stats.hits == 1  # was "pending", no tier's
    store.promoted(h0, source)
    assert disk.stats.promotions == 1  # counted as the disk's, as its hit was
    gate.set()
    store.close()


def test_corrupt_disk_block_is_detected_and_recomputed(llama_dir, cold_reference, tmp_path):
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    disk = llm.engine.store.tiers[0]
    hashes = chain_hashes(shared, 8, extra_key(llm.engine.kv.model_id, None))
    path = disk.path(hashes[3])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # flip bits in the payload
    path.write_bytes(bytes(raw))
    tokens, cached, computed = _run(llm, shared + _prompt(3, 9))
    assert tokens == ref[3]
    assert cached == 24 and computed == 79 - 24  # blocks 0-2 hit; block 3 corrupt: recomputed from there
    assert llm.engine.stats().kv_tiers["disk"]["corrupt"] == 1
    assert not path.exists()
    truncated = disk.path(hashes[5])
    truncated.write_bytes(truncated.read_bytes()[:100])
    assert disk.get(hashes[5]) is None and disk.stats.corrupt == 2


def test_a_damaged_run_of_a_chain_is_stored_anew_when_its_blocks_come_down_again(tmp_path):
    """Damage comes in runs. A lookup stops at the first bad block, so the chain below it was
    never checked: those entries are suspect, and when the recomputed blocks come down again
    they are written anew rather than taken as already there (each damaged file was found one
    request at a time, and a clean stop kept them). Another branch below the bad block is
    suspect too, but kept until then; one read whole and checked is cleared."""
    chain = _chain(5)
    (b_h, _, b_d) = (bytes([0x70]) * 32, None, torch.full((2, 2, 4), 7.0))
    disk = DiskTier(tmp_path / "d", 16)
    for h, p, d in chain:
        disk.put(h, p, d)
    disk.put(b_h, chain[1][0], b_d)  # a branch off block 1
    for h, _, _ in chain:  # every entry of the chain damaged
        path = disk.path(h)
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    assert disk.get(chain[0][0]) is None and disk.stats.corrupt == 1
    assert disk._suspect == {h for h, _, _ in chain[1:]} | {b_h}
    stores = disk.stats.stores
    for h, p, d in chain:  # the request recomputed them; they come down again
        disk.put(h, p, d)
    assert disk.stats.stores == stores + 5  # each written anew, none "already there"
    assert all(torch.equal(disk.get(h), d) for h, _, d in chain) and disk.stats.corrupt == 1
    assert disk._suspect == {b_h} and torch.equal(disk.get(b_h), b_d)  # the branch was intact: kept
    assert not disk._suspect
    disk.put(chain[0][0], None, chain[0][2])  # no longer suspect: already there
    assert disk.stats.stores == stores + 5


def test_an_intact_entry_under_another_key_is_corrupt_not_served(tmp_path, redis_server):
    """The checksum covers the key: another block's whole entry, copied or linked where this one
    should be (or SET under its Redis key), is detected like a damaged one."""
    import redis

    (h0, p0, d0), (h1, p1, d1) = _chain(2)
    disk = DiskTier(tmp_path / "d", 8)
    disk.put(h0, p0, d0)
    disk.put(h1, p1, d1)
    disk.path(h1).write_bytes(disk.path(h0).read_bytes())
    assert disk.get(h1) is None and disk.stats.corrupt == 1
    disk.put(h1, p1, d1)
    disk.path(h1).unlink()
    disk.path(h1).symlink_to(disk.path(h0))
    assert disk.get(h1) is None and disk.stats.corrupt == 2
    assert torch.equal(disk.get(h0), d0)  # the real owner of those bytes still reads
    tier = RedisTier(redis_server.url)
    tier.put(h0, p0, d0)
    tier.put(h1, p1, d1)
    server = redis.Redis.from_url(redis_server.url)
    server.set(tier.key(h1), server.get(tier.key(h0)))
    assert tier.fetch(h1) is None and tier.stats.corrupt == 1
    assert torch.equal(tier.fetch(h0)[0], d0)
    tier.close()


def test_a_fifo_where_a_disk_entry_should_be_is_dropped_without_hanging(tmp_path):
    import os
    import threading

    (h0, p0, d0), = _chain(1)
    disk = DiskTier(tmp_path / "d", 8, index_in_background=False)
    disk.put(h0, p0, d0)
    disk.path(h0).unlink()
    os.mkfifo(disk.path(h0))  # opening or reading it would wait for a writer forever
    got = []
    reader = threading.Thread(target=lambda: got.append(disk.get(h0)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and got == [None] and disk.stats.corrupt == 1
    os.mkfifo(disk.path(h0))  # and an earlier run's: the next engine's index drops it too
    disk.close()
    again = DiskTier(tmp_path / "d", 8, index_in_background=False)
    indexer = threading.Thread(target=again.index, daemon=True)
    indexer.start()
    indexer.join(10)
    assert not indexer.is_alive() and h0 not in again
    again.close()


def _other_process_claims(root) -> None:
    """A DiskTier opened on `root` by another process; re-raises its KVTierError here."""
    import subprocess
    import sys
    code = ("import sys\nfrom tierlm.errors import KVTierError\nfrom tierlm.kv.tiers import DiskTier\n"
            "try:\n    DiskTier(sys.argv[1], 8, block_bytes=64)\nexcept KVTierError as e:\n"
            "    print(e)\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    if done.returncode == 3:
        raise KVTierError(done.stdout.strip())
    raise AssertionError(f"the other process was not refused: rc {done.returncode}, {done.stderr[-500:]}")


def test_disk_tier_is_warm_after_a_restart_and_owned_by_one_engine(llama_dir, cold_reference, tmp_path):
    shared, ref = cold_reference
    kw = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    with _llm(llama_dir, **kw) as first:
        _run(first, shared + _prompt(2, 9))
        assert first.engine.offload_prefix_cache() > 0
        on_disk = len(first.engine.store.tiers[0])
        with pytest.raises(KVTierError, match=r"in use by another engine of this process.*under another name"):
            _llm(llama_dir, **kw)  # a second engine on the same directory would evict blocks unseen
        with pytest.raises(KVTierError, match=r"in use by tierlm pid \d+.*own kv_disk_dir"):
            _other_process_claims(first.engine.store.tiers[0].root)
    _run(first, shared + _prompt(4, 9))
    first.engine.offload_prefix_cache()  # after close: the blocks are dropped, nothing waits or writes
    with _llm(llama_dir, **kw) as second:  # the restarted server: hits whether or not indexing is done
        tokens, cached, computed = _run(second, shared + _prompt(3, 9))
        assert tokens == ref[3]
        assert cached == 64 and computed == 15
        assert second.engine.stats().kv_tiers["disk"]["hits"] == 8
        assert second.engine.store.tiers[0].wait_indexed(timeout=30)
        assert len(second.engine.store.tiers[0]) == on_disk


@pytest.mark.parametrize("host", [False, True])
def test_shutdown_writes_the_whole_cache_down_past_the_writers_backlog(host, llama_dir, tmp_path, caplog):
    """A reviewer's case: persisting the cache at shutdown queued every device block for the
    writer without waiting, so all past its backlog (1 GiB, against a device pool of tens of
    GiB; 4 blocks here) was dropped, chain heads included, while the log said all was written.
    The whole pool was also gathered on the device in one piece: now in batches."""
    from tierlm.kv.tiers import DiskTier

    kw = dict(kv_cache_memory="160 blocks", kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="400 blocks")
    if host:
        kw["kv_host_capacity"] = "16 blocks"
    llm = _llm(llama_dir, **kw)
    eng = llm.engine
    for seed in range(12):
        _run(llm, _prompt(20 + seed, 70), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    cached = len(eng.pool.cached)
    assert cached == 12 * 8  # 8 full blocks a prompt, nothing shared
    disk = next(t for t in eng.store.tiers if isinstance(t, DiskTier))
    eng.store.backlog_bytes = 4 * kv_bytes_per_block(eng.args, torch.float32, 8)
    write, batches = disk._write, []
    disk._write = lambda *a: (time.sleep(0.005), write(*a))[1]  # a disk slower than the copies out
    read, demote, order = eng.kv.io.read, eng.store.demote, []
    eng.kv.io.read = lambda ids: batches.append(len(ids)) or read(ids)
    eng.store.demote = lambda h, parent, *a, **kw: order.append((h, parent)) or demote(h, parent, *a, **kw)
    with caplog.at_level(logging.INFO, logger="tierlm.engine.engine"):
        llm.close()
    assert disk.stats.dropped == 0  # 92 of 96 dropped before
    assert max(batches) <= eng.pool.EVICT_ALL_BATCH and sum(batches) == cached
    # Heads first: a shutdown cut short leaves prefixes a restart can hit (tails first before)
    seen = set()
    for h, parent in order[:cached]:
        assert parent is None or parent in seen
        seen.add(h)
    assert f"moved {cached} cached blocks" in caplog.text and f"{cached} newly written" in caplog.text
    assert "not all" not in caplog.text
    with _llm(llama_dir, **kw) as again:
        tiers = again.engine.store.tiers
        assert next(t for t in tiers if isinstance(t, DiskTier)).wait_indexed(timeout=30)
        assert len(tiers[-1]) == cached
        for seed in range(12):
            assert _run(again, _prompt(20 + seed, 70), SamplingParams(max_tokens=2, temperature=0,
                                                                     ignore_eos=True))[1] == 64


def _chain(n: int) -> list[tuple[bytes, bytes | None, torch.Tensor]]:
    blocks, parent = [], None
    for i in range(n):
        h = bytes([0x10 + i]) * 32
        blocks.append((h, parent, torch.full((2, 2, 4), float(i))))
        parent = h
    return blocks


_CRASHING_ENGINE = """
import os, signal, sys
from tierlm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=64,
          load_progress=False, kv_disk_dir=sys.argv[2], kv_disk_capacity="64 blocks",
          kv_disk_write_through=sys.argv[3] == "1")
llm.generate([{"prompt_token_ids": [int(t) for t in sys.argv[4].split(",")]}],
             SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
llm.engine.store.flush()  # what was queued has landed; now die without any clean-up
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("write_through", [True, False])
def test_disk_write_through_survives_a_crash(llama_dir, cold_reference, tmp_path, write_through):
    """A SIGKILLed engine: with disk write-through its computed blocks are on disk for the next
    one; without, they were only on the device (the clean-stop write-down never ran)."""
    import subprocess
    import sys

    shared, ref = cold_reference
    prompt = shared + _prompt(2, 9)
    proc = subprocess.run([sys.executable, "-c", _CRASHING_ENGINE, str(llama_dir), str(tmp_path / "kv"),
                           "1" if write_through else "0", ",".join(map(str, prompt))], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    with _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks") as after:
        tokens, cached, computed = _run(after, shared + _prompt(3, 9))
    assert tokens == ref[3]
    assert (cached, computed) == ((64, 15) if write_through else (0, 79))


def test_disk_tier_reopens_within_capacity_and_deletes_only_its_debris(tmp_path):
    import os
    blocks = _chain(8)
    disk = DiskTier(tmp_path, 8)
    for i, (h, parent, data) in enumerate(blocks):
        disk.put(h, parent, data)
        os.utime(disk.path(h), ns=(10**18 + i * 10**9,) * 2)  # written in chain order, a second apart
    disk.close()
    half_written = disk.path(blocks[0][0]).with_suffix(".tmp123")
    half_written.write_bytes(b"TLKV1")
    damaged = disk.path(b"\xee" * 32)
    damaged.parent.mkdir(exist_ok=True)
    damaged.write_bytes(b"not a block")
    foreign = disk.path(blocks[0][0]).parent / "notes.txt"
    foreign.write_text("someone else's file")

    again = DiskTier(tmp_path, 4)
    assert again.wait_indexed(timeout=30)
    # Capacity is enforced from the listing (names and file times), before any header is read:
    # the damaged entry, the newest file, holds one of the four places until it is found out.
    kept = blocks[5:]
    assert set(again.parents) == {h for h, _, _ in kept}
    assert all(again.parents[h] == parent for h, parent, _ in kept)  # prefix tree rebuilt from headers
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(again.path(h).name for h, _, _ in kept)
    assert not half_written.exists() and not damaged.exists() and foreign.exists()
    for h, _, data in kept:
        assert torch.equal(again.get(h), data)
    assert again.policy.victim() == kept[-1][0]  # the chain is still evicted from its tail
    again.close()


def test_disk_tier_tells_its_own_temporaries_from_debris_by_name_not_time(tmp_path):
    """After a clock step, file times say nothing about which run wrote a file: the listing must
    neither delete a temporary this run is writing (the block would be lost) nor keep an earlier
    run's."""
    import os
    import time
    (h, parent, data), = _chain(1)
    earlier = DiskTier(tmp_path, 8)  # the directory is not empty
    earlier.put(h, parent, data)
    earlier.close()
    disk = DiskTier(tmp_path, 8, index_in_background=False)
    writing = disk.path(b"\x42" * 32).with_suffix(f".tmp{disk._tmp_tag}{12345:x}")
    debris = disk.path(b"\x43" * 32).with_suffix(".tmp1f2e3d")
    for f, t in ((writing, 10**18), (debris, time.time_ns() + 10**12)):  # ours looks old, theirs new
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"TLKV1")
        os.utime(f, ns=(t, t))
    disk.list_earlier()
    assert writing.exists() and not debris.exists()
    disk.index()
    assert h in disk.parents and writing.exists()
    disk.close()


def test_disk_tier_serves_and_stores_while_it_indexes_an_earlier_run(tmp_path):
    """Indexing runs in the background (`index_in_background=False` lets the test place the tier's
    work before the scan): an entry is found by name before it is indexed, a damaged one is never
    served, and the index ends as if built at start, with this run's work more recent."""
    import os
    blocks = _chain(8)
    first = DiskTier(tmp_path, 8, policy="lru")
    for i, (h, parent, data) in enumerate(blocks):
        first.put(h, parent, data, hint=100 + i)
        os.utime(first.path(h), ns=(10**18 + i * 10**9,) * 2)  # written in chain order, a second apart
    first.close()
    raw = first.path(blocks[5][0]).read_bytes()
    first.path(blocks[5][0]).write_bytes(raw[:-3])  # truncated payload, intact header

    disk = DiskTier(tmp_path, 6, policy="lru", index_in_background=False)
    assert not disk.indexed and len(disk) == 0
    assert blocks[0][0] in disk and b"\x99" * 32 not in disk  # found by name
    assert torch.equal(disk.get(blocks[1][0]), blocks[1][2]) and disk.hint_of(blocks[1][0]) == 101
    assert disk.get(blocks[5][0]) is None and disk.stats.corrupt == 1  # never served, and deleted
    assert not disk.path(blocks[5][0]).exists()
    new_key, new_data = b"\x77" * 32, torch.ones(2, 2, 4)
    disk.put(new_key, None, new_data)
    assert len(disk) == 2

    disk.index()
    assert disk.indexed and disk.wait_indexed(0)
    # 6 old entries left besides the one read, 2 over capacity: the oldest two go.
    assert set(disk.parents) == {blocks[i][0] for i in (1, 3, 4, 6, 7)} | {new_key}
    assert not disk.path(blocks[0][0]).exists() and not disk.path(blocks[2][0]).exists()
    assert disk.parents[blocks[7][0]] == blocks[6][0] and disk.hint_of(blocks[7][0]) == 107
    assert torch.equal(disk.get(blocks[3][0]), blocks[3][2])
    # LRU over leaves (4 lost its child): old entries by file time, then this run's work in order.
    order = []
    while (v := disk.policy.victim()) is not None:
        order.append(v)
        disk.policy.remove(v)
    assert order == [blocks[i][0] for i in (4, 7, 6, 1)] + [new_key, blocks[3][0]]
    disk.close()


def test_a_directory_where_an_earlier_runs_entry_was_is_a_miss_while_indexing(tmp_path):
    """Found by name before it is indexed, a directory at an entry's path is not an entry: a
    miss, never an error out of the tier (on the model loop that failed the engine's step)."""
    (h, parent, data), = _chain(1)
    first = DiskTier(tmp_path, 8)
    first.put(h, parent, data)
    first.close()
    stray = b"\x66" * 32
    first.path(stray).mkdir(parents=True)
    for listed in (False, True):
        disk = DiskTier(tmp_path, 8, index_in_background=False)
        if listed:
            disk.list_earlier()
        assert disk.get(stray) is None and stray not in disk
        assert disk.put(stray, None, data) == [(stray, None, data, None)]  # passed on to the next tier
        assert torch.equal(disk.get(h), data)
        disk.close()


class _FailingThird(DiskTier):
    """A disk tier whose third read raises (a bug, not an OSError)."""

    def _read(self, h):
        self.reads = getattr(self, "reads", 0) + 1
        if self.reads == 3:
            raise RuntimeError("a bug in a tier")
        return super()._read(h)


def _store_over_disk(tmp_path, blocks, tier=DiskTier) -> TieredStore:
    """A store whose one tier is a disk holding `blocks`."""
    disk = tier(tmp_path, 8)
    for h, parent, data in blocks:
        disk.put(h, parent, data)
    return TieredStore([disk])


def test_a_read_a_tier_broke_off_unstages_what_it_staged_once_cancelled(tmp_path):
    blocks = _chain(4)
    store = _store_over_disk(tmp_path, blocks, tier=_FailingThird)
    job = store.prefetch([h for h, _, _ in blocks])
    assert job.done.wait(10) and not job.finished and len(store.staged) == 2
    store.cancel(job)  # the request is gone
    assert not store.staged and store.staged_bytes == 0
    store.close()


def test_tier_counters_lose_no_update_to_threads_counting_at_once():
    """Four readers, the writer and the model loop count into one tier's stats; `+=` from
    several threads lost updates (bytes_out 65 blocks short in a tester's run)."""
    import sys
    import threading

    from tierlm.kv.tiers import TierStats
    stats, before = TierStats(), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=lambda: [stats.count(hits=1, bytes_out=3) for _ in range(20_000)])
                   for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(before)
    assert (stats.hits, stats.bytes_out) == (80_000, 240_000)


def test_a_cancelled_read_keeps_the_blocks_another_waiting_read_wants(tmp_path):
    blocks = _chain(4)
    store = _store_over_disk(tmp_path, blocks)
    hashes = [h for h, _, _ in blocks]
    a = store.prefetch(hashes)
    assert a.done.wait(10) and a.found == 4
    b = store.prefetch(hashes[:2])
    assert b.done.wait(10) and b.found == 2
    store.cancel(a)  # its request is gone; the other one still waits for its two
    assert set(store.staged) == set(hashes[:2])
    store.settle(b)
    store.unstage(hashes[:2])  # b's request let them go
    assert not store.staged and store.staged_bytes == 0 and not store._wanted
    store.close()


def test_disk_tier_stays_within_capacity_while_it_indexes(tmp_path):
    """Once the earlier run's files are listed, a store that needs room deletes the oldest entry
    not yet indexed (what LRU would evict first), so the directory never exceeds capacity; the
    index then ends as if it had been built at start."""
    import os
    blocks = _chain(8)
    first = DiskTier(tmp_path, 8, policy="lru")
    for i, (h, parent, data) in enumerate(blocks):
        first.put(h, parent, data)
        os.utime(first.path(h), ns=(10**18 + i * 10**9,) * 2)
    first.close()

    def files():
        return {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kv")}

    disk = DiskTier(tmp_path, 6, policy="lru", index_in_background=False)
    disk.list_earlier()
    assert files() == {h for h, _, _ in blocks[2:]} and not disk.indexed  # the oldest two went at once
    assert blocks[0][0] not in disk and disk.get(blocks[0][0]) is None
    assert torch.equal(disk.get(blocks[3][0]), blocks[3][2])  # read by name, not yet indexed
    new = [(bytes([0x70 + i]) * 32, torch.full((2, 2, 4), 70.0 + i)) for i in range(3)]
    for i, (h, data) in enumerate(new):
        assert disk.put(h, None, data) == []  # an old entry's file goes, not a block to demote
        assert len(files()) == 6
    assert files() == {blocks[i][0] for i in (3, 6, 7)} | {h for h, _ in new}  # 2, 4, 5: oldest first

    disk.index()
    assert set(disk.parents) == files() and disk.stats.evictions == 5
    assert torch.equal(disk.get(blocks[7][0]), blocks[7][2]) and disk.parents[blocks[7][0]] == blocks[6][0]
    order = []  # LRU over leaves: 7 (now read again) has 6 as parent; 3 lost its child
    while (v := disk.policy.victim()) is not None:
        order.append(v)
        disk.policy.remove(v)
    assert order == [blocks[3][0]] + [h for h, _ in new] + [blocks[7][0], blocks[6][0]]
    disk.close()


def test_closing_a_disk_tier_mid_index_leaves_its_entries_for_the_next(tmp_path):
    blocks = _chain(4)
    first = DiskTier(tmp_path, 8)
    for h, parent, data in blocks:
        first.put(h, parent, data)
    first.close()
    interrupted = DiskTier(tmp_path, 8, index_in_background=False)
    interrupted.close()  # before its scan: nothing indexed, nothing deleted
    interrupted.index()
    assert len(interrupted) == 0 and len(list(tmp_path.rglob("*.kv"))) == 4
    again = DiskTier(tmp_path, 8)
    assert again.wait_indexed(timeout=30) and set(again.parents) == {h for h, _, _ in blocks}
    again.close()


@pytest.mark.parametrize("policy,capacity", [("lru", 600), ("duel", 1500), ("arc", 3000)])
def test_disk_index_stays_consistent_under_concurrent_use(tmp_path, policy, capacity):
    """Gets and puts race the background indexer; whatever the interleaving, the tier ends with
    exactly one file per indexed block, every one tracked by the policy, within capacity."""
    keys = [i.to_bytes(32, "big") for i in range(2000)]
    data = torch.zeros(2, 2, 4)
    first = DiskTier(tmp_path, len(keys))
    for i, h in enumerate(keys):
        first.put(h, keys[i - 1] if i % 25 else None, data, hint=i)
    first.close()
    disk = DiskTier(tmp_path, capacity, policy=policy)
    rng, ops = random.Random(capacity), 0
    while not disk.indexed or ops < 1000:
        h = rng.randrange(len(keys) + 1000).to_bytes(32, "big")
        if rng.random() < 0.5:
            got = disk.get(h)
            assert got is None or torch.equal(got, data)
        else:
            disk.put(h, None, data)
        ops += 1
    files = {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kv")}
    assert files == set(disk.parents) and len(files) <= capacity
    assert len(disk.policy) == len(files) and all(h in disk.policy for h in files)
    assert disk.stats.corrupt == 0
    disk.close()


def test_disk_write_failure_passes_the_block_on_and_serves_on(tmp_path, caplog):
    disk = DiskTier(tmp_path, 8)
    (h, parent, data), = _chain(1)
    disk.path(h).parent.write_text("a file where the shard directory should be")
    with caplog.at_level("WARNING"):
        assert disk.put(h, parent, data) == [(h, parent, data, None)]  # for the next tier down
        disk.put(h, parent, data)
    assert h not in disk and disk.stats.errors == 2 and disk.stats.stores == 0
    assert sum("cannot store blocks" in r.message for r in caplog.records) == 1  # one warning, not a flood
    disk.path(h).parent.unlink()
    assert disk.put(h, parent, data) == [] and torch.equal(disk.get(h), data)
    disk.close()


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 1 MiB filesystem (tmpfs), to run the disk tier out of space."""
    import subprocess
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)  # lazy: a failed test may leave a file open


def test_disk_tier_that_runs_out_of_space_holds_what_fits_and_keeps_storing(small_filesystem, caplog):
    """Capacity above what the disk holds (another process filled it, or the default half of the
    free space was too hopeful): the tier evicts for each new block and holds what fits."""
    blocks = [(i.to_bytes(32, "big"), torch.full((64, 256), float(i))) for i in range(40)]  # 64 KiB each
    disk = DiskTier(small_filesystem / "kv", 1000, policy="lru")
    moved = []
    with caplog.at_level("WARNING"):
        for h, data in blocks:
            moved += disk.put(h, None, data)
    held = len(disk)
    assert 5 < held < 16 and disk.capacity == held  # what 1 MiB holds, not 1000
    assert sum("ran out of space" in r.message for r in caplog.records) == 1
    assert f"KV disk tier {small_filesystem / 'kv'} ran out of space" in caplog.text  # which directory
    assert disk.stats.errors == 0 and disk.stats.stores == 40  # every block was stored ...
    assert [h for h, *_ in moved] == [h for h, _ in blocks[:40 - held]]  # ... the oldest moved down in LRU order
    assert all(torch.equal(disk.get(h), data) for h, data in blocks[-held:])
    disk.close()

    # The next run lists those entries and indexes them lazily: out of space, an unindexed
    # old entry (the oldest) goes first, before any of this run's blocks.
    disk = DiskTier(small_filesystem / "kv", 1000, policy="lru", index_in_background=False)
    disk.list_earlier()
    new = [(i.to_bytes(32, "big"), torch.full((64, 256), -float(i))) for i in range(100, 103)]
    for h, data in new:
        assert disk.put(h, None, data) == []  # old entries are deleted, not moved
    assert disk.capacity == held and disk.stats.errors == 0
    files = {p.name[:64] for p in (small_filesystem / "kv").glob("*/*.kv")}
    assert files == {h.hex() for h, _ in blocks[-held + 3:] + new}
    disk.close()


def test_a_file_left_by_a_failed_delete_goes_before_a_full_disk_lowers_capacity(small_filesystem, monkeypatch):
    """A disk tester's case: an evicted entry's file could not be deleted (the directory was
    read-only for a while); once writes worked again that file filled the disk, and the next
    store lowered the tier's capacity for good instead of deleting it (it was deleted only after
    a write that succeeded)."""
    import pathlib

    blocks = [(i.to_bytes(32, "big"), torch.full((64, 256), float(i))) for i in range(40)]  # 64 KiB each
    disk = DiskTier(small_filesystem / "kv", 1000, policy="lru")
    for h, data in blocks[:30]:
        disk.put(h, None, data)
    held = disk.capacity
    assert held == len(disk) < 16  # full: what 1 MiB holds
    unlink, refused = pathlib.Path.unlink, []

    def read_only_once(self, *a, **kw):
        if not refused:
            refused.append(self)
            raise PermissionError(13, "Read-only file system", str(self))
        return unlink(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only_once)
    h, data = blocks[30]
    disk.put(h, None, data)  # evicts the oldest, whose file stays and takes the room the new one needs
    assert refused and disk.capacity == held  # lowered to 14 of 15 before
    assert not refused[0].exists() and not disk._undeleted  # the leftover went, not the capacity
    for h, data in blocks[31:]:
        disk.put(h, None, data)
    assert disk.capacity == held and len(disk) == held and disk.stats.errors == 0
    disk.close()


def _fill(directory) -> None:
    """Fill the file system under `directory` to the last byte."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(4096))
        except OSError:
            pass


def test_a_full_disk_at_start_is_a_cold_disk_tier_not_a_refusal(llama_dir, cold_reference, small_filesystem,
                                                                 tmp_path, caplog):
    """New weights on a full disk: the engine refused to start (after loading the weights) because
    the pid label of its new directory's lock could not be written; where even the directory
    cannot be made (no inodes left), the tier is off for the run. Either way it serves."""
    import subprocess
    shared, ref = cold_reference
    _fill(small_filesystem)
    llm = _llm(llama_dir, kv_disk_dir=str(small_filesystem / "kv"), kv_disk_capacity="64 blocks")
    assert _run(llm, shared + _prompt(2, 9))[0] == ref[2]
    llm.engine.offload_prefix_cache()  # every write fails: passed on, dropped
    assert _run(llm, shared + _prompt(3, 9))[0] == ref[3]
    assert llm.engine.stats().kv_tiers["disk"]["errors"] > 0
    llm.close()

    no_inodes = tmp_path / "no-inodes"
    no_inodes.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=8", "tmpfs", str(no_inodes)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        for i in range(100):
            try:
                (no_inodes / f"f{i}").touch()
            except OSError:
                break
        with caplog.at_level("WARNING"):
            llm = _llm(llama_dir, kv_disk_dir=str(no_inodes / "kv"), kv_disk_capacity="64 blocks")
        assert f"KV disk tier {no_inodes / 'kv'}" in caplog.text and "off for this run" in caplog.text
        assert llm.engine.store is None  # no tier but the device
        assert _run(llm, shared + _prompt(2, 9))[0] == ref[2]
        llm.close()
    finally:
        subprocess.run(["umount", "-l", str(no_inodes)], check=True)


def test_default_disk_capacity_stays_the_same_across_restarts(small_filesystem):
    """Half of (free + what its entries use), not half the free space plus all of them: a cache
    that filled its half took half of the rest at the next start, and so on towards the whole disk."""
    data = torch.zeros(64, 128)  # 32 KiB blocks
    capacities = []
    for run in range(4):
        disk = DiskTier(small_filesystem / "kv", None, block_bytes=data.numel() * 4, index_in_background=False)
        disk.index()
        capacities.append(disk.capacity)
        for i in range(40):
            disk.put((run * 100 + i).to_bytes(32, "big"), None, data)
        disk.close()
    assert capacities[0] > 4 and max(capacities) - min(capacities) <= 1, capacities


def test_a_read_failing_for_a_reason_not_its_entry_keeps_the_entry(tmp_path, caplog):
    """Out of file descriptors (a server with many client sockets), reads failed like damaged
    entries: each intact entry asked for was counted corrupt and deleted."""
    import os
    import resource
    blocks = [(i.to_bytes(32, "big"), torch.full((16, 64), float(i))) for i in range(6)]
    disk = DiskTier(tmp_path, 20)
    for h, data in blocks:
        disk.put(h, None, data)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:
        with caplog.at_level("WARNING"):
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            got = [disk.get(h) for h, _ in blocks]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert got == [None] * 6 and disk.stats.corrupt == 0 and disk.stats.errors == 6
    assert "cannot read entries" in caplog.text and caplog.text.count("cannot read entries") == 1
    assert all(torch.equal(disk.get(h), data) for h, data in blocks)  # kept, and served again
    disk.close()


def test_links_put_at_the_lock_or_an_entry_temporary_are_never_written_through(tmp_path):
    """A symbolic link at `.lock` had its target truncated and overwritten with the pid label; one
    at the name of an entry's temporary had the block written into its target."""
    import threading
    victim = tmp_path / "victim"
    victim.write_text("someone else's file\n")
    d = tmp_path / "kv"
    d.mkdir()
    (d / ".lock").symlink_to(victim)
    with pytest.raises(KVTierError, match=r"\.lock is a symbolic link"):
        DiskTier(d, 8)
    (d / ".lock").unlink()
    disk = DiskTier(d, 8)
    (h, parent, data), = _chain(1)
    tmp = disk.path(h).with_suffix(f".tmp{disk._tmp_tag}{threading.get_ident():x}")
    tmp.parent.mkdir()
    tmp.symlink_to(victim)
    assert disk.put(h, parent, data) == [] and torch.equal(disk.get(h), data)
    assert victim.read_text() == "someone else's file\n" and not tmp.exists()
    disk.close()


def test_links_put_at_a_shard_or_an_entry_lead_nowhere_outside_the_directory(tmp_path):
    """A shard directory replaced by a link had new entries written, and evicted, through it;
    an entry replaced by a link had its target rewritten by a hint update; at a restart a linked
    shard's files were listed as entries (and trimmed: deleted where they lie)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    d = tmp_path / "kv"
    disk = DiskTier(d, 8, policy="lru")
    (h, parent, data), = _chain(1)
    disk.path(h).parent.symlink_to(outside, target_is_directory=True)
    assert [m[0] for m in disk.put(h, parent, data)] == [h]  # not stored: passed on to the next tier
    assert list(outside.iterdir()) == [] and h not in disk and disk.stats.errors == 1
    disk.path(h).parent.unlink()

    assert disk.put(h, parent, data, hint=3) == []
    victim = outside / "victim"
    victim.write_bytes(disk.path(h).read_bytes())  # an entry's bytes: a hint slot to patch
    disk.path(h).unlink()
    disk.path(h).symlink_to(victim)
    disk.put(h, parent, data, hint=700)  # a new hint: patched in place, never through the link
    assert victim.read_bytes() == encode_block(data, parent, 3, key=h)
    disk.close()

    (outside / disk.path(h).name).write_bytes(encode_block(data, parent, key=h))
    shard = disk.path(h).parent
    for f in shard.iterdir():
        f.unlink()
    shard.rmdir()
    shard.symlink_to(outside, target_is_directory=True)
    again = DiskTier(d, 8, index_in_background=False)
    again.index()
    assert h not in again and (outside / disk.path(h).name).exists()
    again.close()


def test_a_shard_removed_while_an_earlier_run_is_listed_is_skipped(tmp_path, monkeypatch):
    """Shards emptied once space ran out are removed on the writer thread, while the listing of an
    earlier run's entries runs outside the lock: a shard gone between the two scandirs made the
    whole indexing fail, leaving every earlier entry unindexed (and uncounted)."""
    import os
    import shutil
    from tierlm.kv import tiers
    blocks = _chain(12)
    disk = DiskTier(tmp_path, 64)
    for h, parent, data in blocks:
        disk.put(h, parent, data)
    disk.close()
    doomed = disk.path(blocks[-1][0]).parent  # the chain's tail: its ancestors stay whole
    real_scandir = os.scandir

    def scandir(path):
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(doomed):
            shutil.rmtree(doomed)  # removed after the root was listed, before its own listing
        return real_scandir(path)
    monkeypatch.setattr(tiers.os, "scandir", scandir)
    again = DiskTier(tmp_path, 64, index_in_background=False)
    again.index()
    monkeypatch.undo()
    gone = {h for h, *_ in blocks if disk.path(h).parent == doomed}
    assert {h for h, *_ in blocks if h in again} == {h for h, *_ in blocks} - gone
    again.close()


def test_a_disk_short_of_inodes_keeps_holding_entries(tmp_path):
    """On a file system short of inodes (not of bytes), each new shard directory took the inode
    an evicted entry freed, and empty shards stayed, until all 256 existed and no entry fitted:
    the tier ended holding nothing and failing every write."""
    import subprocess
    mnt = tmp_path / "few-inodes"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=60", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        disk = DiskTier(mnt / "kv", 1000, policy="lru")
        blocks = [(hashlib.sha256(b"%d" % i).digest(), torch.full((4, 8), float(i))) for i in range(400)]
        for h, data in blocks:
            disk.put(h, None, data)
        assert len(disk) >= 10 and disk.stats.errors == 0, (len(disk), disk.stats.errors)
        assert all(torch.equal(disk.get(h), data) for h, data in blocks[-len(disk):])
        disk.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_entries_with_file_times_in_the_future_are_an_earlier_runs(tmp_path):
    """After the clock stepped back (NTP, a restored VM) an earlier run's entries look newer than
    this run's start: they were neither served, counted against capacity nor deleted."""
    import os
    blocks = _chain(4)
    disk = DiskTier(tmp_path, 4)
    for h, parent, data in blocks:
        disk.put(h, parent, data)
    disk.close()
    future = time.time_ns() + 10**15
    for p in tmp_path.glob("*/*.kv"):
        os.utime(p, ns=(future, future))
    disk = DiskTier(tmp_path, 4, index_in_background=False)
    disk.index()
    assert len(disk) == 4 and all(torch.equal(disk.get(h), data) for h, _, data in blocks)
    disk.close()


def test_a_directory_renamed_away_is_locked_and_recorded_again(llama_dir, cold_reference, tmp_path):
    """Its lock file moved with it, so the recreated directory had none (a second engine could
    start on it) and no model.json (`kv ls` could never call it stale)."""
    from tierlm.kv import admin
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    disk = llm.engine.store.tiers[0]
    _run(llm, shared + _prompt(2, 9))
    disk.root.rename(tmp_path / "moved-away")
    llm.engine.persist_kv()  # writes into a directory it has to make again
    assert (disk.root / ".lock").is_file() and admin.read_about(disk.root)["model_dir"] == str(llama_dir.resolve())
    with pytest.raises(KVTierError, match="in use by another engine of this process"):
        DiskTier(disk.root, 8)
    assert _run(llm, shared + _prompt(2, 9))[0] == ref[2]
    llm.close()


def test_deletes_that_failed_are_done_once_writes_work_again(tmp_path):
    """A read-only (here immutable) shard: evicting for a write that then fails left the evicted
    entry's file behind, unindexed, so the directory held more files than its capacity."""
    import subprocess
    blocks = [(bytes([7]) + i.to_bytes(31, "big"), torch.full((16, 64), float(i))) for i in range(4)]  # one shard
    disk = DiskTier(tmp_path, 2, policy="lru")
    for h, data in blocks[:2]:
        disk.put(h, None, data)
    shard = disk.path(blocks[0][0]).parent
    if subprocess.run(["chattr", "+i", str(shard)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        moved = disk.put(blocks[2][0], None, blocks[2][1])  # evicts the oldest (its file stays), then cannot write
        assert [m[0] for m in moved] == [blocks[0][0], blocks[2][0]] and len(disk) == 1
    finally:
        subprocess.run(["chattr", "-i", str(shard)], capture_output=True)
    (h0, d0), (h3, d3) = blocks[0], blocks[3]
    assert disk.put(h0, None, d0) == []  # the block whose delete failed, stored again: its file is kept
    assert torch.equal(disk.get(h0), d0) and disk.stats.corrupt == 0
    assert [m[0] for m in disk.put(h3, None, d3)] == [blocks[1][0]]  # the least recent moves down
    assert {p.name[:64] for p in tmp_path.glob("*/*.kv")} == {h.hex() for h in disk.parents} == {h0.hex(), h3.hex()}
    disk.close()


def test_a_lock_file_that_cannot_be_looked_at_for_a_moment_costs_one_write(tmp_path, monkeypatch):
    """Only a lock file that is gone (or another file at its path) is taken again; a stat that
    fails for a moment (permissions, I/O) turned the tier off for the rest of the run, with a
    wrong "in use by another engine of this process"."""
    import errno
    import os
    from tierlm.kv import tiers
    blocks = _chain(2)
    disk = DiskTier(tmp_path, 8)
    real_stat, failing = os.stat, [True]

    def stat(path, *a, **kw):
        if str(path).endswith(".lock") and failing:
            failing.clear()
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(tiers.os, "stat", stat)
    (h, parent, data), (h2, p2, d2) = blocks
    assert disk.put(h, parent, data) == [(h, parent, data, None)]  # this write fails: passed on
    assert disk.put(h2, p2, d2) == [] and disk._lost is None  # the next one works
    assert torch.equal(disk.get(h2), d2)
    disk.close()


def test_an_earlier_runs_entry_whose_read_fails_for_a_moment_stays_evictable(tmp_path, monkeypatch):
    """Adopted into the index for a read that then failed (out of file descriptors), it was held
    but unknown to the policy: never evicted, a capacity slot lost until asked for again."""
    import errno
    blocks = _chain(3)
    disk = DiskTier(tmp_path, 3)
    for h, parent, data in blocks:
        disk.put(h, parent, data)
    disk.close()
    disk = DiskTier(tmp_path, 3, index_in_background=False)  # not indexed: entries are found by name
    tail = blocks[-1][0]
    monkeypatch.setattr(disk, "_read", lambda h: (_ for _ in ()).throw(OSError(errno.EMFILE, "Too many open files")))
    assert disk.get(tail) is None and disk.stats.errors == 1 and disk.stats.corrupt == 0
    monkeypatch.undo()
    assert tail in disk.parents and tail in disk.policy  # evictable like any entry
    disk.close()


def test_a_write_failing_now_and_then_is_warned_about_once(tmp_path, caplog):
    disk = DiskTier(tmp_path, 100)
    bad, good = bytes([1]) * 32, bytes([2]) * 32
    disk.path(bad).parent.write_text("a file where the shard directory should be")
    with caplog.at_level("WARNING"):
        for i in range(10):
            disk.put(bad, None, torch.zeros(4))
            disk.put(good[:-1] + bytes([i]), None, torch.zeros(4))  # succeeds in between
    assert disk.stats.errors == 10 and caplog.text.count("cannot store blocks") == 1
    assert str(tmp_path) in caplog.text
    disk.close()


def test_disk_tier_grows_back_when_space_frees_up(small_filesystem, caplog):
    filler = small_filesystem / "other-files"
    filler.write_bytes(bytes(700 << 10))  # someone else's 700 KiB of the 1 MiB
    blocks = [(i.to_bytes(32, "big"), torch.full((64, 256), float(i))) for i in range(30)]  # 64 KiB each
    disk = DiskTier(small_filesystem / "kv", 1000, policy="lru", regrow_every_s=0)
    for h, data in blocks[:10]:
        disk.put(h, None, data)
    low = disk.capacity
    assert low == len(disk) < 5 and disk.stats.errors == 0
    filler.unlink()
    with caplog.at_level("INFO"):
        for h, data in blocks[10:]:
            disk.put(h, None, data)
    assert "has space again" in caplog.text
    assert caplog.text.count("ran out of space") == 1  # grown within what is free, not into a second full disk
    assert low < disk.capacity < 1000 and len(disk) > low + 3  # took back some of the freed space ...
    assert all(torch.equal(disk.get(h), data) for h, data in blocks[-len(disk):])
    assert disk.stats.errors == 0  # ... and never more than the disk holds
    disk.close()


def test_a_disk_tier_given_no_capacity_on_a_full_disk_takes_half_of_what_frees_up_once(small_filesystem, caplog):
    """Without kv_disk_capacity the tier takes half the free space at start: none on a full disk,
    for the whole run, said at INFO only. It says so as a warning, and once space frees up takes
    half of it, as a start would have, and no more after that (growing again with each freeing
    would creep towards the whole disk)."""
    data = torch.zeros(64, 256)  # 64 KiB blocks
    DiskTier(small_filesystem / "kv", None, block_bytes=data.numel() * 4).close()  # its directory exists
    filler = small_filesystem / "other-files"
    _fill(small_filesystem)
    (small_filesystem / "filler").rename(filler)
    with caplog.at_level("WARNING"):
        disk = DiskTier(small_filesystem / "kv", None, block_bytes=data.numel() * 4, regrow_every_s=0)
    assert disk.capacity == 0 and "no room for a block" in caplog.text and "kv_disk_capacity" in caplog.text
    blocks = [(i.to_bytes(32, "big"), torch.full((64, 256), float(i))) for i in range(12)]
    assert disk.put(*blocks[0][:1], None, blocks[0][1]) != [] and len(disk) == 0  # still full: passed on
    filler.unlink()
    with caplog.at_level("INFO"):
        for h, d in blocks[1:]:
            disk.put(h, None, d)
    grown = disk.capacity
    assert 3 <= grown <= 8 and "has space again" in caplog.text and "no capacity given" in caplog.text
    assert len(disk) == grown and disk.stats.errors == 0  # half of ~1 MiB free, in 64 KiB blocks
    for h, d in blocks[:6]:  # more blocks, with space still free: no second helping
        disk.put(h + b"x", None, d)
    assert disk.capacity == grown and caplog.text.count("has space again") == 1
    assert all(torch.equal(disk.get(h + b"x"), d) for h, d in blocks[:6][-grown:])  # what it holds reads back
    disk.close()


def test_the_shutdown_log_counts_the_blocks_written_not_the_blocks_moved(llama_dir, cold_reference, small_filesystem,
                                                                         tmp_path, caplog):
    """persist_kv logged "wrote N cached blocks ... down to the disk tier" for every block it
    moved: blocks already there, and all of them on a disk tier with no room, which wrote none."""
    shared, _ = cold_reference
    found = r"moved (\d+) cached blocks .* (\d+) newly written"
    with caplog.at_level("INFO", logger="tierlm.engine.engine"):
        llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
        _run(llm, shared + _prompt(2, 9))
        llm.engine.persist_kv()
        first = re.findall(found, caplog.text)
        assert len(first) == 1 and first[0][0] == first[0][1] != "0"  # all new
        _run(llm, shared + _prompt(2, 9))  # read back up from the disk: the same blocks
        caplog.clear()
        llm.engine.persist_kv()
        assert re.findall(found, caplog.text) == [(first[0][0], "0")]  # all there already
        llm.close()
        _llm(llama_dir, kv_disk_dir=str(small_filesystem / "kv")).close()  # its directory, no entries
        _fill(small_filesystem)
        caplog.clear()
        llm = _llm(llama_dir, kv_disk_dir=str(small_filesystem / "kv"))  # on a full disk: capacity 0
        _run(llm, _prompt(5, 40))
        llm.engine.persist_kv()
        assert "the disk tier has no room (capacity 0 blocks" in caplog.text and "newly written" not in caplog.text
        llm.close()


def test_disk_tier_recovers_when_its_directory_is_deleted(tmp_path):
    """A cache directory under /tmp or /var/tmp can be wiped by a cleaner while the server runs:
    the blocks that were there become misses, and storing works again at once."""
    import shutil
    (h, parent, data), (h2, _, data2) = _chain(2)
    disk = DiskTier(tmp_path / "kv", 8)
    disk.put(h, parent, data)
    shutil.rmtree(tmp_path / "kv")
    assert disk.get(h) is None and h not in disk  # gone: a miss, dropped from the index
    assert disk.put(h2, h, data2) == [] and torch.equal(disk.get(h2), data2)
    assert disk.stats.errors == 0
    # The lock went with the directory and was taken again: a second engine is still refused.
    with pytest.raises(KVTierError, match="in use"):
        DiskTier(tmp_path / "kv", 8)
    disk.close()
    DiskTier(tmp_path / "kv", 8).close()  # and the lock is released on close as before


def test_disk_tier_stops_storing_if_another_engine_took_its_recreated_directory(tmp_path, caplog):
    import shutil
    (h, parent, data), (h2, _, data2), (h3, _, data3) = _chain(3)
    disk = DiskTier(tmp_path / "kv", 8)
    disk.put(h, parent, data)
    shutil.rmtree(tmp_path / "kv")
    other = DiskTier(tmp_path / "kv", 8)  # started on the recreated directory before our next store
    other.put(h2, h, data2)
    disk.path(h3).parent.mkdir()  # a shard the other engine already made: no missing directory to notice
    with caplog.at_level("WARNING"):
        assert disk.put(h3, h2, data3) == [(h3, h2, data3, None)]  # passed on to the next tier
    assert "in use by another engine of this process" in caplog.text  # both are in this test's process
    assert disk.stats.errors == 1 and h3 not in disk
    assert disk.put(h2, h, data2) == [(h2, h, data2, None)]  # no writes into the other engine's directory
    assert disk.stats.errors == 2
    disk.close()
    assert torch.equal(other.get(h2), data2) and len(list((tmp_path / "kv").glob("*/*.kv"))) == 1
    other.close()


def test_disk_capacity_defaults_to_half_the_free_space(tmp_path):
    import shutil
    block_bytes = 1 << 20
    disk = DiskTier(tmp_path, None, block_bytes=block_bytes)
    half_free = shutil.disk_usage(tmp_path).free // 2 // block_bytes
    assert abs(disk.capacity - half_free) <= max(2, half_free // 100)
    disk.close()


def test_redis_stopped_mid_run_degrades_to_misses(llama_dir, cold_reference, redis_server):
    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_remote=redis_server.url)
    assert llm.engine.kv.prefetching  # with Redis, on by default even on CPU: round trips off the loop
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    redis_server.stop()
    tokens, cached, computed = _run(llm, shared + _prompt(3, 9))
    assert tokens == ref[3] and cached == 0 and computed == 79
    assert llm.engine.stats().kv_tiers["redis"]["errors"] >= 1
    # And it keeps working: demotion while Redis is down is a dropped write, not an error.
    llm.engine.offload_prefix_cache()
    assert _run(llm, shared + _prompt(2, 9))[0] == ref[2]


def test_redis_outage_is_logged_once_backs_off_and_ends_when_redis_returns(redis_server, caplog):
    import time
    (h, parent, data), = _chain(1)
    tier = RedisTier(redis_server.url, retry_after_s=0.2, max_retry_after_s=0.8)
    tier.put(h, parent, data)
    redis_server.stop()
    backoffs = []
    with caplog.at_level("INFO", logger="tierlm.kv.tiers"):
        for _ in range(4):  # each a retry that fails: the wait doubles, up to its cap
            assert tier.fetch(h) is None and tier.put(h, parent, data) == []
            backoffs.append(tier.backoff)
            assert tier.fetch(h) is None  # within the back-off: not even tried
            time.sleep(max(0.0, tier.down_until - time.monotonic()) + 0.01)
        assert backoffs == [0.2, 0.4, 0.8, 0.8] and tier.stats.errors == 4
        redis_server.start()  # the same address, empty (no persistence)
        assert tier.fetch(h) is None and tier.backoff == 0  # answered: a plain miss now
        tier.put(h, parent, data)
        assert torch.equal(tier.get(h), data)
    down = [r.message for r in caplog.records if "unavailable" in r.message]
    back = [r.message for r in caplog.records if "is back" in r.message]
    assert len(down) == 1 and len(back) == 1 and "4 failed tries" in back[0]
    tier.close()


def test_redis_memory_limit_is_set_again_after_a_redis_restart(redis_server):
    import redis

    (h, parent, data), = _chain(1)
    tier = RedisTier(redis_server.url, retry_after_s=0.05, capacity_bytes=4 << 20)
    server = redis.Redis.from_url(redis_server.url)
    limit = int(server.config_get("maxmemory")["maxmemory"])
    assert limit > 4 << 20
    redis_server.stop()
    assert tier.fetch(h) is None and tier.backoff > 0  # the outage starts
    redis_server.start()  # a fresh server: no limit, noeviction (CONFIG SET does not persist)
    server = redis.Redis.from_url(redis_server.url)
    assert int(server.config_get("maxmemory")["maxmemory"]) == 0
    import time
    time.sleep(0.06)
    assert tier.fetch(h) is None and tier.backoff == 0  # answered: the outage is over
    assert int(server.config_get("maxmemory")["maxmemory"]) > 4 << 20  # and the limit is back
    assert server.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    tier.close()


def test_redis_tier_size_is_the_servers_maxmemory(llama_dir, redis_server, caplog):
    import redis

    server = redis.Redis.from_url(redis_server.url)
    with caplog.at_level("WARNING", logger="tierlm.kv.tiers"):
        RedisTier(redis_server.url)  # a stock redis-server has no limit: say so
    assert "no maxmemory" in caplog.text and "kv_remote_capacity" in caplog.text
    overhead = int(server.info("memory")["used_memory_overhead"])
    llm = _llm(llama_dir, kv_remote=redis_server.url, kv_remote_capacity="1000 blocks", kv_remote_ttl=600)
    block, = llm.engine.runner.read_blocks([0])
    maxmemory = int(server.config_get("maxmemory")["maxmemory"]) - 1000 * block.numel() * block.element_size()
    assert overhead < maxmemory < overhead + (2 << 20)  # 1000 blocks on top of the server's overhead (+1 MiB)
    assert server.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    _run(llm, _prompt(5, 40))
    llm.engine.store.flush()  # write-through landed, with the TTL
    keys = server.keys("tierlm:kv:*")
    assert len(keys) == llm.engine.stats().kv_tiers["redis"]["stores"] >= 5  # nothing evicted
    assert all(0 < server.ttl(k) <= 600 for k in keys)


def test_redis_full_under_noeviction_drops_writes_but_keeps_serving(redis_server):
    import redis

    server = redis.Redis.from_url(redis_server.url)
    tier = RedisTier(redis_server.url)
    data = torch.randn(64, 256)  # 64 KiB a block
    tier.put(b"\x01" * 32, None, data)
    used = int(server.info("memory")["used_memory"])
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", used + 200_000)  # room for about three more blocks
    for i in range(2, 12):
        tier.put(bytes([i]) * 32, None, data)
    assert 1 <= tier.stats.errors <= 9 and tier.stats.stores >= 2  # refused writes, counted
    assert tier._available()  # not treated as an outage
    got = tier.get(b"\x01" * 32)
    assert got is not None and torch.equal(got, data)


def test_redis_capacity_evicts_instead_of_refusing(redis_server):
    import redis

    server = redis.Redis.from_url(redis_server.url)
    data = torch.randn(64, 256)  # 64 KiB a block
    tier = RedisTier(redis_server.url, capacity_bytes=1_000_000)  # about 15 blocks
    for i in range(1, 41):
        tier.put(bytes([i]) * 32, None, data)
    assert tier.stats.errors == 0 and tier.stats.stores == 40
    assert 0 < server.dbsize() < 40  # the server evicted, within its limit
    assert tier.get(bytes([40]) * 32) is not None  # the newest is kept


def test_a_small_redis_capacity_holds_what_it_says_on_an_empty_server(redis_server):
    """The limit is set above what the server takes with no data: with a capacity of four
    64 KiB blocks, the writes land (the newest kept) instead of all being refused."""
    data = torch.randn(64, 256)
    tier = RedisTier(redis_server.url, capacity_bytes=4 * 70_000)
    for i in range(1, 9):
        tier.put(bytes([i]) * 32, None, data)
    assert tier.stats.errors == 0 and tier.stats.stores == 8
    assert tier.get(bytes([8]) * 32) is not None
    tier.close()


def test_a_redis_database_that_does_not_exist_is_refused_at_start(redis_server):
    with pytest.raises(KVTierError, match="has no such database"):
        RedisTier(redis_server.url.rsplit("/", 1)[0] + "/99")
    with pytest.raises(ValueError, match="the path names the database and must be a number"):
        LLM("no-model-here", kv_remote=redis_server.url.rsplit("/", 1)[0] + "/abc")


def test_redis_with_a_password_works_and_never_shows_it(llama_dir, cold_reference, redis_server_with_password,
                                                        caplog):
    srv = redis_server_with_password
    for wrong in (srv.url.replace("s3cret-pw", "nope"), srv.url.replace(":s3cret-pw@", "")):
        with pytest.raises(KVTierError, match="refused the credentials") as err:
            RedisTier(wrong)  # at start, not as an outage retried forever
        assert "nope" not in str(err.value)
    shared, ref = cold_reference
    with caplog.at_level("DEBUG"):
        first = _llm(llama_dir, kv_remote=srv.url)
        _run(first, shared + _prompt(2, 9))
        first.engine.store.flush()
        second = _llm(llama_dir, kv_remote=srv.url)
        tokens, cached, _ = _run(second, shared + _prompt(3, 9))
        assert tokens == ref[3] and cached == 64  # the first engine's prefix, from Redis
        srv.stop()  # an outage is logged with the URL: without the password
        assert _run(second, _prompt(4, 30))[1] == 0
        first.close()
        second.close()
    assert "unavailable" in caplog.text  # the outage was logged ...
    assert "Redis KV tier redis://:***@127.0.0.1" in caplog.text and "s3cret-pw" not in caplog.text  # ... without it


def test_redis_over_tls_works_and_an_untrusted_certificate_is_refused_at_start(llama_dir, cold_reference,
                                                                                redis_server_with_tls):
    srv = redis_server_with_tls
    with pytest.raises(KVTierError, match="TLS certificate was not accepted .*self-signed.*ssl_ca_certs"):
        RedisTier(srv.url)  # not retried as an outage forever
    url = f"{srv.url}?ssl_ca_certs={srv.cert}"
    shared, ref = cold_reference
    first = _llm(llama_dir, kv_remote=url)
    _run(first, shared + _prompt(2, 9))
    first.engine.store.flush()
    second = _llm(llama_dir, kv_remote=url)
    tokens, cached, _ = _run(second, shared + _prompt(3, 9))
    assert tokens == ref[3] and cached == 64 and second.engine.stats().kv_tiers["redis"]["hits"] == 8
    first.close()
    second.close()


def test_two_engines_share_one_redis_tier(llama_dir, cold_reference, redis_server):
    import redis

    shared, ref = cold_reference
    first = _llm(llama_dir, kv_remote=redis_server.url)
    _run(first, shared + _prompt(2, 9))
    first.engine.store.flush()  # write-through of computed blocks has landed
    second = _llm(llama_dir, kv_remote=redis_server.url)
    server = redis.Redis.from_url(redis_server.url)
    server.config_resetstat()
    tokens, cached, computed = _run(second, shared + _prompt(3, 9))
    assert tokens == ref[3] and cached == 64 and computed == 15
    assert second.engine.stats().kv_tiers["redis"]["hits"] == 8
    reads = {k: v["calls"] for k, v in server.info("commandstats").items() if k in ("cmdstat_get", "cmdstat_mget")}
    assert reads == {"cmdstat_mget": 1}  # the 8-block prefix in one round trip, not 8


def test_redis_run_reads_stop_at_the_first_missing_or_damaged_block(redis_server):
    import redis

    tier = RedisTier(redis_server.url)
    blocks = _chain(6)
    for h, parent, data in blocks[:5]:
        tier.put(h, parent, data, hint=7)
    hashes = [h for h, _, _ in blocks]
    run = tier.fetch_run(hashes)
    assert [torch.equal(d, blocks[i][2]) and hint == 7 for i, (d, hint) in enumerate(run)] == [True] * 5
    assert (tier.stats.hits, tier.stats.misses) == (5, 1)
    redis.Redis.from_url(redis_server.url).set(tier.key(hashes[2]), b"TLKV1 truncated")
    assert len(tier.fetch_run(hashes)) == 2 and tier.stats.corrupt == 1
    store = TieredStore([tier], remote_batch=2)  # read ahead two at a time: the same run
    assert [src for src, _, _ in store.fetch_run(hashes)] == ["redis"] * 2
    store.close()


def test_redis_entries_carry_the_output_length_hint_to_another_engine(llama_dir, redis_server):
    prompt = _prompt(13, 40)
    first = _llm(llama_dir, kv_remote=redis_server.url)
    _run(first, prompt)  # 10 tokens out: its blocks' hint
    assert first.engine.offload_prefix_cache() == 6  # demoted to Redis, hint in each entry's header
    first.engine.store.flush()
    second = _llm(llama_dir, kv_remote=redis_server.url, eviction_policy="gittins_hint")
    eng = second.engine
    req = eng.add_request({"prompt_token_ids": prompt + _prompt(14, 9)}, GREEDY)
    eng.step()  # admitted: the 40-token prompt's 5 blocks come from Redis
    assert req.num_cached_tokens == 40 and eng.stats().kv_tiers["redis"]["hits"] == 5
    assert [b.output_tokens for b in req.blocks[:5]] == [10] * 5
    assert [eng.pool.policy._hist[b.block_hash].hint for b in req.blocks[:5]] == [3] * 5  # bucket [4, 16)


def test_different_salts_never_share_blocks(llama_dir):
    llm = _llm(llama_dir)
    p = _prompt(9, 40)
    eng = llm.engine

    def run(salt):
        r = eng.add_request({"prompt_token_ids": p}, GREEDY, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
        return r

    a = run("tenant-a")
    b = run("tenant-b")
    c = run("tenant-a")
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0 and c.num_cached_tokens == 32
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids


def test_finished_requests_tell_the_policy_their_output_length(llama_dir):
    llm = _llm(llama_dir, eviction_policy="gittins_hint")
    eng = llm.engine
    done = eng.add_request({"prompt_token_ids": _prompt(11, 40)}, GREEDY)  # 10 tokens out
    while eng.has_unfinished():
        eng.step()
    aborted = eng.add_request({"prompt_token_ids": _prompt(12, 40)}, GREEDY)
    while aborted.num_output_tokens < 3:
        eng.step()
    eng.abort(aborted.request_id)
    hist = eng.pool.policy._hist
    # 40 prompt + 9 fed-back output tokens = 6 full blocks, all told "10 tokens out" (bucket [4, 16))
    assert len(done.block_hashes) == 6
    assert [hist[h].hint for h in done.block_hashes] == [3] * 6
    assert all(hist[h].hint == 0 for h in aborted.block_hashes[:5])  # an abort says nothing
    assert eng.pool.num_used == 0  # nothing leaked either way


def test_output_length_hint_travels_down_the_tiers_and_back(llama_dir, tmp_path):
    """`gittins_hint` in every tier: the hint a finished request leaves on its blocks follows them
    to host and disk, survives a restart in the disk entries' headers and comes back up on a hit."""
    kw = dict(eviction_policy="gittins_hint", kv_tier_policy="gittins_hint", kv_host_capacity="2 blocks",
              kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    prompt = _prompt(11, 40)
    with _llm(llama_dir, **kw) as llm:
        eng = llm.engine
        done = eng.add_request({"prompt_token_ids": prompt}, GREEDY)
        while eng.has_unfinished():
            eng.step()
        hashes = done.block_hashes  # 6 full blocks, 10 tokens out: hint bucket [4, 16) = 3
        assert eng.offload_prefix_cache() == 6
        host, disk = eng.store.tiers
        assert set(host.parents) == set(hashes[:2])  # the device lets a chain go tail first
        assert set(disk.parents) == set(hashes[2:])
        for tier in (host, disk):
            assert {tier.hint_of(h) for h in tier.parents} == {10}
            assert {tier.policy._hist[h].hint for h in tier.parents} == {3}
    # Closing wrote the host's chain heads to disk too: without them the tails there are unreachable.
    assert set(disk.parents) == set(hashes) and not host.parents
    with _llm(llama_dir, **kw) as again:  # fresh policies everywhere, and the disk entries
        eng = again.engine
        req = eng.add_request({"prompt_token_ids": prompt + _prompt(12, 9)}, GREEDY)
        eng.step()  # admitted: 5 blocks (the 40-token prompt) promoted from disk, the rest computed
        assert req.num_cached_tokens == 40 and not req.is_finished
        assert [b.output_tokens for b in req.blocks[:5]] == [10] * 5
        assert [eng.pool.policy._hist[h].hint for h in hashes[:5]] == [3] * 5
        disk = eng.store.tiers[1]
        assert disk.wait_indexed(timeout=30)
        assert {disk.hint_of(h) for h in hashes} == {10}
        assert {disk.policy._hist[h].hint for h in hashes} == {3}


def test_written_through_blocks_get_their_hint_on_disk_later(llama_dir, tmp_path):
    """Written through while its request ran, a block's disk entry has no hint yet; when the
    block comes down later with one (or a new one), the entry's hint slot is patched in place (a
    few bytes, not the block), so a restart still has it and the K/V still checks out."""
    kw = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_disk_write_through=True,
              kv_tier_policy="gittins_hint")
    with _llm(llama_dir, **kw) as llm:
        eng = llm.engine
        done = eng.add_request({"prompt_token_ids": _prompt(15, 40)}, GREEDY)
        while eng.has_unfinished():
            eng.step()
        eng.store.flush()
        disk = eng.store.tiers[0]
        hashes = done.block_hashes  # 6 full blocks, 10 tokens out
        assert {DiskTier._entry(disk.path(h))[3] for h in hashes} == {None}  # written mid-request
        inodes = {h: disk.path(h).stat().st_ino for h in hashes}
        assert eng.offload_prefix_cache() == 6
        assert disk.stats.stores == 6 and disk.stats.errors == 0
        assert {DiskTier._entry(disk.path(h))[3] for h in hashes} == {10}
        assert inodes == {h: disk.path(h).stat().st_ino for h in hashes}  # patched in place, not rewritten
        assert all(disk.get(h) is not None for h in hashes)  # payloads still pass their checksum
        again = eng.add_request({"prompt_token_ids": _prompt(15, 40)}, SamplingParams(max_tokens=3, temperature=0,
                                                                                      ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        eng.offload_prefix_cache()  # the prompt's 5 blocks come down again, last used by a 3-token answer
        assert [DiskTier._entry(disk.path(h))[3] for h in hashes] == [3] * 5 + [10]
        assert inodes == {h: disk.path(h).stat().st_ino for h in hashes}
        hints = [disk.hint_of(h) for h in hashes]
    with _llm(llama_dir, **kw) as again:
        disk = again.engine.store.tiers[0]
        assert disk.wait_indexed(timeout=30) and [disk.hint_of(h) for h in hashes] == hints == [3] * 5 + [10]


async def test_server_shutdown_leaves_the_kv_cache_on_disk(llama_dir, tmp_path):
    from tierlm.engine.async_engine import AsyncEngine
    eng = AsyncEngine.from_model(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, block_size=8,
                                 load_progress=False, kv_host_capacity="2 blocks",
                                 kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    deltas = [d async for d in eng.generate({"prompt_token_ids": _prompt(21, 40)}, GREEDY)]
    assert deltas[-1].finished
    cached = len(eng.engine.pool.cached)
    assert cached == 6 and len(eng.engine.store.tiers[1]) == 0
    await eng.shutdown()
    host, disk = eng.engine.store.tiers
    assert len(eng.engine.pool.cached) == 0 and len(host) == 0 and len(disk) == cached
    assert len(list((tmp_path / "kv").rglob("*.kv"))) == cached
    eng.engine.close()


@pytest.fixture(scope="module")
def greedy_reference(llama_dir):
    """Greedy tokens of a prompt from an engine without prefix caching (memoised)."""
    llm, memo = _llm(llama_dir, enable_prefix_caching=False), {}

    def tokens(prompt: list[int], n: int) -> list[int]:
        if (key := (tuple(prompt), n)) not in memo:
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            memo[key] = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        return memo[key]
    return tokens


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_traffic_through_every_tier_and_a_restart_matches_cold_runs(llama_dir, greedy_reference,
                                                                           tmp_path_factory, redis_server, data):
    """Shared prefixes under a small device pool, host, disk and (half the time) Redis tiers,
    random policies, aborts, offloads and one restart on the same disk directory (its index
    racing the next requests): every finished request has the cold run's greedy tokens and
    nothing leaks."""
    rng = random.Random(data.draw(st.integers(0, 10_000)))
    kw = dict(kv_remote=redis_server.url if rng.random() < 0.5 else None, kv_remote_write_through=rng.random() < 0.5,
              kv_disk_write_through=rng.random() < 0.5,
              kv_host_capacity=f"{rng.choice([1, 3, 6])} blocks", kv_disk_capacity=f"{rng.choice([4, 12, 40])} blocks",
              kv_disk_dir=str(tmp_path_factory.mktemp("kv")), kv_prefetch=rng.choice([True, False]),
              eviction_policy=rng.choice(["lru", "duel", "chain", "arc"]),
              kv_tier_policy=rng.choice(["lru", "duel", "gittins_hint"]), max_model_len=200,
              kv_cache_memory=rng.choice([12, 20, 40]) * 8 * 2 * 2 * 2 * 16 * 4)  # blocks of 8 tokens
    llm = _llm(llama_dir, **kw)
    prefixes = [_prompt(rng.randrange(10**6), rng.randint(8, 60)) for _ in range(4)]
    done: dict[str, tuple[list[int], int, list[int]]] = {}
    live: list[str] = []
    restarted = False
    for step in range(150):
        eng = llm.engine
        draining = 75 <= step and not restarted  # for the restart
        if len(live) < 6 and not draining and rng.random() < 0.5:
            prompt = rng.choice(prefixes)[:rng.randint(4, 60)] + _prompt(rng.randrange(10**6), rng.randint(0, 12))
            n = rng.randint(1, 20)
            req = eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=n, temperature=0,
                                                                               ignore_eos=True))
            done[req.request_id] = (prompt, n, [])
            live.append(req.request_id)
        if live and rng.random() < 0.07:
            rid = live.pop(rng.randrange(len(live)))
            eng.abort(rid)
            del done[rid]
        if rng.random() < 0.05:
            eng.offload_prefix_cache()
        for d in eng.step():
            done[d.request_id][2].extend(d.token_ids)
            if d.finished:
                live.remove(d.request_id)
        if draining and not live:
            llm.close()  # the blocks go down to disk; the next engine indexes them in the background
            llm, restarted = _llm(llama_dir, **kw), True
    eng = llm.engine
    for rid in live:
        eng.abort(rid)
        del done[rid]
    assert restarted and done and all(toks == greedy_reference(p, n) for p, n, toks in done.values())
    assert eng.pool.num_used == 0 and all(b.ref_cnt == 0 for b in eng.pool.blocks)
    disk = eng.store.tiers[1]
    assert disk.wait_indexed(timeout=30)
    eng.store.flush()
    with disk.lock:
        assert {bytes.fromhex(p.stem) for p in disk.root.rglob("*.kv")} == set(disk.parents)
    llm.close()


def test_entries_deleted_behind_the_disk_tiers_back_are_misses_and_stored_again(tmp_path):
    """A cleaner deletes entry files, or the whole directory, while the engine runs. A read of
    one is a miss (not "corrupt"), the index forgets it, and a block stored again is written
    again (it was skipped as already there: a tester saw a hot prefix mostly uncached for ~18
    rounds, and the tier counting 107 blocks over 38 files)."""
    import shutil

    blocks = _chain(3)
    disk = DiskTier(tmp_path / "kv", 8, index_in_background=False)
    disk.index()
    for block in blocks:
        disk.put(*block)
    (h0, p0, d0), (h1, p1, d1), (h2, p2, d2) = blocks
    for h, _, _ in blocks:
        disk.path(h).unlink()
    assert disk.get(h0) is None and h0 not in disk
    assert disk.stats.lost == 1 and disk.stats.corrupt == 0
    disk.put(h1, p1, d1)  # indexed, but its file is gone: written again
    assert disk.path(h1).exists() and torch.equal(disk.get(h1), d1) and disk.stats.lost == 2
    shutil.rmtree(tmp_path / "kv")  # the whole directory, lock file included
    disk.put(h0, p0, d0)
    assert h0 in disk and torch.equal(disk.get(h0), d0)
    assert len(disk) == 1 and h1 not in disk and h2 not in disk  # what went with the old directory is forgotten
    assert disk.stats.corrupt == 0
    disk.close()


def test_a_full_disk_tier_forgets_entries_deleted_behind_its_back_before_evicting_live_ones(tmp_path):
    """Deleted files that nothing asked for again kept their places in a full tier: the next
    store evicted a live entry (LRU's oldest) instead. An audit of the directory, at most every
    `audit_every_s` and only when the tier is full, forgets them first."""
    live = _chain(2)
    ghosts = [(bytes([0x40 + i]) * 32, bytes([0x40]) * 32 if i else None, torch.full((2, 2, 4), 9.0 + i))
              for i in range(2)]
    for every, kept in ((3600.0, False), (0.0, True)):
        disk = DiskTier(tmp_path / f"kv{every}", 4, index_in_background=False, audit_every_s=every)
        disk.index()
        for block in live + ghosts:  # the live chain is older: LRU's victim
            disk.put(*block)
        for h, _, _ in ghosts:
            disk.path(h).unlink()
        (h5, p5, d5), = [(bytes([0x70]) * 32, None, torch.zeros(2, 2, 4))]
        disk.put(h5, p5, d5)
        assert all(h in disk for h, _, _ in live) is kept, every
        if kept:
            assert len(disk) == 3 and disk.stats.lost == 2 and disk.stats.evictions == 0
            assert all(torch.equal(disk.get(h), d) for h, _, d in live) and torch.equal(disk.get(h5), d5)
        disk.close()


def test_every_tier_counts_bytes_of_k_v_not_of_its_encoding(tmp_path, redis_server):
    """Host and disk counted the K/V payload, Redis the encoded entry with its header: the
    per-tier byte counters could not be compared."""
    (h0, p0, d0), = _chain(1)
    size = d0.numel() * d0.element_size()
    for tier in (HostTier(4), DiskTier(tmp_path / "kv", 4, index_in_background=False), RedisTier(redis_server.url)):
        tier.put(h0, p0, d0)
        assert torch.equal(tier.fetch(h0)[0], d0)
        assert tier.stats.bytes_in == tier.stats.bytes_out == size, tier.name
        tier.close()


def test_with_prefetch_the_model_loop_never_reads_disk_itself(llama_dir, cold_reference, tmp_path):
    """Requests sharing a prefix on disk, more than the pool holds: some are held for room, some
    preempted and admitted again. Every disk read runs on a reader (or the writer) thread, none on
    the model loop: a preempted request re-admitted without a read of its own read a hung tier on
    the loop, stalling every request (a reviewer measured 16.8 s, and 64 s on a hung disk)."""
    import threading

    shared, ref = cold_reference
    llm = _prefix_on_disk(llama_dir, tmp_path, shared, kv_cache_memory="18 blocks", kv_prefetch=True)
    eng, disk = llm.engine, llm.engine.store.tiers[0]
    readers, read = [], disk._read

    def spy(h):
        readers.append(threading.current_thread().name)
        return read(h)

    disk._read = spy
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    reqs = [eng.add_request({"prompt_token_ids": shared + _prompt(k, 9)}, params) for k in (2, 3, 2, 3)]
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.num_preemptions > 0 and readers
    assert all(name.startswith("tierlm-kv-") for name in readers), set(readers)
    for k, req in zip((2, 3, 2, 3), reqs):
        assert req.output_token_ids[:10] == ref[k]
    assert eng.pool.num_used == 0 and not eng.kv._held and not eng.kv._prefetches
    llm.close()


def test_blocks_a_reader_stages_after_another_request_brought_them_up_are_dropped(llama_dir, cold_reference,
                                                                                  tmp_path):
    """Two requests read the same disk prefix; one's read ends first, it is admitted and its
    blocks go to the device. The other's reader then stages them again, and its request finds
    them on the device: nothing took them from staging, which held them for good."""
    import threading

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True)
    eng = llm.engine
    _run(llm, shared + _prompt(2, 9))
    eng.persist_kv()
    entered, lock, gate, find_run = [], threading.Lock(), threading.Event(), eng.store._find_run

    def second_waits(*a, job=None, **kw):  # the second request's reader starts once the gate opens
        if job is not None:
            with lock:
                entered.append(job)
                second = len(entered) == 2
            if second:
                assert gate.wait(10)
        return find_run(*a, job=job, **kw)

    eng.store._find_run = second_waits
    reqs = [eng.add_request({"prompt_token_ids": shared + _prompt(k, 9)}, GREEDY) for k in (2, 3)]
    deadline = time.monotonic() + 10
    while len(entered) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(entered) == 2
    while not any(r.status.name == "RUNNING" for r in reqs):  # one read ends
        eng.step()
    gate.set()  # the other reads the same blocks from disk, after they went to the device
    eng.store.flush()
    assert eng.stats().kv_staged_bytes > 0
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [ref[2], ref[3]]
    assert eng.stats().kv_staged_bytes == 0 and not eng.store.staged
    llm.close()


def test_a_read_timeout_too_large_for_a_wait_means_no_timeout(llama_dir, cold_reference, tmp_path):
    """kv_read_timeout=1e12 (how one asks for "never give up"): the step's wait for the read
    raised OverflowError (past threading.TIMEOUT_MAX) instead of waiting."""
    import threading

    shared, ref = cold_reference
    llm = _llm(llama_dir, kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_prefetch=True,
               kv_read_timeout=1e12)
    _run(llm, shared + _prompt(2, 9))
    llm.engine.offload_prefix_cache()
    disk, gate = llm.engine.store.tiers[0], threading.Event()
    read = disk._read
    disk._read = lambda h: read(h) if gate.wait(10) else None
    threading.Timer(0.3, gate.set).start()
    assert _run(llm, shared + _prompt(3, 9))[:2] == (ref[3], 64)  # waited for the whole read
    llm.close()


def test_disk_tier_files_are_private_to_their_owner(llama_dir, tmp_path):
    """Entries hold the KV of clients' prompts: directories were 0755 and files 0644, readable by
    every local user. Now 0700 and 0600, whatever the umask; a directory an older version made
    0755 is made 0700 when an engine takes it."""
    import os
    import stat as st

    old = os.umask(0o002)
    try:
        llm = _llm(llama_dir, kv_host_capacity="3 blocks", kv_disk_dir=str(tmp_path / "kv"))
        _run(llm, _prompt(1, 70))
        llm.engine.offload_prefix_cache()  # host evictions demote to disk
        assert llm.engine.stats().kv_tiers["disk"]["stores"] > 0
        llm.engine.persist_kv()
        made = [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]
        assert any(p.suffix == ".kv" for p in made)
        for p in made:
            assert st.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), (p, oct(p.stat().st_mode))
        older = tmp_path / "older"
        older.mkdir(mode=0o755)
        DiskTier(older, 4).close()
        assert st.S_IMODE(older.stat().st_mode) == 0o700
    finally:
        os.umask(old)
