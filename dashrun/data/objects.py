"""A data cache served to others: dash-memd's (``--data-cache``) and each node's, by its dash-agent on the peer link.

Two requests, the same on both links (:class:`ObjectServer`); the client's
side is :meth:`dashrun.wire.link.Link.data_object` and
:meth:`~dashrun.wire.link.Link.put_data_object`:

- ``DATA_OBJECT_GET`` {url, object: its listed ObjectInfo}: OK {found,
  sha256} with the bytes as data; the reader checks them again (SHA-256, and
  the ETag's MD5 or the manifest's SHA-256 where the listing has one:
  :func:`~dashrun.data.sources.expected_of`).
- ``DATA_OBJECT_PUT`` {url, object, sha256}: OK {accept: false} when held,
  too large or beyond the cache's limit, else OK {accept: true}; then the
  bytes as ``DATA_OBJECT_BYTES``' data, answered OK once they hash to the
  announced SHA-256 and to what the listing fixes.
- ``DATA_STATUS`` {url or none}: OK with :func:`summary` of the cache, what
  ``dashrun data status --job`` shows of each node.

The entry's id is computed here from the object's listed identity, never
taken from the peer, and every field is bounded before use. Objects above
:data:`MAX_OBJECT` are neither served nor taken (each is held whole in
memory on its way).
"""

from __future__ import annotations

from typing import Any, Callable

from dashrun.data.cache import Cache
from dashrun.data.sources import MAX_SHARED_OBJECT as MAX_OBJECT
from dashrun.data.sources import ObjectInfo, expected_of
from dashrun.errors import ProtocolError
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind, field_str

__all__ = ["MAX_OBJECT", "MAX_SOURCES", "MAX_URL", "ObjectServer", "check_summary", "object_request", "summary"]

#: The longest source URL accepted.
MAX_URL = 2048
#: Sources a summary lists at most (the most recently cached... any beyond are counted in its totals only).
MAX_SOURCES = 256


def object_request(body: dict) -> tuple[str, ObjectInfo]:
    """The URL and the object of a DATA_OBJECT_* body, every field checked."""
    url = field_str(body, "url", MAX_URL)
    return url, ObjectInfo.from_json(body.get("object"))


def summary(cache: Cache, url: str | None = None) -> dict[str, Any]:
    """What ``cache`` holds, per source (of ``url`` alone, if given): {cache, limit_bytes, used_bytes, sources:
    [{url, objects, bytes, and listed_objects, listed_bytes where the source's listing is stored}]}."""
    from dashrun.data.listings import Listing
    from dashrun.errors import DashError

    sources: dict[str, dict] = {}
    for entry in cache.entries():
        if url is None or entry.url == url:
            held = sources.setdefault(entry.url, {"url": entry.url, "objects": 0, "bytes": 0})
            held["objects"] += 1
            held["bytes"] += entry.size
    for held in sources.values():
        text = cache.stored_listing(held["url"])
        try:
            listing = Listing.from_text(text, held["url"]) if text is not None else None
        except DashError:
            listing = None
        if listing is not None:
            held["listed_objects"], held["listed_bytes"] = len(listing.objects), listing.nbytes
    return {"cache": str(cache.root), "limit_bytes": cache.limit, "used_bytes": cache.usage(),
            "sources": sorted(sources.values(), key=lambda s: s["url"])[:MAX_SOURCES]}


def check_summary(body: Any) -> dict[str, Any]:
    """A :func:`summary` as a peer sent it, every field checked (ProtocolError otherwise)."""
    from dashrun.wire.protocol import field_int

    if not isinstance(body, dict) or not isinstance(body.get("sources"), list) or \
            len(body["sources"]) > MAX_SOURCES:
        raise ProtocolError("a data cache's summary must be an object listing its sources")
    checked = {"cache": field_str(body, "cache", 4096), "limit_bytes": field_int(body, "limit_bytes", 0, 1 << 62),
               "used_bytes": field_int(body, "used_bytes", 0, 1 << 62), "sources": []}
    for held in body["sources"]:
        if not isinstance(held, dict):
            raise ProtocolError("a source of a data cache's summary must be an object")
        one = {"url": field_str(held, "url", MAX_URL), "objects": field_int(held, "objects", 0, 1 << 40),
               "bytes": field_int(held, "bytes", 0, 1 << 62)}
        if held.get("listed_objects") is not None:
            one["listed_objects"] = field_int(held, "listed_objects", 0, 1 << 40)
            one["listed_bytes"] = field_int(held, "listed_bytes", 0, 1 << 62)
        checked["sources"].append(one)
    return checked


class ObjectServer:
    """``cache``'s objects for whoever the link logged in (dash-memd: the cluster; an agent: its job's nodes).
    ``cache`` may be a function that makes it on the first request (a node's cache is made only if asked)."""

    def __init__(self, cache: Cache | Callable[[], Cache]):
        self._cache = cache
        #: Objects served and taken, for the tests and the logs.
        self.served = {"get": 0, "put": 0}

    @property
    def cache(self) -> Cache:
        if not isinstance(self._cache, Cache):
            self._cache = self._cache()
        return self._cache

    def handlers(self) -> dict[Kind, Callable[[Channel, Frame], None]]:
        return {Kind.DATA_OBJECT_GET: self.get, Kind.DATA_OBJECT_PUT: self.put, Kind.DATA_STATUS: self.status}

    def status(self, ch: Channel, frame: Frame) -> None:
        url = field_str(frame.body, "url", MAX_URL) if frame.body.get("url") is not None else None
        ch.send(Kind.OK, summary(self.cache, url))

    def get(self, ch: Channel, frame: Frame) -> None:
        url, info = object_request(frame.body)
        pinned = self.cache.pin(info.identity(url)) if info.size <= MAX_OBJECT else None
        if pinned is None:
            ch.send(Kind.OK, {"found": False})
            return
        try:
            data = pinned.path.read_bytes()
        finally:
            pinned.release()
        self.served["get"] += 1
        ch.send(Kind.OK, {"found": True, "sha256": pinned.entry.sha256}, data=[data])

    def put(self, ch: Channel, frame: Frame) -> None:
        url, info = object_request(frame.body)
        sha256 = field_str(frame.body, "sha256", 64)
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ProtocolError("field 'sha256' must be 64 lowercase hex digits")
        ident, cache = info.identity(url), self.cache
        if info.size > min(MAX_OBJECT, cache.limit) or cache.entry(ident) is not None:
            ch.send(Kind.OK, {"accept": False})
            return
        ch.send(Kind.OK, {"accept": True})
        data = ch.recv(max_data=info.size)
        if data.kind != Kind.DATA_OBJECT_BYTES or data.data_len != info.size:
            raise ProtocolError("expected the offered object's bytes")
        body = ch.recv_data(data)
        expected = expected_of(info, sha256)
        cache.get(ident, url, info.key, info.size, lambda: (expected, iter([body]))).release()
        self.served["put"] += 1
        ch.send(Kind.OK)
