"""dash-memd's network server: authenticated clients, one thread each.

Every connection must prove it holds the cluster's token within
``auth_timeout`` before any state is touched; until then a body may not
exceed 4 KiB, no data is accepted, and the connection counts against a small
budget of its own (:mod:`dashrun.memd.admission`). Afterwards a client sends requests one at a time,
each validated field by field (:mod:`dashrun.wire.protocol`), answered with OK or ERROR. A request that
breaks the framing closes the connection; one that is merely refused (no space, not found) does not.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from typing import Callable

from dashrun import errors
from dashrun.errors import ChecksumError, DashError, ProtocolError, RecordTagError, UnavailableError
from dashrun.memd.admission import Admission, Slot
from dashrun.memd.config import MemdConfig
from dashrun.memd.datasets import DataListings
from dashrun.memd.fleet.requests import FleetRequests
from dashrun.memd.scope import authorize
from dashrun.memd.store.catalogue import Catalogue
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.util.files import read_or_create_id, write_atomic
from dashrun.util.problems import ProblemLog
from dashrun.wire import blocks
from dashrun.wire.auth import server_handshake
from dashrun.wire.blocks import Marks
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.messages import JobSpec, Notice, ShardHeader
from dashrun.wire.protocol import (
    MAX_BODY,
    Kind,
    crc32c,
    encode_body,
    field_bool,
    field_float,
    field_int,
    field_job,
    field_step,
    field_str,
)
from dashrun.wire.tls import ServerTls, accept

__all__ = ["ID_FILE", "LIST_PAGE_BYTES", "LIST_PAGE_JOBS", "LOCK_FILE", "MAX_WAIT", "MemdServer"]

log = logging.getLogger(__name__)

#: Pause after a failed accept (out of descriptors, say) before the next.
ACCEPT_PAUSE = 0.05
#: Pause of the disk writer's loop after an error it did not foresee, so that a lasting one does not spin.
DISK_LOOP_PAUSE = 0.5
#: Longest a WAIT request may block.
MAX_WAIT = 3600.0
#: File in the data dir that a running dash-memd holds locked (and writes its pid to).
LOCK_FILE = "LOCK"
#: File in the data dir with dash-memd's lasting id, which every login names (:mod:`dashrun.wire.auth`).
ID_FILE = "ID"
#: Most jobs one LIST reply summarises, and most bytes of summaries it carries (a quarter of MAX_BODY: the
#: rest of the reply is a few fields, and one summary alone is far smaller).
LIST_PAGE_JOBS = 1000
LIST_PAGE_BYTES = MAX_BODY // 4


class MemdServer:
    """dash-memd's listener, its connection threads, and the disk-writer and uploader threads."""

    def __init__(self, config: MemdConfig):
        self.config = config
        objects = None
        if config.s3:
            from dashrun.memd.store.tiers.object import ObjectTier  # boto3 only when asked for
            from dashrun.memd.store.tiers.signing import manifest_key
            objects = ObjectTier(config.s3, key=manifest_key(config.token))
        self.catalogue = Catalogue(RamTier(config.memory_limit), DiskTier(config.data_dir),
                                   keep_ram=config.keep_ram, keep_disk=config.keep_disk, objects=objects,
                                   keep_object=config.keep_object, upload_queue=config.upload_queue)
        self.fleet = FleetRequests(config.data_dir, self.catalogue.uploader)
        self.catalogue.receiver.fence = self.fleet.membership.check_shard
        self.fleet.catalogued = self.catalogue.latest
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._handlers: dict[Kind, Callable[[Channel, Frame], None]] = {
            Kind.PUT_SHARD: self._put_shard, Kind.LATEST: self._latest, Kind.GET_SHARD: self._get_shard,
            Kind.WAIT: self._wait, Kind.LIST: self._list, Kind.PING: self._ping,
            Kind.PUT_SPEC: self._put_spec,
            Kind.GET_SPEC: self._get_spec,
            Kind.DELETE: self._delete,
            Kind.NOTICE: self._notice,
            **self.fleet.handlers(),
            **DataListings(config.data_dir, config.data_cache, config.data_cache_limit).handlers(),
        }
        self.address: tuple[str, int] | None = None
        self.id = ""
        self.forbidden = 0  # requests refused for a credential that did not cover them
        #: records that failed their tag since start (altered on the path, or a bug): in every LIST reply
        self.tag_failures = 0
        self._tag_lock = threading.Lock()
        # Made (or loaded) before anything listens: a certificate that cannot be loaded is a usage error.
        self.tls = None if config.no_tls else ServerTls.load(config.tls_cert, config.tls_key, config.data_dir)
        self.metrics = None  # --metrics-listen's (dashrun.memd.metrics), from start() to stop()

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        self._lock_data_dir()
        self.id = read_or_create_id(self.config.data_dir / ID_FILE)
        self.catalogue.load_disk()
        self.fleet.load()
        if self.config.metrics is not None:  # prometheus-client only when asked for
            from dashrun.memd.metrics import MemdMetrics
            self.metrics = MemdMetrics(self, self.config.metrics)
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.config.host, self.config.port))
        except OSError as e:
            listener.close()
            raise errors.UsageError(f"cannot listen on {self.config.host}:{self.config.port}: {e.strerror}",
                                    hint="pick another --listen address or stop what holds the port") from None
        listener.listen(max(128, self.config.max_connections))
        self._listener = listener
        self.address = listener.getsockname()[:2]
        # Connection threads keep the platform's default stack (on Linux the stack rlimit, 8 MiB): a stack is
        # address space, touched only as deep as a thread goes, so a smaller one saves no memory and only lowers
        # how deep the C code a request runs through (the JSON parser, ssl) may recurse before the process dies
        # of SIGSEGV; CPython's own recursion limits assume the default.
        loops = [(self._accept_loop, "accept"), (self._disk_loop, "disk-writer")]
        if self.catalogue.objects is not None:
            loops.append((self._object_loop, "uploader"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=f"memd-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.config.ready_file:
            write_atomic(self.config.ready_file, f"{self.address[0]}:{self.address[1]}\n")
        log.info("listening on %s:%d, %s", *self.address, self._tls_banner())

    def _tls_banner(self) -> str:
        if self.tls is None:
            return ("plaintext (--no-tls): no encryption, anyone on the path reads what crosses; the token login "
                    "and each record's MAC still hold; clients must run with --no-tls too")
        what = "the operator's certificate" if self.tls.operator else f"its own certificate ({self.tls.kept})"
        return f"TLS with {what}, fingerprint {self.tls.fingerprint} (clients pin it: --tls-fingerprint)"

    def _lock_data_dir(self) -> None:
        """Refuse to share a data dir: two daemons writing one disk tier would lose checkpoints."""
        path = self.config.data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise errors.UsageError(f"data dir {self.config.data_dir} is in use by another dash-memd (pid {holder})",
                                    hint="stop it, or give this one its own --data-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd  # held (and the lock with it) until the process exits

    def connections(self) -> int:
        """Client connections open now, logged in or logging in."""
        return len(self._clients)  # one read of a set's size: no lock needed

    def stop(self) -> None:
        """Stop serving, then finish pending disk writes within the shutdown timeout."""
        self._stopping.set()
        if self.metrics is not None:
            self.metrics.close()
        self.catalogue.close()
        self.fleet.close()  # requests waiting for store keys return now
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress
            except OSError:
                pass
            self._listener.close()
        with self._clients_lock:
            for sock in self._clients:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        deadline = time.monotonic() + self.config.shutdown_timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.fleet.membership.flush()  # the run histories' last changes
        # tried for --shutdown-timeout: what is lost, by name
        for line in self.catalogue.disk_writer.unwritten_report():
            log.error("%s", line)
        uploader = self.catalogue.uploader
        if uploader is not None:
            if uploader.pending_uploads():
                log.warning("%d uploads were not done before shutdown; the newest checkpoint of each job on disk "
                            "goes up at the next start", uploader.pending_uploads())
            self.catalogue.objects.close()

    def _disk_loop(self) -> None:
        problems = ProblemLog(log)
        while not self._stopping.is_set():  # between writes, the shards listed at start are checked one by one
            try:
                self.catalogue.disk_writer.persist_next(timeout=0 if self.catalogue.verifier.next() else 0.5)
                self.fleet.rendezvous.flush()  # state files a failing disk left behind RAM, even with no new set
                problems.ok("loop")
            except Exception as e:  # no error may end the writer: nothing would reach the disk again
                problems.problem("loop", type(e).__name__, "disk writer: internal error: %s", e,
                                 level=logging.ERROR, exc_info=True)
                self._stopping.wait(DISK_LOOP_PAUSE)
        deadline = time.monotonic() + self.config.shutdown_timeout
        while self.catalogue.disk_writer.pending() and time.monotonic() < deadline:
            try:
                self.catalogue.disk_writer.persist_next(timeout=0.1)
            except Exception:
                log.exception("disk writer: internal error")
                time.sleep(DISK_LOOP_PAUSE)

    def _object_status(self) -> dict:
        """The object tier as ``dashrun status`` shows it."""
        uploader = self.catalogue.uploader
        return uploader.status() if uploader is not None else {"object_store": None}

    def _object_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.catalogue.uploader.next(timeout=0.5)
                self.fleet.membership.mirror_due()
            except Exception:  # a bug must not stop uploads for good
                log.exception("object tier: internal error")
                self._stopping.wait(5.0)

    def _accept_loop(self) -> None:
        # A connection counts against --max-unauthenticated until it logs in, then against --max-connections:
        # connections that never log in cannot keep clients out (dashrun.memd.admission).
        admission = Admission(self.config.max_connections, self.config.max_unauthenticated)
        problems = ProblemLog(log)
        while not self._stopping.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError as e:
                if self._stopping.is_set():
                    return
                problems.problem("accept", type(e).__name__, "cannot take a connection: %s", e)
                self._stopping.wait(ACCEPT_PAUSE)  # out of descriptors: do not spin
                continue
            problems.ok("accept")
            try:
                slot = admission.admit(sock, peer[0])
            except errors.BusyError as e:  # a source guessing tokens: closed before a byte is read
                problems.problem("guess", peer[0], "refused %s: %s", peer[0], e)
                sock.close()
                continue
            except OSError as e:  # out of descriptors: this connection cannot be served
                log.warning("refused %s:%d: %s", peer[0], peer[1], e)
                sock.close()
                continue
            thread = threading.Thread(target=self._serve, args=(sock, peer, slot), daemon=True,
                                      name=f"memd-conn-{peer[0]}:{peer[1]}")
            try:
                thread.start()
            except RuntimeError as e:  # no thread to be had: refuse this one, keep accepting
                log.warning("refused %s:%d: %s", peer[0], peer[1], e)
                slot.release()
                sock.close()

    # --- one connection ---------------------------------------------------------------

    def _serve(self, sock: socket.socket, peer, slot: Slot) -> None:
        with self._clients_lock:
            self._clients.add(sock)
        ch = Channel(sock)
        who = f"{peer[0]}:{peer[1]}"
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            # One deadline for the whole login, TLS handshake included, however slowly the bytes trickle in.
            deadline = time.monotonic() + self.config.auth_timeout
            secured, binding = self._secure(sock, deadline)
            ch = Channel(secured)
            ch.set_deadline(deadline - time.monotonic())
            # Logged in: from the unauthenticated budget to the authenticated one, or BusyError in place of WELCOME.
            try:
                job = server_handshake(ch, self.config.token, "dash-memd", binding, admit=slot.logged_in,
                                       server_id=self.id)
            except errors.AuthError:
                slot.login_failed()
                raise
            ch.settimeout(self.config.idle_timeout)
            while not self._stopping.is_set():
                frame = ch.recv()
                handler = self._handlers.get(frame.kind)
                if handler is None:
                    raise ProtocolError(f"unexpected {frame.kind.name} request")
                try:
                    authorize(job, frame)  # a job's credential: that job's requests only
                    began = time.monotonic()
                    handler(ch, frame)
                    if self.metrics is not None:
                        self.metrics.handled(frame, time.monotonic() - began)
                except errors.ForbiddenError as e:
                    log.warning("%s: refused %s: %s", who, frame.kind.name, e)
                    self.forbidden += 1
                    ch.send_error(e)
                except (ProtocolError, UnavailableError):
                    raise
                except DashError as e:  # refused, but the stream is still in step
                    ch.send_error(e)
                except OSError as e:  # dash-memd's own files (a full disk, say): refused, logged, served on
                    log.error("%s: %s failed: %s", who, frame.kind.name, e)
                    ch.send_error(_refusal(e))
        except RecordTagError as e:  # not the network: something on the path altered the stream (or a bug)
            with self._tag_lock:
                self.tag_failures += 1
            log.warning("%s: %s", who, e)
        except UnavailableError as e:
            log.debug("%s: %s", who, e)
        except errors.BusyError as e:  # logged in while every client slot is taken
            log.warning("%s: refused: %s", who, e)
            self._try_send_error(ch, e)
        except errors.UsageError as e:  # a client of the other mode (--no-tls), told so already
            log.warning("%s: refused: %s", who, e)
        except errors.AuthError:
            log.warning("%s: refused: wrong token (or a relay that intercepts TLS)", who)
        except ProtocolError as e:
            log.warning("%s: refused: %s", who, e)
            self._try_send_error(ch, e)
        except Exception as e:  # a bug must not take the daemon down with it
            log.exception("%s: internal error", who)
            self._try_send_error(ch, e)
        finally:
            with self._clients_lock:
                self._clients.discard(sock)
                self._clients.discard(ch.sock)
            ch.close()
            slot.release()

    def _secure(self, sock: socket.socket, deadline: float) -> tuple[socket.socket, bytes]:
        """The connection the login runs on (TLS unless --no-tls) and its binding: :func:`dashrun.wire.tls.accept`."""
        secured, binding = accept(sock, self.tls, deadline)
        if secured is not sock:
            with self._clients_lock:  # stop() must reach the TLS socket: the plain one no longer owns the descriptor
                self._clients.discard(sock)
                self._clients.add(secured)
        return secured, binding

    @staticmethod
    def _try_send_error(ch: Channel, err: BaseException) -> None:
        try:
            ch.settimeout(1.0)
            ch.send_error(err)
        except DashError:
            pass

    # --- requests ---------------------------------------------------------------------

    def _put_shard(self, ch: Channel, frame: Frame) -> None:
        header = ShardHeader.from_body(frame.body)
        node = field_str(frame.body, "node", 255) if frame.body.get("node") is not None else None
        restored, domain = self.fleet.shard_notes(frame.body)
        ticket = self.catalogue.receiver.begin_shard(header, cancel=lambda: _hang_up(ch))
        try:
            ch.send(Kind.OK, {"accept": True})
            data = ch.recv(max_data=header.nbytes)
            if data.kind != Kind.SHARD_DATA or data.data_len != header.nbytes:
                raise ProtocolError("expected the announced shard's data")
            marks = Marks("I")
            with memoryview(ticket.buffer) as view:
                crc = ch.recv_data_into(data, [view[:header.nbytes]], marks)
        except BaseException:
            self.catalogue.receiver.abort_shard(ticket)
            raise
        committed = self.catalogue.receiver.finish_shard(ticket, crc, marks)
        if node is not None:  # a node is listed once a shard of it was taken, not for announcing one
            self.catalogue.node_seen(header.job, node)
        ch.send(Kind.OK, {"committed": committed, "crc": crc})
        self.fleet.shard_stored(header, restored, domain, node)  # after the reply: its write never delays it

    def _latest(self, ch: Channel, frame: Frame) -> None:
        step = field_step(frame.body) if frame.body.get("step") is not None else None
        ch.send(Kind.OK, self.fleet.locate(field_job(frame.body), step,
                                           fleet=field_bool(frame.body, "fleet", default=False)))

    def _get_shard(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        offset = field_int(body, "offset", default=0)
        length = body.get("length")
        committed_at = field_float(body, "committed_at", 0.0, 1e11) if body.get("committed_at") is not None else None
        verify = field_bool(body, "verify", default=False)
        job, step, rank = field_job(body), field_step(body), field_int(body, "rank", 0, 1 << 16)
        with self.catalogue.open_shard(job, step, rank, committed_at=committed_at) as (view, crc, marks):
            whole = offset == 0 and length is None
            if offset > len(view):
                raise ProtocolError(f"offset {offset} is past the shard's {len(view)} bytes")
            length = field_int(body, "length", 0, len(view) - offset, default=len(view) - offset)
            # The whole shard carries its checksum from when it arrived (or was checked on disk or in the bucket
            # just now). So does a byte range from RAM, from the shard's marks (its edge blocks read and checked
            # here): bytes changed at rest fail at the reader. A range from disk or the bucket gets a checksum
            # computed as it goes out, which guards the transfer.
            expected = crc if whole else None
            if marks is not None:
                try:
                    if not whole:
                        expected = blocks.range_crc(view, marks, offset, offset + length)
                    # Asked again after the reader's check failed: the bytes themselves, all of them.
                    if verify and crc32c(view[offset:offset + length]) != expected:
                        raise ChecksumError(f"bytes {offset}-{offset + length} have changed in RAM since they "
                                            "arrived")
                except ChecksumError as e:
                    self.catalogue.ram_copy_failed(job, step, rank, marks, e)
                    raise ChecksumError(f"{job} step {step}, rank {rank}'s shard: {e}",
                                        hint="read it again: it is served from disk or the bucket now") from None
            reply = {"nbytes": len(view), "crc": crc, **({} if whole else {"offset": offset})}
            ch.send(Kind.OK, reply, data=[view[offset:offset + length]], crc=expected)

    def _wait(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        committed = self.catalogue.wait(field_job(body), field_step(body),
                                        field_float(body, "timeout", 0.0, MAX_WAIT),
                                        on_disk=field_bool(body, "on_disk", default=False))
        ch.send(Kind.OK, {"committed": committed})

    def _list(self, ch: Channel, frame: Frame) -> None:
        """One page of the jobs' summaries, in job-id order: those after ``after`` (or ``job`` alone), as many as
        ``limit`` and LIST_PAGE_BYTES allow; ``next`` is the ``after`` of the next page (None after the last),
        ``total`` the number of jobs. A summary is bounded (:mod:`dashrun.memd.store.listing`), so a page, however
        many jobs there are, stays well inside MAX_BODY."""
        body = frame.body
        after = field_job(body, "after") if body.get("after") is not None else None
        only = field_job(body, "job") if body.get("job") is not None else None
        limit = field_int(body, "limit", 1, LIST_PAGE_JOBS, default=LIST_PAGE_JOBS)
        summaries, more, total = self.catalogue.jobs_page(after=after, limit=limit, job=only)
        page, size = [], 0
        for summary in summaries:  # the byte budget, outside the catalogue's lock
            size += len(encode_body(summary)) + 1
            if page and size > LIST_PAGE_BYTES:
                more = True
                break
            page.append(summary)
        ram = self.catalogue.ram
        ch.send(Kind.OK, {"jobs": page, "next": page[-1]["job"] if more and page else None, "total": total,
                          "memory": {"used": ram.used, "limit": ram.limit},
                          "pending_disk_writes": self.catalogue.disk_writer.pending(),
                          "tag_failures": self.tag_failures, "forbidden": self.forbidden,
                          **self._object_status()})

    def _put_spec(self, ch: Channel, frame: Frame) -> None:
        spec = frame.body.get("spec")
        if not isinstance(spec, dict):
            raise ProtocolError("field 'spec' must be an object")
        self.catalogue.put_spec(field_job(frame.body), JobSpec.from_body(spec))
        ch.send(Kind.OK)

    def _get_spec(self, ch: Channel, frame: Frame) -> None:
        spec = self.catalogue.spec(field_job(frame.body))
        ch.send(Kind.OK, {"spec": spec.to_body() if spec else None})

    def _delete(self, ch: Channel, frame: Frame) -> None:
        job, keep = field_job(frame.body), field_int(frame.body, "keep", 0, 1 << 20)
        if keep == 0 and not field_bool(frame.body, "force_live", default=False):
            self.fleet.refuse_if_live(job)  # its running nodes would lose every checkpoint and their rendezvous
        deleted = self.catalogue.delete(job, keep)
        if keep == 0:  # the whole job: its fleet records go with its launch spec and notices
            self.fleet.delete_job(job)
        else:
            self.fleet.holdings.delete_steps(job, deleted)
        ch.send(Kind.OK, {"deleted": deleted})

    def _notice(self, ch: Channel, frame: Frame) -> None:
        self.catalogue.record_notice(field_job(frame.body), Notice.from_body(frame.body))
        ch.send(Kind.OK)

    def _ping(self, ch: Channel, frame: Frame) -> None:
        ch.send(Kind.OK, {"pid": os.getpid()})


def _hang_up(ch: Channel) -> None:
    """End a connection from another thread: its recv in progress fails at once (a receive a newer copy of
    its shard replaced, whose link may have died without a word)."""
    try:
        ch.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _refusal(error: OSError) -> DashError:
    """What a client is told when dash-memd's own file system fails a request."""
    reason = error.strerror or str(error)
    if error.errno == errno.ENOSPC:
        return errors.NoSpaceError(f"dash-memd's disk is full: {reason}", hint="free space in its --data-dir")
    return errors.RemoteError(f"dash-memd could not do it: {reason}", hint="see dash-memd's log")
