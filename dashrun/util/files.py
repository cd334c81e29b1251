"""Atomic, durable file writes (temp file, fsync, rename, fsync the directory), whole-directory removal, and
memory mappings."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import shutil
import uuid
from pathlib import Path
from typing import Callable

__all__ = ["discard_tree", "fsync_dir", "populated", "read_or_create_id", "unmap", "write_atomic",
           "write_new"]

_CHUNK = 8 << 20
#: Alignment O_DIRECT asks of addresses, lengths and offsets (the largest logical block size in use).
_BLOCK = 4096


def populated(size: int) -> mmap.mmap:
    """Anonymous shared memory with every page touched as it is mapped (MAP_POPULATE): writes into it never
    fault, and on VMs that hand untouched memory back to the host that fault costs more than the write."""
    return mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


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


def write_new(path: str | os.PathLike, data: bytes | memoryview, mode: int = 0o600, *,
              bypass_cache: bool = False, durable: bool = True,
              written_piece: Callable[[memoryview], object] | None = None) -> None:
    """Write a file that must not exist yet, and fsync it (not its directory) unless not ``durable``.

    ``written_piece`` is called with each piece of ``data`` as soon as it is
    written, in order, each byte once: a checksum of the bytes as they went
    out, for data that may change in memory meanwhile.

    ``bypass_cache`` writes the block-aligned bulk with O_DIRECT, for callers
    that keep the bytes in RAM themselves: through the page cache they would
    be copied once more into freshly allocated pages, several times the CPU
    time and memory traffic of the write itself. Where the file system or the
    buffer's alignment does not allow it, the write goes through the page cache.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data).cast("B")
        each = written_piece or _ignore
        written = _write_direct(fd, view[:len(view) - len(view) % _BLOCK], each) if bypass_cache else 0
        while written < len(view):
            written += _write_chunk(fd, view, written, each)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def _ignore(piece: memoryview) -> None:
    pass


def _write_chunk(fd: int, view: memoryview, at: int, each: Callable[[memoryview], object]) -> int:
    """Write up to a chunk of ``view`` from ``at`` and hand what was written to ``each``; returns its length."""
    n = os.write(fd, view[at:at + _CHUNK])
    each(view[at:at + n])
    return n


def _write_direct(fd: int, view: memoryview, each: Callable[[memoryview], object]) -> int:
    """Write block-aligned ``view`` at the start of ``fd`` with O_DIRECT; returns the bytes written that way."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:  # tmpfs and some others have no direct I/O
        return 0
    written = 0
    try:
        # An unaligned buffer (bytes, say) fails with EINVAL before anything is written; what is left goes buffered.
        while written < len(view):
            written += _write_chunk(fd, view, written, each)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return written


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o600, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers see the old file or the new one, never a mix.

    ``durable``: fsynced, so that a crash of the machine keeps the new file; without it the rename still
    survives the writing process dying however it dies (the page cache is the kernel's)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    # A name of its own per call: writers of the same file in other threads (dash-memd serves every host of a
    # job at once) or processes must never take over, or rename away, each other's temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        write_new(tmp, data, mode, durable=durable)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def read_or_create_id(path: str | os.PathLike) -> str:
    """The random id (32 hex digits) kept in ``path``; made, durably, the first time. A file that holds no such
    id (cut short by a crash before the rename could not be) is made anew."""
    path = Path(path)
    try:
        held = path.read_text().strip()
        if len(held) == 32 and all(c in "0123456789abcdef" for c in held):
            return held
    except FileNotFoundError:
        pass
    made = secrets.token_hex(16)
    write_atomic(path, made + "\n", 0o644)
    return made


def discard_tree(path: str | os.PathLike) -> bool:
    """Remove the directory ``path`` so that it is gone whole at once, and durably: renamed to a ``.trash-``
    sibling (which a start-up sweep may remove if this is interrupted), the rename fsynced, then deleted. False
    if it did not exist. OSError if the rename or its fsync fails: then ``path`` may come back after a crash of
    the machine, and the caller must not report it gone."""
    path = Path(path)
    trash = path.with_name(f".trash-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    try:
        fsync_dir(path.parent)  # until then a crash can undo the rename, with the tree whole or half deleted
    finally:
        shutil.rmtree(trash, ignore_errors=True)
    return True
