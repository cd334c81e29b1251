"""dash-memd's side of the data cache: each data source's listing, kept for every job of the cluster, and, with
``--data-cache DIR``, a cache of the objects behind the nodes'.

A listing (:class:`dashrun.data.listings.Listing` as JSON) is stored under
``<data dir>/datasets/listings/<sha256 of the URL>.json``, atomically, and
read back from disk at each request (listings change rarely and are read
once per job and node). A new job on a new node gets the listing of a source
whose bucket is down from here. Any logged-in connection may read and store
one: a listing belongs to the cluster, not to a job. What it names is checked
where it is used (an S3 GET names the listed ETag; bytes are checked against
the source's checksums), and a listing is refused unless it is one, of the
URL it is stored under, within :data:`~dashrun.data.listings.MAX_LISTING` bytes.

The object cache is a :class:`dashrun.data.cache.Cache` (the nodes' format and
rules: verified entries, LRU within its limit). It fills from the nodes: a
node that fetched an object from its source offers it (``DATA_OBJECT_PUT``
{url, object: its listed ObjectInfo, sha256}; OK {accept: false} when held or
too large, else OK {accept: true}, then the bytes as ``DATA_OBJECT_BYTES``'
data, answered OK once they hash to the announced SHA-256 and, where the
object's ETag is a plain MD5, to that). The entry's id is computed here from
the object's listed identity, never taken from the peer. ``DATA_OBJECT_GET``
{url, object} answers OK {found, sha256} with the bytes as data; the reader
checks them again (SHA-256, and the ETag's MD5 where there is one).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from dashrun.data.cache import Cache
from dashrun.data.listings import MAX_LISTING, Listing
from dashrun.data.sources import MAX_SHARED_OBJECT as MAX_OBJECT
from dashrun.data.sources import ObjectInfo, expected_of
from dashrun.errors import ProtocolError
from dashrun.util.files import write_atomic
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind, field_int, field_str

__all__ = ["MAX_OBJECT", "MAX_URL", "DataListings", "object_request"]

#: The longest source URL accepted.
MAX_URL = 2048


def object_request(body: dict) -> tuple[str, ObjectInfo]:
    """The URL and the object of a DATA_OBJECT_* body, every field checked."""
    url = field_str(body, "url", MAX_URL)
    return url, ObjectInfo.from_json(body.get("object"))


class DataListings:
    def __init__(self, data_dir: Path, cache_dir: Path | None = None, cache_limit: int | None = None):
        self.root = Path(data_dir) / "datasets" / "listings"
        self.cache = Cache(cache_dir, cache_limit) if cache_dir is not None else None

    def handlers(self) -> dict[Kind, Callable[[Channel, Frame], None]]:
        return {Kind.DATA_LISTING_GET: self._get, Kind.DATA_LISTING_PUT: self._put,
                Kind.DATA_OBJECT_GET: self._object_get, Kind.DATA_OBJECT_PUT: self._object_put}

    def _object_get(self, ch: Channel, frame: Frame) -> None:
        url, info = object_request(frame.body)
        held = self.cache is not None and info.size <= MAX_OBJECT
        pinned = self.cache.pin(info.identity(url)) if held else None
        if pinned is None:
            ch.send(Kind.OK, {"found": False})
            return
        try:
            data = pinned.path.read_bytes()
        finally:
            pinned.release()
        ch.send(Kind.OK, {"found": True, "sha256": pinned.entry.sha256}, data=[data])

    def _object_put(self, ch: Channel, frame: Frame) -> None:
        url, info = object_request(frame.body)
        sha256 = field_str(frame.body, "sha256", 64)
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ProtocolError("field 'sha256' must be 64 lowercase hex digits")
        ident = info.identity(url)
        if self.cache is None or info.size > MAX_OBJECT or self.cache.entry(ident) is not None:
            ch.send(Kind.OK, {"accept": False})
            return
        ch.send(Kind.OK, {"accept": True})
        data = ch.recv(max_data=info.size)
        if data.kind != Kind.DATA_OBJECT_BYTES or data.data_len != info.size:
            raise ProtocolError("expected the offered object's bytes")
        body = ch.recv_data(data)
        expected = expected_of(info, sha256)
        self.cache.get(ident, url, info.key, info.size, lambda: (expected, iter([body])))
        ch.send(Kind.OK)

    def path(self, url: str) -> Path:
        return self.root / (hashlib.sha256(url.encode()).hexdigest() + ".json")

    def _get(self, ch: Channel, frame: Frame) -> None:
        url = field_str(frame.body, "url", MAX_URL)
        try:
            text = self.path(url).read_bytes()
        except FileNotFoundError:
            ch.send(Kind.OK, {"found": False})
            return
        ch.send(Kind.OK, {"found": True}, data=[text])

    def _put(self, ch: Channel, frame: Frame) -> None:
        url = field_str(frame.body, "url", MAX_URL)
        nbytes = field_int(frame.body, "nbytes", 2, MAX_LISTING)
        ch.send(Kind.OK)
        data = ch.recv(max_data=nbytes)
        if data.kind != Kind.DATA_LISTING_BYTES or data.data_len != nbytes:
            raise ProtocolError("expected the announced listing's bytes")
        text = ch.recv_data(data)
        Listing.from_text(text, url)  # a listing of this URL, or ProtocolError, before anything is stored
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path(url), text, 0o600)
        ch.send(Kind.OK)
