"""One source planner: which holder serves each byte range of a committed checkpoint.

A restore names the byte ranges it needs (:class:`Extent`: a piece of one
saved rank's shard, and where it goes in the node's image; :func:`wanted`
says which a node needs). The planner tries its sources in order of speed —
this node's own copy first, then dash-memd, which serves from its RAM, its
disk or the bucket, whichever holds the checkpoint — and reads each range from
the first source that holds it. Other holders (a peer's RAM) join the list of
sources; nothing else changes.

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
import os
import queue
import threading
from typing import Callable, Collection, ContextManager, Iterable, Protocol, Sequence

from dashrun.errors import ProtocolError
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo

__all__ = ["PIECE", "Extent", "MemdSource", "NodeCopy", "Planner", "Scatter", "Source", "every_cpu", "everything",
           "pieces", "replicated_span", "wanted", "widen_once"]

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

        threads = [threading.Thread(target=stream, name=f"restore-stream-{i}", daemon=True)
                   for i in range(min(self.streams, count))]
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
        served = {}
        for index, chosen in sorted(plan.items()):
            source = self.sources[index]
            source.read(info, chosen, image)
            served[source.name] = served.get(source.name, 0) + sum(e.nbytes for e in chosen)
        return served
