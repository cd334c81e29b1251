"""The node-local data cache: verified entries on disk, one download per object per node, LRU within a limit.

Layout under the cache directory (shared by every job, rank and worker of the node)::

    objects/<id[:2]>/<id>        an object's bytes           (id: ObjectInfo.identity, a SHA-256 in hex)
    objects/<id[:2]>/<id>.json   its record, written last     {"url", "key", "size", "sha256", "checked_by", "mtime_ns"}
    tmp/<id>.<size>.<pid>.<n>    a download in progress
    locks/<id>                   flock: held by the one process downloading <id>
    evict.lock                   flock: held while bytes are reserved or entries evicted
    usage                        bytes held and reserved (recounted by every eviction)
    listings/<sha(url)>.json     the newest listing of each source seen here

Contracts:

- An entry exists if and only if its record does, and is served only while
  its file's size and mtime are those the record gives: bytes are written to a
  temporary name, fsynced, checked against what the source says (S3's
  checksum or a single-part ETag, a manifest's SHA-256, else the size) and
  hashed (SHA-256) on the way, renamed into place, and only then is the record
  written (atomically). A file changed afterwards (truncated, rewritten) no
  longer matches its record and is fetched again; :meth:`Cache.verify` also
  rehashes every entry, for corruption that leaves size and mtime alone.
- One download per object per node: a process takes ``locks/<id>`` (an
  exclusive flock) before it fetches, and looks for the entry again once it
  holds it. The kernel drops a flock when its holder dies, however it dies, so
  a crashed download's lock is broken at once; its temporary file is removed by
  the next holder.
- A pin is a shared flock on the entry's file, held by the reader
  (:class:`Pinned`); eviction takes an exclusive one without waiting, so a
  pinned entry is skipped. Eviction removes least recently used entries first
  (use touches the record's mtime) until the new object fits the limit; an
  object larger than the limit is a UsageError, and a cache whose every byte is
  pinned a NoSpaceError.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dashrun.data.sources import Expected, Hasher
from dashrun.errors import ChecksumError, NoSpaceError, ProtocolError, UsageError
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.files import fsync_dir, write_atomic
from dashrun.util.units import format_size

__all__ = ["Cache", "Entry", "Pinned", "default_dir"]

log = logging.getLogger(__name__)

_RECORD = ".json"
_counter = itertools.count()


def default_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dashrun" / "data"


@dataclass(frozen=True)
class Entry:
    """A cached object, as its record gives it."""

    ident: str
    url: str
    key: str
    size: int
    sha256: str
    checked_by: str
    mtime_ns: int
    used: float = 0.0

    def to_json(self) -> dict:
        return {"url": self.url, "key": self.key, "size": self.size, "sha256": self.sha256,
                "checked_by": self.checked_by, "mtime_ns": self.mtime_ns}


class Pinned:
    """A cached object's path, kept from eviction until :meth:`release` (a shared flock on its file)."""

    def __init__(self, entry: Entry, path: Path, fd: int):
        self.entry, self.path, self._fd = entry, path, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.release()


class Cache:
    """The cache directory ``root``, holding at most ``limit`` bytes (default: what it holds now plus the file
    system's free space, less a tenth of the file system)."""

    def __init__(self, root: str | os.PathLike | None = None, limit: int | None = None):
        self.root = Path(root).expanduser() if root is not None else default_dir()
        for sub in ("objects", "tmp", "locks", "listings"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if limit is not None and limit <= 0:
            raise UsageError(f"the data cache limit must be positive, not {limit}")
        self._limit = limit

    @property
    def limit_given(self) -> int | None:
        """The limit as given (None: the default, which follows the file system's free space)."""
        return self._limit

    @property
    def limit(self) -> int:
        if self._limit is not None:
            return self._limit
        fs = shutil.disk_usage(self.root)
        return max(1, self.usage() + fs.free - fs.total // 10)

    # --- paths ------------------------------------------------------------------------------

    def path(self, ident: str) -> Path:
        if len(ident) != 64 or any(c not in "0123456789abcdef" for c in ident):
            raise ProtocolError(f"{ident!r} is not a cache entry's id")
        return self.root / "objects" / ident[:2] / ident

    def _record_path(self, ident: str) -> Path:
        return self.path(ident).with_name(ident + _RECORD)

    # --- reading ----------------------------------------------------------------------------

    def entry(self, ident: str) -> Entry | None:
        """The entry ``ident`` if it is cached and its file still matches its record; a mismatching file is
        removed (it is fetched again)."""
        record = self._record_path(ident)
        try:
            text = record.read_bytes()
        except FileNotFoundError:
            return None
        try:
            body = loads_bounded(text)
        except ValueError:
            body = None
        try:
            st = os.stat(self.path(ident))
        except FileNotFoundError:
            st = None
        entry = _entry(ident, body)
        if entry is None or st is None or (st.st_size, st.st_mtime_ns) != (entry.size, entry.mtime_ns):
            log.warning("data cache entry %s (%s) no longer matches its record: removed, to be fetched again",
                        ident[:12], entry.key if entry else "?")
            self._discard(ident)
            return None
        return entry

    def pin(self, ident: str) -> Pinned | None:
        """The entry ``ident``, pinned, and its use recorded; None if it is not cached."""
        try:
            fd = os.open(self.path(ident), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        entry = self.entry(ident)  # after the pin: an eviction that won the race has removed the record
        if entry is None:
            os.close(fd)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._record_path(ident))
        return Pinned(entry, self.path(ident), fd)

    def entries(self) -> list[Entry]:
        found = []
        for record in (self.root / "objects").glob("*/*" + _RECORD):
            ident = record.name[:-len(_RECORD)]
            try:
                body, st = loads_bounded(record.read_bytes()), record.stat()
            except (FileNotFoundError, ValueError):
                continue
            entry = _entry(ident, body)
            if entry is not None:
                found.append(Entry(**{**entry.__dict__, "used": st.st_mtime}))
        return found

    # --- filling ----------------------------------------------------------------------------

    def get(self, ident: str, url: str, key: str, size: int,
            produce: Callable[[], tuple[Expected, Iterator[bytes]]]) -> Pinned:
        """The entry ``ident``, pinned: from the cache, or else made from ``produce()`` by this process alone.

        ``produce`` returns the checks the bytes must pass and the bytes; it is called only while this process
        holds the entry's lock, and only if the entry is still missing then.
        """
        pinned = self.pin(ident)
        if pinned is not None:
            return pinned
        if size > self.limit:
            raise UsageError(f"{key} ({format_size(size)}) is larger than the data cache's limit "
                             f"({format_size(self.limit)})",
                             hint="raise --data-cache-limit (DASH_DATA_CACHE_LIMIT), or read it uncached")
        with self._download_lock(ident):
            pinned = self.pin(ident)  # another process finished it while this one waited
            if pinned is not None:
                return pinned
            for stale in (self.root / "tmp").glob(ident + ".*"):  # its writer is gone: it held this lock
                stale.unlink(missing_ok=True)
            self._reserve(size)
            tmp = self.root / "tmp" / f"{ident}.{size}.{os.getpid()}.{next(_counter)}"
            try:
                expected, pieces = produce()
                if expected.size != size:
                    raise ChecksumError(f"{key} is {expected.size} bytes at its source, {size} in its listing")
                hasher = Hasher(expected)
                self._write(tmp, pieces, hasher)
                problem = hasher.mismatch()
                if problem:
                    raise ChecksumError(f"{key} from {url} failed its check: {problem}")
                final = self.path(ident)
                final.parent.mkdir(exist_ok=True)
                os.rename(tmp, final)
                st = final.stat()
                entry = Entry(ident, url, key, size, hasher.sha256.hexdigest(), expected.checked_by, st.st_mtime_ns)
                fsync_dir(final.parent)
                write_atomic(self._record_path(ident), json.dumps(entry.to_json()), 0o644)  # the commit
            except BaseException:
                tmp.unlink(missing_ok=True)
                self._unreserve(size)
                raise
        pinned = self.pin(ident)
        if pinned is None:
            raise NoSpaceError(f"{key} was evicted as soon as it was cached",
                               hint="the data cache is too small for what is read at once")
        return pinned

    @contextlib.contextmanager
    def _download_lock(self, ident: str):
        fd = os.open(self.root / "locks" / ident, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _write(tmp: Path, pieces: Iterator[bytes], hasher: Hasher) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            for piece in pieces:
                hasher.update(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view):]
                if hasher.size > hasher.expected.size:
                    break  # more than listed: no use writing the rest
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- accounting and eviction ----------------------------------------------------------

    @contextlib.contextmanager
    def _accounting(self):
        fd = os.open(self.root / "evict.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _read_usage(self) -> int | None:
        try:
            return int((self.root / "usage").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _write_usage(self, n: int) -> None:
        write_atomic(self.root / "usage", str(max(0, n)), 0o644, durable=False)  # a hint, recounted when wrong

    def usage(self) -> int:
        """Bytes held by entries and reserved by downloads in progress."""
        held = self._read_usage()
        return held if held is not None else self._count()[0]

    def _count(self) -> tuple[int, list[Entry]]:
        """Bytes held and reserved, recounted; and the entries. Temporary files of dead writers are removed."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        for tmp in (self.root / "tmp").iterdir():
            ident, _, rest = tmp.name.partition(".")
            size = rest.partition(".")[0]
            if self._lock_free(ident):
                tmp.unlink(missing_ok=True)
            elif size.isdigit():
                total += int(size)
        return total, entries

    def _lock_free(self, ident: str) -> bool:
        try:
            fd = os.open(self.root / "locks" / ident, os.O_RDWR | os.O_CLOEXEC)
        except (FileNotFoundError, ValueError):
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    def _reserve(self, size: int) -> None:
        with self._accounting():
            limit = self.limit
            held = self._read_usage()
            if held is None or held + size > limit:
                held, entries = self._count()
                for entry in sorted(entries, key=lambda e: e.used):
                    if held + size <= limit:
                        break
                    if self._evict(entry.ident):
                        held -= entry.size
                if held + size > limit:
                    self._write_usage(held)
                    raise NoSpaceError(f"the data cache ({format_size(limit)}) is full of objects in use",
                                       hint="raise --data-cache-limit (DASH_DATA_CACHE_LIMIT), or hold fewer "
                                            "paths at once")
            self._write_usage(held + size)

    def _unreserve(self, size: int) -> None:
        with self._accounting():
            held = self._read_usage()
            if held is not None:
                self._write_usage(held - size)

    def _evict(self, ident: str) -> bool:
        """Remove an unpinned entry (record first); False if it is pinned."""
        try:
            fd = os.open(self.path(ident), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._record_path(ident).unlink(missing_ok=True)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            self._discard(ident)
        finally:
            os.close(fd)
        log.info("data cache: evicted %s", ident[:12])
        return True

    def _discard(self, ident: str) -> None:
        self._record_path(ident).unlink(missing_ok=True)
        self.path(ident).unlink(missing_ok=True)

    # --- whole cache ------------------------------------------------------------------------

    def verify(self, url: str | None = None) -> list[Entry]:
        """Rehash every entry (of ``url``, or all); those whose bytes differ from their record are removed and
        returned."""
        bad = []
        for entry in self.entries():
            if url is not None and entry.url != url:
                continue
            digest = hashlib.sha256()
            try:
                with open(self.path(entry.ident), "rb") as f:
                    while piece := f.read(8 << 20):
                        digest.update(piece)
            except FileNotFoundError:
                continue
            if digest.hexdigest() != entry.sha256:
                log.warning("data cache entry of %s failed its SHA-256: removed", entry.key)
                with self._accounting():
                    if self._evict(entry.ident):
                        bad.append(entry)
        if bad:
            with self._accounting():
                self._write_usage(self._count()[0])
        return bad

    def clear(self, url: str | None = None) -> tuple[int, int]:
        """Remove every unpinned entry (of ``url``, or all); (entries, bytes) removed."""
        count = nbytes = 0
        with self._accounting():
            for entry in self.entries():
                if (url is None or entry.url == url) and self._evict(entry.ident):
                    count, nbytes = count + 1, nbytes + entry.size
            self._write_usage(self._count()[0])
        return count, nbytes

    # --- listings ---------------------------------------------------------------------------

    def listing_path(self, url: str) -> Path:
        return self.root / "listings" / (hashlib.sha256(url.encode()).hexdigest() + ".json")

    def store_listing(self, url: str, text: str) -> None:
        write_atomic(self.listing_path(url), text, 0o644)

    def stored_listing(self, url: str) -> str | None:
        try:
            return self.listing_path(url).read_text()
        except FileNotFoundError:
            return None


def _entry(ident: str, body) -> Entry | None:
    """An Entry from a record's body, or None if the body is not one."""
    try:
        if not isinstance(body, dict):
            return None
        entry = Entry(ident, str(body["url"]), str(body["key"]), int(body["size"]), str(body["sha256"]),
                      str(body.get("checked_by", "")), int(body["mtime_ns"]))
    except (KeyError, TypeError, ValueError):
        return None
    return entry if entry.size >= 0 and len(entry.sha256) == 64 else None

