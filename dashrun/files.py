"""Atomic, durable file writes (temp file, fsync, rename, fsync the directory), and closing file mappings."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

_CHUNK = 8 << 20


def unmap(mapped: mmap.mmap) -> None:
    """Close a mapping; if a view of it is still alive (a slice being sent, one a traceback holds), the
    mapping goes when that view is collected instead of failing here."""
    try:
        mapped.close()
    except BufferError:
        pass


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: str | os.PathLike, data: bytes | memoryview, mode: int = 0o600) -> None:
    """Write a file that must not exist yet, and fsync it (not its directory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:written + _CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o600) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never a mix."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    try:
        write_new(tmp, data, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
