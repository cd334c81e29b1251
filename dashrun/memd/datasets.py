"""dash-memd's side of the data cache: each data source's listing, kept for every job of the cluster.

A listing (:class:`dashrun.data.listings.Listing` as JSON) is stored under
``<data dir>/datasets/listings/<sha256 of the URL>.json``, atomically, and
read back from disk at each request (listings change rarely and are read
once per job and node). A new job on a new node gets the listing of a source
whose bucket is down from here. Any logged-in connection may read and store
one: a listing belongs to the cluster, not to a job. What it names is checked
where it is used (an S3 GET names the listed ETag; bytes are checked against
the source's checksums), and a listing is refused unless it is one, of the
URL it is stored under, within :data:`~dashrun.data.listings.MAX_LISTING` bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

from dashrun.data.listings import MAX_LISTING, Listing
from dashrun.errors import ProtocolError
from dashrun.util.files import write_atomic
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.protocol import Kind, field_int, field_str

__all__ = ["MAX_URL", "DataListings"]

#: The longest source URL accepted.
MAX_URL = 2048


class DataListings:
    def __init__(self, data_dir: Path):
        self.root = Path(data_dir) / "datasets" / "listings"

    def handlers(self) -> dict[Kind, Callable[[Channel, Frame], None]]:
        return {Kind.DATA_LISTING_GET: self._get, Kind.DATA_LISTING_PUT: self._put}

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
