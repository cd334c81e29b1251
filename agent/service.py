"""dash-agent's service to the ranks of its node.

Ranks connect to a Unix socket. A rank hands over a staged shard by sending
a SNAPSHOT frame with the shared-memory segment's file descriptor attached
(SCM_RIGHTS): the bytes never pass through the socket. Each rank connection
has its own sender thread and its own connection to dash-memd, which streams
the segment straight from the agent's mapping of it (memoryview sends, no
copy in user space; ``sendfile`` measured no faster on loopback) and answers
the rank — "your buffer may be reused" — once dash-memd has stored and
verified the shard. The checksum dash-memd verifies is the rank's, computed as
it staged (sent with its last PROGRESS), so the agent makes no pass of its own
over the bytes; a rank without dashrun's C helper leaves it to the agent. The
agent holds its own descriptor of the segment, so a shard handed over is still
delivered if its rank dies right after.

RESTORE fetches a committed checkpoint from dash-memd once per node into a
new segment that every local rank maps, so a node downloads the state once
however many ranks it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import queue
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from dashrun.agent.pollers import Poller, make_poller
from dashrun.env import PreemptionRecord
from dashrun.errors import ChecksumError, DashError, NotFoundError, ProtocolError, UnavailableError
from dashrun.util.files import unmap, write_atomic
from dashrun.wire import image
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import CheckpointInfo, Notice, ShardHeader
from dashrun.wire.protocol import MAX_STEP, MAX_WORLD, Kind, field_bool, field_float, field_int, field_job, field_step

log = logging.getLogger(__name__)

#: Longest a handed-over shard may wait for its rank's next staging progress.
STAGING_TIMEOUT = 300.0
#: Corrupt newest checkpoints a restore skips before it gives up.
CORRUPT_FALLBACKS = 5


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    memd_host: str
    memd_port: int
    token: bytes = dataclasses.field(repr=False)
    socket_path: Path = Path("agent.sock")
    #: seconds one request to dash-memd may stay silent before it counts as lost
    memd_timeout: float = 60.0
    #: seconds a fetched restore image is kept for the node's other ranks
    restore_ttl: float = 120.0
    #: seconds to finish handed-over shards on SIGTERM
    drain_timeout: float = 60.0
    #: this node's name, as dash-memd lists it among the job's nodes
    node: str = dataclasses.field(default_factory=socket.gethostname)
    #: the job this agent serves (its notices are recorded on it in dash-memd)
    job: str | None = None
    #: where interruption notices come from: auto, aws, gcp, azure or none; and an endpoint override
    cloud: str = "none"
    metadata_endpoint: str | None = None
    #: seconds between polls of the metadata service (None: each cloud's own default)
    poll_interval: float | None = None

    @property
    def preempted_file(self) -> Path:
        """Written when this node must stop: its notice arrived, or its ranks took an emergency checkpoint."""
        return self.socket_path.parent / PreemptionRecord.FILE


@dataclasses.dataclass
class RestoreImage:
    """A committed checkpoint laid out for ranks: the replicated state, then each shard's tail."""

    info: CheckpointInfo
    fd: int
    tails: list[int]  # offset of each old rank's private bytes + meta in the image
    created: float = dataclasses.field(default_factory=time.monotonic)
    handed_out: int = 0  # ranks that received a descriptor of it

    def describe(self) -> dict[str, Any]:
        return {"checkpoint": self.info.to_body(), "tails": self.tails}


class RestoreCache:
    """One fetch per (job, step) per node; kept briefly for the other local ranks."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}
        self._images: dict[tuple[str, int], RestoreImage] = {}

    def _client(self) -> MemdClient:
        return MemdClient(self.config.memd_host, self.config.memd_port, self.config.token,
                          timeout=self.config.memd_timeout)

    def get(self, job: str, step: int | None) -> RestoreImage | None:
        """The image of a committed checkpoint (the newest, or ``step``); None if the job has none.

        A newest checkpoint whose bytes fail their checksum (dash-memd drops
        one that fails in its object tier), or that is gone by the time it is
        read, gives way to the newest one then.
        """
        self.expire()
        with self._client() as client:
            for attempt in range(1, CORRUPT_FALLBACKS + 1):
                info = client.latest(job, step)
                if info is None:
                    return None
                try:
                    return self._get(client, info)
                except (ChecksumError, NotFoundError) as e:  # corrupt, or dropped since LATEST answered
                    if step is not None or attempt == CORRUPT_FALLBACKS:
                        raise
                    log.error("%s step %d cannot be restored (%s); trying the newest checkpoint before it", job,
                              info.step, e)
        return None

    def _get(self, client: MemdClient, info: CheckpointInfo) -> RestoreImage:
        job = info.job
        with self._lock:
            job_lock = self._fetching.setdefault(job, threading.Lock())
        with job_lock:
            with self._lock:
                image = self._images.get((job, info.step))
            if image is None or image.info.committed_at != info.committed_at:
                image = self._fetch(client, info)
                with self._lock:
                    old = self._images.pop((job, info.step), None)
                    self._images[(job, info.step)] = image
                if old is not None:
                    os.close(old.fd)
            return image

    def _fetch(self, client: MemdClient, info: CheckpointInfo) -> RestoreImage:
        tails, size = image.layout(info)
        fd = os.memfd_create(f"dashrun-restore-{info.job}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(size, 1))
            started = time.monotonic()
            mapped = mmap.mmap(fd, max(size, 1))
            try:
                with memoryview(mapped) as view:
                    image.fetch(client, info, view, tails)
            finally:
                unmap(mapped)
            log.info("fetched %s step %d (%d bytes) in %.2fs", info.job, info.step, info.nbytes,
                     time.monotonic() - started)
        except BaseException:
            os.close(fd)
            raise
        return RestoreImage(info, fd, tails)

    def handed_out(self, image: RestoreImage, local_ranks: int) -> None:
        """Count a rank served; once every local rank has its own descriptor, the agent's goes."""
        with self._lock:
            image.handed_out += 1
            key = (image.info.job, image.info.step)
            if image.handed_out >= local_ranks and self._images.get(key) is image:
                del self._images[key]
                os.close(image.fd)

    def expire(self, everything: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            for key, held in list(self._images.items()):
                if everything or now - held.created > self.config.restore_ttl:
                    del self._images[key]
                    os.close(held.fd)


@dataclasses.dataclass
class Staged:
    """A shard a rank handed over, readable in the agent's mapping of its segment, perhaps still being staged."""

    request_id: int
    header: ShardHeader
    view: memoryview
    ready: int  # bytes [0, ready) of the shard are final
    emergency: bool = False  # taken because of an interruption notice
    checksum: bool = False  # the rank computes the shard's CRC-32C as it stages and sends it when done
    crc: int | None = None
    failed: bool = False
    cond: threading.Condition = dataclasses.field(default_factory=threading.Condition)

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


class SegmentMaps:
    """The agent's read-only mappings of a rank's staging segments, kept while the rank reuses them.

    A rank alternates between two segments; mapping each once avoids
    faulting its pages in again for every checkpoint.
    """

    KEEP = 2

    def __init__(self):
        self._maps: dict[tuple[int, int], mmap.mmap] = {}

    def view(self, fd: int, nbytes: int) -> memoryview:
        st = os.fstat(fd)
        if st.st_size < nbytes:
            raise ProtocolError("the segment is smaller than the shard it should hold")
        key = (st.st_dev, st.st_ino)
        mapped = self._maps.pop(key, None)
        if mapped is None or len(mapped) != st.st_size:
            mapped = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        self._maps[key] = mapped  # most recently used last
        while len(self._maps) > self.KEEP:
            unmap(self._maps.pop(next(iter(self._maps))))
        return memoryview(mapped)[:nbytes]

    def close(self) -> None:
        for mapped in self._maps.values():
            unmap(mapped)
        self._maps.clear()


class RankConnection:
    """One rank's connection: a reader (this thread), a sender thread, helpers for slow requests."""

    def __init__(self, agent: AgentServer, sock: socket.socket):
        self.agent = agent
        self.ch = Channel(sock)
        self._send_lock = threading.Lock()
        self._snapshots: queue.Queue[Staged | None] = queue.Queue()
        self._staging: dict[int, Staged] = {}
        self._maps = SegmentMaps()
        self.sender = threading.Thread(target=self._send_loop, name="agent-sender", daemon=True)
        self.who = "rank ?"

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

    def serve(self) -> None:
        self.sender.start()
        if self.agent.notice is not None:
            self.send_notice(self.agent.notice)  # a rank that (re)connects after the notice learns it now
        try:
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
        finally:
            for staged in list(self._staging.values()):
                staged.advance(failed=True)  # a shard its rank never finished staging must not go out
            self._snapshots.put(None)

    def _dispatch(self, frame: Frame) -> None:
        request_id = field_int(frame.body, "id", 0, MAX_STEP)
        if frame.kind == Kind.SNAPSHOT:
            if len(frame.fds) != 1:
                raise ProtocolError("SNAPSHOT needs exactly one segment descriptor")
            try:
                header = ShardHeader.from_body(frame.body.get("shard") or {})
                view = self._maps.view(frame.fds[0], header.nbytes)
            except ProtocolError as e:
                self.reply_error(request_id, e)
                return
            self.who = f"{header.job} rank {header.rank}"
            staged = Staged(request_id, header, view, field_int(frame.body, "ready", 0, header.nbytes),
                            emergency=field_bool(frame.body, "emergency", default=False),
                            checksum=field_bool(frame.body, "checksum", default=False))
            self._staging[request_id] = staged
            self._snapshots.put(staged)
        elif frame.kind == Kind.PROGRESS:
            staged = self._staging.get(request_id)
            if staged is not None:
                failed = frame.body.get("failed") is True
                crc = field_int(frame.body, "crc", 0, 0xFFFFFFFF) if frame.body.get("crc") is not None else None
                staged.advance(None if failed else field_int(frame.body, "ready", 0, staged.header.nbytes), failed,
                               crc)
        elif frame.kind == Kind.RESTORE:
            threading.Thread(target=self._restore, args=(request_id, frame.body), daemon=True).start()
        elif frame.kind == Kind.WAIT:
            threading.Thread(target=self._wait, args=(request_id, frame.body), daemon=True).start()
        elif frame.kind == Kind.PING:
            self.reply(request_id, {"pid": os.getpid()})
        else:
            raise ProtocolError(f"unexpected {frame.kind.name}")

    def _send_loop(self) -> None:
        client = self.agent.memd_client()
        try:
            while (staged := self._snapshots.get()) is not None:
                try:
                    result = self._put_with_retry(client, staged)
                    self.reply(staged.request_id, {"committed": bool(result.get("committed")),
                                                   "crc": result.get("crc")})
                    if staged.emergency:
                        self.agent.emergency_stored(staged.header)
                except DashError as e:
                    if not staged.failed:
                        self.agent.report_failure(staged.header.job, e)
                    self.reply_error(staged.request_id, e)
                finally:
                    self._staging.pop(staged.request_id, None)
                    staged.view.release()
        finally:
            client.close()
            self._maps.close()

    def _put_with_retry(self, client: MemdClient, staged: Staged) -> dict[str, Any]:
        def put() -> dict[str, Any]:
            return client.put_shard(staged.header, [staged.view], gate=staged.wait_ready, node=self.agent.config.node,
                                    crc=staged.rank_crc if staged.checksum else None)
        try:
            return put()
        except UnavailableError:
            if staged.failed:
                raise
            # A kept-alive connection may have been closed by dash-memd (idle, restart): one fresh try.
            return put()

    def _restore(self, request_id: Any, body: dict[str, Any]) -> None:
        try:
            step = field_step(body) if body.get("step") is not None else None
            local_ranks = field_int(body, "local_ranks", 1, MAX_WORLD, default=1)
            image = self.agent.restores.get(field_job(body), step)
            if image is None:
                self.reply(request_id, {"found": False})
            else:
                self.reply(request_id, {"found": True, **image.describe()}, fds=[image.fd])
                self.agent.restores.handed_out(image, local_ranks)
        except DashError as e:
            self.reply_error(request_id, e)
        except Exception as e:
            log.exception("restore failed")
            self.reply_error(request_id, e)

    def _wait(self, request_id: Any, body: dict[str, Any]) -> None:
        try:
            timeout = field_float(body, "timeout", 0.0, 3600.0)
            with self.agent.memd_client() as client:
                committed = client.wait(field_job(body), field_step(body), timeout)
            self.reply(request_id, {"committed": committed})
        except DashError as e:
            self.reply_error(request_id, e)


class AgentServer:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.restores = RestoreCache(config)
        self._listener: socket.socket | None = None
        self._connections: list[RankConnection] = []
        self._lock = threading.Lock()
        self._reported: dict[str, str] = {}
        self.notice: Notice | None = None      # the most serious notice this node received
        self._poller: Poller | None = None
        self._acknowledged = False

    def memd_client(self) -> MemdClient:
        return MemdClient(self.config.memd_host, self.config.memd_port, self.config.token,
                          timeout=self.config.memd_timeout)

    def report_failure(self, job: str, err: DashError) -> None:
        """Log a delivery failure once per job and kind, not once per shard."""
        if self._reported.get(job) != err.code.value:
            self._reported[job] = err.code.value
            log.error("%s: shards are not reaching dash-memd at %s:%d: %s", job, self.config.memd_host,
                      self.config.memd_port, err)

    def start(self) -> None:
        path = self.config.socket_path
        if path.exists():
            path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is for this user's ranks only
        try:
            listener.bind(str(path))
        finally:
            os.umask(old_umask)
        listener.listen(256)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="agent-accept", daemon=True).start()
        log.info("serving ranks on %s, forwarding to dash-memd at %s:%d", path, self.config.memd_host,
                 self.config.memd_port)
        if self.config.cloud != "none":
            # Detecting the cloud can take a second: ranks are served meanwhile.
            threading.Thread(target=self._watch_notices, name="agent-notices", daemon=True).start()

    # --- interruption notices -------------------------------------------------------------

    def _watch_notices(self) -> None:
        options = {"interval": self.config.poll_interval} if self.config.poll_interval else {}
        try:
            poller = make_poller(self.config.cloud, self.config.metadata_endpoint, **options)
        except DashError as e:
            log.error("interruption notices are not watched: %s", e)
            return
        if poller is None:
            log.info("no cloud metadata service answers: interruption notices are not watched")
            return
        log.info("watching %s interruption notices at %s", type(poller).__name__.removesuffix("Poller").upper(),
                 poller.base_url)
        self._poller = poller.start(self._on_notice)

    def _on_notice(self, notice: Notice) -> None:
        info = dataclasses.replace(notice, node=self.config.node)
        with self._lock:
            if not info.outranks(self.notice):
                return  # nothing more serious than what the ranks already know
            self.notice = info
            connections = list(self._connections)
        log.warning("%s", notice.describe())
        for conn in connections:
            conn.send_notice(info)
        if not info.early_warning:
            self._mark_preempted(PreemptionRecord(PreemptionRecord.NOTICE, cloud=info.cloud, kind=info.kind.value,
                                                  deadline=info.deadline))
        if self.config.job:
            threading.Thread(target=self._record_notice, args=(info,), daemon=True).start()

    def _record_notice(self, info: Notice) -> None:
        try:
            with self.memd_client() as client:
                client.notice(self.config.job, info)
        except DashError as e:
            log.warning("could not record the notice in dash-memd: %s", e)

    def _mark_preempted(self, record: PreemptionRecord) -> None:
        if not self.config.preempted_file.exists():
            write_atomic(self.config.preempted_file, record.to_json())

    def emergency_stored(self, header: ShardHeader) -> None:
        """A rank of this node took its emergency checkpoint: this node stops, and the cloud may be told."""
        self._mark_preempted(PreemptionRecord(PreemptionRecord.JOB, step=header.step))
        if self._poller is not None and self.notice is not None and not self._acknowledged:
            self._acknowledged = True
            threading.Thread(target=self._acknowledge, args=(header, self.notice), daemon=True).start()

    def _acknowledge(self, header: ShardHeader, notice: Notice) -> None:
        """Azure: start the event early once the whole checkpoint is committed (the others do nothing)."""
        try:
            left = notice.seconds_left()
            with self.memd_client() as client:
                committed = client.wait(header.job, header.step, max(1.0, left if left is not None else 60.0))
            if committed and self._poller.acknowledge(notice):
                log.info("told %s the state is safe (step %d committed)", notice.cloud, header.step)
        except DashError as e:
            log.warning("could not acknowledge the notice: %s", e)

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if not _same_user(sock):
                sock.close()
                continue
            conn = RankConnection(self, sock)
            with self._lock:
                self._connections.append(conn)
            threading.Thread(target=conn.serve, name="agent-rank", daemon=True).start()

    def stop(self) -> None:
        """Stop accepting, deliver what ranks already handed over (within the drain timeout)."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
            self.config.socket_path.unlink(missing_ok=True)
        deadline = time.monotonic() + self.config.drain_timeout
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn._snapshots.put(None)
        for conn in connections:
            if conn.sender.is_alive():
                conn.sender.join(timeout=max(0.0, deadline - time.monotonic()))
        self.restores.expire(everything=True)
        if self._poller is not None:
            self._poller.stop(timeout=2.0)


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)

