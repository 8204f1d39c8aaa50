"""Writes that are whole or absent: a file or directory is built under a temporary name beside its
target, flushed to disk, and moved into place in one rename, so a reader (or a crash) never meets a
half-written one, and a replaced target is never missing for a moment."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_RENAME_EXCHANGE = 2  # renameat2 flag: swap two paths in one step
_AT_FDCWD = -100


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary file path beside `path` for the caller to write; renamed over `path` on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, data: bytes | str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_dir(path: Path) -> Iterator[Path]:
    """A temporary directory beside `path` for the caller to fill; on success it takes `path`'s place.
    An existing `path` is swapped out in the same step (renameat2 RENAME_EXCHANGE) and then removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        if path.exists():
            _exchange(tmp, path)  # tmp now holds the old contents, removed below
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None and renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return
    # No renameat2 (not Linux, old libc, a file system without exchange): move the old one aside first.
    # The gap between the two renames is the only moment `b` is missing; its old contents survive in `aside`.
    aside = b.with_name(f".{b.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    b.rename(aside)
    a.rename(b)
    aside.rename(a)
