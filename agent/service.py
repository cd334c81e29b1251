"""dash-agent's service to the ranks of its node: the socket, the notices, stopping.

:class:`AgentServer` listens on a Unix socket that only this user's ranks may
use and serves each rank's connection in a thread of its own
(:class:`dashrun.agent.ranks.RankConnection`: shards out to dash-memd,
restores and waits in). It watches the cloud's interruption notices
(:mod:`dashrun.agent.pollers`), tells every rank the most serious one, records
it in dash-memd and in the node's preemption record, and, once the node's
emergency checkpoint is committed, lets the cloud go ahead (Azure). With a
store (``--peer-memory-limit``, or ``--replicas``) it keeps a copy of each
shard its ranks hand over (:mod:`dashrun.agent.peers.own`); with a job and
replicas it also serves the job's other agents (:mod:`dashrun.agent.peers`)
and sends its own shards to its holders in the background. On
:meth:`~AgentServer.stop` it takes no more connections and delivers what the
ranks already handed over, within the drain timeout. A rank's connection is
forgotten (and closed) once the rank is gone and what it handed over is
delivered, so workers restarting all day cost the agent nothing; nothing
that goes wrong with one connection stops the agent taking the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import struct
import threading
import time

from typing import Callable

from dashrun.agent.announcer import Announcer
from dashrun.agent.config import AgentConfig
from dashrun.agent.identity import this_domain
from dashrun.agent.metrics import AgentMetrics
from dashrun.wire.domain import FailureDomain
from dashrun.wire.peer_client import PeerClient
from dashrun.agent.peers.delivery import MemdFeed, Outcome
from dashrun.agent.peers.own import OwnCopy
from dashrun.agent.peers.placement import Member as Placed
from dashrun.agent.peers.placement import choose_holders
from dashrun.agent.peers.replicas import Peer, Replicator
from dashrun.agent.peers.server import PeerServer
from dashrun.data.files import cache_from_env
from dashrun.data.objects import ObjectServer
from dashrun.agent.peers.store import Store
from dashrun.agent.pollers import Poller, make_poller
from dashrun.agent.ranks import MAX_HELPERS, RankConnection, Staged
from dashrun.agent.restores import RestoreCache
from dashrun.env import DEFAULT_PEER_PORT, PreemptionRecord
from dashrun.errors import DashError, UsageError
from dashrun.util.daemon import private_listener
from dashrun.util.files import write_atomic
from dashrun.util.problems import ProblemLog
from dashrun.util.units import format_size
from dashrun.wire.credentials import Credential
from dashrun.wire.holdings import Announced, HeldShard
from dashrun.wire.messages import CheckpointInfo, Notice, ShardHeader

__all__ = ["AgentServer", "outbound_address"]

log = logging.getLogger(__name__)

#: Pause after a failed accept (out of descriptors, a connection reset before it was taken) before the next.
ACCEPT_PAUSE = 0.05


class AgentServer:
    """The node's agent: :meth:`start` serves the socket (and watches notices) in threads, :meth:`stop` drains."""

    def __init__(self, config: AgentConfig):
        self.config = config
        #: shards in this agent's memory: its node's own snapshot and other nodes' replicas (None: none kept)
        self.store: Store | None = Store(config.store_limit) if config.store_limit > 0 else None
        self._store_problems = ProblemLog(log)
        #: (node, host, port) of the agents this node's replicas go to, in order of preference; the fleet's
        #: registry replaces this function (by default: the --peer options)
        self.holders: Callable[[], list[Peer]] = lambda: list(self.config.peers) or list(self._placement)
        #: per saved rank, the peers that hold its shard of a checkpoint a restore reads (by default: --peer)
        self.restore_holders: Callable[[CheckpointInfo], dict[int, list[Peer]]] = self._given_holders
        self.peer_server: PeerServer | None = None
        #: the node's data set cache (DASH_DATA_CACHE, as dashrun hands it on), served to the job's other nodes
        self.data = ObjectServer(cache_from_env)
        self.replicator: Replicator | None = None
        self.announcer: Announcer | None = None
        self._feeds: dict[RankConnection, MemdFeed] = {}  # per rank's connection: dash-memd fed from the store
        self.domain: FailureDomain | None = None  # this node's, read once at start (None: not yet)
        self._placement: list[Peer] = []  # where this node's replicas go, from the newest announcement's answer
        self._credential: Credential | None = None
        self.restores = RestoreCache(config, store=self.store, holders=lambda info: self.restore_holders(info),
                                     peer_connect=self.peer_client)
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._connections: list[RankConnection] = []
        self._lock = threading.Lock()
        self._failures = ProblemLog(log)
        self.helpers = threading.BoundedSemaphore(MAX_HELPERS)  # RESTORE and WAIT threads of every connection
        self.notice: Notice | None = None      # the most serious notice this node received
        self._poller: Poller | None = None
        self._acknowledged = False  # the cloud was told the node's state is safe (guarded by _lock)
        #: the newest world generation whose ranks must end at their next checkpoint (a node joins the job)
        self.reshape_generation: int | None = None
        #: this node's saves, stall, stream and notices, served with --metrics-listen (dashrun.agent.metrics)
        self.metrics = AgentMetrics()

    def report_failure(self, job: str, err: DashError) -> None:
        """Log a delivery failure once per job and kind, not once per shard."""
        self._failures.problem(job, err.code.value, "%s: shards are not reaching dash-memd at %s:%d: %s", job,
                               self.config.memd_host, self.config.memd_port, err, level=logging.ERROR)

    @property
    def peer_address(self) -> tuple[str, int] | None:
        """(host, port) the peer link listens on (None: it does not), as the fleet's registry lists it."""
        return self.peer_server.address if self.peer_server is not None else None

    def peer_client(self, host: str, port: int) -> PeerClient:
        """A new client of the agent at ``host:port`` of this job (the caller closes it)."""
        # Never dash-memd's TLS settings: a peer's certificate is its own, authenticated by the login.
        return PeerClient(host, port, self._job_credential(), timeout=self.config.memd_timeout)

    def _job_credential(self) -> Credential:
        """The job's credential, which the peer link logs in with; UsageError without a job (or another's)."""
        if self._credential is None:
            if self.config.job is None:
                raise UsageError("the peer link needs the agent's job", hint="give --job-id")
            self._credential = Credential.parse(self.config.token).for_job(self.config.job)
        return self._credential

    def _given_holders(self, info: CheckpointInfo) -> dict[int, list[Peer]]:
        """--peer's agents, which tests give in place of the fleet's registry, as holders of every shard."""
        return {rank: list(self.config.peers) for rank in range(info.world)} if self.config.peers else {}

    # --- the fleet's registry ------------------------------------------------------------------

    def _join_fleet(self) -> None:
        """Read this node's failure domain once, then announce what it holds every few seconds."""
        config = self.config
        self._read_domain()
        self.announcer = Announcer(config.memd_client, config.job, config.node, address=self._announced_address,
                                   held=self._held, answered=self._on_answer, replicas=config.replicas,
                                   domain=self.domain if self.domain.known else None)
        self.store.changed = self.announcer.changed
        if not self._stopping.is_set():
            self.announcer.start()

    def _read_domain(self) -> None:
        config = self.config
        self.domain = this_domain(config.failure_domain, config.cloud, config.metadata_endpoint,
                                  instance_type=config.instance_type, market=config.market)

    def _announced_address(self) -> tuple[str, int]:
        return self.peer_address or ("-", 0)  # port 0: no peer reads from this node

    def _held(self) -> list[HeldShard]:
        return [HeldShard(held.header, held.owner, held.committed) for held in self.store.holdings(self.config.job)]

    def _on_answer(self, answer: Announced) -> None:
        """dash-memd's answer: older copies go once a newer step is committed; this node's replicas go to the
        holders placement chooses from the members (another zone and pool first)."""
        if answer.committed is not None:
            self.store.committed(self.config.job, answer.committed)
        reachable = {m.node: m for m in answer.members if m.port}
        placed = choose_holders(self.config.node, [Placed(self.config.node, self.domain or FailureDomain()),
                                                   *(Placed(m.node, m.domain or FailureDomain())
                                                     for m in reachable.values())], self.config.replicas)
        placement = [(node, reachable[node].host, reachable[node].port) for node in placed]
        if placement != self._placement:
            log.info("this node's replicas go to %s", ", ".join(p[0] for p in placement) or "no other node yet")
        self._placement = placement

    def _start_peers(self) -> None:
        """Serve the job's other agents, and send them this node's replicas (a job with replicas only)."""
        config = self.config
        if config.replicas <= 0 or self.store is None:
            return
        host = config.peer_host or outbound_address(config.memd_host, config.memd_port)
        self.peer_server = PeerServer(self.store, self._job_credential(), host, config.peer_port, data=self.data)
        try:
            self.peer_server.start()
        except UsageError as e:
            if config.peer_port != DEFAULT_PEER_PORT:
                raise  # a port the user chose, that this agent cannot have: its error at start
            # The default taken (another node's agent on this machine): any port does, since the job's other
            # agents learn it from dash-memd's registry.
            self.peer_server = PeerServer(self.store, self._job_credential(), host, 0, data=self.data)
            self.peer_server.start()
            log.warning("%s; listening for peers on port %d instead", e.message, self.peer_server.port)
        self.replicator = Replicator(self.store, config.node, config.replicas, lambda: self.holders(),
                                     self.peer_client).start()
        log.info("serving the job's other agents on %s:%d (%s for shards, %d replica%s of each)",
                 *self.peer_server.address, format_size(self.store.limit), config.replicas,
                 "" if config.replicas == 1 else "s")

    def keep_own(self, staged: Staged) -> OwnCopy | None:
        """Start copying a handed-over shard into the store (None: no store, or the copies cannot fit)."""
        if self.store is None or not self._copies_fit(staged.header):
            return None
        return OwnCopy(self.store, staged.header, self.config.node, staged.view, staged.wait_ready,
                       self._store_problems)

    def _copies_fit(self, header: ShardHeader) -> bool:
        """Whether the copies a node keeps fit its store: its own ranks' shards and those of the R nodes it holds
        copies for, of the newest committed step and the one arriving. Said once, loud, where they do not: the
        node's shards then go to dash-memd alone, as without replicas."""
        with self._lock:
            ranks = max(1, sum(1 for conn in self._connections if conn.who.startswith(f"{header.job} rank ")))
        need = 2 * (1 + self.config.replicas) * ranks * header.nbytes
        if need <= self.store.limit:
            self._store_problems.ok("fit")
            return True
        self._store_problems.problem(
            "fit", "too small", "--replicas %d needs about %s of dash-agent's memory on this node (2 steps x %d "
            "copies x %d rank%s x %s), and --peer-memory-limit is %s: this node's shards go to dash-memd alone "
            "(hint: raise --peer-memory-limit, or give --replicas 0)", self.config.replicas, format_size(need),
            1 + self.config.replicas, ranks, "" if ranks == 1 else "s", format_size(header.nbytes),
            format_size(self.store.limit), level=logging.ERROR)
        return False

    def fleet_delivers(self, own: OwnCopy | None) -> bool:
        return own is not None and self.replicator is not None and own.header.job == self.config.job

    def own_held(self, own: OwnCopy, crc: int | None) -> ShardHeader | None:
        return own.finish(crc)

    def deliver(self, conn: RankConnection, held: ShardHeader) -> dict | None:
        outcome = Outcome(self.config.replicas)
        self._feed(conn).submit(held, outcome)
        self.replicator.submit(held, done=outcome.replicated)
        answer = outcome.wait()
        if answer is not None and answer.get("committed"):
            self.store.committed(held.job, held.step)
        return answer

    def _feed(self, conn: RankConnection) -> MemdFeed:
        """The connection's feed of dash-memd from the store (made at its first shard, closed with it)."""
        with self._lock:
            feed = self._feeds.get(conn)
            if feed is None:
                feed = self._feeds[conn] = MemdFeed(self.store, self.config.memd_client, self.config.node,
                                                    stored=self._memd_stored)
        return feed

    def _memd_stored(self, header: ShardHeader, answer: dict) -> None:
        if answer.get("committed"):  # dash-memd caught up: older copies may go
            self.store.committed(header.job, header.step)

    def own_kept(self, own: OwnCopy | None, crc: int | None, committed: bool) -> None:
        """Keep ``own`` if its CRC-32C is ``crc``; its replicas then go out in the background."""
        if own is None:
            return
        header = own.finish(crc)
        if header is None:
            return
        if committed:
            self.store.committed(header.job, header.step)
        if self.replicator is not None and header.job == self.config.job:
            self.replicator.submit(header)

    def start(self) -> None:
        if self.config.job is not None:
            self._start_peers()  # first: a port it cannot have is the agent's error at start
        if self.config.metrics is not None:
            self.metrics.serve(self.config.metrics)
        path = self.config.socket_path
        if self.config.listen_fd is None:
            listener = private_listener(path)  # for this user's ranks only
        else:
            listener = _inherited_listener(self.config.listen_fd)
        self._listener = listener
        threading.Thread(target=self._accept_loop, args=(listener,), name="agent-accept", daemon=True).start()
        log.info("serving ranks on %s, forwarding to dash-memd at %s:%d", path, self.config.memd_host,
                 self.config.memd_port)
        if self.config.job is not None and self.config.prefetch:
            threading.Thread(target=self.restores.prefetch, args=(self.config.job,), name="agent-prefetch",
                             daemon=True).start()
        if self.config.cloud != "none":
            # Detecting the cloud can take a second: ranks are served meanwhile.
            threading.Thread(target=self._watch_notices, name="agent-notices", daemon=True).start()
        if self.config.job is not None and self.store is not None:
            threading.Thread(target=self._join_fleet, name="agent-fleet", daemon=True).start()
        elif self.config.job is not None:  # no fleet to join: the domain goes with the shards, for the job's ledger
            threading.Thread(target=self._read_domain, name="agent-domain", daemon=True).start()

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
        self.metrics.notice(info)
        for conn in connections:
            conn.send_notice(info)
        if not info.early_warning:
            self._mark_preempted(PreemptionRecord(PreemptionRecord.NOTICE, cloud=info.cloud, kind=info.kind.value,
                                                  deadline=info.deadline))
        if self.config.job:
            threading.Thread(target=self._record_notice, args=(info,), daemon=True).start()

    def reshape(self, generation: int) -> None:
        """The launcher's request: the world of ``generation`` ends at a checkpoint; every rank of it learns."""
        with self._lock:
            if self.reshape_generation is not None and generation <= self.reshape_generation:
                return
            self.reshape_generation = generation
            connections = list(self._connections)
        log.info("the job's world grows: the ranks of generation %d checkpoint and restart", generation)
        for conn in connections:
            conn.send_reshape(generation)

    def _record_notice(self, info: Notice) -> None:
        try:
            with self.config.memd_client() as client:
                client.notice(self.config.job, info)
        except DashError as e:
            log.warning("could not record the notice in dash-memd: %s", e)

    def _mark_preempted(self, record: PreemptionRecord) -> None:
        if not self.config.preempted_file.exists():
            write_atomic(self.config.preempted_file, record.to_json())

    def emergency_stored(self, header: ShardHeader) -> None:
        """A rank of this node took its emergency checkpoint: this node stops, and the cloud may be told."""
        self._mark_preempted(PreemptionRecord(PreemptionRecord.JOB, step=header.step))
        with self._lock:  # every rank's sender reports its emergency shard: one acknowledgement
            notice = self.notice
            if self._poller is None or notice is None or self._acknowledged:
                return
            self._acknowledged = True
        threading.Thread(target=self._acknowledge, args=(header, notice), daemon=True).start()

    def _acknowledge(self, header: ShardHeader, notice: Notice) -> None:
        """Azure: start the event early once the whole checkpoint is committed (the others do nothing)."""
        try:
            left = notice.seconds_left()
            with self.config.memd_client() as client:
                committed = client.wait(header.job, header.step, max(1.0, left if left is not None else 60.0))
            if committed and self._poller.acknowledge(notice):
                log.info("told %s the state is safe (step %d committed)", notice.cloud, header.step)
        except DashError as e:
            log.warning("could not acknowledge the notice: %s", e)

    # --- ranks' connections ---------------------------------------------------------------

    def connection_finished(self, conn: RankConnection) -> None:
        """A rank's connection is over and closed: forget it (notices go to live connections only); what its
        feed of dash-memd still holds is delivered first, within the drain timeout."""
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
                self.metrics.rank_connected(-1)
            feed = self._feeds.pop(conn, None)
        if feed is not None:
            feed.close(self.config.drain_timeout)

    def _accept_loop(self, listener: socket.socket) -> None:
        """Serve each rank that connects until :meth:`stop`; a connection that fails costs only itself."""
        problems = ProblemLog(log)
        while not self._stopping.is_set():
            try:
                self._accept_one(listener)
            except Exception as e:  # never the end of the loop: the node would stop checkpointing unseen
                if self._stopping.is_set():
                    return
                problems.problem("accept", type(e).__name__, "cannot take a rank's connection: %s", e)
                self._stopping.wait(ACCEPT_PAUSE)  # out of descriptors, say: do not spin
            else:
                problems.ok("accept")

    def _accept_one(self, listener: socket.socket) -> None:
        """Take one rank's connection and serve it in threads of its own."""
        sock, _ = listener.accept()
        try:
            if not _same_user(sock) or self._stopping.is_set():  # (stop()'s own wake-up call, say)
                sock.close()
                return
            conn = RankConnection(self, sock)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._connections.append(conn)
            self.metrics.rank_connected(+1)
        conn.start()  # if a thread cannot start, the connection closes and forgets itself

    def stop(self) -> None:
        """Stop accepting, deliver what ranks already handed over (within the drain timeout)."""
        self._stopping.set()
        if self._listener is not None:
            if self.config.listen_fd is None:
                try:
                    self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
                except OSError:
                    pass
            else:  # the launcher's socket outlives us (it may start another agent on it): wake the loop by calling
                with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                    wake.connect(str(self.config.socket_path))
            self._listener.close()
            if self.config.listen_fd is None:  # an inherited socket's path is its maker's
                self.config.socket_path.unlink(missing_ok=True)
        deadline = time.monotonic() + self.config.drain_timeout
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.finish()
        for conn in connections:
            conn.wait_finished(max(0.0, deadline - time.monotonic()))
        with self._lock:
            feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:  # dash-memd's copies of what the fleet holds, within the drain timeout
            feed.close(max(0.0, deadline - time.monotonic()))
        self.metrics.close()
        if self.replicator is not None:
            self.replicator.wait_idle(max(0.0, deadline - time.monotonic()))
            self.replicator.stop()
        if self.announcer is not None:
            self.announcer.stop()
        if self.peer_server is not None:
            self.peer_server.stop()
        self.restores.expire(everything=True)
        self.restores.clients.close()
        if self.store is not None:
            self.store.close()
        if self._poller is not None:
            self._poller.stop(timeout=2.0)


def outbound_address(host: str, port: int) -> str:
    """The address of this machine that connections to ``host:port`` go out from (a route lookup: nothing is
    sent), so that the peer link listens where the job's other nodes reach this one."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as e:
        raise UsageError(f"cannot tell which address of this node reaches dash-memd at {host}:{port}: "
                         f"{e.strerror or e}", hint="check --memd") from None


def _inherited_listener(fd: int) -> socket.socket:
    """The launcher's listening Unix socket at descriptor ``fd``; a one-line error if that is not one."""
    try:
        listener = socket.socket(fileno=fd)
    except OSError as e:
        raise UsageError(f"--listen-fd {fd}: {e.strerror or e}", hint="dashrun passes the descriptor itself") from None
    if (listener.family != socket.AF_UNIX or listener.type != socket.SOCK_STREAM
            or not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        listener.detach()
        raise UsageError(f"--listen-fd {fd} is not a listening Unix stream socket",
                         hint="dashrun passes the descriptor itself")
    return listener


def _same_user(sock: socket.socket) -> bool:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)
