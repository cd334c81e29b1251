"""This node's own snapshot, kept in the agent's store: each handed-over shard copied in as its rank stages it.

The rank's sender (:mod:`dashrun.agent.ranks`) starts an :class:`OwnCopy`
as it takes a shard, then streams the shard to dash-memd from the rank's
segment as before. The copy runs on a thread of its own, block by block as
the rank's staging progress allows (``Staged.wait_ready``), each block
checksummed as it lands; so it mostly overlaps the stream to dash-memd, and
the sender only waits for its end (:meth:`OwnCopy.finish`) before it tells
the rank that its buffer may be reused. A shard whose copy does not fit in
the store, fails, or does not match the checksum dash-memd verified (or the
rank's) is not kept; the snapshot goes on without it.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from dashrun.agent.peers.store import Receiving, Store, copy_in
from dashrun.errors import DashError
from dashrun.util.problems import ProblemLog
from dashrun.wire.blocks import Marks
from dashrun.wire.messages import ShardHeader

__all__ = ["OwnCopy"]

log = logging.getLogger(__name__)


class OwnCopy:
    """A copy of one handed-over shard (``view``, final up to what ``gate(end)`` waits for) into ``store``."""

    def __init__(self, store: Store, header: ShardHeader, owner: str, view: memoryview,
                 gate: Callable[[int], None], problems: ProblemLog):
        self.header, self.problems = header, problems
        self._slot: Receiving | None = None
        self._marks: Marks | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        try:
            self._slot = store.reserve(header, owner)
        except (DashError, OSError) as e:  # no room, or no memory segment to be had now: the snapshot goes on
            kind = e.code.value if isinstance(e, DashError) else type(e).__name__
            problems.problem("store", kind, "%s step %d, rank %d: this node's own copy is not kept: %s",
                             header.job, header.step, header.rank, e)
            return
        self._thread = threading.Thread(target=self._copy, args=(self._slot.view, view, gate), name="agent-own-copy",
                                        daemon=True)
        try:
            self._thread.start()
        except RuntimeError as e:
            self._thread = None
            self._error = e

    def _copy(self, dest: memoryview, view: memoryview, gate: Callable[[int], None]) -> None:
        try:
            self._marks = copy_in(dest, [view], gate)
        except BaseException as e:  # the rank gave up staging, say: the copy is not kept
            self._error = e

    def finish(self, expected: int | None) -> ShardHeader | None:
        """Wait for the copy; keep it if its CRC-32C is ``expected`` (None: unknown); the header as held, or None.
        Must be called before the rank's segment may change (its buffer is reused once it is answered)."""
        if self._slot is None:
            return None
        slot, self._slot = self._slot, None  # finished once: a second call does nothing
        if self._thread is not None:
            self._thread.join()
        if self._error is not None or self._marks is None:
            slot.abort()
            if self._error is not None and not isinstance(self._error, DashError):
                log.error("%s step %d, rank %d: copying into the store failed: %r", self.header.job,
                          self.header.step, self.header.rank, self._error)
            return None
        try:
            held = slot.finish(self._marks, expected)
        except DashError as e:
            self.problems.problem("store", e.code.value, "%s step %d, rank %d: this node's own copy is not kept: "
                                  "%s", self.header.job, self.header.step, self.header.rank, e)
            return None
        self.problems.ok("store")
        return held
