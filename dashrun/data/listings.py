"""A source's listing: listed once, kept (in the node's cache, and in dash-memd for the whole cluster), reused.

``keys()`` must give the same answer on every rank, whether the source can be
reached or not, and a new node must list a source whose bucket is down. So a
listing, once made, is stored, and read back before the source is asked:

1. unless ``refresh``: dash-memd's copy (keyed by the source's URL, shared by
   every job of the cluster), then this node's copy (``listings/`` of the cache);
2. else, or when neither has it: the source itself, and the result stored in both.

A refresh is how a change in the source is noticed: the new listing carries
the new identities, and the entries of the old ones are simply not used again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from dashrun.data.cache import Cache
from dashrun.data.sources import ObjectInfo, Source
from dashrun.errors import DashError, NotFoundError, ProtocolError, UnavailableError
from dashrun.util.boundedjson import loads_bounded

__all__ = ["MAX_LISTING", "Listing", "StoredListings", "load"]

log = logging.getLogger(__name__)

#: The largest listing accepted (bytes of JSON): about a million objects.
MAX_LISTING = 256 << 20


@dataclass(frozen=True)
class Listing:
    url: str
    objects: tuple[ObjectInfo, ...]

    def __post_init__(self):
        object.__setattr__(self, "_by_key", {info.key: info for info in self.objects})

    def keys(self) -> list[str]:
        return [info.key for info in self.objects]

    def get(self, key: str) -> ObjectInfo:
        try:
            return self._by_key[key]
        except KeyError:
            raise NotFoundError(f"{key!r} is not in the listing of {self.url}",
                                hint="keys() gives the keys; refresh=True lists the source again") from None

    @property
    def nbytes(self) -> int:
        return sum(info.size for info in self.objects)

    def to_text(self) -> str:
        import json

        return json.dumps({"url": self.url, "objects": [info.to_json() for info in self.objects]},
                          separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str | bytes, url: str) -> Listing:
        if len(text) > MAX_LISTING:
            raise ProtocolError(f"the stored listing of {url} is larger than {MAX_LISTING} bytes")
        try:
            body = loads_bounded(text)
        except ValueError as e:
            raise ProtocolError(f"the stored listing of {url} is not JSON: {e}") from None
        if not isinstance(body, dict) or body.get("url") != url or not isinstance(body.get("objects"), list):
            raise ProtocolError(f"the stored listing of {url} is not one")
        objects = tuple(ObjectInfo.from_json(o) for o in body["objects"])
        if len({info.key for info in objects}) != len(objects):
            raise ProtocolError(f"the stored listing of {url} names a key twice")
        return cls(url, objects)


class StoredListings:
    """Where listings are kept beyond this node: ``get(url) -> text | None`` and ``put(url, text)``
    (dash-memd's store, :mod:`dashrun.data.memd`)."""

    def get(self, url: str) -> str | None:
        raise NotImplementedError

    def put(self, url: str, text: str) -> None:
        raise NotImplementedError


def load(url: str, cache: Cache, source: Callable[[], Source], remote: StoredListings | None = None,
         refresh: bool = False) -> Listing:
    """The listing of ``url``; see the module docstring for where it comes from."""
    if not refresh:
        for where, read in (("dash-memd", remote.get if remote else None), ("this node", cache.stored_listing)):
            if read is None:
                continue
            try:
                text = read(url)
            except DashError as e:  # dash-memd unreachable: this node's copy, or the source, will do
                log.warning("the listing of %s could not be read from %s: %s", url, where, e)
                continue
            if text is not None:
                listing = Listing.from_text(text, url)
                if where == "dash-memd":
                    cache.store_listing(url, text)
                elif remote is not None:
                    _put(remote, url, text)
                return listing
    try:
        objects = source().list()
    except UnavailableError as e:
        raise UnavailableError(f"{e.message}; and no listing of it is stored"
                               if not refresh else e.message, hint=e.hint) from None
    listing = Listing(url, tuple(objects))
    text = listing.to_text()
    cache.store_listing(url, text)
    if remote is not None:
        _put(remote, url, text)
    return listing


def _put(remote: StoredListings, url: str, text: str) -> None:
    try:
        remote.put(url, text)
    except DashError as e:
        log.warning("the listing of %s could not be stored in dash-memd: %s", url, e)
