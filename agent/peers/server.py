"""The peer link's server: other agents of the job send this node replicas of their shards, and read them back.

The agent listens on TCP (``--peer-port``) once it serves a job with
replicas. Each connection goes as one to dash-memd does: TLS with a
certificate made in memory at start (no CA: the login signs its channel
binding, :mod:`dashrun.wire.tls`), the login with the job's credential
(:func:`dashrun.wire.auth.one_job`: a login for another job, or with the
cluster's token, is refused), then sealed records. Requests, one at a time:

- ``REPLICA_PUT`` {shard: header with its crc, owner: node, committed: the
  newest step of the job its owner knows committed, or none}, no data: room is
  reserved in the store (:mod:`dashrun.agent.peers.store`) and the answer is
  OK {accept}, or NoSpaceError before a byte is sent; then a second
  ``REPLICA_PUT`` {} with the shard's bytes as data (no more than announced),
  received into that room and answered OK {crc} only once their CRC-32C is
  the header's.
- ``REPLICA_GET`` {job, step, rank, crc, offset, length}: OK {nbytes, crc} with
  the bytes as data, their trailer the CRC-32C of the bytes as they arrived
  (from the shard's marks, :mod:`dashrun.wire.blocks`), so bytes changed in this
  agent's memory fail at the reader; NotFoundError when not held.
- ``DATA_OBJECT_GET``, ``DATA_OBJECT_PUT``, ``DATA_STATUS``: the node's data
  set cache, read by the job's other nodes and given second copies by them,
  as dash-memd's is (:class:`dashrun.data.objects.ObjectServer`).

Every field is bounded before use. At most ``max_connections`` connections are
served at once, and of them at most ``max_unauthenticated`` still logging in,
each within ``auth_timeout`` seconds; a connection beyond either is closed at
once.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

from dashrun.agent.peers.store import Store
from dashrun.data.objects import ObjectServer
from dashrun.errors import DashError, ForbiddenError, NotFoundError, ProtocolError, UnavailableError, UsageError
from dashrun.util.problems import ProblemLog
from dashrun.wire import blocks
from dashrun.wire.auth import one_job, server_handshake
from dashrun.wire.blocks import Marks
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.credentials import Credential
from dashrun.wire.messages import ShardHeader
from dashrun.wire.protocol import MAX_BYTES, MAX_WORLD, Kind, field_int, field_job, field_step, field_str
from dashrun.wire.tls import ServerTls, accept

__all__ = ["MAX_NODE", "NODE", "PeerServer", "replica_get_request", "replica_put_request"]

log = logging.getLogger(__name__)

#: Longest node name a peer may send, and what it may hold (a host name, printable, no spaces).
MAX_NODE = 255
NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@\[\]-]{0,254}")
#: Pause after a failed accept (out of descriptors) before the next.
ACCEPT_PAUSE = 0.05


def replica_put_request(body: dict) -> tuple[ShardHeader, str, int | None]:
    """The header, owner and newest committed step (None: not said) of a REPLICA_PUT body, every field checked."""
    raw = body.get("shard")
    if not isinstance(raw, dict) or type(raw.get("crc")) is not int:
        raise ProtocolError("REPLICA_PUT needs the shard's header with its crc")
    committed = field_step(body, "committed") if body.get("committed") is not None else None
    return ShardHeader.from_body(raw), field_str(body, "owner", MAX_NODE, NODE), committed


def replica_get_request(body: dict) -> tuple[str, int, int, int, int, int]:
    """(job, step, rank, crc, offset, length) of a REPLICA_GET body, every field checked."""
    return (field_job(body), field_step(body), field_int(body, "rank", 0, MAX_WORLD - 1),
            field_int(body, "crc", 0, 0xFFFFFFFF), field_int(body, "offset", 0, MAX_BYTES),
            field_int(body, "length", 0, MAX_BYTES))


class PeerServer:
    """Serves ``store`` to the agents of ``credential``'s job on ``host:port`` (0: any free port)."""

    def __init__(self, store: Store, credential: Credential, host: str, port: int, *, max_connections: int = 64,
                 max_unauthenticated: int = 16, auth_timeout: float = 10.0, idle_timeout: float = 300.0,
                 data: ObjectServer | None = None):
        if credential.job is None:
            raise ValueError("the peer link needs a job's credential")
        self.store, self.credential = store, credential
        self.data = data  # the node's data set cache, served to the job's other nodes (None: not served)
        self.job = credential.job
        self.host, self.port = host, port
        self.max_connections, self.max_unauthenticated = max_connections, max_unauthenticated
        self.auth_timeout, self.idle_timeout = auth_timeout, idle_timeout
        self.tls = ServerTls.load()  # made in memory: the login authenticates it
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._logging_in = 0
        #: requests served, by kind (for tests and the agent's log)
        self.served = {"put": 0, "get": 0, "refused": 0}

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on, once started."""
        return self.host, self.port

    def start(self) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(128)
        except OSError as e:
            listener.close()
            raise UsageError(f"dash-agent cannot listen for its peers on {self.host}:{self.port}: {e.strerror or e}",
                             hint="give another --peer-port (0: any free port)") from None
        self._listener = listener
        self.port = listener.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="peer-accept", daemon=True).start()
        return self.address

    def stop(self) -> None:
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            open_now = list(self._open)
        for sock in open_now:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        problems = ProblemLog(log)
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                problems.problem("accept", type(e).__name__, "cannot take a peer's connection: %s", e)
                self._stopping.wait(ACCEPT_PAUSE)
                continue
            with self._lock:
                admitted = len(self._open) < self.max_connections and self._logging_in < self.max_unauthenticated
                if admitted:
                    self._open.add(sock)
                    self._logging_in += 1
            if not admitted:
                problems.problem("busy", peer[0], "refused a peer's connection from %s: %d connections, %d logging "
                                 "in already", peer[0], len(self._open), self._logging_in)
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(sock, peer), name=f"peer-{peer[0]}:{peer[1]}",
                                 daemon=True).start()
            except RuntimeError:
                self._forget(sock, logging_in=True)
                sock.close()

    def _forget(self, sock: socket.socket, *, logging_in: bool) -> None:
        with self._lock:
            self._open.discard(sock)
            if logging_in:
                self._logging_in -= 1

    def _serve(self, sock: socket.socket, peer) -> None:
        who = f"peer {peer[0]}:{peer[1]}"
        ch = Channel(sock)
        logging_in = True

        def logged_in() -> None:
            nonlocal logging_in
            with self._lock:
                self._logging_in -= 1
            logging_in = False

        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.auth_timeout  # the whole login, however slowly it trickles in
            secured, binding = accept(sock, self.tls, deadline)
            with self._lock:
                self._open.discard(sock)
                self._open.add(secured)
            sock = secured
            ch = Channel(secured)
            ch.set_deadline(deadline - time.monotonic())
            server_handshake(ch, one_job(self.credential), "dash-agent", binding, admit=logged_in)
            ch.settimeout(self.idle_timeout)
            while not self._stopping.is_set():
                frame = ch.recv()  # a request carries no data (a replica's bytes follow its acceptance)
                try:
                    if frame.kind == Kind.REPLICA_PUT:
                        self._put(ch, frame)
                    elif frame.kind == Kind.REPLICA_GET:
                        self._get(ch, frame)
                    elif frame.kind in (Kind.DATA_OBJECT_GET, Kind.DATA_OBJECT_PUT, Kind.DATA_STATUS) \
                            and not frame.data_len:
                        self._data(ch, frame)
                    elif frame.kind == Kind.PING and not frame.data_len:
                        ch.send(Kind.OK, {})
                    else:
                        raise ProtocolError(f"unexpected {frame.kind.name} on the peer link")
                except (ProtocolError, UnavailableError):
                    raise
                except DashError as e:  # refused, the link still in step
                    self.served["refused"] += 1
                    ch.send_error(e)
        except UnavailableError as e:
            log.debug("%s: %s", who, e)
        except (DashError, OSError) as e:  # a wrong credential, a broken frame: that connection's end
            log.warning("%s: refused: %s", who, e)
        except Exception:  # a bug costs this connection, not the server
            log.exception("%s: internal error", who)
        finally:
            self._forget(sock, logging_in=logging_in)
            ch.close()

    def _data(self, ch: Channel, frame: Frame) -> None:
        if self.data is not None:
            self.data.handlers()[frame.kind](ch, frame)
        else:  # this node serves no data cache: it holds nothing and takes nothing
            raise NotFoundError("this node's agent serves no data cache")

    def _put(self, ch: Channel, frame: Frame) -> None:
        header, owner, committed = replica_put_request(frame.body)
        if header.job != self.job:
            raise ForbiddenError(f"this agent holds replicas of job {self.job} only")
        if committed is not None:  # before the room is sought: older steps may go
            self.store.committed(header.job, committed)
        with self.store.reserve(header, owner) as slot:
            ch.send(Kind.OK, {"accept": True})
            data = ch.recv(max_data=header.nbytes)
            if data.kind != Kind.REPLICA_PUT or data.data_len != header.nbytes or data.body:
                raise ProtocolError("expected the announced replica's bytes")
            marks = Marks("I")
            ch.recv_data_into(data, [slot.view], marks)
            held = slot.finish(marks, header.crc)
        self.served["put"] += 1
        ch.send(Kind.OK, {"crc": held.crc})

    def _get(self, ch: Channel, frame: Frame) -> None:
        if frame.data_len:
            raise ProtocolError("REPLICA_GET carries no data")
        job, step, rank, crc, offset, length = replica_get_request(frame.body)
        if job != self.job:
            raise ForbiddenError(f"this agent holds replicas of job {self.job} only")
        with self.store.open(job, step, rank, crc) as opened:
            if opened is None:
                raise NotFoundError(f"{job} step {step}, rank {rank}'s shard (crc {crc:#010x}) is not held here")
            view, marks, header = opened
            if offset + length > header.nbytes:
                raise ProtocolError(f"bytes [{offset}, {offset + length}) of a {header.nbytes}-byte shard")
            # The checksum of the bytes as they arrived: bytes changed here since fail at the reader.
            expected = blocks.range_crc(view, marks, offset, offset + length)
            self.served["get"] += 1
            ch.send(Kind.OK, {"nbytes": header.nbytes, "crc": header.crc}, data=[view[offset:offset + length]],
                    crc=expected)

