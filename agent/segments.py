"""The agent's mappings of the ranks' staging segments, kept while a rank reuses them.

A rank alternates between a few staging segments (:mod:`dashrun.rank.stager`); the agent maps each once
and keeps the mapping, so that the pages are not faulted in again for every checkpoint.
"""

from __future__ import annotations

import mmap
import os
import threading

from dashrun.errors import ProtocolError
from dashrun.util.files import unmap

__all__ = ["SegmentMaps"]


class SegmentMaps:
    """The agent's read-only mappings of the staging segments a rank alternates between, kept while the rank
    reuses them: mapping each once avoids faulting its pages in again for every checkpoint."""

    KEEP = 2

    def __init__(self, writable: bool = False):
        self.writable = writable
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._lock = threading.Lock()  # restores map from several threads

    def view(self, fd: int, nbytes: int) -> memoryview:
        st = os.fstat(fd)
        if st.st_size < nbytes:
            raise ProtocolError("the segment is smaller than the shard it should hold")
        key = (st.st_dev, st.st_ino)
        with self._lock:
            mapped = self._maps.pop(key, None)
            if mapped is None or len(mapped) != st.st_size:
                mapped = _mapped(fd, st.st_size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0))
            self._maps[key] = mapped  # most recently used last
            while len(self._maps) > self.KEEP:
                unmap(self._maps.pop(next(iter(self._maps))))
            return memoryview(mapped)[:nbytes]

    def forget(self, fd: int) -> None:
        """Let go of the mapping of the segment behind ``fd``, if one is kept (once its views are released)."""
        st = os.fstat(fd)
        with self._lock:
            mapped = self._maps.pop((st.st_dev, st.st_ino), None)
        if mapped is not None:
            unmap(mapped)

    def close(self) -> None:
        with self._lock:
            for mapped in self._maps.values():
                unmap(mapped)
            self._maps.clear()


def _mapped(fd: int, nbytes: int, **kwargs) -> mmap.mmap:
    """``mmap.mmap(fd, nbytes, **kwargs)``; a descriptor that cannot be mapped so (a directory, a file the rank
    opened read-only) is the rank's error, refused like any other malformed request."""
    try:
        return mmap.mmap(fd, nbytes, **kwargs)
    except (OSError, ValueError) as e:
        raise ProtocolError(f"the attached descriptor cannot be mapped: {getattr(e, 'strerror', None) or e}") \
            from None
