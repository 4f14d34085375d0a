"""The model part of every KV block key follows the weights' content, not the directory's name."""
from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierlm import LLM, SamplingParams
from tierlm.engine.engine import disk_tier_dir, model_identity
from tierlm.models import fingerprint
from tierlm.models.fingerprint import weights_fingerprint

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
F32 = torch.float32


def _ident(path, dtype=F32, kv_dtype=F32) -> str:
    return model_identity(path, dtype, kv_dtype)


def _perturb(path, name: str = "layers.0.self_attn.k_proj.weight") -> None:
    """Change one tensor's values: same config, same shapes, same file size."""
    size = path.stat().st_size
    tensors = load_file(str(path))
    key = next(k for k in tensors if k.endswith(name))
    tensors[key] = tensors[key] + 0.5 * torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(7))
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


def _copy(src, dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(autouse=True)
def fp_cache(tmp_path, monkeypatch):
    """A fingerprint cache of this test's own (never ~/.cache)."""
    d = tmp_path / "tierlm-cache"
    monkeypatch.setenv("TIERLM_CACHE", str(d))
    return d / "fingerprints"


@pytest.fixture
def not_racy(monkeypatch):
    """Cache digests of files written a moment ago too (the test's checkpoints all are)."""
    monkeypatch.setattr(fingerprint, "RACY_S", 0.0)


@pytest.fixture(scope="module")
def runs(llama_dir, tmp_path_factory):
    """runA/checkpoint-500 and runB/checkpoint-500: equal config, name and size, different weights."""
    root = tmp_path_factory.mktemp("runs")
    a = _copy(llama_dir, root / "runA" / "checkpoint-500")
    b = _copy(llama_dir, root / "runB" / "checkpoint-500")
    _perturb(b / "model.safetensors")
    _perturb(b / "model.safetensors", "layers.0.self_attn.v_proj.weight")
    return a, b


@pytest.fixture(scope="module")
def sharded(runs, tmp_path_factory):
    """The same two checkpoints saved in shards (model-0000X-of-0000N.safetensors + index)."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("sharded")
    out = []
    for run in runs:
        d = root / run.parent.name / "checkpoint-500"
        d.mkdir(parents=True)
        AutoModelForCausalLM.from_pretrained(str(run), dtype=torch.float32).save_pretrained(
            str(d), max_shard_size="200KB")
        for f in run.iterdir():  # tokenizer files
            if not (d / f.name).exists() and not f.name.endswith(".safetensors"):
                shutil.copy2(f, d / f.name)
        out.append(d)
    return out


def test_same_weights_under_another_name_same_id(runs, tmp_path):
    a, _ = runs
    other = _copy(a, tmp_path / "somewhere" / "renamed-model")
    assert _ident(other) == _ident(a)
    assert "checkpoint-500" not in _ident(a) and "renamed" not in _ident(other)
    assert _ident(a, kv_dtype=torch.bfloat16) != _ident(a) != _ident(a, dtype=torch.bfloat16)


def test_same_config_and_size_different_weights_differ(runs):
    a, b = runs
    assert a.name == b.name and (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert _ident(a) != _ident(b)


def test_sharded_checkpoints_hash_every_shard(sharded, runs, tmp_path):
    a, b = sharded
    shards = sorted(p.name for p in a.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (a / "model.safetensors.index.json").is_file()
    assert _ident(a) != _ident(b)
    assert _ident(a) != _ident(runs[0])  # the same tensors in other files: not assumed equal
    # a later shard changed, same size: a new id
    c = _copy(a, tmp_path / "c" / "checkpoint-500")
    index = json.loads((c / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = next((k, v) for k, v in sorted(index.items()) if v == shards[-1])
    _perturb(c / shard, name)
    assert _ident(c) != _ident(a)
    assert _ident(_copy(a, tmp_path / "d" / "copy")) == _ident(a)


def test_rewritten_in_place_gets_a_new_id_despite_the_cache(runs, tmp_path, fp_cache, not_racy, monkeypatch):
    a, b = runs
    c = _copy(a, tmp_path / "run" / "model")
    weights = c / "model.safetensors"
    first = _ident(c)
    entries = [json.loads(p.read_text()) for p in fp_cache.glob("*.json")]
    assert [e["path"] for e in entries] == [os.path.realpath(weights)]
    # the cache is used: nothing is hashed again while the file is unchanged
    real_hash = fingerprint._hash_file
    monkeypatch.setattr(fingerprint, "_hash_file", lambda *a: pytest.fail("hashed a cached file"))
    assert _ident(c) == first
    monkeypatch.setattr(fingerprint, "_hash_file", real_hash)
    # new weights written over the old bytes (same file, same size), mtime put back as `cp -p` would
    st = weights.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    with open(weights, "r+b") as f:
        f.write((b / "model.safetensors").read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = weights.stat()
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert _ident(c) == _ident(b) != first
    # copied over (a new inode) and back: each change is seen
    time.sleep(0.05)
    shutil.copy2(a / "model.safetensors", weights)
    assert _ident(c) == first


def test_a_just_written_file_is_hashed_but_not_cached(runs, tmp_path, fp_cache):
    c = _copy(runs[0], tmp_path / "fresh")
    assert _ident(c) == _ident(runs[0])
    assert not list(fp_cache.glob("*.json"))  # it may change again within one timestamp tick


def test_corrupt_or_unwritable_cache_never_fails_a_load(runs, tmp_path, fp_cache, not_racy, monkeypatch):
    a, b = runs
    c = _copy(a, tmp_path / "m")
    want = _ident(c)
    (entry,) = fp_cache.glob("*.json")
    good = json.loads(entry.read_text())
    for bad in ("{not json", "[]", json.dumps({**good, "sha256": 5}), json.dumps({**good, "sha256": "ab"}),
                json.dumps({**good, "path": "/elsewhere"}), "\xff\xfe"):
        entry.write_text(bad)
        assert _ident(c) == want
        assert json.loads(entry.read_text()) == good  # hashed and cached again
    entry.unlink()
    entry.mkdir()  # unreadable and unwritable as a file
    assert _ident(c) == want
    entry.rmdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TIERLM_CACHE", str(blocker / "cache"))  # its directory cannot be created
    assert _ident(c) == want
    assert _ident(b) != want


def test_cache_forgets_files_that_are_gone(runs, tmp_path, fp_cache, not_racy):
    gone = _copy(runs[0], tmp_path / "gone")
    _ident(gone)
    shutil.rmtree(gone)
    kept = _copy(runs[1], tmp_path / "kept")
    _ident(kept)
    assert [json.loads(p.read_text())["path"] for p in fp_cache.glob("*.json")] == \
        [os.path.realpath(kept / "model.safetensors")]


def test_large_checkpoints_log_progress(runs, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(fingerprint, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(fingerprint, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(fingerprint, "CHUNK", 64 << 10)
    c = _copy(runs[0], tmp_path / "big")
    with caplog.at_level(logging.INFO, logger="tierlm.models.fingerprint"):
        assert weights_fingerprint(c) == weights_fingerprint(runs[0])
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"fingerprinting the weights of {c} for KV-cache keys: " in m and " / " in m for m in msgs)


def test_config_metadata_does_not_matter_but_config_does(runs, tmp_path):
    a = runs[0]
    c = _copy(a, tmp_path / "meta")
    cfg = json.loads((c / "config.json").read_text())
    (c / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/x", "transformers_version": "9"}, indent=4))
    assert _ident(c) == _ident(a)
    (c / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    assert _ident(c) != _ident(a)


def test_disk_dir_is_labelled_but_keyed_by_the_id(runs):
    a, b = runs
    ia, ib = _ident(a), _ident(b)
    assert disk_tier_dir("/kv", ia, a.name) != disk_tier_dir("/kv", ib, b.name)
    assert disk_tier_dir("/kv", ia, a.name).name.startswith("checkpoint-500-")
    assert disk_tier_dir("/kv", ia, "x/y z").name.startswith("x_y_z-")


# -- end to end --------------------------------------------------------------------------------

def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 600) for _ in range(n)]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=64,
               load_progress=False, **kw)


def _run(llm: LLM, prompt: list[int]):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_other_weights_same_name_get_no_blocks_from_a_shared_disk_dir(layout, runs, sharded, tmp_path):
    a, b = runs if layout == "single" else sharded
    prompt = _prompt(1, 70)
    cold_b = _run(_llm(b, enable_prefix_caching=False), prompt)[0]
    kw = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks")
    with _llm(a, **kw) as first:
        out_a = _run(first, prompt)[0]
        assert first.engine.offload_prefix_cache() > 0
    assert out_a != cold_b  # the perturbation shows: served A's K/V, B would answer differently
    with _llm(b, **kw) as second:
        assert second.engine.store.tiers[0].wait_indexed(timeout=30)
        assert _run(second, prompt) == (cold_b, 0)
    with _llm(a, **kw) as again:  # control: A's own blocks are there and found
        assert again.engine.store.tiers[0].wait_indexed(timeout=30)
        assert _run(again, prompt) == (out_a, 64)


def test_equal_weights_under_another_path_share_blocks_through_redis(runs, tmp_path, redis_server):
    a, _ = runs
    other = _copy(a, tmp_path / "mirror" / "served-copy")
    prompt = _prompt(2, 70)
    first = _llm(a, kv_remote=redis_server.url)
    out = _run(first, prompt)[0]
    first.engine.store.flush()
    second = _llm(other, kv_remote=redis_server.url)
    assert second.engine.kv.model_id == first.engine.kv.model_id
    assert _run(second, prompt) == (out, 64)


# -- start-up edges (from a tester) -------------------------------------------------------------

def test_weights_replaced_while_loading_are_refused_not_served_under_the_wrong_key(runs, tmp_path, monkeypatch):
    """The loader and the hash read the files separately: if a copy replaces them meanwhile, the
    engine could serve one version under the other's key and poison a shared cache."""
    import tierlm.engine.engine as engine_mod

    a, b = runs
    d = _copy(a, tmp_path / "ckpt")
    real_load = engine_mod.load_model

    def load_then_replace(*args, **kw):
        loaded = real_load(*args, **kw)
        tmp = d / "incoming.tmp"
        shutil.copy(b / "model.safetensors", tmp)
        os.replace(tmp, d / "model.safetensors")  # as rsync or a downloader finishes a file
        return loaded

    monkeypatch.setattr(engine_mod, "load_model", load_then_replace)
    with pytest.raises(Exception, match="changed while tierlm was loading them"):
        _llm(d, kv_disk_dir=str(tmp_path / "kv"))
    monkeypatch.setattr(engine_mod, "load_model", real_load)
    with _llm(d, kv_disk_dir=str(tmp_path / "kv")) as again:  # complete now: it starts
        assert again.engine.kv.model_id == _ident(b)


def test_without_disk_or_redis_nothing_is_hashed(runs, fp_cache, not_racy):
    import threading

    a, _ = runs
    llm = _llm(a)
    assert llm.engine.kv.model_id.startswith("process-")  # blocks never leave this process
    assert not fp_cache.exists()
    assert not [t for t in threading.enumerate() if t.name.startswith("tierlm-fingerprint")]


def test_a_start_that_fails_after_loading_stops_the_hash(runs, tmp_path, monkeypatch):
    import threading

    from tierlm.engine.runner import ModelRunner

    def fail(self, *args, **kw):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(ModelRunner, "warm_up", fail)  # a failure after the weights loaded
    a, _ = runs
    with pytest.raises(RuntimeError, match="warm-up failed"):
        LLM(str(a), dtype="float32", load_progress=False, kv_disk_dir=str(tmp_path / "kv"))
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("tierlm-fingerprint")]:
        assert time.monotonic() < deadline, "the fingerprint thread outlived the failed start"
        time.sleep(0.05)


def test_an_index_naming_shards_by_absolute_path_is_fingerprinted(runs, tmp_path):
    from safetensors import safe_open

    a, _ = runs
    d = _copy(a, tmp_path / "ckpt")
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", elsewhere)
    with safe_open(str(elsewhere), "pt") as f:
        keys = list(f.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: str(elsewhere) for k in keys}}))
    assert len(weights_fingerprint(d)) == 64  # it was a ValueError from relative_to


def test_a_fifo_in_the_fingerprint_cache_does_not_hang_start_up(runs, fp_cache, not_racy):
    import threading

    a, _ = runs
    first = weights_fingerprint(a)
    entries = list(fp_cache.glob("*.json"))
    assert entries
    for e in entries:
        e.unlink()
        os.mkfifo(e)
    (fp_cache / "other.json").symlink_to("/dev/zero")  # read without bound it would fill memory
    got = []
    t = threading.Thread(target=lambda: got.append(weights_fingerprint(a)), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and got == [first]


def test_an_empty_tierlm_cache_means_the_default(monkeypatch):
    from pathlib import Path

    from tierlm.models.demo import cache_root

    monkeypatch.setenv("TIERLM_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "tierlm"  # not the current directory


def test_other_model_directories_under_kv_disk_dir_are_named_at_start(runs, tmp_path, caplog):
    a, b = runs
    kv = tmp_path / "kv"
    with _llm(b, kv_disk_dir=str(kv)):
        pass
    (kv / "operator-notes").mkdir()  # not a model directory: not named
    with caplog.at_level(logging.INFO, logger="tierlm.engine.engine"):
        with _llm(a, kv_disk_dir=str(kv)) as llm:
            own = llm.engine.store.tiers[0].root.name
    said = [r.message for r in caplog.records if "also holds 1 other model directory" in r.message]
    assert len(said) == 1 and own not in said[0] and "tierlm never deletes them" in said[0]
    assert "operator-notes" not in said[0] and f"tierlm kv ls {kv}" in said[0]


def test_engines_sharing_kv_disk_dir_with_the_default_capacity_are_warned_about(runs, tmp_path, caplog):
    """Each disk tier's default capacity is half the free space at its start, so two engines on
    one kv_disk_dir took half each (a 4 MiB disk filled to its last block), unwarned where they
    were two servers, or two LLMs. A model directory held now (by this process or another) is
    named in a warning when this engine takes the default; not with kv_disk_capacity given, nor
    once the other engine is gone."""
    from tierlm.kv.admin import LOCK_FILE

    a, b = runs
    kv = tmp_path / "kv"

    def warned(**kw) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tierlm.engine.engine"):
            with _llm(a, kv_disk_dir=str(kv), **kw):
                pass
        return [r.getMessage() for r in caplog.records if "took the default capacity" in r.getMessage()]

    with _llm(b, kv_disk_dir=str(kv)) as other:
        other_dir = other.engine.store.tiers[0].root.name
        said = warned()
        assert len(said) == 1 and other_dir in said[0] and "kv_disk_capacity" in said[0]
        assert warned(kv_disk_capacity="64 blocks") == []
    assert warned() == []  # an earlier run's directory
    fd = os.open(kv / other_dir / LOCK_FILE, os.O_RDONLY)  # another server's engine holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        said = warned()
        assert len(said) == 1 and other_dir in said[0]
    finally:
        os.close(fd)


def test_models_sharing_kv_disk_dir_each_keep_their_own_capacity_and_entries(runs, tmp_path):
    """kv_disk_capacity is each model's own: two models on one kv_disk_dir, each past its 8
    blocks, hold 8 entries each, and one's eviction never deletes the other's files."""
    a, b = runs
    kv = tmp_path / "kv"
    with _llm(a, kv_disk_dir=str(kv), kv_disk_capacity="8 blocks") as first, \
            _llm(b, kv_disk_dir=str(kv), kv_disk_capacity="8 blocks") as second:
        dirs = []
        for llm, seed in ((first, 80), (second, 81), (first, 82)):  # the first evicts after the second stored
            _run(llm, _prompt(seed, 97))
            assert llm.engine.offload_prefix_cache() > 0
            llm.engine.store.flush()
            dirs.append(llm.engine.store.tiers[0].root)
        counts = {d.name: sum(1 for _ in d.rglob("*.kv")) for d in dirs}
        assert len(counts) == 2 and set(counts.values()) == {8}, counts
        assert first.engine.stats().kv_tiers["disk"]["evictions"] > 0


def test_weights_rounded_for_float32_compute_do_not_share_blocks_with_float32_weights(runs, tmp_path):
    """dtype bfloat16 computed in float32 (weights rounded to bf16) and dtype float32 with a bf16
    KV cache (weights kept in float32) compute different K/V: they had one model id, so the second
    was served the first's blocks from a shared disk directory."""
    a, _ = runs
    prompt = _prompt(3, 70)
    kw = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_capacity="64 blocks", kv_cache_memory=4 << 20, block_size=8,
              max_num_batched_tokens=64, load_progress=False)
    with LLM(str(a), dtype="bfloat16", compute_dtype="float32", **kw) as first:
        first.generate([{"prompt_token_ids": prompt}], GREEDY)
        assert first.engine.offload_prefix_cache() > 0
        rounded = first.engine.kv.model_id
    with LLM(str(a), dtype="float32", kv_cache_dtype="bfloat16", **kw) as second:
        assert second.engine.kv.model_id != rounded
        assert second.engine.store.tiers[0].wait_indexed(timeout=30)
        assert _run(second, prompt)[1] == 0
    with LLM(str(a), dtype="bfloat16", compute_dtype="float32", **kw) as again:  # control: its own blocks
        assert again.engine.kv.model_id == rounded
        assert again.engine.store.tiers[0].wait_indexed(timeout=30)
        assert _run(again, prompt)[1] == 64
