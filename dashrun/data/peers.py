"""Where else than the source a node's data set comes from: the job's other nodes, dash-memd's data cache.

:func:`from_env` gives a :class:`~dashrun.data.files.CachedFiles` what the
environment dashrun gives its ranks (``DASH_MEMD``, ``DASH_TOKEN_FILE``,
``DASH_JOB_ID``, TLS settings) makes reachable, in the order they are asked:

- ``"peer"``, :class:`PeerData`: the data caches of the job's other nodes,
  which their dash-agents serve on the peer link (TLS, the login with the
  job's credential: :mod:`dashrun.agent.peers.server`), found in dash-memd's
  fleet view (each node's agent announces where it listens). An object is
  asked of the nodes in an order fixed by a hash of the object and the node
  (rendezvous hashing), so the reads of a refilling node spread over its
  peers; :meth:`PeerData.offer` gives the first node of that order that has
  room a second copy of what this node fetched from the source, so losing a
  node loses no object from the fleet.
- ``"dash-memd"``, :class:`MemdListings`: dash-memd's store of listings and,
  where it was started with ``--data-cache``, its objects
  (:meth:`MemdListings.offer` hands it a copy of what came from the source).

Called with an object, a provider answers its copy or None. Without
dash-memd: nothing (the node's own cache and the source). Every byte crosses
a logged-in, encrypted link and is checked again as it is cached.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import logging
import socket
import threading
import time
from typing import Callable, Iterator

from dashrun import env
from dashrun.data.listings import MAX_LISTING, StoredListings
from dashrun.data.sources import MAX_SHARED_OBJECT, Expected, ObjectInfo, expected_of
from dashrun.errors import DashError, UnavailableError

__all__ = ["MAX_PEERS_ASKED", "MemdListings", "PeerData", "from_env"]

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

    def members(self, job: str) -> list[Peer]:
        """``job``'s nodes whose agents listen for the others, as dash-memd's fleet view lists them."""
        return [(view.node, view.host, view.port) for view in self._memd().fleet_view(job)[2] if view.port]

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


#: The job's other nodes an object is asked of at most (each a round trip when it holds none).
MAX_PEERS_ASKED = 8
#: Seconds the job's nodes, as dash-memd's fleet view lists them, are used before they are asked for again.
MEMBERS_TTL = 5.0
#: Seconds a node that could not be reached is not asked again (dash-memd lists a vanished node that long).
UNREACHABLE_FOR = 10.0

Peer = tuple[str, str, int]  # (node, host, port)


class PeerData:
    """The data caches of ``job``'s other nodes: ``members()`` lists them (this node, ``node``, left out),
    ``connect(peer)`` makes a client of one's agent (a :class:`dashrun.wire.peer_client.PeerClient`)."""

    def __init__(self, members: Callable[[], list[Peer]], connect: Callable[[Peer], object], node: str):
        self._members, self._connect, self.node = members, connect, node
        self._known: tuple[float, list[Peer]] | None = None
        self._unreachable: dict[Peer, float] = {}  # peer -> until when it is not asked
        self._local = threading.local()  # per thread: {peer: client}, as MemdListings
        self._clients: list = []
        self._lock = threading.Lock()
        self._offers: cf.ThreadPoolExecutor | None = None
        #: Objects a peer took a second copy of.
        self.offered = 0

    def order(self, ident: str) -> list[Peer]:
        """The other nodes, in the order ``ident`` is asked of them (at most :data:`MAX_PEERS_ASKED`)."""
        now = time.monotonic()
        with self._lock:
            known = self._known
        if known is None or now - known[0] > MEMBERS_TTL:
            try:
                peers = [p for p in self._members() if p[0] != self.node and p[2]]
            except (DashError, OSError) as e:
                log.info("the job's nodes are not known (%s): their data caches are not asked", e)
                peers = []
            with self._lock:
                self._known = known = (now, peers)
        with self._lock:
            reachable = [p for p in known[1] if self._unreachable.get(p, 0.0) <= now]
        return sorted(reachable, key=lambda p: hashlib.sha256(f"{ident}\0{p[0]}".encode()).digest())[:MAX_PEERS_ASKED]

    def _failed(self, peer: Peer, e: Exception) -> None:
        """``peer`` did not answer: a node just gone (a preemption) costs each object one connect timeout only
        until it is left out."""
        if isinstance(e, (UnavailableError, OSError)):
            with self._lock:
                self._unreachable[peer] = time.monotonic() + UNREACHABLE_FOR

    def _client(self, peer: Peer):
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        client = clients.get(peer)
        if client is None:
            client = clients[peer] = self._connect(peer)
            with self._lock:
                self._clients.append(client)
        return client

    def __call__(self, ident: str, info: ObjectInfo, url: str) -> tuple[Expected, Iterator[bytes]] | None:
        if info.size > MAX_SHARED_OBJECT:
            return None
        for peer in self.order(ident):
            try:
                held = self._client(peer).data_object(url, info.to_json(), info.size)
            except (DashError, OSError) as e:  # that node is gone or refuses: the next is asked
                log.debug("%s of %s not read from node %s: %s", info.key, url, peer[0], e)
                self._failed(peer, e)
                continue
            if held is not None:
                sha256, data = held
                return expected_of(info, sha256), iter([data])
        return None

    def offer(self, url: str, info: ObjectInfo, path, sha256: str) -> None:
        """Give the first node of ``info``'s order that has room a copy of ``path``, in the background."""
        if info.size > MAX_SHARED_OBJECT:
            return
        with self._lock:
            if self._offers is None:
                self._offers = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dash-data-peer-offer")
            self._offers.submit(self._offer, url, info, path, sha256)

    def _offer(self, url: str, info: ObjectInfo, path, sha256: str) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            log.info("%s of %s was not offered to a peer: %s", info.key, url, e)
            return
        for peer in self.order(info.identity(url)):
            try:
                if self._client(peer).put_data_object(url, info.to_json(), sha256, data):
                    self.offered += 1
                    return
            except (DashError, OSError) as e:
                log.debug("%s of %s not offered to node %s: %s", info.key, url, peer[0], e)
                self._failed(peer, e)
            # held there already, no room, or gone: the next node is asked

    def flush(self) -> None:
        """Wait until every offer made so far is done."""
        with self._lock:
            offers, self._offers = self._offers, None
        if offers is not None:
            offers.shutdown(wait=True)

    def close(self) -> None:
        self.flush()
        with self._lock:
            clients, self._clients = self._clients, []
            self._local = threading.local()
        for client in clients:
            client.close()


def from_env(cache) -> tuple[StoredListings | None, list]:
    from dashrun.wire.memd_client import memd_from_env
    from dashrun.wire.peer_client import peers_from_env

    connect = memd_from_env()
    if connect is None:
        return None, []
    memd = MemdListings(connect)
    providers: list = [("dash-memd", memd)]
    job = env.get(env.JOB_ID)
    peer_connect = peers_from_env(job) if job else None
    if peer_connect is not None:  # this node's name as its agent announces it (dash-agent --node)
        node = env.get(env.NODE) or socket.gethostname()
        providers.insert(0, ("peer", PeerData(lambda: memd.members(job), peer_connect, node)))
    return memd, providers
