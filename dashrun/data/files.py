"""``CachedFiles``: a data set's objects as local files, read through the node's cache.

::

    files = CachedFiles("s3://bucket/datasets/shards/")   # or a directory, or https://host/manifest.json
    files.keys()                  # the object keys, sorted; the same on every rank (the stored listing)
    path = files.local_path(key)  # a local file with the object's verified bytes (blocks until cached)
    files.prefetch(keys)          # fetch ahead, in the background
    files.dataset()               # a torch Dataset of (key, path)

The cache is ``cache_dir`` (else ``DASH_DATA_CACHE``, else ``~/.cache/dashrun/data``),
bounded by ``limit`` (else ``DASH_DATA_CACHE_LIMIT``). Where an object comes
from, in order: this node's cache; the other places :mod:`dashrun.data.peers`
names (the job's peers and dash-memd's cache), when dash-memd is known; last
the source itself. A path returned by :meth:`CachedFiles.local_path` stays
valid while this object lives (or until :meth:`CachedFiles.release`): its
entry is pinned against eviction.

A ``CachedFiles`` pickles (for a DataLoader's workers) as its URL, its cache
and its listing: a worker lists nothing again and fetches through the same
cache, whose locks make it one download per object per node.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from typing import Callable, Iterable, Iterator

from dashrun import env
from dashrun.data.cache import Cache, Pinned
from dashrun.data.listings import Listing, StoredListings, load
from dashrun.data.sources import Expected, ObjectInfo, Source, normal_url, open_source
from dashrun.errors import ChecksumError, NotFoundError, UnavailableError
from dashrun.util.units import parse_size

__all__ = ["CachedFiles", "Provider", "cache_from_env"]

log = logging.getLogger(__name__)

#: ``provider(ident, info, url) -> (Expected, pieces) | None``: another place than the source an object may come
#: from; one with an ``offer(url, info, path, sha256)`` is handed a copy of each object fetched from the source.
Provider = Callable[[str, ObjectInfo, str], "tuple[Expected, Iterator[bytes]] | None"]


def cache_from_env(cache_dir=None, limit=None) -> Cache:
    cache_dir = cache_dir or env.get(env.DATA_CACHE)
    limit = limit if limit is not None else env.get(env.DATA_CACHE_LIMIT)
    return Cache(cache_dir, parse_size(limit) if limit is not None else None)


class CachedFiles:
    """The objects of ``url`` through the node's data cache; see the module docstring.

    ``refresh=True`` lists the source again (noticing changed, new and removed
    objects) instead of using the stored listing. ``workers``: fetches at once
    for :meth:`prefetch`. ``remote`` and ``providers`` are given by the code
    that knows dash-memd and the peers (:mod:`dashrun.data.peers`); by default
    they come from the environment dashrun gives its ranks (``DASH_MEMD``).
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike | None = None, limit: int | str | None = None,
                 refresh: bool = False, workers: int = 8, remote: StoredListings | None = None,
                 providers: list[tuple[str, Provider]] | None = None, _listing: Listing | None = None):
        self.url = normal_url(url)
        self.cache = cache_from_env(cache_dir, limit)
        self.workers = workers
        self._source: Source | None = None
        self._source_lock = threading.Lock()
        self._owns_remote = remote is None and providers is None
        if self._owns_remote:
            from dashrun.data import peers

            remote, providers = peers.from_env(self.cache)
        self._remote = remote
        self._providers = list(providers or [])
        self.listing = _listing or load(self.url, self.cache, self.source, remote, refresh)
        self._pins: dict[str, Pinned] = {}
        self._pins_lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        #: Objects this object cached, by where they came from ("source", "peer", "dash-memd").
        self.fetched: dict[str, int] = {}

    # --- the listing ------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every object's key, sorted."""
        return self.listing.keys()

    def info(self, key: str) -> ObjectInfo:
        return self.listing.get(key)

    def __len__(self) -> int:
        return len(self.listing.objects)

    # --- reading ----------------------------------------------------------------------------

    def source(self) -> Source:
        with self._source_lock:
            if self._source is None:
                self._source = open_source(self.url)
            return self._source

    def local_path(self, key: str) -> str:
        """A local file holding ``key``'s verified bytes, fetched first if this node does not hold it."""
        with self._pins_lock:
            pinned = self._pins.get(key)
        if pinned is not None and self.cache.entry(pinned.entry.ident) is not None:
            return str(pinned.path)
        return str(self._fetch(key).path)

    def _fetch(self, key: str) -> Pinned:
        info = self.listing.get(key)
        ident = info.identity(self.url)
        pinned = self.cache.pin(ident)
        if pinned is None:
            pinned = self._fill(ident, info)
        with self._pins_lock:
            old = self._pins.pop(key, None)
            self._pins[key] = pinned
        if old is not None:
            old.release()
        return pinned

    def _fill(self, ident: str, info: ObjectInfo) -> Pinned:
        """Cache ``info`` from the first place that has it; an offer of the copy to a peer if it came from the
        source (so the fleet holds two)."""
        candidates = [*self._providers, ("source", lambda _ident, i, _url: self.source().read(i))]
        for n, (name, provider) in enumerate(candidates):
            used = []

            def produce(provider=provider, name=name):
                produced = provider(ident, info, self.url)
                if produced is None:
                    raise _NotThere(name)
                used.append(name)
                return produced

            try:
                pinned = self.cache.get(ident, self.url, info.key, info.size, produce)
            except _NotThere:
                continue
            except (UnavailableError, ChecksumError, NotFoundError) as e:
                if n == len(candidates) - 1:
                    raise
                log.info("%s of %s did not come from %s: %s", info.key, self.url, name, e)
                continue
            if used:
                with self._pins_lock:
                    self.fetched[name] = self.fetched.get(name, 0) + 1
                if name == "source":
                    for _name, provider in self._providers:
                        offer = getattr(provider, "offer", None)
                        if offer is not None:
                            offer(self.url, info, pinned.path, pinned.entry.sha256)
            return pinned
        raise AssertionError("unreachable: the source is the last candidate")

    def prefetch(self, keys: Iterable[str]) -> list[cf.Future]:
        """Start fetching ``keys`` in the background (``workers`` at a time); a future per key, whose result is
        its local path."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="dash-data")
        return [self._pool.submit(self.local_path, key) for key in keys]

    def release(self, key: str | None = None) -> None:
        """Unpin ``key`` (or every key): its path may be evicted from now on."""
        with self._pins_lock:
            gone = [self._pins.pop(key)] if key in self._pins else [] if key is not None else list(self._pins.values())
            if key is None:
                self._pins.clear()
        for pinned in gone:
            pinned.release()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.release()
        for _name, provider in self._providers:
            if hasattr(provider, "flush"):
                provider.flush()
        if self._source is not None:
            self._source.close()
            self._source = None
        if self._owns_remote:  # the links from_env made: dash-memd's, the peers'
            for closable in {id(p): p for p in (self._remote, *(p for _name, p in self._providers))}.values():
                if hasattr(closable, "close"):
                    closable.close()

    def __enter__(self) -> CachedFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dataset(self):
        """A ``torch.utils.data.Dataset`` of ``(key, local path)``, in the order of :meth:`keys`."""
        from dashrun.data.torch_dataset import CachedDataset

        return CachedDataset(self)

    # --- pickling, for a DataLoader's workers -----------------------------------------------

    def __getstate__(self) -> dict:
        return {"url": self.url, "root": str(self.cache.root), "limit": self.cache.limit_given,
                "workers": self.workers, "listing": self.listing.to_text()}

    def __setstate__(self, state: dict) -> None:  # noqa: D105
        listing = Listing.from_text(state["listing"], state["url"])
        self.__init__(state["url"], cache_dir=state["root"], limit=state["limit"], workers=state["workers"],
                      _listing=listing)


class _NotThere(Exception):
    """A provider does not hold the object: the next one is asked."""
