"""Reading files that something else may have put in place: never block, never read without bound."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


# What a path that is not there (or is not a readable kind of file) answers: the file is absent.
# Any other error (out of file descriptors, permissions, I/O) says nothing about its content.
ABSENT = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO, errno.ENODEV})


def read_regular(p: Path, limit: int, whole: bool = True, strict: bool = False,
                 absent_raises: bool = False, nofollow: bool = False, mutable: bool = False) -> bytes | bytearray | None:
    """Up to `limit` bytes of the regular file `p` (all of it with `whole`, or None if it is
    longer), or None. Opened without blocking and checked with fstat first: a FIFO or device
    put where an entry should be hung the model loop in open() or read() (a tester's find).
    With `strict`, an error other than the file being absent is raised, not None: a reader that
    deletes what it cannot read (a cache's damaged entry) must not delete an intact file because
    the process ran out of file descriptors. With `absent_raises` an absent file raises
    FileNotFoundError too (a cache entry deleted behind its back is gone, not damaged). With
    `nofollow` a symbolic link at `p` is not followed: it is not a regular file, so None (a
    cache's own files are never links). With `mutable` the bytes come as a bytearray, read
    into it directly: a tensor can then use them in place (bytes would need a copy first)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | (os.O_NOFOLLOW if nofollow else 0))
    except OSError as e:
        if nofollow and e.errno == errno.ELOOP and os.path.islink(p):
            return None
        if e.errno in ABSENT and absent_raises:
            raise FileNotFoundError(e.errno, e.strerror, str(p)) from None
        if strict and e.errno not in ABSENT:
            raise
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (whole and st.st_size > limit):
            return None
        if mutable:
            return _read_into(fd, min(st.st_size, limit), limit)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    except OSError:
        if strict:
            raise
        return None
    finally:
        os.close(fd)


def _read_into(fd: int, size: int, limit: int) -> bytearray:
    """Up to `limit` bytes of open file `fd`, read into a bytearray of `size` (its size by fstat)
    and cut to what was read; a file that grew since is read on, in pieces, up to `limit`."""
    buf, n = bytearray(size), 0
    with memoryview(buf) as view:
        while n < size:
            got = os.readv(fd, [view[n:]])
            if not got:
                break
            n += got
    del buf[n:]
    while len(buf) == n < limit:
        more = os.read(fd, min(limit - n, 1 << 16))
        if not more:
            break
        buf += more
        n = len(buf)
    return buf
