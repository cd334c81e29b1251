"""One source planner: which holder serves each byte range of a committed checkpoint.

A restore names the byte ranges it needs (:class:`Extent`: a piece of one
saved rank's shard, and where it goes in the node's image; :func:`wanted`
says which a node needs). The planner tries its sources in order of speed —
this node's image (:class:`NodeCopy`), the agent's own store of shards (its
own snapshot and peers' replicas, :class:`HeldSource`), peers' stores over the
peer link (:class:`PeerSource`), then dash-memd, which serves from its RAM,
its disk or the bucket, whichever holds the checkpoint — and reads each range
from the first source that holds it. A source that may fail where a later
one would not (a store that dropped the shard meanwhile, a peer gone or
serving bytes that fail their checksum) says so (``fallible``): the ranges it
could not serve go on to the sources after it.

dash-memd's ranges are read over several connections at once, in pieces of
at most :data:`PIECE` bytes, so that receiving and decrypting one large shard
runs on more than one core on both ends. Every piece's checksum is verified
as it arrives: from dash-memd's RAM it is the checksum of the bytes as they
arrived there (:mod:`dashrun.wire.blocks`); from its disk or the bucket, the
shard was checked whole as it was read back. A piece that fails is asked for
again (:meth:`~dashrun.wire.memd_client.MemdClient.get_shard_checked_into`).

The image is one buffer (a node's shared memory), or a :class:`Scatter`: byte
ranges that each land in memory of their own, as when the only rank of a node
reads the replicated state straight into its tensors.

Used by dash-agent for a node's restores, by the only rank of a node for its
replicated state (:mod:`dashrun.rank.direct`), by :class:`dashrun.dcp.Reader`,
and by ``dashrun export`` (:func:`everything`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import logging
import os
import queue
import threading
import zlib
from typing import Callable, Collection, ContextManager, Iterable, Protocol, Sequence

from dashrun.errors import DashError, NotFoundError, ProtocolError, UnavailableError
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo

__all__ = ["PIECE", "Extent", "HeldSource", "HeldStore", "MemdSource", "NodeCopy", "PeerReader", "PeerSource",
           "Planner", "Scatter", "Source", "every_cpu", "everything", "pick_holder", "pieces", "replicated_span",
           "wanted", "widen_once"]

log = logging.getLogger(__name__)

#: Largest byte range read in one request from dash-memd: small enough to spread one shard over every
#: stream, large enough that a request's round trip is lost in its transfer.
PIECE = 32 << 20


@dataclasses.dataclass(frozen=True, order=True)
class Extent:
    """Bytes ``[start, stop)`` of saved rank ``rank``'s shard, which go to offset ``at`` of the image."""

    rank: int
    start: int
    stop: int
    at: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start

    def split(self, most: int) -> list[Extent]:
        return [Extent(self.rank, s, min(s + most, self.stop), self.at + s - self.start)
                for s in range(self.start, self.stop, most)] or [self]


def wanted(info: CheckpointInfo, tails: Sequence[int], ranks: Collection[int] | None, *,
           replicated: bool = True) -> list[Extent]:
    """What a node restoring ``info`` needs: every shard's slice of the replicated state (unless not
    ``replicated``: a rank reads it itself, see :func:`replicated_span`), and the tails (private state and
    layout description) of saved rank 0, which describes the replicated state, and of ``ranks``, the node's
    ranks (None: every saved rank's).

    Pieces of sharded state (the end of a private part) are left out: each rank reads the ranges of them it
    needs (:func:`pieces`), from every saved rank's, whose layout descriptions it then needs too.
    """
    sharded = any(shard.pieces_len for shard in info.shards)
    extents = []
    for shard, tail in zip(info.shards, tails):
        rep = shard.rep_end - shard.rep_start
        if rep and replicated:
            extents.append(Extent(shard.rank, 0, rep, shard.rep_start))
        own = shard.private_len - shard.pieces_len
        if shard.rank == 0 or ranks is None or shard.rank in ranks:
            if not shard.pieces_len:
                extents.append(Extent(shard.rank, rep, shard.nbytes, tail))
                continue
            if own:
                extents.append(Extent(shard.rank, rep, rep + own, tail))
        if sharded and shard.meta_len:
            extents.append(Extent(shard.rank, rep + shard.private_len, shard.nbytes, tail + shard.private_len))
    return extents


def pieces(info: CheckpointInfo, tails: Sequence[int], ranges: Iterable[tuple[int, int, int]]) -> list[Extent]:
    """The extents of ``ranges`` — (saved rank, start, stop) of a private part, as a rank asks for its pieces
    of sharded state — checked against ``info``."""
    extents = []
    for rank, start, stop in ranges:
        if not 0 <= rank < len(info.shards):
            raise ProtocolError(f"a range of saved rank {rank}, of a checkpoint saved by {len(info.shards)}")
        shard = info.shards[rank]
        if not 0 <= start <= stop <= shard.private_len:
            raise ProtocolError(f"range [{start}, {stop}) is outside saved rank {rank}'s {shard.private_len} "
                                "private bytes")
        if stop > start:
            rep = shard.rep_end - shard.rep_start
            extents.append(Extent(rank, rep + start, rep + stop, tails[rank] + start))
    return extents


def everything(info: CheckpointInfo, tails: Sequence[int]) -> list[Extent]:
    """Every byte of ``info``: what a node needs for every saved rank (:func:`wanted`), and every saved rank's
    pieces of sharded state (:func:`pieces`), as an export reads it whole."""
    return wanted(info, tails, None) + pieces(info, tails, [
        (shard.rank, shard.private_len - shard.pieces_len, shard.private_len)
        for shard in info.shards if shard.pieces_len])


def replicated_span(info: CheckpointInfo, start: int, stop: int, at: int = 0) -> list[Extent]:
    """The extents of bytes ``[start, stop)`` of the replicated state (every shard holds its slice of it first),
    going to offset ``at`` of a buffer onwards."""
    if not 0 <= start <= stop <= info.rep_total:
        raise ProtocolError(f"range [{start}, {stop}) is outside the {info.rep_total} bytes of replicated state")
    extents = []
    for shard in info.shards:
        lo, hi = max(start, shard.rep_start), min(stop, shard.rep_end)
        if lo < hi:
            extents.append(Extent(shard.rank, lo - shard.rep_start, hi - shard.rep_start, at + lo - start))
    return extents


class Scatter:
    """An image that is not one buffer: ``places`` are (offset, memory), sorted and apart, and the bytes at
    each place's offset onwards land in its memory."""

    def __init__(self, places: Sequence[tuple[int, memoryview]]):
        self.starts = [at for at, _ in places]
        self.places = [memoryview(view).cast("B") for _, view in places]
        if any(at + len(view) > following for at, view, following in zip(self.starts, self.places,
                                                                           self.starts[1:])):
            raise ProtocolError("places of a scatter overlap")

    def views(self, start: int, stop: int) -> list[memoryview]:
        """The memory of bytes ``[start, stop)``, in order; ProtocolError where places do not cover them."""
        views, at = [], start
        index = bisect.bisect_right(self.starts, start) - 1
        while at < stop:
            if not 0 <= index < len(self.places) or not 0 <= at - self.starts[index] < len(self.places[index]):
                raise ProtocolError(f"bytes [{at}, {stop}) have no place to go")
            base = self.starts[index]
            views.append(self.places[index][at - base:stop - base])  # a slice past the place's end stops there
            at += len(views[-1])
            index += 1
        return views


def _views_of(image: memoryview | Scatter, start: int, stop: int) -> list[memoryview]:
    """Where bytes ``[start, stop)`` of ``image`` go."""
    return image.views(start, stop) if isinstance(image, Scatter) else [image[start:stop]]


class Source(Protocol):
    """A holder of checkpoint bytes."""

    name: str

    def holds(self, info: CheckpointInfo, extent: Extent) -> bool: ...

    def read(self, info: CheckpointInfo, extents: Sequence[Extent], image: memoryview | Scatter) -> None: ...


class HeldStore(Protocol):
    """What :class:`HeldSource` needs of the agent's store (:mod:`dashrun.agent.peers.store`)."""

    def holds(self, job: str, step: int, rank: int, crc: int) -> bool: ...

    def read(self, job: str, step: int, rank: int, crc: int, offset: int, views: Sequence[memoryview]) -> bool:
        """Copy a range of a held shard into ``views``, checked; False if not held (any more)."""


class PeerReader(Protocol):
    """What :class:`PeerSource` needs of a connection to a peer (:class:`dashrun.wire.peer_client.PeerClient`)."""

    def get_into(self, job: str, step: int, rank: int, crc: int, offset: int,
                 views: Sequence[memoryview]) -> None: ...


#: A peer agent that holds shards: its node's name and where it listens.
Peer = tuple[str, str, int]


class HeldSource:
    """This agent's own store: its node's own snapshot and the replicas it holds, read without the network."""

    name = "this agent's store"
    fallible = True  # dropped since the plan was made (a newer step committed)

    def __init__(self, store: HeldStore):
        self.store = store

    def holds(self, info: CheckpointInfo, extent: Extent) -> bool:
        return self.store.holds(info.job, info.step, extent.rank, info.shards[extent.rank].crc)

    def read(self, info: CheckpointInfo, extents: Sequence[Extent], image: memoryview | Scatter) -> None:
        for extent in extents:
            crc = info.shards[extent.rank].crc
            if not self.store.read(info.job, info.step, extent.rank, crc, extent.start,
                                   _views_of(image, extent.at, extent.at + extent.nbytes)):
                raise NotFoundError(f"{info.job} step {info.step}, rank {extent.rank}'s shard left this agent's "
                                    "store")


def pick_holder(me: str, rank: int, holders: Sequence[Peer]) -> list[Peer]:
    """``holders`` in the order a restoring node ``me`` tries them for saved rank ``rank``'s shard: from one
    chosen by a hash of (``me``, ``rank``) on, so that nodes restoring at once read from different holders."""
    if not holders:
        return []
    first = zlib.crc32(f"{me}\0{rank}".encode()) % len(holders)
    return list(holders[first:]) + list(holders[:first])


class PeerSource:
    """Other agents' stores over the peer link: ``holders`` names, per saved rank, the peers that hold its shard
    (with the checkpoint's crc); ``connect(peer)`` a connection to one (a context manager, closed after).

    Each holder is read by up to ``streams`` connections at once, every holder at once; a piece a holder fails
    to serve (gone, not held, its bytes failing their check) is asked of that rank's next holder, and only when
    every holder failed it goes on to the sources after this one.
    """

    name = "peers"
    fallible = True

    def __init__(self, holders: dict[int, Sequence[Peer]], connect: Callable[[Peer], ContextManager[PeerReader]],
                 me: str, streams: int = 2):
        self.holders = {rank: list(peers) for rank, peers in holders.items() if peers}
        self.connect, self.me, self.streams = connect, me, max(1, streams)

    def holds(self, info: CheckpointInfo, extent: Extent) -> bool:
        return extent.rank in self.holders

    def read(self, info: CheckpointInfo, extents: Sequence[Extent], image: memoryview | Scatter) -> None:
        by_holder: dict[Peer, queue.SimpleQueue[Extent]] = {}
        for extent in extents:
            first = pick_holder(self.me, extent.rank, self.holders[extent.rank])[0]
            for piece in extent.split(PIECE):
                by_holder.setdefault(first, queue.SimpleQueue()).put(piece)
        failures: list[BaseException] = []
        dead: set[Peer] = set()  # holders that could not be reached: not asked again in this read

        def stream(holder: Peer, pieces: queue.SimpleQueue[Extent]) -> None:
            with contextlib.ExitStack() as stack:
                try:
                    client: PeerReader | None = stack.enter_context(self.connect(holder))
                except DashError as e:
                    log.warning("peer %s: %s", holder[0], e)
                    dead.add(holder)
                    client = None
                try:
                    while not failures:
                        try:
                            piece = pieces.get_nowait()
                        except queue.Empty:
                            return
                        self._read_piece(info, piece, image, holder, client, dead)
                except BaseException as e:  # the first failure stops every stream, and is raised
                    failures.append(e)

        _run_streams([(f"peer-restore-{holder[0]}", functools.partial(stream, holder, pieces))
                      for holder, pieces in by_holder.items() for _ in range(self.streams)], failures)

    def _read_piece(self, info: CheckpointInfo, piece: Extent, image: memoryview | Scatter, holder: Peer,
                    client: PeerReader | None, dead: set[Peer]) -> None:
        """Read ``piece`` from ``client`` (of ``holder``), else from the rank's other holders in turn."""
        crc = info.shards[piece.rank].crc
        views = _views_of(image, piece.at, piece.at + piece.nbytes)
        problem: DashError | None = None
        for other in [holder] + [p for p in pick_holder(self.me, piece.rank, self.holders[piece.rank])
                                 if p != holder]:
            if other in dead:
                continue
            try:
                if other == holder and client is not None:
                    client.get_into(info.job, info.step, piece.rank, crc, piece.start, views)
                elif other != holder:
                    with self.connect(other) as another:
                        another.get_into(info.job, info.step, piece.rank, crc, piece.start, views)
                else:
                    continue
                return
            except DashError as e:
                problem = e
                if isinstance(e, UnavailableError):
                    dead.add(other)
                log.warning("peer %s: %s step %d, rank %d: %s", other[0], info.job, info.step, piece.rank, e)
        raise problem or NotFoundError(f"no peer holds {info.job} step {info.step}, rank {piece.rank}'s shard")


class NodeCopy:
    """This node: the ranges already in the image (fetched by an earlier restore, or ahead of the ranks)."""

    name = "this node"

    def __init__(self, held: Iterable[Extent] = ()):
        self.held = set(held)

    def holds(self, info: CheckpointInfo, extent: Extent) -> bool:
        return extent in self.held

    def read(self, info: CheckpointInfo, extents: Sequence[Extent], image: memoryview | Scatter) -> None:
        pass  # already in place


class MemdSource:
    """dash-memd, over up to ``streams`` connections at once (each made by ``connect``, closed after).

    Its threads stay on dash-agent's CPUs until ``waited_on()`` says a rank waits for the bytes; from then on
    they may run on every CPU (see :func:`every_cpu`). ``progress(nbytes)``, if given, is told each piece once it
    is in place, by one thread at a time.
    """

    name = "dash-memd"

    def __init__(self, connect: Callable[[], ContextManager[MemdClient]], streams: int = 2,
                 waited_on: Callable[[], bool] = lambda: True, progress: Callable[[int], None] | None = None):
        self.connect = connect
        self.streams = max(1, streams)
        self.waited_on = waited_on
        self.progress = progress

    def holds(self, info: CheckpointInfo, extent: Extent) -> bool:
        return True  # the checkpoint is committed: dash-memd has every byte of it in one of its tiers

    def read(self, info: CheckpointInfo, extents: Sequence[Extent], image: memoryview | Scatter) -> None:
        pieces: queue.SimpleQueue[Extent] = queue.SimpleQueue()
        count = 0
        for extent in extents:
            for piece in extent.split(PIECE):
                pieces.put(piece)
                count += 1
        failures: list[BaseException] = []
        told = threading.Lock()

        def stream() -> None:
            widen = widen_once(self.waited_on)
            try:
                with self.connect() as client:
                    while not failures:
                        widen()
                        try:
                            piece = pieces.get_nowait()
                        except queue.Empty:
                            return
                        client.get_shard_checked_into(info.job, info.step, piece.rank,
                                                      _views_of(image, piece.at, piece.at + piece.nbytes),
                                                      offset=piece.start, committed_at=info.committed_at)
                        if self.progress is not None:
                            with told:
                                self.progress(piece.nbytes)
            except BaseException as e:  # the first failure stops every stream, and is raised
                failures.append(e)

        _run_streams([(f"restore-stream-{i}", stream) for i in range(min(self.streams, count))], failures)


def _run_streams(streams: Sequence[tuple[str, Callable[[], None]]], failures: list[BaseException]) -> None:
    """Run each stream (name, function) on a thread of its own until all are done; then raise the first of
    ``failures``, where each stream puts what stopped it (and which tells the others to stop)."""
    threads = [threading.Thread(target=run, name=name, daemon=True) for name, run in streams]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def every_cpu() -> bool:
    """Let the calling thread run on every CPU of the node (True once it may).

    dash-agent is kept off the ranks' cores so that shipping checkpoints takes no CPU from training; a
    restore the ranks are waiting for may use their cores too. (One fetched ahead, while the ranks are
    still starting, may not: it would slow their start.)
    """
    with contextlib.suppress(AttributeError, OSError):  # no CPU affinity here, or a cpuset narrower than that
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # pid 0: this thread only
    return True


def widen_once(waited_on: Callable[[], bool]) -> Callable[[], None]:
    """A check for a loop of a fetch: the first time it finds ``waited_on()``, the thread goes to every CPU."""
    widened = False

    def check() -> None:
        nonlocal widened
        if not widened and waited_on():
            widened = every_cpu()
    return check


class Planner:
    """Reads the ranges a restore needs, each from the fastest of ``sources`` (in that order) that holds it."""

    def __init__(self, sources: Sequence[Source]):
        self.sources = list(sources)

    def read(self, info: CheckpointInfo, extents: Iterable[Extent], image: memoryview | Scatter) -> dict[str, int]:
        """Fill ``image`` with ``extents``; returns the bytes each source served, by name."""
        plan: dict[int, list[Extent]] = {}
        for extent in extents:
            index = next(i for i, source in enumerate(self.sources) if source.holds(info, extent))
            plan.setdefault(index, []).append(extent)
        served: dict[str, int] = {}
        for index, chosen in sorted(plan.items()):
            self._read_from(index, info, chosen, image, served)
        return served

    def _read_from(self, index: int, info: CheckpointInfo, chosen: list[Extent], image: memoryview | Scatter,
                   served: dict[str, int]) -> None:
        """Read ``chosen`` from source ``index``; if it is ``fallible`` and fails, from the sources after it."""
        source = self.sources[index]
        try:
            source.read(info, chosen, image)
        except DashError as e:
            later = range(index + 1, len(self.sources))
            if not getattr(source, "fallible", False) or not later:
                raise
            log.warning("%s step %d: %s could not serve %d bytes (%s); reading them from the next source",
                        info.job, info.step, source.name, sum(x.nbytes for x in chosen), e)
            plan: dict[int, list[Extent]] = {}
            for extent in chosen:
                following = next((i for i in later if self.sources[i].holds(info, extent)), None)
                if following is None:
                    raise
                plan.setdefault(following, []).append(extent)
            for following, extents in sorted(plan.items()):
                self._read_from(following, info, extents, image, served)
            return
        served[source.name] = served.get(source.name, 0) + sum(e.nbytes for e in chosen)
