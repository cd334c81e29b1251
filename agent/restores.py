"""Restore images: a committed checkpoint fetched once per node into shared memory that every local rank maps.

A node downloads the state once however many ranks it runs: the first
RESTORE of a (job, step) fetches what the node's ranks need (every slice of
the replicated state, and their own private parts; see
:func:`dashrun.wire.planner.wanted`) through the source planner into a new
memfd segment laid out as :mod:`dashrun.wire.layout` says, and the node's
other ranks are handed descriptors of the same segment; a rank whose private
part is not in it yet has it fetched into place first. The only rank of a
node may instead read the replicated state itself (``direct``), from the
peers that hold it or from dash-memd, where this agent's store does not hold
it, straight into the tensors it has (:mod:`dashrun.rank.direct`): the image then
holds the tails alone, and no fresh memory the size of the state is written
first. When the agent
starts for a job it fetches the job's newest checkpoint at once
(:meth:`RestoreCache.prefetch`), while the ranks are still starting, so that
their ``restore()`` finds it on this node. The agent drops its own descriptor
once every local rank has one, or after ``restore_ttl`` seconds. A rank being
served holds a :class:`Lease`, a descriptor of its own, so the cache dropping
the image meanwhile never closes (or lets the system reuse) what is being sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import threading
import time
from typing import Callable, Collection, Iterator

from dashrun.agent.config import AgentConfig
from dashrun.wire.peer_client import PeerClient
from dashrun.agent.peers.store import Store
from dashrun.errors import ChecksumError, DashError, NotFoundError, UnavailableError
from dashrun.util.files import unmap
from dashrun.wire import layout
from dashrun.wire.holdings import ANNOUNCE_PERIOD, Holder, Located
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo
from dashrun.wire.planner import (
    Extent,
    HeldSource,
    MemdSource,
    NodeCopy,
    Peer,
    PeerSource,
    Planner,
    Source,
    pieces,
    replicated_span,
    wanted,
    widen_once,
)

__all__ = ["CORRUPT_FALLBACKS", "ClientPool", "Lease", "RestoreCache", "RestoreImage"]

log = logging.getLogger(__name__)

#: Corrupt newest checkpoints a restore skips before it gives up.
CORRUPT_FALLBACKS = 5

#: Seconds a connection to dash-memd may wait idle in the pool for the next restore.
IDLE_CLIENT = 30.0

#: dash-memd's answers (a checkpoint's holders) a restore cache remembers, the newest.
KEEP_LOCATED = 16

#: Bytes of a restore image given memory at a time ahead of the streams that fill it.
ALLOCATE_STEP = 8 << 20


@dataclasses.dataclass
class RestoreImage:
    """A committed checkpoint laid out for ranks: the replicated state, then each shard's tail."""

    info: CheckpointInfo
    fd: int
    tails: list[int]  # offset of each old rank's private bytes + meta in the image
    created: float = dataclasses.field(default_factory=time.monotonic)
    handed_out: int = 0  # ranks that received a descriptor of it
    held: set[Extent] = dataclasses.field(default_factory=set)  # the byte ranges in it

    @property
    def has_replicated(self) -> bool:
        """Whether the replicated state is in it (not left to a rank that reads it directly)."""
        return all(e in self.held for e in replicated_span(self.info, 0, self.info.rep_total))


@dataclasses.dataclass
class Lease:
    """One caller's own descriptor of a restore image, open until the caller closes it."""

    image: RestoreImage
    fd: int

    @property
    def info(self) -> CheckpointInfo:
        return self.image.info

    @property
    def tails(self) -> list[int]:
        return self.image.tails

    @property
    def direct(self) -> bool:
        """The image leaves the replicated state to the rank (see :mod:`dashrun.rank.direct`)."""
        return not self.image.has_replicated

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClientPool:
    """Logged-in connections to dash-memd kept between restores: a restore opens several at once, and a TLS
    handshake and a login each cost round trips and CPU that a small state's restore would mostly consist of.
    A connection idle for IDLE_CLIENT seconds is closed rather than reused (well before dash-memd's own
    --idle-timeout); one that broke reconnects on its next request (see MemdClient)."""

    def __init__(self, make: Callable[[], MemdClient], most: int):
        self.make, self.most = make, most
        self._idle: list[tuple[MemdClient, float]] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def client(self) -> Iterator[MemdClient]:
        now = time.monotonic()
        with self._lock:
            stale = [c for c, at in self._idle if now - at > IDLE_CLIENT]
            self._idle = [(c, at) for c, at in self._idle if now - at <= IDLE_CLIENT]
            taken = self._idle.pop()[0] if self._idle else None
        if taken is not None and not taken.idle_and_open():
            stale.append(taken)
            taken = None
        for old in stale:
            old.close()
        client = taken or self.make()
        try:
            yield client
        except BaseException:
            client.close()
            raise
        with self._lock:
            if len(self._idle) < self.most:
                self._idle.append((client, time.monotonic()))
                return
        client.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for client, _ in idle:
            client.close()


class RestoreCache:
    """One fetch per (job, step) per node; kept briefly for the other local ranks."""

    def __init__(self, config: AgentConfig, store: Store | None = None,
                 holders: Callable[[CheckpointInfo], dict[int, list[Peer]]] | None = None,
                 peer_connect: Callable[[str, int], PeerClient] | None = None):
        self.config = config
        self.store = store  # this agent's own shards: a source before the network
        self.holders, self.peer_connect = holders, peer_connect  # other agents that hold a checkpoint's shards
        self.clients = ClientPool(config.memd_client, config.restore_streams + 1)
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._images: dict[tuple[str, int], RestoreImage] = {}
        self._located: dict[tuple[str, int, float], Located] = {}  # dash-memd's answers: holders of each checkpoint
        self._waiting = 0  # ranks in get(): a fetch meanwhile is what they wait for (guarded by _lock)

    def get(self, job: str, step: int | None, ranks: Collection[int] | None = None,
            ranges: Collection[tuple[int, int, int]] = (), direct: bool = False) -> Lease | None:
        """The image of a committed checkpoint (the newest, or ``step``); None if the job has none.

        The image holds the replicated state and the private parts of saved rank 0 and of ``ranks``
        (None: of every saved rank), and ``ranges`` of private parts (see
        :func:`dashrun.wire.planner.pieces`). The caller closes the lease once it has sent the descriptor on.
        With ``direct``, the replicated state is left out unless this node holds it already (the lease says).

        A newest checkpoint whose bytes fail their checksum (dash-memd drops
        one that fails in its object tier), or that is gone by the time it is
        read, gives way to the newest one then.
        """
        self.expire()
        with self._lock:
            self._waiting += 1
        try:
            return self._get_newest(job, step, ranks, ranges, direct)
        finally:
            with self._lock:
                self._waiting -= 1

    def _waited_on(self) -> bool:
        with self._lock:
            return self._waiting > 0

    def _get_newest(self, job: str, step: int | None, ranks: Collection[int] | None,
                    ranges: Collection[tuple[int, int, int]] = (), direct: bool = False) -> Lease | None:
        with self.clients.client() as client:
            for attempt in range(1, CORRUPT_FALLBACKS + 1):
                info = self._latest(client, job, step)
                if info is None:
                    return None
                try:
                    return self._get(info, ranks, ranges, direct)
                except (ChecksumError, NotFoundError) as e:  # corrupt, or dropped since LATEST answered
                    if attempt == CORRUPT_FALLBACKS:
                        raise
                    if self._on_fleet_only(info):
                        # Its holders announce every few seconds (after dash-memd restarted, say): ask again then.
                        log.warning("%s step %d is held by the fleet, and no holder of it answered yet (%s); asking "
                                    "dash-memd again in %.0f s", job, info.step, e, ANNOUNCE_PERIOD)
                        time.sleep(ANNOUNCE_PERIOD)
                        continue
                    if step is not None:
                        raise
                    log.error("%s step %d cannot be restored (%s); trying the newest checkpoint before it", job,
                              info.step, e)
        return None

    def _latest(self, client: MemdClient, job: str, step: int | None) -> CheckpointInfo | None:
        """dash-memd's newest committed checkpoint (or ``step``), also one committed on the fleet only, whose
        holders it names (:meth:`_holders_of`); while dash-memd cannot be reached, the newest committed one whose
        every shard this agent's store holds."""
        try:
            located = client.locate(job, step)
        except UnavailableError as e:
            held = self.store.checkpoint(job, step) if self.store is not None else None
            if held is None:
                raise
            log.warning("dash-memd is unreachable (%s): restoring %s step %d from this agent's store", e, job,
                        held.step)
            return held
        if located is None:
            return None
        with self._lock:
            self._located[(job, located.info.step, located.info.committed_at)] = located
            while len(self._located) > KEEP_LOCATED:
                del self._located[next(iter(self._located))]
        return located.info

    def _on_fleet_only(self, info: CheckpointInfo) -> bool:
        """Whether dash-memd answered ``info`` as committed on the fleet, not held whole by itself."""
        with self._lock:
            located = self._located.get((info.job, info.step, info.committed_at))
        return located is not None and not located.in_memd

    def _holders_of(self, info: CheckpointInfo) -> dict[int, list[Peer]]:
        """The other nodes holding each saved rank's shard of ``info``: as dash-memd named them when it answered
        with ``info``, else as the agent's ``holders`` says (tests' --peer)."""
        with self._lock:
            located = self._located.get((info.job, info.step, info.committed_at))
        named = {}
        if located is not None:
            named = {rank: others for rank, found in located.holders.items()
                     if (others := [(h.node, h.host, h.port) for h in found if h.node != self.config.node])}
        return named or (self.holders(info) if self.holders is not None else {})

    def prefetch(self, job: str) -> None:
        """Fetch the job's newest checkpoint now, for the ranks that are about to ask for it."""
        try:
            lease = self._get_newest(job, None, None)  # no rank waits for it yet
        except DashError as e:
            log.warning("could not fetch %s's newest checkpoint ahead of its ranks: %s", job, e)
            return
        if lease is not None:
            lease.close()

    def _get(self, info: CheckpointInfo, ranks: Collection[int] | None,
             ranges: Collection[tuple[int, int, int]] = (), direct: bool = False) -> Lease:
        job = info.job
        # A rank reads the replicated state itself (from peers or dash-memd) unless this node holds it.
        direct = direct and not self._held_here(info)
        with self._lock:
            job_lock = self._fetching.setdefault(job, threading.Lock())
        with job_lock:
            with self._lock:  # expire() and handed_out() close the image's descriptor under this lock
                cached = self._images.get((job, info.step))
                lease = None
                if cached is not None and cached.info.committed_at == info.committed_at:
                    lease = Lease(cached, os.dup(cached.fd))
            if lease is not None:
                try:
                    # ranges this rank needs that no rank of the node needed before
                    self._fill(cached, ranks, ranges, replicated=not direct or cached.has_replicated)
                except BaseException:
                    lease.close()
                    raise
                return lease
            fetched = self._fetch(info, ranks, ranges, replicated=not direct)
            with self._lock:
                old = self._images.pop((job, info.step), None)
                self._images[(job, info.step)] = fetched
                lease = Lease(fetched, os.dup(fetched.fd))
            if old is not None:
                os.close(old.fd)
            return lease

    def _fetch(self, info: CheckpointInfo, ranks: Collection[int] | None,
               ranges: Collection[tuple[int, int, int]] = (), replicated: bool = True) -> RestoreImage:
        tails, size = layout.image_tails(info)
        fd = os.memfd_create(f"dashrun-restore-{info.job}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            fetched = RestoreImage(info, fd, tails)
            self._fill(fetched, ranks, ranges, replicated=replicated)
        except BaseException:
            os.close(fd)
            raise
        return fetched

    def _fill(self, held: RestoreImage, ranks: Collection[int] | None,
              ranges: Collection[tuple[int, int, int]] = (), replicated: bool = True) -> None:
        """Read the ranges of ``held`` that ``ranks`` (and ``ranges``) need and it lacks, through the planner."""
        info = held.info
        missing = [e for e in wanted(info, held.tails, ranks, replicated=replicated) + pieces(info, held.tails, ranges)
                   if e not in held.held]
        if not missing:
            return
        started = time.monotonic()
        planner = Planner(self._sources(held))
        stop = threading.Event()
        allocator = threading.Thread(target=_allocate, args=(held.fd, missing, stop, self._waited_on),
                                     name="restore-allocate", daemon=True)
        allocator.start()
        mapped = mmap.mmap(held.fd, os.fstat(held.fd).st_size)
        try:
            with memoryview(mapped) as view:
                served = planner.read(info, missing, view)
        finally:
            stop.set()
            allocator.join()
            unmap(mapped)
        held.held.update(missing)
        log.info("fetched %s step %d (%s) in %.2fs", info.job, info.step,
                 ", ".join(f"{n} bytes from {source}" for source, n in served.items()), time.monotonic() - started)

    def _held_here(self, info: CheckpointInfo) -> bool:
        """Whether this agent's store holds every slice of the checkpoint's replicated state (the node's image
        is filled from it without the network, rather than a rank reading it from elsewhere)."""
        slices = [shard for shard in info.shards if shard.rep_end > shard.rep_start]
        return self.store is not None and all(self.store.holds(info.job, info.step, shard.rank, shard.crc)
                                              for shard in slices)

    def direct_holders(self, info: CheckpointInfo) -> dict[int, list[Holder]]:
        """The other nodes a rank reading ``info``'s replicated state itself reads it from, before dash-memd."""
        if self.peer_connect is None:
            return {}
        return {rank: [Holder(*peer) for peer in peers] for rank, peers in self._holders_of(info).items()
                if info.shards[rank].rep_end > info.shards[rank].rep_start}

    def _sources(self, image: RestoreImage) -> list[Source]:
        """Where a restore's bytes come from, fastest first: the image, this agent's store, peers, dash-memd."""
        sources: list[Source] = [NodeCopy(image.held)]
        if self.store is not None:
            sources.append(HeldSource(self.store))
        holders = self._holders_of(image.info) if self.peer_connect is not None else {}
        if holders:
            sources.append(PeerSource(holders, self._peer, self.config.node, self.config.restore_streams))
        sources.append(MemdSource(self.clients.client, self.config.restore_streams, waited_on=self._waited_on))
        return sources

    @contextlib.contextmanager
    def _peer(self, peer: Peer) -> Iterator[PeerClient]:
        with self.peer_connect(peer[1], peer[2]) as client:
            yield client

    def handed_out(self, image: RestoreImage, local_ranks: int) -> None:
        """Count a rank served; once every local rank has its own descriptor, the agent's goes."""
        with self._lock:
            image.handed_out += 1
            key = (image.info.job, image.info.step)
            if image.handed_out >= local_ranks and self._images.get(key) is image:
                del self._images[key]
                os.close(image.fd)

    def expire(self, everything: bool = False) -> None:
        """Drop the images kept longer than ``restore_ttl`` (all of them if ``everything``)."""
        now = time.monotonic()
        with self._lock:
            for key, held in list(self._images.items()):
                if everything or now - held.created > self.config.restore_ttl:
                    del self._images[key]
                    os.close(held.fd)


def _allocate(fd: int, extents: list[Extent], stop: threading.Event, waited_on: Callable[[], bool]) -> None:
    """Give the image its memory ahead of the bytes, on another core where there is one.

    Fresh memory costs the kernel (and, in a VM, the host) far more per byte than receiving does; done
    here, piece by piece in the order the streams fill them, the receivers mostly write to pages that
    exist already. A page the receivers reach first is simply allocated by them.
    """
    widen = widen_once(waited_on)
    for extent in sorted(extents, key=lambda e: e.at):
        for piece in extent.split(ALLOCATE_STEP):
            if stop.is_set():
                return
            widen()
            try:
                os.posix_fallocate(fd, piece.at, piece.nbytes)
            except OSError:  # out of memory for it now: the receivers will say so, or manage
                return

