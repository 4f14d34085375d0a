"""What a `kv_disk_dir` holds, and removing what no model will use again.

Each model gets a directory of its own under `kv_disk_dir` (`disk_tier_dir`), named after the
checkpoint and its weights' fingerprint. New weights mean a new directory (the block keys
change), so directories of old weights, and of models no longer served, stay behind: each one
counted only against its own capacity, and tierlm never deletes one by itself, since another
server may be using it. An engine records, in `model.json`, which checkpoint a directory is for;
`tierlm kv ls` reads that to say whether those weights are still there, and `tierlm kv prune`
removes directories that no engine holds, chosen by that or by age, holding each directory's
lock while it deletes it so an engine cannot start on it halfway.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tierlm.files import read_regular
from tierlm.kv.tiers import ENTRY_NAME

log = logging.getLogger("tierlm.kv")

ABOUT_FILE = "model.json"
LOCK_FILE = ".lock"
_DIR_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}-[0-9a-f]{12}")  # disk_tier_dir's names
_LEFTOVER = re.compile(r"\.tierlm-prune-[A-Za-z0-9._-]{1,64}-[0-9a-f]{12}-[0-9a-f]{8}")  # a prune that failed partway
_LEFTOVER_OF = re.compile(r"^\.tierlm-prune-|-[0-9a-f]{8}$")  # a leftover's name -> the directory's

# Whether a directory's recorded weights are still at their recorded path. UNKNOWN: no record, or
# the checkpoint could not be read (permissions, a download under way); never pruned as stale.
CURRENT, CHANGED, GONE, UNKNOWN, UNCHECKED = "current", "changed", "gone", "unknown", "unchecked"
PARTLY_REMOVED = "partly removed"  # what an interrupted prune left behind
STALE = (CHANGED, GONE, PARTLY_REMOVED)


def write_about(directory: Path, about: dict) -> None:
    """Record which checkpoint `directory` holds blocks for (atomically: a reader never sees half
    a file). Not needed to serve, so a failure is a warning."""
    tmp = None
    try:  # a fresh temporary (O_EXCL): never written through a link someone put at a guessable name
        fd, tmp = tempfile.mkstemp(prefix=f".{ABOUT_FILE}.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w") as f:  # mkstemp's 0600, as the tier's entries (the directory is 0700)
            f.write(json.dumps(about, indent=1) + "\n")
        os.replace(tmp, directory / ABOUT_FILE)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log.warning("could not write %s (%s); `tierlm kv ls` will not know which model it is for",
                    directory / ABOUT_FILE, e)


def read_about(directory: Path) -> dict:
    raw = read_regular(directory / ABOUT_FILE, 1 << 16)
    try:
        about = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return about if isinstance(about, dict) else {}


@dataclass
class ModelDir:
    """One model's directory under a kv_disk_dir."""
    name: str
    path: str
    entries: int
    bytes: int
    last_write: float | None  # newest entry's file time (epoch seconds)
    started: float | None  # when an engine last started on it (model.json)
    in_use_by: str | None  # the lock holder ("tierlm pid 42"), or None when free
    model_dir: str | None  # the checkpoint it holds blocks for (model.json)
    weights: str  # CURRENT, CHANGED, GONE, UNKNOWN, UNCHECKED, or PARTLY_REMOVED for a leftover

    @property
    def last_used(self) -> float | None:
        times = [t for t in (self.last_write, self.started) if t is not None]
        return max(times) if times else None

    @property
    def stale(self) -> bool:
        return self.weights in STALE


    @property
    def leftover(self) -> bool:
        return self.weights == PARTLY_REMOVED


def _is_model_dir(entry: os.DirEntry, leftovers: bool = False) -> bool:
    try:
        if not entry.is_dir(follow_symlinks=False):
            return False
        if leftovers and _LEFTOVER.fullmatch(entry.name):
            return True
        if not _DIR_NAME.fullmatch(entry.name):
            return False
        return any(os.path.lexists(os.path.join(entry.path, f)) for f in (LOCK_FILE, ABOUT_FILE))
    except OSError as e:
        log.warning("skipped %s: %s", entry.path, e)
        return False


def model_dir_names(root: Path, leftovers: bool = False) -> list[str]:
    """The names of the model directories under `root` (cheap: no entry is looked at), and with
    `leftovers` what an interrupted prune left."""
    return sorted(e.name for e in os.scandir(root) if _is_model_dir(e, leftovers))


def lock_holder(directory: Path) -> str | None:
    """Who holds the directory's engine lock, or None if nobody does."""
    fd = _try_lock(directory)
    if isinstance(fd, int):
        os.close(fd)
        return None
    return fd


def _try_lock(directory: Path, mine: bool = False) -> int | str | None:
    """The directory's lock taken (its fd), the holder's name if an engine holds it, or None if
    there is no lock file an engine could hold (none, a dangling link, a socket). `mine`: say
    in the file who holds it, for an engine refused meanwhile."""
    lock = directory / LOCK_FILE
    try:  # a link is followed here (read-only); the engine refuses one at .lock
        fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        if not mine:
            return None
        try:  # no lock file: make one to hold, so an engine starting meanwhile waits for it
            fd = os.open(lock, os.O_RDONLY | os.O_NONBLOCK | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:  # a dangling link, or the directory is gone: nothing an engine could hold
            return None
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.ELOOP, errno.ENOTDIR):
            return None
        return f"unknown ({e.strerror})"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = os.read(fd, 256).decode(errors="replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        return holder or "another engine"
    if mine:
        _label(directory / LOCK_FILE, f"tierlm kv prune pid {os.getpid()}\n")
    return fd


def _label(lock: Path, text: str) -> None:
    """Write who holds the lock into its file: only the directory's own regular file (never
    through a link, which could point anywhere), and only as a courtesy."""
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
            os.write(fd, text.encode())
    except OSError:
        pass
    finally:
        os.close(fd)


def _entries(directory: Path) -> tuple[int, int, float | None]:
    """(entries, bytes, newest entry's time) of the block files in the directory's shards."""
    n = size = 0
    newest: float | None = None
    t0 = time.monotonic()
    for shard in os.scandir(directory):
        if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
            continue
        try:
            files = list(os.scandir(shard.path))
        except OSError as e:  # one unreadable shard must not hide the rest of the directory
            log.warning("%s: cannot list %s (%s); its entries are not counted", directory.name, shard.path, e)
            continue
        for f in files:
            match = ENTRY_NAME.fullmatch(f.name)  # the disk tier's own name for an entry
            if match is None or match.group(1) != "kv":
                continue
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue
            n += 1
            if n % 500_000 == 0:  # a million entries take seconds to count: show it is moving
                log.info("%s: %d entries counted in %.0f s", directory.name, n, time.monotonic() - t0)
            size += st.st_size
            newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    return n, size, newest


def _fingerprint(model_dir: str) -> str | None:
    """The checkpoint's fingerprint; GONE when nothing is at its path; None when it cannot be
    read (no permission, a copy under way, config.json missing so far): then nobody can say
    the blocks are stale."""
    from tierlm.models.fingerprint import weights_fingerprint

    try:
        os.stat(model_dir)
    except (FileNotFoundError, NotADirectoryError):
        return GONE  # nothing at that path: no engine started from it computes these blocks
    except OSError:
        return None
    try:
        return weights_fingerprint(model_dir)
    except Exception as e:
        log.warning("could not fingerprint %s (%s); its directories' weights are 'unknown'", model_dir, e)
        return None


def _weights(about: dict, seen: dict[str, str | None]) -> str:
    """`seen`: fingerprints already taken in this scan, by checkpoint path (each hashed once)."""
    model_dir, recorded = _recorded_dir(about), about.get("fingerprint")
    if model_dir is None or not isinstance(recorded, str):
        return UNKNOWN
    if model_dir not in seen:
        seen[model_dir] = _fingerprint(model_dir)
    now = seen[model_dir]
    if now is None:
        return UNKNOWN
    return now if now == GONE else CURRENT if now == recorded else CHANGED


_LATEST = 32503680000.0  # the year 3000, in epoch seconds: a later "time" is a damaged record


def _time(value: object) -> float | None:
    """A recorded time, or None if the record holds no plausible one (NaN, 1e300, a 400-digit
    integer: each once broke the listing of every directory)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        t = float(value)
    except OverflowError:
        return None
    return t if math.isfinite(t) and 0.0 <= t <= _LATEST else None


def _recorded_dir(about: dict) -> str | None:
    """The checkpoint path a record names, if it is one a file system could hold."""
    model_dir = about.get("model_dir")
    return model_dir if isinstance(model_dir, str) and model_dir and "\0" not in model_dir else None


def _describe(root: Path, name: str, check_weights: bool, seen: dict[str, str | None]) -> ModelDir:
    p = root / name
    about = read_about(p)
    n, size, newest = _entries(p)
    model_dir = _recorded_dir(about)
    if _LEFTOVER.fullmatch(name):
        weights = PARTLY_REMOVED
    else:
        weights = _weights(about, seen) if check_weights else UNCHECKED
    return ModelDir(name=name, path=str(p), entries=n, bytes=size, last_write=newest,
                    started=_time(about.get("started")), in_use_by=lock_holder(p), model_dir=model_dir,
                    weights=weights)


def scan(root: str | Path, check_weights: bool = True) -> list[ModelDir]:
    """Every model directory under `root`, by name, and what an interrupted prune left. With
    `check_weights`, each recorded checkpoint is fingerprinted once (cached per file, so only
    changed files are read again). A directory that cannot be read is skipped with a warning."""
    if not str(root):
        raise ValueError("no kv_disk_dir given (an empty path); give the directory a server was started with")
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; give the kv_disk_dir a server was started with")
    found, seen = [], {}
    for name in model_dir_names(root, leftovers=True):
        try:
            found.append(_describe(root, name, check_weights, seen))
        except (OSError, ValueError) as e:  # unreadable, or removed meanwhile (another prune)
            log.warning("skipped %s: %s", root / name, e)
    return found


@dataclass
class Pruned:
    dir: ModelDir
    removed: bool
    why: str  # what was done, or why not
    failed: bool = False  # a removal was tried and did not complete


def _remove(d: ModelDir, root: Path) -> Pruned:
    """Delete a directory no engine holds. Holding its lock, it is first renamed aside (one
    atomic step; a leftover too, so of two prunes only one deletes it): an engine starting now
    finds the lock held and waits, or finds no directory and makes a fresh one; none ever
    starts on entries being deleted. A deletion that fails partway leaves the renamed
    directory, which `scan` lists as PARTLY_REMOVED."""
    p = Path(d.path)
    fd = _try_lock(p, mine=True)
    if isinstance(fd, str):
        return Pruned(d, False, f"kept: in use by {fd}")
    try:
        base = _LEFTOVER_OF.sub("", p.name) if d.leftover else p.name
        target = p.with_name(f".tierlm-prune-{base}-{secrets.token_hex(4)}")
        try:
            os.rename(p, target)
        except FileNotFoundError:
            return Pruned(d, False, "gone meanwhile (another prune?)")
        except OSError as e:
            return Pruned(d, False, f"kept: could not move it aside to delete it ({e.strerror})", failed=True)
        errors: list[str] = []
        shutil.rmtree(target, onerror=lambda _fn, path, exc: errors.append(f"{path}: {exc[1]}"))
    finally:
        if isinstance(fd, int):
            os.close(fd)
    if errors and not os.path.lexists(target):  # renamed away mid-deletion by another prune, which finished it
        return Pruned(d, False, "gone meanwhile (another prune?)")
    if os.path.lexists(target):
        return Pruned(d, False, f"partly removed ({len(errors)} error(s), first: {errors[0] if errors else '?'}); "
                                f"the rest is in {target.name}: `tierlm kv prune {root} {target.name}` "
                                "(or any filter) removes it", failed=True)
    return Pruned(d, True, "removed")


def prune(root: str | Path, *, names: Sequence[str] = (), stale: bool = False,
          unused_for_s: float | None = None, dry_run: bool = False,
          now: Callable[[], float] = time.time) -> list[Pruned]:
    """Remove the model directories named, or those matching every filter given: `stale`
    (the recorded weights are gone or changed) and `unused_for_s` (no engine started on it and
    no block was written for that long). What an interrupted prune left matches any filter. A
    directory an engine holds is never removed."""
    if names and (stale or unused_for_s is not None):
        raise ValueError("name directories or give filters (--stale, --unused-for), not both")
    if not names and not stale and unused_for_s is None:
        raise ValueError("say what to remove: directory names, --stale, --unused-for, or both filters")
    dirs = scan(root, check_weights=stale)
    by_name = {d.name: d for d in dirs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"no model directory {', '.join(map(repr, unknown))} under {root}; "
                         f"`tierlm kv ls {root}` lists them")
    if names:
        chosen = [by_name[n] for n in dict.fromkeys(names)]
    else:
        cutoff = now() - unused_for_s if unused_for_s is not None else None
        chosen = [d for d in dirs if d.leftover or (
            (not stale or d.stale) and (cutoff is None or (d.last_used is not None and d.last_used < cutoff)))]
    results = []
    for d in chosen:
        if d.in_use_by is not None:
            results.append(Pruned(d, False, f"kept: in use by {d.in_use_by}"))
        elif dry_run:
            results.append(Pruned(d, False, "would remove"))
        else:
            results.append(_remove(d, Path(root)))
            if results[-1].removed:
                log.info("removed KV disk directory %s (%d entries, %d bytes)", d.path, d.entries, d.bytes)
    return results


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """'90s', '45m', '12h', '30d', '2w' -> seconds."""
    m = _DURATION.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"cannot read duration {text!r}; use a number and a unit: '90s', '45m', '12h', '30d', '2w'")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def as_json(dirs: Sequence[ModelDir]) -> list[dict]:
    return [asdict(d) | {"stale": d.stale, "last_used": d.last_used} for d in dirs]
