"""A checkpoint's content fingerprint: the model part of every KV-cache block key.

Cached K/V is right only for the weights that computed it, and blocks outlive the process (the
disk tier) and leave it (Redis), so the key must change whenever the weights do: two fine-tunes
of one base with equal config and size, `runA/checkpoint-500` vs `runB/checkpoint-500`, new
weights copied over the old files before a restart. The fingerprint is a SHA-256 over what the
loader reads: config.json, the safetensors index, and every weight file it loads (the same
`weight_files` list). It does not cover the directory's name or path: equal weights anywhere
share blocks.

Hashing runs at about 0.8 GB/s per core, so each weight file's digest is cached in a small
JSON under $TIERLM_CACHE/fingerprints (default ~/.cache/tierlm/fingerprints, beside the demo
model and the CPU kernels), one file per weight file, named after its real path and valid only
while the file's (size, mtime_ns, ctime_ns, inode, device) are unchanged: any rewrite, copy
or rename over it hashes again. A cache that cannot be read or written costs a re-hash, never
a failed load. (As with git, a file rewritten through a writable mmap without its times
changing is not noticed; rewrite checkpoints by writing files.) The engine compares the
files' stamps before loading with those after loading and hashing, and refuses to start if
they differ: the weights it serves could then be other than the ones it hashed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierlm.files import read_regular
from tierlm.models.demo import cache_root
from tierlm.models.loader import weight_files

log = logging.getLogger(__name__)

CHUNK = 8 << 20
PROGRESS_MIN_BYTES = 1 << 30  # log progress when at least this much has to be hashed
PROGRESS_EVERY_S = 5.0
# A file changed this recently may change again within one tick of the file system's clock and
# keep its stamps, so its digest is not cached (git's "racily clean" files).
RACY_S = 2.0
MAX_WORKERS = 8  # shards hashed at once (hashlib releases the GIL), at most half the cores
_CONFIG_METADATA = ("_name_or_path", "transformers_version")  # never change what the model computes
_VERSION = 1


class Cancelled(Exception):
    """`stop` was set while hashing."""


def cache_dir() -> Path:
    return cache_root() / "fingerprints"


def _stamp(st: os.stat_result) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def _entry_path(real: str) -> Path:
    return cache_dir() / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"


def _read_entry(p: Path) -> dict:
    raw = read_regular(p, 64 << 10)  # a FIFO or device there must not hang start-up
    if raw is None:
        raise FileNotFoundError(p)
    return json.loads(raw)


def _cached(real: str, st: os.stat_result) -> str | None:
    try:
        entry = _read_entry(_entry_path(real))
        if (entry.get("version") == _VERSION and entry.get("path") == real
                and all(entry.get(k) == v for k, v in _stamp(st).items())):
            digest = entry["sha256"]
            if isinstance(digest, str) and len(digest) == 64:
                return digest
    except FileNotFoundError:
        pass
    except Exception as e:  # unreadable or corrupt: hash again
        log.debug("weights fingerprint cache entry for %s unusable (%s); hashing the file", real, e)
    return None


def _store(real: str, st: os.stat_result, digest: str) -> None:
    tmp = None
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = _entry_path(real)
        tmp = d / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        tmp.write_text(json.dumps({"version": _VERSION, "path": real, **_stamp(st), "sha256": digest}))
        os.replace(tmp, path)
        tmp = None
        _prune(d, keep=path)
    except Exception as e:
        log.debug("cannot cache the weights fingerprint of %s in %s (%s); it is hashed again next start",
                  real, cache_dir(), e)
    finally:
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass


def _prune(d: Path, keep: Path) -> None:
    """Drop entries of files that are gone (temporary checkpoints), so the cache stays small."""
    for p in d.glob("*.json"):
        if p == keep:
            continue
        try:
            if not os.path.exists(_read_entry(p)["path"]):
                p.unlink()
        except Exception:
            pass  # another process's entry half-seen, or unreadable: left alone


class _Progress:
    def __init__(self, model_dir: Path, total: int) -> None:
        self.model_dir, self.total, self.done = model_dir, total, 0
        self.on = total >= PROGRESS_MIN_BYTES
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()
        if self.on:
            log.info("fingerprinting the weights of %s for KV-cache keys: %.1f GB to hash (cached for later starts)",
                     model_dir, total / 1e9)

    def add(self, n: int) -> None:
        if not self.on:
            return
        with self.lock:
            self.done += n
            now = time.monotonic()
            if now - self.last >= PROGRESS_EVERY_S:
                self.last = now
                log.info("fingerprinting the weights of %s for KV-cache keys: %.1f / %.1f GB", self.model_dir,
                         self.done / 1e9, self.total / 1e9)

    def finish(self) -> None:
        if self.on:
            log.info("fingerprinted the weights of %s (%.1f GB) in %.1f s", self.model_dir, self.total / 1e9,
                     time.monotonic() - self.t0)


def _hash_file(path: Path, progress: _Progress, stop: threading.Event | None) -> str:
    """The file's SHA-256, cached when the file held still while it was read and is not racy."""
    real = os.path.realpath(path)
    started = time.time_ns()
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there must not hang start-up
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"weight file {path} is not a regular file")
    with os.fdopen(fd, "rb", buffering=0) as f:
        before = os.fstat(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])
            progress.add(n)
            if stop is not None and stop.is_set():
                raise Cancelled
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    if (_stamp(before) == _stamp(after) and after.st_nlink > 0
            and started - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_S * 1e9):
        try:
            on_path = os.stat(real)  # still the file that was read (not replaced meanwhile)
        except OSError:
            on_path = None
        if on_path is not None and _stamp(on_path) == _stamp(after):
            _store(real, after, digest)
    return digest


CONFIG_LIMIT = 64 << 20  # a config.json or safetensors index is kilobytes; anything this long is not one


def _small_file(path: Path) -> bytes:
    """A config or index file's bytes: read without blocking, regular files only, bounded (a
    FIFO or /dev/zero there hung, or filled memory)."""
    raw = read_regular(path, CONFIG_LIMIT)
    if raw is None:
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing")
        raise ValueError(f"{path} is not a readable regular file under {CONFIG_LIMIT >> 20} MiB")
    return raw


def _config_digest(path: Path) -> str:
    raw = _small_file(path)
    try:
        cfg = json.loads(raw)
    except ValueError:
        return hashlib.sha256(raw).hexdigest()
    if not isinstance(cfg, dict):
        return hashlib.sha256(raw).hexdigest()
    for key in _CONFIG_METADATA:
        cfg.pop(key, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def weights_fingerprint(model_dir: str | Path, stop: threading.Event | None = None) -> str:
    """SHA-256 hex over config.json, the safetensors index and each weight file the loader reads,
    by name relative to `model_dir` (never the directory's own name)."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    parts = [("config.json", _config_digest(model_dir / "config.json"))]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        parts.append((index.name, hashlib.sha256(_small_file(index)).hexdigest()))
    digests: dict[Path, str] = {}
    todo: list[Path] = []
    for f in files:
        real = os.path.realpath(f)
        try:
            hit = _cached(real, os.stat(real))
        except OSError:
            hit = None
        if hit is None:
            todo.append(f)
        else:
            digests[f] = hit
    if todo:
        progress = _Progress(model_dir, sum(f.stat().st_size for f in todo))
        workers = min(len(todo), MAX_WORKERS, max(1, (os.cpu_count() or 1) // 2))
        if workers == 1:
            for f in todo:
                digests[f] = _hash_file(f, progress, stop)
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="tierlm-fingerprint") as pool:
                for f, digest in zip(todo, pool.map(lambda f: _hash_file(f, progress, stop), todo)):
                    digests[f] = digest
        progress.finish()
    for f in files:
        try:
            name = f.relative_to(model_dir).as_posix()
        except ValueError:  # an index may name shards by absolute path, outside the checkpoint
            name = os.path.realpath(f)
        parts.append((name, digests[f]))
    total = hashlib.sha256(b"tierlm-weights-fingerprint-v1\n")
    for name, digest in parts:
        total.update(f"{name}\0{digest}\n".encode())
    return total.hexdigest()


def weight_stamps(model_dir: str | Path) -> list[tuple]:
    """(name, size, mtime, ctime, inode, device) of config.json and each weight file: equal
    before and after loading and hashing means both read the same bytes (a file replaced or
    rewritten meanwhile changes its inode or times)."""
    model_dir = Path(model_dir)
    out = []
    for f in [model_dir / "config.json", *weight_files(model_dir)]:
        try:
            st = os.stat(f)
        except OSError:
            out.append((str(f), None))
            continue
        out.append((str(f), *_stamp(st).values()))
    return out


class BackgroundFingerprint:
    """`weights_fingerprint` on a thread of its own, so that it overlaps loading the weights."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._stop = threading.Event()
        self._value: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tierlm-fingerprint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = weights_fingerprint(self.model_dir, self._stop)
        except BaseException as e:  # handed to result()
            self._error = e

    def result(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def cancel(self) -> None:
        """Stop hashing (the load failed: nobody will ask for the result)."""
        self._stop.set()
