"""One rank's connection to dash-agent, and the sender that streams its shards to dash-memd.

A rank hands over a staged shard by sending a SNAPSHOT frame with the
shared-memory segment's file descriptor attached (SCM_RIGHTS): the bytes
never pass through the socket. Each rank connection has its own sender
thread and its own connection to dash-memd, which streams the segment
straight from the agent's mapping of it (memoryview sends, no copy in user
space; ``sendfile`` gains nothing on loopback) and answers the rank —
"your buffer may be reused" — once dash-memd has stored and verified the
shard. The checksum dash-memd verifies is the rank's, computed as it staged
(sent with its last PROGRESS), so the agent makes no pass of its own over
the bytes; a rank without dashrun's C helper leaves it to the agent. The
agent holds its own descriptor of the segment, so a shard handed over is
still delivered if its rank dies right after. It reads the segment only
through that descriptor (and its mapping of it), which carries the rank's
lock: so a rank whose link dropped before the reply learns when the agent
is done with the segment (:mod:`dashrun.rank.stager`). A connection is over once
its rank is gone and its sender has delivered what was handed over: then
its socket closes, and the agent forgets it.

The frames and their bodies are :mod:`dashrun.wire.agent_messages`; each
request's ``id`` is read here and repeated in its reply. A RESTORE or WAIT
runs on a helper thread of its own, at most :data:`MAX_RANK_HELPERS` of them
per connection and :data:`MAX_HELPERS` in the agent: one more is refused at
once with BusyError, so a rank that floods the agent costs it no more
threads (a rank has one restore or wait at a time).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Protocol

from dashrun.agent.config import AgentConfig
from dashrun.agent.metrics import AgentMetrics
from dashrun.agent.restores import RestoreCache
from dashrun.agent.peers.delivery import wait_committed
from dashrun.agent.segments import SegmentMaps
from dashrun.errors import BusyError, ConflictError, DashError, ProtocolError, UnavailableError
from dashrun.util.units import format_size
from dashrun.wire.agent_messages import (
    Progress,
    RestoreReply,
    RestoreRequest,
    SnapshotReply,
    SnapshotRequest,
    WaitReply,
    WaitRequest,
)
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.history import Restored
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import Notice, ShardHeader
from dashrun.wire.protocol import MAX_STEP, Kind, crc32c, field_int

__all__ = ["MAX_HELPERS", "MAX_RANK_HELPERS", "STAGING_TIMEOUT", "Agent", "RankConnection", "Staged"]

log = logging.getLogger(__name__)

#: Longest a handed-over shard may wait for its rank's next staging progress.
STAGING_TIMEOUT = 300.0
#: RESTORE and WAIT requests one rank's connection may have running at once (each on a thread of its own): a
#: rank has one restore or one wait at a time.
MAX_RANK_HELPERS = 4
#: RESTORE and WAIT requests all the connections to the agent may have running at once: room for a restore and
#: a wait of each of 128 ranks on the node.
MAX_HELPERS = 256


class Agent(Protocol):
    """What a rank's connection needs of the agent that accepted it (:class:`dashrun.agent.service.AgentServer`)."""

    config: AgentConfig
    restores: RestoreCache
    #: the most serious interruption notice this node received, if any
    notice: Notice | None
    #: the helper threads (RESTORE, WAIT) every connection's count against: MAX_HELPERS in all
    helpers: threading.Semaphore
    #: this node's saves, stall and stream, as counted for --metrics-listen
    metrics: AgentMetrics

    def report_failure(self, job: str, err: DashError) -> None:
        """A shard of ``job`` could not be delivered."""

    def emergency_stored(self, header: ShardHeader) -> None:
        """An emergency snapshot's shard is stored in dash-memd."""

    def connection_finished(self, conn: RankConnection) -> None:
        """``conn`` is over (its rank gone, its shards delivered) and closed: forget it."""

    def keep_own(self, staged: Staged) -> Any:
        """Start copying ``staged`` into the agent's store, as it is staged (None: no store, or no room)."""

    def own_kept(self, own: Any, crc: int | None, committed: bool) -> None:
        """Wait for ``own`` (from :meth:`keep_own`; None: nothing) and keep it if its CRC-32C is ``crc`` (None:
        unknown), its step ``committed`` or not; then its replicas go out, in the background."""

    def fleet_delivers(self, own: Any) -> bool:
        """Whether the shard whose own copy is ``own`` is delivered on the fleet's rule (with replicas)."""

    def own_held(self, own: Any, crc: int | None) -> ShardHeader | None:
        """:meth:`own_kept` without the replicas: the header as the store holds it, or None."""

    def deliver(self, conn: RankConnection, held: ShardHeader) -> dict[str, Any] | None:
        """``held`` to dash-memd and the peers: dash-memd's answer, or None if R peers held it first."""


@dataclasses.dataclass
class Staged:
    """A shard a rank handed over, readable in the agent's mapping of its segment, perhaps still being staged."""

    request_id: int
    header: ShardHeader
    view: memoryview
    ready: int  # bytes [0, ready) of the shard are final
    emergency: bool = False  # taken because of an interruption notice
    checksum: bool = False  # the rank computes the shard's CRC-32C as it stages and sends it when done
    restored: Restored | None = None  # how the rank's run began, for the job's run history in dash-memd
    crc: int | None = None
    failed: bool = False
    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    handed_at: float = dataclasses.field(default_factory=time.monotonic)  # when the rank handed it over

    def advance(self, ready: int | None = None, failed: bool = False, crc: int | None = None) -> None:
        with self.cond:
            if ready is not None:
                self.ready = max(self.ready, min(ready, self.header.nbytes))
            if crc is not None:
                self.crc = crc
            self.failed = self.failed or failed
            self.cond.notify_all()

    def rank_crc(self) -> int:
        """The rank's checksum of the whole shard, once it has staged it (dash-memd verifies it)."""
        self.wait_ready(self.header.nbytes)
        with self.cond:
            if self.crc is None:
                raise ProtocolError("the rank staged its shard without the checksum it announced")
            return self.crc

    def wait_ready(self, end: int) -> None:
        """Block until the shard's first ``end`` bytes are final; raise if the rank gave up or went away."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready >= end or self.failed, timeout=STAGING_TIMEOUT)
            if self.ready < end:
                raise UnavailableError("the rank stopped before its snapshot was staged")


class RankConnection:
    """One rank's connection: a reader thread, a sender thread, helpers for slow requests.

    It closes itself once both halves are over: the reader (the rank hung
    up, or broke the protocol) and the sender (it delivered what the rank
    handed over before that).
    """

    def __init__(self, agent: Agent, sock: socket.socket):
        self.agent = agent
        self.ch = Channel(sock)
        self._send_lock = threading.Lock()
        self._snapshots: queue.Queue[Staged | None] = queue.Queue()
        self._staging: dict[int, Staged] = {}
        self._maps = SegmentMaps()
        self.sender = threading.Thread(target=self._send_loop, name="agent-sender", daemon=True)
        self.who = "rank ?"
        self._helpers = threading.BoundedSemaphore(MAX_RANK_HELPERS)
        self._halves_left = 2  # the reader and the sender
        self._halves_lock = threading.Lock()
        self._reported = (0, 0.0)  # the rank's skipped snapshots and stall at its last hand-over

    def reply(self, request_id: Any, body: dict[str, Any] | None = None, fds=()) -> None:
        with self._send_lock:
            try:
                self.ch.send(Kind.OK, {**(body or {}), "id": request_id}, fds=fds)
            except UnavailableError:
                pass  # the rank is gone; nothing to tell it

    def reply_error(self, request_id: Any, err: BaseException) -> None:
        with self._send_lock:
            try:
                self.ch.send_error(err, id=request_id)
            except UnavailableError:
                pass

    def send_notice(self, notice: Notice) -> None:
        with self._send_lock:
            try:
                self.ch.send(Kind.NOTICE, notice.to_body())
            except UnavailableError:
                pass

    def send_reshape(self, generation: int) -> None:
        """Tell the rank that the world of ``generation`` ends at its next checkpoint (a node joins)."""
        with self._send_lock:
            try:
                self.ch.send(Kind.RESHAPE, {"generation": generation})
            except UnavailableError:
                pass

    def finish(self) -> None:
        """Take no more snapshots: the sender ends once it has delivered those already handed over."""
        self._snapshots.put(None)

    def wait_finished(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the sender to end (after :meth:`finish`)."""
        if self.sender.is_alive():
            self.sender.join(timeout=timeout)

    def start(self) -> None:
        """Serve the rank: the sender, then the reader, each in a thread of its own.

        Raises if a thread cannot start; the connection then closes itself
        (at once, or once the sender is done if only the reader is missing).
        """
        try:
            self.sender.start()
        except BaseException:
            self._half_over(2)  # neither half runs
            raise
        try:
            threading.Thread(target=self.serve, name="agent-rank", daemon=True).start()
        except BaseException:
            self._reader_over()
            raise

    def serve(self) -> None:
        """The reader: take the rank's requests until it hangs up (runs on its own thread, see :meth:`start`)."""
        try:
            if self.agent.notice is not None:
                self.send_notice(self.agent.notice)  # a rank that (re)connects after the notice learns it now
            if self.agent.reshape_generation is not None:
                self.send_reshape(self.agent.reshape_generation)  # a rank of a newer world ignores it
            while True:
                frame = self.ch.recv()
                try:
                    self._dispatch(frame)
                finally:
                    frame.close_fds()
        except UnavailableError:
            pass  # the rank exited or died: shards it had fully staged are still delivered
        except ProtocolError as e:
            log.warning("%s: %s", self.who, e)
        except Exception:  # a bug must cost this rank its connection, not the agent its descriptors
            log.exception("%s: reading the rank's requests failed", self.who)
        finally:
            self._reader_over()

    def _reader_over(self) -> None:
        for staged in list(self._staging.values()):
            staged.advance(failed=True)  # a shard its rank never finished staging must not go out
        self._snapshots.put(None)
        self._half_over()

    def _half_over(self, halves: int = 1) -> None:
        """The reader or the sender ended; after both, close the socket and let the agent forget us."""
        with self._halves_lock:
            self._halves_left -= halves
            if self._halves_left > 0:
                return
        try:
            # Wakes a helper thread blocked replying to a rank that stopped reading, so the lock comes free.
            self.ch.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._send_lock:  # not under a reply being sent: the descriptor's number could be reused meanwhile
            self.ch.close()
        self.agent.connection_finished(self)

    def _dispatch(self, frame: Frame) -> None:
        request_id = field_int(frame.body, "id", 0, MAX_STEP)
        if frame.kind == Kind.SNAPSHOT:
            if len(frame.fds) != 1:
                raise ProtocolError("SNAPSHOT needs exactly one segment descriptor")
            try:
                request = SnapshotRequest.from_body(frame.body)
                view = self._maps.view(frame.fds[0], request.shard.nbytes)
            except ProtocolError as e:
                self.reply_error(request_id, e)
                return
            self.who = f"{request.shard.job} rank {request.shard.rank}"
            skipped, stall = self._reported
            self.agent.metrics.rank_reported(request.skipped - skipped, request.stall_s - stall)
            self._reported = (max(skipped, request.skipped), max(stall, request.stall_s))
            staged = Staged(request_id, request.shard, view, request.ready, emergency=request.emergency,
                            checksum=request.checksum, restored=request.restored)
            self._staging[request_id] = staged
            self._snapshots.put(staged)
        elif frame.kind == Kind.PROGRESS:
            staged = self._staging.get(request_id)
            if staged is not None:
                progress = Progress.from_body(frame.body, staged.header.nbytes)
                staged.advance(progress.ready, progress.failed, progress.crc)
        elif frame.kind == Kind.RESTORE:
            self._help(request_id, frame, self._restore)
        elif frame.kind == Kind.WAIT:
            self._help(request_id, frame, self._wait)
        elif frame.kind == Kind.PING:
            self.reply(request_id, {"pid": os.getpid()})
        elif frame.kind == Kind.RESHAPE:  # from the launcher beside us, not from a rank
            self.agent.reshape(field_int(frame.body, "generation", 0, MAX_STEP))
            self.reply(request_id)
        else:
            raise ProtocolError(f"unexpected {frame.kind.name}")

    def _help(self, request_id: int, frame: Frame, work: Callable[[int, dict[str, Any]], None]) -> None:
        """Run ``work(request_id, body)`` on a helper thread of its own, if this connection and the agent each
        have one to spare (see the module's text); else refuse the request with BusyError."""
        what = frame.kind.name
        if not self._helpers.acquire(blocking=False):
            self.reply_error(request_id, BusyError(f"this rank has {MAX_RANK_HELPERS} RESTORE and WAIT requests "
                                                   f"running in dash-agent already: {what} refused"))
            return
        if not self.agent.helpers.acquire(blocking=False):
            self._helpers.release()
            self.reply_error(request_id, BusyError(f"dash-agent runs {MAX_HELPERS} RESTORE and WAIT requests of "
                                                   f"this node's ranks already: {what} refused"))
            return

        def run() -> None:
            try:
                work(request_id, frame.body)
            finally:
                self.agent.helpers.release()
                self._helpers.release()

        try:
            threading.Thread(target=run, name=f"agent-{what.lower()}", daemon=True).start()
        except RuntimeError as e:  # no thread to be had now
            self.agent.helpers.release()
            self._helpers.release()
            self.reply_error(request_id, BusyError(f"dash-agent cannot start a thread for {what}: {e}"))

    def _send_loop(self) -> None:
        client = self.agent.config.memd_client()
        try:
            while (staged := self._snapshots.get()) is not None:
                # This node's own copy runs beside the stream to dash-memd, and ends before the rank hears
                # anything: its buffer may change once it does.
                own = self.agent.keep_own(staged)
                try:
                    if self.agent.fleet_delivers(own) and self._deliver_on_the_fleet(client, staged, own):
                        continue
                    result = self._put_with_retry(client, staged)
                    reply = SnapshotReply(committed=bool(result.get("committed")), crc=result.get("crc"))
                    self.agent.own_kept(own, reply.crc, reply.committed)
                    self._answer(client, staged, reply)
                except DashError as e:
                    self.agent.metrics.failed()
                    if not staged.failed:
                        self.agent.report_failure(staged.header.job, e)
                    self.agent.own_kept(own, staged.crc, False)  # kept by the rank's checksum (if it sent one)
                    self.reply_error(staged.request_id, e)
                except Exception as e:  # a bug costs this shard, not the shards queued behind it
                    self.agent.metrics.failed()
                    log.exception("%s: delivering step %d failed", self.who, staged.header.step)
                    self.agent.own_kept(own, staged.crc, False)  # (once: a second call does nothing)
                    self.reply_error(staged.request_id, e)
                finally:
                    self._staging.pop(staged.request_id, None)
                    staged.view.release()
        finally:
            client.close()
            self._maps.close()
            self._half_over()

    def _deliver_on_the_fleet(self, client: MemdClient, staged: Staged, own: Any) -> bool:
        """With replicas: the shard is safe, and the rank answered, once dash-memd stored it or this node and R
        peers hold it (:mod:`dashrun.agent.peers.delivery`); False where the node's own copy was not kept
        (dash-memd then gets it from the rank's segment, as without replicas)."""
        held = self.agent.own_held(own, staged.rank_crc() if staged.checksum else None)
        if held is None:
            return False
        answer = self.agent.deliver(self, held)
        self._answer(client, staged, SnapshotReply(committed=bool(answer and answer.get("committed")), crc=held.crc))
        return True

    def _answer(self, client: MemdClient, staged: Staged, reply: SnapshotReply) -> None:
        """The shard is safe: the rank may reuse its buffer."""
        self.reply(staged.request_id, reply.to_body())
        self.agent.metrics.stored(time.monotonic() - staged.handed_at, staged.emergency)
        if staged.emergency:
            self.agent.emergency_stored(staged.header)
        if reply.committed:
            self._say_committed(client, staged)

    @staticmethod
    def _say_committed(client: MemdClient, staged: Staged) -> None:
        """One line per checkpoint, from the agent whose shard completed it: its size in all and how long the last
        shard took from the rank's hand-over to the commit. Only at INFO (the size is one request more)."""
        if not log.isEnabledFor(logging.INFO):
            return
        header, took = staged.header, time.monotonic() - staged.handed_at
        try:
            info = client.latest(header.job, header.step)
        except Exception:  # noqa: BLE001 - the shard is delivered and answered: a line must not fail it
            info = None
        size = format_size(info.nbytes) if info is not None and info.step == header.step else "size unknown"
        log.info("%s: step %d committed (%s, %.0f ms)", header.job, header.step, size, took * 1000)

    def _put_with_retry(self, client: MemdClient, staged: Staged) -> dict[str, Any]:
        def put() -> dict[str, Any]:
            began = time.monotonic()
            answer = client.put_shard(staged.header, [staged.view], gate=staged.wait_ready,
                                      node=self.agent.config.node, crc=staged.rank_crc if staged.checksum else None,
                                      restored=staged.restored, domain=self.agent.domain)
            self.agent.metrics.streamed(staged.header.nbytes, time.monotonic() - began)
            return answer
        try:
            try:
                return put()
            except UnavailableError:
                if staged.failed:
                    raise
                # A kept-alive connection may have been closed by dash-memd (idle, restart): one fresh try.
                return put()
        except ConflictError:
            # dash-memd refuses a copy of a shard it already holds: the first try may have got through
            # before its connection broke. Stored is stored, if the committed shard is this one.
            stored = self._already_committed(client, staged)
            if stored is None:
                raise
            return stored

    @staticmethod
    def _already_committed(client: MemdClient, staged: Staged) -> dict[str, Any] | None:
        header = staged.header
        info = client.latest(header.job, header.step)
        if info is None or info.step != header.step or header.rank >= len(info.shards):
            return None
        shard = info.shards[header.rank]
        ours = staged.crc if staged.crc is not None else crc32c(staged.view)
        if shard.nbytes != header.nbytes or shard.crc != ours:
            return None
        return {"committed": True, "crc": shard.crc}

    def _restore(self, request_id: Any, body: dict[str, Any]) -> None:
        try:
            request = RestoreRequest.from_body(body)
            lease = self.agent.restores.get(request.job, request.step, request.ranks, request.ranges or (),
                                            direct=request.direct)
            if lease is None:
                self.reply(request_id, RestoreReply(found=False).to_body())
            else:
                with lease:  # our own descriptor: the cache may drop the image while we send it
                    holders = self.agent.restores.direct_holders(lease.info) if lease.direct else {}
                    reply = RestoreReply(found=True, checkpoint=lease.info, tails=tuple(lease.tails),
                                         direct=lease.direct, holders=holders, node=self.agent.config.node)
                    self.reply(request_id, reply.to_body(), fds=[lease.fd])
                # A rank restoring sharded state asks again for its pieces (in several requests if they are
                # many): the image stays for that.
                if (request.ranges is not None and not request.more) or not any(s.pieces_len
                                                                                 for s in lease.info.shards):
                    self.agent.restores.handed_out(lease.image, request.local_ranks)
        except DashError as e:
            self.reply_error(request_id, e)
        except Exception as e:
            log.exception("restore failed")
            self.reply_error(request_id, e)

    def _wait(self, request_id: Any, body: dict[str, Any]) -> None:
        try:
            request = WaitRequest.from_body(body)
            with self.agent.config.memd_client() as client:
                committed = wait_committed(client, request.job, request.step, request.timeout,
                                           fleet=self.agent.config.replicas > 0)
            self.reply(request_id, WaitReply(committed).to_body())
        except DashError as e:
            self.reply_error(request_id, e)
