"""Where else than the source a node's data set comes from: dash-memd's stored listings and its data cache.

:func:`from_env` gives a :class:`~dashrun.data.files.CachedFiles` what the
environment dashrun gives its ranks (``DASH_MEMD``, ``DASH_TOKEN_FILE``, TLS
settings) makes reachable: :class:`MemdListings`, dash-memd's store of
listings and, where it was started with ``--data-cache``, its objects
(``MemdListings`` is also the provider named ``"dash-memd"``: called with an
object, it answers dash-memd's copy or None; :meth:`MemdListings.offer` hands
it, in the background, a copy of what this node fetched from the source).
Without dash-memd: nothing (the node's own cache and the source). Every byte
crosses the logged-in, encrypted link to dash-memd (:mod:`dashrun.wire.link`).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from typing import Callable, Iterator

from dashrun.data.listings import MAX_LISTING, StoredListings
from dashrun.data.sources import MAX_SHARED_OBJECT, Expected, ObjectInfo, expected_of
from dashrun.errors import DashError

__all__ = ["MemdListings", "from_env"]

log = logging.getLogger(__name__)


class MemdListings(StoredListings):
    """The listings (and objects) dash-memd keeps for the cluster, through clients made by ``connect``: one per
    thread that asks, so that a DataLoader's or prefetch's readers do not wait on each other's requests."""

    def __init__(self, connect: Callable[[], object]):
        self._connect = connect
        self._local = threading.local()
        self._clients: list = []
        self._lock = threading.Lock()
        self._offers: cf.ThreadPoolExecutor | None = None
        #: Objects offered to dash-memd that it took.
        self.offered = 0

    def _memd(self):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._connect()
            with self._lock:
                self._clients.append(client)
        return client

    def get(self, url: str) -> str | None:
        raw = self._memd().data_listing(url, MAX_LISTING)
        return None if raw is None else raw.decode("utf-8", "replace")

    def put(self, url: str, text: str) -> None:
        self._memd().put_data_listing(url, text.encode())

    def __call__(self, ident: str, info: ObjectInfo, url: str) -> tuple[Expected, Iterator[bytes]] | None:
        held = self._memd().data_object(url, info.to_json(), info.size)
        if held is None:
            return None
        sha256, data = held
        return expected_of(info, sha256), iter([data])

    def offer(self, url: str, info: ObjectInfo, path, sha256: str) -> None:
        """Hand dash-memd a copy of ``path`` (the cached ``info``), in the background; a failure is logged."""
        if info.size > MAX_SHARED_OBJECT:
            return
        with self._lock:
            if self._offers is None:
                self._offers = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dash-data-offer")
            self._offers.submit(self._offer, url, info, path, sha256)

    def _offer(self, url: str, info: ObjectInfo, path, sha256: str) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read()
            if self._memd().put_data_object(url, info.to_json(), sha256, data):
                self.offered += 1
        except (DashError, OSError) as e:
            log.info("%s of %s was not handed to dash-memd's data cache: %s", info.key, url, e)

    def flush(self) -> None:
        """Wait until every offer made so far is done."""
        with self._lock:
            offers, self._offers = self._offers, None
        if offers is not None:
            offers.shutdown(wait=True)

    def close(self) -> None:
        self.flush()  # the offers under way are finished first
        with self._lock:
            clients, self._clients = self._clients, []
            self._local = threading.local()
        for client in clients:
            client.close()


def from_env(cache) -> tuple[StoredListings | None, list]:
    from dashrun.wire.memd_client import memd_from_env

    connect = memd_from_env()
    if connect is None:
        return None, []
    memd = MemdListings(connect)
    return memd, [("dash-memd", memd)]
