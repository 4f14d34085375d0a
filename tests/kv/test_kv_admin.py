"""`tierlm kv ls` / `tierlm kv prune`: the model directories a kv_disk_dir accumulates, with real
engines writing them, holding their locks and serving from them afterwards."""
from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import subprocess
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tierlm import LLM, SamplingParams
from tierlm.cli import main
from tierlm.errors import KVTierError
from tierlm.kv import admin
from tierlm.kv.tiers import DiskTier

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def fp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERLM_CACHE", str(tmp_path / "tierlm-cache"))


def _perturb(path) -> None:
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.weight"))
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, str(f), metadata={"format": "pt"})


def _llm(path, kv) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory=4 << 20, block_size=8, max_num_batched_tokens=64,
               load_progress=False, kv_disk_dir=str(kv), warmup=False)


def _fill(llm: LLM, seed: int) -> list[int]:
    rng = random.Random(seed)
    prompt = [rng.randrange(5, 600) for _ in range(40)]
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    assert llm.engine.offload_prefix_cache() > 0
    llm.engine.store.flush()
    return prompt


def _files(d) -> list:
    return [p for p in d.rglob("*.kv")]


def _strict(token: str):
    raise AssertionError(f"not JSON: {token}")


def _ls(capsys, kv) -> dict:
    capsys.readouterr()
    assert main(["kv", "ls", str(kv), "--json"]) == 0
    return {d["model_dir"] and os.path.basename(d["model_dir"]) or d["name"]: d
            for d in json.loads(capsys.readouterr().out, parse_constant=_strict)["dirs"]}


@pytest.fixture
def site(llama_dir, tmp_path):
    """A kv_disk_dir after three checkpoints were served: `alpha` (still served, by an engine
    this test holds open), `beta` (weights changed since) and `gamma` (deleted since), plus
    `delta`, current and not served, and a directory tierlm did not make."""
    kv = tmp_path / "kv"
    ck = {n: shutil.copytree(llama_dir, tmp_path / "ckpt" / n) for n in ("alpha", "beta", "gamma", "delta")}
    _perturb(ck["beta"])  # distinct weights from alpha's, so distinct block keys
    for name in ("beta", "gamma", "delta"):
        with _llm(ck[name], kv) as llm:
            _fill(llm, seed=1)
    _perturb(ck["beta"])
    shutil.rmtree(ck["gamma"])
    (kv / "operator-notes").mkdir()
    (kv / "operator-notes" / "README").write_text("not tierlm's")
    alpha = _llm(ck["alpha"], kv)
    _fill(alpha, seed=2)
    yield kv, ck, alpha
    alpha.close()


def test_ls_says_what_each_directory_holds_who_holds_it_and_whether_its_weights_are_there(site, capsys):
    kv, ck, alpha = site
    dirs = _ls(capsys, kv)
    assert set(dirs) == {"alpha", "beta", "gamma", "delta"}  # operator-notes is not a model directory
    assert dirs["alpha"]["in_use_by"] == f"tierlm pid {os.getpid()}"
    assert {n: d["weights"] for n, d in dirs.items()} == {
        "alpha": "current", "beta": "changed", "gamma": "gone", "delta": "current"}
    assert [n for n, d in dirs.items() if d["stale"]] == ["beta", "gamma"]
    for n, d in dirs.items():
        files = _files(kv / d["name"])
        assert d["entries"] == len(files) > 0
        assert d["bytes"] == sum(f.stat().st_size for f in files)
        assert d["model_dir"] == os.path.abspath(ck[n])
        assert d["last_used"] >= d["last_write"] > time.time() - 600
    assert dirs["alpha"]["name"] == alpha.engine.store.tiers[0].root.name
    capsys.readouterr()
    assert main(["kv", "ls", str(kv)]) == 0
    table = capsys.readouterr().out
    assert "4 model directories" in table and "operator-notes" not in table
    assert f"tierlm kv prune {kv} --stale" in table  # beta and gamma: the hint names the command


def test_prune_stale_removes_free_stale_directories_only(site, capsys):
    kv, ck, alpha = site
    before = _ls(capsys, kv)
    _perturb(ck["alpha"])  # alpha's weights change under its running engine: stale, but held
    assert main(["kv", "prune", str(kv), "--stale"]) == 0
    out = capsys.readouterr().out
    assert "kept: in use by tierlm pid" in out and "removed: " + before["beta"]["name"] in out
    left = {p.name for p in kv.iterdir()}
    assert left == {before["alpha"]["name"], before["delta"]["name"], "operator-notes"}
    assert (kv / "operator-notes" / "README").read_text() == "not tierlm's"
    # The engine holding alpha still serves from it, and beta starts afresh in a new directory.
    prompt = _fill(alpha, seed=3)
    assert alpha.generate([{"prompt_token_ids": prompt}], GREEDY)[0].num_cached_tokens > 0
    with _llm(ck["beta"], kv) as beta:
        assert beta.engine.store.tiers[0].root.is_dir()


def test_dry_run_and_filters_that_match_nothing_remove_nothing(site, capsys):
    kv, _, _ = site
    snapshot = sorted(str(p) for p in kv.rglob("*"))
    assert main(["kv", "prune", str(kv), "--stale", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove") == 2 and "would free" in out
    assert main(["kv", "prune", str(kv), "--stale", "--unused-for", "30d"]) == 0  # used minutes ago
    assert "nothing matches" in capsys.readouterr().out
    assert sorted(str(p) for p in kv.rglob("*")) == snapshot


def test_unused_for_counts_from_the_last_start_or_write(site):
    kv, _, _ = site
    later = time.time() + 2 * 3600
    assert admin.prune(kv, unused_for_s=3 * 3600, now=lambda: later) == []
    gone = admin.prune(kv, unused_for_s=3600, now=lambda: later)
    assert sorted((os.path.basename(r.dir.model_dir), r.removed) for r in gone) == [
        ("alpha", False), ("beta", True), ("delta", True), ("gamma", True)]


def test_a_directory_named_while_in_use_is_kept_and_the_exit_status_says_so(site, capsys):
    kv, _, alpha = site
    held = alpha.engine.store.tiers[0].root
    assert main(["kv", "prune", str(kv), held.name]) == 1
    assert "kept: in use by tierlm pid" in capsys.readouterr().out
    assert _files(held)


def test_an_engine_starting_while_a_directory_is_pruned_never_starts_on_its_entries(site, monkeypatch):
    """prune holds the directory's lock and renames it aside before deleting: an engine starting
    before the rename is refused (in use), one starting after it gets a fresh, empty directory."""
    kv, _, _ = site
    target = next(d for d in admin.scan(kv) if os.path.basename(d.model_dir or "") == "delta")
    real_rename, real_rmtree, seen = os.rename, shutil.rmtree, []

    def rename(src, dst):
        with pytest.raises(KVTierError, match="in use"):
            DiskTier(target.path, 64, block_bytes=1024)
        seen.append("refused")
        return real_rename(src, dst)

    def rmtree(path, *a, **kw):
        fresh = DiskTier(target.path, 64, block_bytes=1024)
        assert len(fresh) == 0 and not _files(fresh.root)  # none of the entries being deleted
        fresh.close()
        seen.append("fresh")
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(admin.os, "rename", rename)
    monkeypatch.setattr(admin.shutil, "rmtree", rmtree)
    [r] = admin.prune(kv, names=[target.name])
    assert r.removed and seen == ["refused", "fresh"]
    assert not _files(kv / target.name) and not [p for p in kv.iterdir() if p.name.startswith(".tierlm-prune")]


def test_a_prune_that_fails_partway_is_listed_and_finished_by_the_next(site, capsys):
    """A file that cannot be deleted (immutable) stops the deletion partway: what is left is
    listed as 'partly removed', counts as stale, and the next prune removes it."""
    kv, _, _ = site
    target = next(d for d in admin.scan(kv) if os.path.basename(d.model_dir or "") == "delta")
    stuck = _files(kv / target.name)[0]
    inside = stuck.relative_to(kv / target.name)
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        assert main(["kv", "prune", str(kv), target.name]) == 1
        assert "partly removed" in capsys.readouterr().out
        [left] = [d for d in admin.scan(kv) if d.leftover]
        assert left.weights == "partly removed" and left.stale and left.entries == 1
        assert not (kv / target.name).exists()
    finally:  # wherever the file is now, so pytest can clean up and a failure above shows as itself
        for p in [stuck, *kv.glob(f".tierlm-prune-*/{inside}")]:
            subprocess.run(["chattr", "-i", str(p)], capture_output=True)
    assert main(["kv", "prune", str(kv), "--stale", "--unused-for", "30d"]) == 0  # leftovers match any filter
    assert not [d for d in admin.scan(kv) if d.leftover]


def test_bad_requests_are_one_line_errors(site, capsys):
    kv, _, _ = site
    cases = [
        (["kv", "prune", str(kv)], "say what to remove"),
        (["kv", "prune", str(kv), "no-such-0123456789ab"], "no model directory 'no-such-0123456789ab'"),
        (["kv", "prune", str(kv), "--unused-for", "soon"], "cannot read duration 'soon'"),
        (["kv", "ls", str(kv / "missing")], "is not a directory"),
    ]
    snapshot = sorted(str(p) for p in kv.rglob("*"))
    for argv, said in cases:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err
    d = next(iter(admin.scan(kv, check_weights=False)))
    with pytest.raises(ValueError, match="not both"):
        admin.prune(kv, names=[d.name], stale=True)
    assert sorted(str(p) for p in kv.rglob("*")) == snapshot
    capsys.readouterr()
    assert main(["kv", "ls", ""]) == 2 and "empty path" in capsys.readouterr().err


def test_names_may_follow_the_options_and_a_held_name_fails_a_dry_run_too(site, capsys):
    kv, _, alpha = site
    held = alpha.engine.store.tiers[0].root.name
    free = next(d.name for d in admin.scan(kv, check_weights=False) if d.name != held)
    assert main(["kv", "prune", str(kv), "--dry-run", free]) == 0
    assert f"would remove: {free}" in capsys.readouterr().out
    assert main(["kv", "prune", str(kv), "--dry-run", held]) == 1
    assert main(["kv", "prune", str(kv), "--dry-run", "--", free]) == 0  # after --, names only
    with pytest.raises(SystemExit) as exited:
        main(["kv", "prune", str(kv), "--dry-run", free, "--bogus"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert (kv / free).is_dir()


def test_a_checkpoint_that_cannot_be_read_is_unknown_not_gone(site, capsys):
    """Shards missing (a download or copy under way) or a FIFO for config.json: the blocks may
    still be right, so the weights are 'unknown' and --stale leaves them; nothing hangs."""
    kv, ck, _ = site
    (ck["delta"] / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (ck["alpha"] / "config.json").unlink()
    os.mkfifo(ck["alpha"] / "config.json")
    done = {}
    t = threading.Thread(target=lambda: done.update(dirs=_ls(capsys, kv)), daemon=True)
    t.start()
    t.join(timeout=60)
    assert "dirs" in done, "kv ls hung on a FIFO config.json"
    assert {n: d["weights"] for n, d in done["dirs"].items()} == {
        "alpha": "unknown", "beta": "changed", "gamma": "gone", "delta": "unknown"}
    assert sorted(os.path.basename(r.dir.model_dir) for r in admin.prune(kv, stale=True)) == ["beta", "gamma"]


def test_each_checkpoint_is_fingerprinted_once_per_scan(site, monkeypatch):
    from tierlm.models import fingerprint
    kv, ck, _ = site
    for i in range(3):  # more directories recording the same checkpoint (e.g. started under other dtypes)
        d = kv / f"delta-{i:012x}"
        d.mkdir()
        admin.write_about(d, admin.read_about(next(kv.glob("delta-*"))))
    real, calls = fingerprint.weights_fingerprint, []
    monkeypatch.setattr(fingerprint, "weights_fingerprint", lambda p, *a: calls.append(p) or real(p, *a))
    assert len(admin.scan(kv)) == 7
    assert sorted(calls) == sorted(os.path.abspath(ck[n]) for n in ("alpha", "beta", "delta"))


def test_directories_without_a_record_are_listed_as_unknown_and_never_stale(tmp_path, capsys):
    """A directory of an earlier tierlm (no model.json) or one whose record is damaged."""
    kv = tmp_path / "kv"
    for name, about in (("old-0123456789ab", None), ("bad-ba9876543210", "{not json")):
        (kv / name / "ab").mkdir(parents=True)
        (kv / name / ".lock").write_text("")
        (kv / name / "ab" / ("ab" * 32 + ".kv")).write_bytes(b"x" * 100)
        if about is not None:
            (kv / name / "model.json").write_text(about)
    for name, about in (("huge-00000000000b", {"started": 10 ** 400, "model_dir": "/x\0y", "fingerprint": "x"}),
                        ("far-00000000000c", {"started": 1e300, "model_dir": 7})):
        (kv / name).mkdir()
        admin.write_about(kv / name, about)  # numbers and paths that broke the whole listing
    odd = kv / "odd-00000000000a"  # a record with numbers JSON has no place for, and a dangling lock link
    (odd / "ab").mkdir(parents=True)
    (odd / ".lock").symlink_to(tmp_path / "nowhere")
    (odd / "model.json").write_text('{"started": 1e999, "model_dir": "/gone\\u001b[2J", "fingerprint": "x"}')
    dirs = _ls(capsys, kv)  # strict JSON: no NaN or Infinity in the output
    assert {n: (d["weights"], d["entries"], d["bytes"], d["stale"], d["started"]) for n, d in dirs.items()} == {
        "old-0123456789ab": ("unknown", 1, 100, False, None), "bad-ba9876543210": ("unknown", 1, 100, False, None),
        "huge-00000000000b": ("unknown", 0, 0, False, None), "far-00000000000c": ("unknown", 0, 0, False, None),
        "gone\x1b[2J": ("gone", 0, 0, True, None)}
    assert dirs["gone\x1b[2J"]["in_use_by"] is None  # nothing can hold a dangling link
    capsys.readouterr()
    assert main(["kv", "ls", str(kv)]) == 0
    assert "\x1b" not in capsys.readouterr().out  # escaped: the terminal is not cleared
    assert [r.dir.name for r in admin.prune(kv, stale=True)] == ["odd-00000000000a"]
    assert not odd.exists() and (tmp_path / "nowhere").exists() is False


def test_an_engine_waits_out_a_probe_and_is_told_who_holds_a_directory(tmp_path, monkeypatch):
    """`kv ls` locks each directory for a moment to see whether it is free: an engine starting
    then waits that moment out instead of being refused. A lock held for longer (a prune
    deleting) refuses it, naming the prune."""
    from tierlm.kv import tiers
    root = tmp_path / "kv" / "m-0123456789ab"
    DiskTier(root, 8, block_bytes=64).close()
    fd = admin._try_lock(root, mine=True)
    real_sleep, waited = time.sleep, []

    def sleep(s):  # the engine's first wait: the probe ends
        if not waited:
            os.close(fd)
        waited.append(s)
        real_sleep(s)

    monkeypatch.setattr(tiers.time, "sleep", sleep)
    tier = DiskTier(root, 8, block_bytes=64)  # waits for the release
    monkeypatch.setattr(tiers.time, "sleep", real_sleep)
    assert waited
    assert admin.scan(root.parent, check_weights=False)[0].in_use_by == f"tierlm pid {os.getpid()}"
    tier.close()
    fd = admin._try_lock(root, mine=True)
    try:
        with pytest.raises(KVTierError, match=f"in use by tierlm kv prune pid {os.getpid()}"):
            DiskTier(root, 8, block_bytes=64)
    finally:
        os.close(fd)


def test_a_lock_file_moved_away_while_an_engine_takes_it_is_not_the_engines_lock(tmp_path, monkeypatch):
    """A prune renames a directory aside between an engine's open of `.lock` and its flock: the
    flock then succeeds on the moved file, which guards nothing; the engine must lock the file
    at its path instead (before, it went on in a directory that was no longer there)."""
    from tierlm.kv import tiers
    root = tmp_path / "kv" / "m-0123456789ab"
    DiskTier(root, 8, block_bytes=64).close()
    real_flock, moved = fcntl.flock, []

    def flock(f, op):
        if not moved:
            moved.append(root.rename(root.with_name(".tierlm-prune-m-0123456789ab-00000000")))
        return real_flock(f, op)

    monkeypatch.setattr(tiers.fcntl, "flock", flock)
    tier = DiskTier(root, None, block_bytes=64)  # default capacity: reads the directory's free space
    monkeypatch.setattr(tiers.fcntl, "flock", real_flock)
    assert moved and (root / ".lock").is_file()
    held = {d.name: d.in_use_by for d in admin.scan(root.parent, check_weights=False)}
    assert held == {root.name: f"tierlm pid {os.getpid()}", ".tierlm-prune-m-0123456789ab-00000000": None}
    tier.close()


def test_a_directory_without_a_lock_file_is_locked_before_it_is_moved(tmp_path, monkeypatch):
    """No .lock (a record only): prune makes one and holds it, so an engine starting before the
    rename waits and is refused rather than starting in a directory about to be deleted."""
    kv = tmp_path / "kv"
    d = kv / "m-0123456789ab"
    (d / "ab").mkdir(parents=True)
    admin.write_about(d, {"model_dir": str(tmp_path / "gone"), "fingerprint": "x"})
    real_rename, seen = os.rename, []

    def rename(src, dst):
        with pytest.raises(KVTierError, match="in use by tierlm kv prune"):
            DiskTier(d, 8, block_bytes=64)
        seen.append(dst)
        return real_rename(src, dst)

    monkeypatch.setattr(admin.os, "rename", rename)
    [r] = admin.prune(kv, stale=True)
    assert r.removed and seen and not d.exists()


def test_a_checkpoint_without_config_json_yet_is_unknown_not_gone(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()  # a copy under way: the directory is there, its config.json not yet
    assert admin._weights({"model_dir": str(ck), "fingerprint": "x"}, {}) == admin.UNKNOWN
    assert admin._weights({"model_dir": str(tmp_path / "nothing"), "fingerprint": "x"}, {}) == admin.GONE


def test_of_two_prunes_removing_one_directory_only_one_counts_it(site):
    kv, _, _ = site
    target = next(d for d in admin.scan(kv) if os.path.basename(d.model_dir or "") == "delta")
    first, second = admin._remove(target, kv), admin._remove(target, kv)
    assert (first.removed, second.removed, second.failed) == (True, False, False)
    assert "gone meanwhile" in second.why


def test_durations():
    assert [admin.parse_duration(s) for s in ("90s", "45m", "1.5h", "30d", "2w", " 3D ")] == [
        90, 2700, 5400, 30 * 86400, 14 * 86400, 3 * 86400]
    for bad in ("", "10", "d", "-1d", "1y"):
        with pytest.raises(ValueError, match="cannot read duration"):
            admin.parse_duration(bad)


def test_an_unreadable_shard_does_not_hide_its_directory(llama_dir, tmp_path):
    """One shard this user cannot list (root without its override, here) made `kv ls` say "no
    model directories" and `prune NAME` say there was no such directory."""
    import sys
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop root's permission override")
    kv = tmp_path / "kv"
    with _llm(llama_dir, kv) as llm:
        _fill(llm, seed=1)
        name = llm.engine.store.tiers[0].root.name
    shard = _files(kv / name)[0].parent
    shard.chmod(0)
    try:
        done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all",
                               sys.executable, "-m", "tierlm.cli", "kv", "ls", str(kv), "--json",
                               "--no-check-weights"], capture_output=True, text=True, timeout=120)
    finally:
        shard.chmod(0o755)
    if "Operation not permitted" in done.stderr and done.returncode and not done.stdout:
        pytest.skip(f"setpriv cannot drop capabilities here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    [listed] = json.loads(done.stdout)["dirs"]
    assert listed["name"] == name and listed["entries"] == len(_files(kv / name)) - len(list(shard.glob("*.kv")))
    assert f"cannot list {shard}" in done.stderr
