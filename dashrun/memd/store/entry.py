"""One checkpoint in dash-memd's catalogue and the states it moves through.

A checkpoint of step N of a job is assembled from one shard per rank. States
only move forward, each move checked and logged once::

    RECEIVING -> COMMITTED -> ON_DISK -> IN_OBJECT_STORE

The state is how far a checkpoint got; :attr:`Entry.tiers` says where its
bytes are now (copies leave tiers through eviction and retention while the
state stays). An entry may be created in any state (the start-up scans create
them ON_DISK or IN_OBJECT_STORE); after that, :meth:`Entry.advance` is the only
way its state changes.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import mmap
import time

from dashrun.wire.blocks import Marks
from dashrun.wire.messages import CheckpointInfo, ShardHeader

__all__ = ["NEXT", "Entry", "State"]

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    RECEIVING = "receiving"
    COMMITTED = "committed"
    ON_DISK = "on_disk"
    IN_OBJECT_STORE = "in_object_store"


#: The states each state may advance to.
NEXT: dict[State, frozenset[State]] = {
    State.RECEIVING: frozenset({State.COMMITTED}),
    State.COMMITTED: frozenset({State.ON_DISK}),
    State.ON_DISK: frozenset({State.IN_OBJECT_STORE}),
    State.IN_OBJECT_STORE: frozenset(),
}


@dataclasses.dataclass(eq=False)
class Entry:
    """One checkpoint (job, step); its fields change only under the catalogue's lock."""

    job: str
    step: int
    world: int
    rep_total: int
    layout: str
    state: State = State.RECEIVING
    shards: dict[int, ShardHeader] = dataclasses.field(default_factory=dict)
    buffers: dict[int, mmap.mmap] = dataclasses.field(default_factory=dict)
    marks: dict[int, Marks] = dataclasses.field(default_factory=dict)  # each buffer's CRC-32C at its blocks' ends
    tiers: set[str] = dataclasses.field(default_factory=set)
    info: CheckpointInfo | None = None
    readers: int = 0
    #: rank -> the receive of its shard under way (a catalogue Ticket): a new copy of the shard replaces it
    arriving: dict[int, object] = dataclasses.field(default_factory=dict)
    #: the (world generation, step restored) of the run its shards are from: one for all, the newest that sent any
    attempt: tuple[int, int] = (0, -1)
    dropped: bool = False    # no longer in the catalogue; release buffers when unpinned
    touched: float = dataclasses.field(default_factory=time.monotonic)
    #: when its first shard was announced (monotonic): a commit's latency counts from here
    begun: float = dataclasses.field(default_factory=time.monotonic)
    #: seconds from ``begun`` to its commit; None for one loaded from disk or the bucket at a start
    commit_seconds: float | None = None

    def __setattr__(self, name: str, value) -> None:
        if name == "state" and "state" in self.__dict__:
            raise AttributeError(f"{self.job} step {self.step}: the state changes only through advance()")
        super().__setattr__(name, value)

    def advance(self, new: State) -> None:
        """Move to state ``new``; AssertionError if that is not a step forward from the current state."""
        if new not in NEXT[self.state]:
            raise AssertionError(f"{self.job} step {self.step}: {self.state.value} -> {new.value} is not allowed")
        log.info("%s step %d: %s -> %s", self.job, self.step, self.state.value, new.value)
        super().__setattr__("state", new)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards.values())
