"""Where else than the source a node's data set comes from: dash-memd (the stored listings) and the job's peers.

:func:`from_env` gives a :class:`~dashrun.data.files.CachedFiles` what the
environment dashrun gives its ranks (``DASH_MEMD``, ``DASH_TOKEN_FILE``, TLS
settings) makes reachable: dash-memd's store of listings; without dash-memd,
nothing (the node's own cache and the source).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from dashrun.data.listings import MAX_LISTING, StoredListings

__all__ = ["MemdListings", "from_env"]

log = logging.getLogger(__name__)


class MemdListings(StoredListings):
    """The listings dash-memd keeps for the cluster, through one client made on first use by ``connect``."""

    def __init__(self, connect: Callable[[], object]):
        self._connect = connect
        self._client = None
        self._lock = threading.Lock()

    def _memd(self):
        with self._lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    def get(self, url: str) -> str | None:
        raw = self._memd().data_listing(url, MAX_LISTING)
        return None if raw is None else raw.decode("utf-8", "replace")

    def put(self, url: str, text: str) -> None:
        self._memd().put_data_listing(url, text.encode())

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def from_env(cache) -> tuple[StoredListings | None, list]:
    from dashrun.wire.memd_client import memd_from_env

    connect = memd_from_env()
    return (MemdListings(connect) if connect is not None else None), []
