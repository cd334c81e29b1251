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
rules: verified entries, LRU within its limit), served as each node's agent
serves its node's (:class:`dashrun.data.objects.ObjectServer`:
``DATA_OBJECT_GET``, ``DATA_OBJECT_PUT``). It fills from the nodes: a node
that fetched an object from its source offers it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from dashrun.data.cache import Cache
from dashrun.data.listings import MAX_LISTING, Listing
from dashrun.data.objects import MAX_OBJECT, MAX_URL, ObjectServer, object_request
from dashrun.errors import ProtocolError
from dashrun.util.files import write_atomic
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind, field_int, field_str

__all__ = ["MAX_OBJECT", "MAX_URL", "DataListings", "object_request"]

class DataListings:
    def __init__(self, data_dir: Path, cache_dir: Path | None = None, cache_limit: int | None = None):
        self.root = Path(data_dir) / "datasets" / "listings"
        self.cache = Cache(cache_dir, cache_limit) if cache_dir is not None else None
        self.objects = ObjectServer(self.cache) if self.cache is not None else None

    def handlers(self) -> dict[Kind, Callable[[Channel, Frame], None]]:
        return {Kind.DATA_LISTING_GET: self._get, Kind.DATA_LISTING_PUT: self._put,
                Kind.DATA_OBJECT_GET: self._object_get, Kind.DATA_OBJECT_PUT: self._object_put}

    def _object_get(self, ch: Channel, frame: Frame) -> None:
        if self.objects is None:  # no --data-cache: it holds none
            object_request(frame.body)
            ch.send(Kind.OK, {"found": False})
        else:
            self.objects.get(ch, frame)

    def _object_put(self, ch: Channel, frame: Frame) -> None:
        if self.objects is None:
            object_request(frame.body)
            ch.send(Kind.OK, {"accept": False})
        else:
            self.objects.put(ch, frame)

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
