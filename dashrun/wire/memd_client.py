"""A client of dash-memd: one authenticated (and, unless ``--no-tls``, TLS) connection, requests one at a time.

Used by dash-agent (shards in, restores out) and by the ``dashrun``
commands. A broken connection is dropped and the next request reconnects;
retrying is the caller's decision. A connection dash-memd closed while it was
idle (its ``--idle-timeout``, or a restart) is found before a request is sent
on it, and replaced: a client kept between uses never fails for that.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any, Callable, Sequence

from dashrun import env
from dashrun.errors import ChecksumError, DashError, NotFoundError, ProtocolError
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.domain import FailureDomain
from dashrun.wire.history import Restored, RunHistory
from dashrun.wire.holdings import MAX_MEMBERS, Announced, Holdings, Located, Member, NodeView, holders_from_body
from dashrun.wire.link import Link
from dashrun.wire.messages import (
    MAX_RDZV_STATE,
    MAX_RDZV_WAIT,
    MAX_STORE_JOB_BYTES,
    MAX_STORE_VALUE,
    MAX_STORE_WAIT,
    CheckpointInfo,
    JobSpec,
    MembershipEvent,
    Notice,
    ShardHeader,
)
from dashrun.wire.protocol import MAX_BYTES, MAX_STEP, Kind, field_bool, field_step, valid_job_id
from dashrun.wire.tls import TlsSettings

__all__ = ["LIST_MOST", "MemdClient", "StoreTimeoutError", "memd_from_env"]

log = logging.getLogger(__name__)

#: Most jobs :meth:`MemdClient.list` fetches summaries of (page after page) unless told otherwise.
LIST_MOST = 10_000


class StoreTimeoutError(NotFoundError):
    """Keys of a job's key/value store did not all exist within the timeout of a ``store_get``,
    ``store_multi_get`` or ``store_wait`` (torch's stores raise ``DistStoreError`` then)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class MemdClient(Link):
    """dash-memd's client (see the module's text and :class:`dashrun.wire.link.Link`)."""

    def another(self) -> MemdClient:
        """A client of the same dash-memd, logged in as this one and with its settings, on a connection of its
        own (made on its first request): to read over several at once."""
        return MemdClient(self.host, self.port, self._token, timeout=self.timeout,
                          connect_timeout=self.connect_timeout, tls=self.tls)

    # --- requests -------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return self._request(lambda ch: ch.call(Kind.PING).body)

    def put_shard(self, header: ShardHeader, parts: Sequence[memoryview | bytes], *,
                  gate: Callable[[int], None] | None = None, node: str | None = None,
                  crc: Callable[[], int] | None = None, restored: Restored | None = None,
                  domain: FailureDomain | None = None) -> dict[str, Any]:
        """Send a shard's bytes (``parts``, in order); returns {committed, crc} once dash-memd stored them.
        ``restored``: how the rank's run began, and ``domain``, the sending node's failure domain, for the job's
        run history (:mod:`dashrun.wire.history`).

        ``gate`` lets the bytes stream while they are still being staged; ``crc``, the sender's checksum
        of them, known once they are (see Channel.send).
        """
        def run(ch: Channel):
            body = {**header.to_body(), "node": node}
            if restored is not None:
                body["restored"] = restored.to_body()
            if domain is not None and domain.known:
                body["domain"] = domain.to_body()
            ch.call(Kind.PUT_SHARD, body)
            ch.send(Kind.SHARD_DATA, {}, data=parts, gate=gate, crc=crc)
            return ch.expect_reply().body
        return self._request(run)

    def latest(self, job: str, step: int | None = None) -> CheckpointInfo | None:
        body = self._request(lambda ch: ch.call(Kind.LATEST, {"job": job, "step": step}).body)
        raw = body.get("checkpoint")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ProtocolError("malformed LATEST reply")
        return CheckpointInfo.from_body(raw)

    def locate(self, job: str, step: int | None = None) -> Located | None:
        """:meth:`latest` (also a step committed on the fleet only), with the nodes that hold each saved rank's
        shard of it in their own RAM and whether dash-memd holds it whole; None if the job has none."""
        body = self._request(lambda ch: ch.call(Kind.LATEST, {"job": job, "step": step, "fleet": True}).body)
        raw = body.get("checkpoint")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ProtocolError("malformed LATEST reply")
        info = CheckpointInfo.from_body(raw)
        return Located(info, holders_from_body(body.get("holders"), info.world),
                       field_bool(body, "in_memd", default=True))

    def announce(self, holdings: Holdings) -> Announced:
        """Tell dash-memd what this node holds and where its agent listens; returns the job's other members."""
        body = self._request(lambda ch: ch.call(Kind.HOLDINGS, holdings.to_body()).body)
        raw = body.get("members")
        if not isinstance(raw, list) or len(raw) > MAX_MEMBERS:
            raise ProtocolError("malformed HOLDINGS reply")
        committed = None if body.get("committed") is None else field_step(body, "committed")
        return Announced([Member.from_body(member) for member in raw], committed)

    def get_shard_into(self, job: str, step: int, rank: int, views: Sequence[memoryview], *,
                       offset: int | None = None, committed_at: float | None = None, verify: bool = False) -> int:
        """Receive one committed shard into ``views`` (in order); returns its verified CRC-32C.

        With ``offset``, only the bytes from there that fill ``views`` (a byte range); the CRC returned
        is then the range's. With ``committed_at`` (the checkpoint's, as LATEST described it), dash-memd
        refuses (NotFoundError) if the step has been committed again since: a restore read in several
        requests never mixes the bytes of two attempts at one step. With ``verify``, dash-memd reads the
        bytes of its RAM copy against their checksums from when they arrived before it sends them (see
        :meth:`get_shard_checked_into`).
        """
        length = sum(len(v) for v in views)
        request: dict[str, Any] = {"job": job, "step": step, "rank": rank}
        if offset is not None:
            request.update(offset=offset, length=length)
        if committed_at is not None:
            request["committed_at"] = committed_at
        if verify:
            request["verify"] = True

        def run(ch: Channel):
            ch.send(Kind.GET_SHARD, request)
            reply = ch.expect_reply(max_data=MAX_BYTES)
            if reply.data_len != length:
                ch.close()
                raise ProtocolError(f"shard {rank} of {job} step {step} has an unexpected size")
            return ch.recv_data_into(reply, views)
        return self._request(run)

    def get_shard_checked_into(self, job: str, step: int, rank: int, views: Sequence[memoryview], *,
                               offset: int | None = None, committed_at: float | None = None) -> int:
        """:meth:`get_shard_into`, asked again if the bytes fail their checksum here: first with ``verify``,
        so that dash-memd checks its own copy (a copy in RAM changed since it arrived leaves the RAM tier,
        and dash-memd says so), then once more, served from its disk or the bucket. ChecksumError if the
        bytes still fail."""
        for verify in (False, True, False):
            try:
                return self.get_shard_into(job, step, rank, views, offset=offset, committed_at=committed_at,
                                           verify=verify)
            except ChecksumError as e:
                failure = e
                log.warning("%s step %d, rank %d's shard failed its checksum (%s); reading it again", job, step,
                            rank, e)
        raise failure

    def wait(self, job: str, step: int, timeout: float, *, on_disk: bool = False) -> bool:
        """Block until the step is committed (with ``on_disk``: written to disk too); False on timeout."""
        def run(ch: Channel):
            ch.settimeout(self.timeout + timeout)
            try:
                body = {"job": job, "step": step, "timeout": timeout, "on_disk": on_disk}
                return bool(ch.call(Kind.WAIT, body).body.get("committed"))
            finally:
                ch.settimeout(self.timeout)
        return self._request(run)

    def list(self, job: str | None = None, *, most: int = LIST_MOST) -> dict[str, Any]:
        """dash-memd's state and its jobs' summaries, newest first: of every job (at most ``most``), or of ``job``
        alone. dash-memd answers a page at a time (in job-id order, each within its reply's bound); this
        fetches page after page. Where jobs are left out beyond ``most``, ``jobs_left`` counts them."""
        jobs: list[dict[str, Any]] = []
        after, left = None, 0
        while True:
            request = {"job": job} if job is not None else {"after": after}
            listing = self._request(lambda ch: ch.call(Kind.LIST, request).body)
            page, following = listing.pop("jobs", None), listing.pop("next", None)
            if not isinstance(page, list) or not all(isinstance(j, dict) and valid_job_id(j.get("job")) for j in page):
                raise ProtocolError("malformed LIST reply")
            jobs.extend(page)
            if job is not None or following is None:
                break
            # Each page must move on, so that a confused (or hostile) dash-memd cannot keep this fetching forever.
            if not page or not valid_job_id(following) or (after is not None and following <= after):
                raise ProtocolError("malformed LIST reply: its next page does not follow this one")
            if len(jobs) >= most:
                total = listing.get("total")
                left = max(total - most, 1) if type(total) is int else 1
                break
            after = following
        left = max(left, len(jobs) - most)
        if left:
            listing["jobs_left"] = left
        listing["jobs"] = sorted(jobs[:most], key=_updated, reverse=True)
        return listing

    def put_spec(self, job: str, spec: JobSpec) -> None:
        self._request(lambda ch: ch.call(Kind.PUT_SPEC, {"job": job, "spec": spec.to_body()}))

    def get_spec(self, job: str) -> JobSpec | None:
        raw = self._request(lambda ch: ch.call(Kind.GET_SPEC, {"job": job}).body.get("spec"))
        if raw is not None and not isinstance(raw, dict):
            raise ProtocolError("malformed GET_SPEC reply")
        return JobSpec.from_body(raw) if raw is not None else None

    def data_listing(self, url: str, max_bytes: int) -> bytes | None:
        """The listing of the data source ``url`` dash-memd keeps (dashrun.data.listings), or None."""
        def run(ch: Channel) -> bytes | None:
            reply = ch.call(Kind.DATA_LISTING_GET, {"url": url}, max_data=max_bytes)
            if not field_bool(reply.body, "found"):
                return None
            return ch.recv_data(reply)
        return self._request(run)

    def put_data_listing(self, url: str, text: bytes) -> None:
        def run(ch: Channel) -> None:
            ch.call(Kind.DATA_LISTING_PUT, {"url": url, "nbytes": len(text)})
            ch.send(Kind.DATA_LISTING_BYTES, data=[text])
            ch.expect_reply()
        self._request(run)

    def delete(self, job: str, keep: int = 0, *, force_live: bool = False) -> list[int]:
        """Delete a job's checkpoints but the newest ``keep`` (0: everything, launch spec included). The whole job
        is refused (ConflictError) while nodes of it are alive, unless ``force_live``."""
        body = {"job": job, "keep": keep, **({"force_live": True} if force_live else {})}
        return self._request(lambda ch: ch.call(Kind.DELETE, body).body.get("deleted", []))

    def notice(self, job: str, notice: Notice) -> None:
        """Record an interruption notice on the job (shown by ``dashrun status``)."""
        self._request(lambda ch: ch.call(Kind.NOTICE, {"job": job, **notice.to_body()}))

    # --- the fleet view: rendezvous, world generation, membership ------------------------------

    def rendezvous_get(self, job: str, run_id: str, unlike: int | None = None,
                       wait: float = 0.0) -> tuple[bytes, int] | None:
        """The rendezvous state of ``run_id`` of ``job`` and its token, or None if none was set yet. With
        ``wait`` (at most ``MAX_RDZV_WAIT`` seconds), dash-memd answers once the token is not ``unlike``: another
        node changed the state, or the time is up."""
        body = {"job": job, "run_id": run_id}
        if wait > 0:
            body.update(unlike=unlike, wait=min(wait, MAX_RDZV_WAIT))
        def run(ch: Channel):
            reply = ch.call(Kind.RDZV_GET, body, max_data=MAX_RDZV_STATE)
            state = ch.recv_data(reply)
            token = reply.body.get("token")
            if token is None:
                return None
            return state, _token(token)
        return self._request(run)

    def rendezvous_set(self, job: str, run_id: str, state: bytes, token: int | None) -> tuple[bytes, int, bool] | None:
        """Compare-and-set, torch's ``RendezvousBackend.set_state``: stores ``state`` iff ``token`` is the
        current token (None: iff there is no state yet) under a new token; returns the state and token now
        held and whether this call set them. None only if ``token`` is not None and there is no state (the job
        was removed): as torch's ``set_state`` may answer."""
        def run(ch: Channel):
            body = {"job": job, "run_id": run_id, "state": _b64(state), "token": token}
            reply = ch.call(Kind.RDZV_SET, body, max_data=MAX_RDZV_STATE)
            held = ch.recv_data(reply)
            if reply.body.get("token") is None:
                return None
            return held, _token(reply.body["token"]), reply.body.get("set") is True
        return self._request(run)

    def set_generation(self, job: str, generation: int) -> int:
        """Raise the job's world generation to ``generation`` if it is higher; returns the job's generation.
        dash-memd then refuses shards of older generations (above 0)."""
        return _token(self._request(lambda ch: ch.call(Kind.GENERATION, {"job": job, "generation": generation})
                                    .body.get("generation")), low=0)

    def generation(self, job: str) -> int:
        """The job's world generation (0: never raised)."""
        return self.set_generation(job, 0)

    def record_membership(self, job: str, event: MembershipEvent) -> None:
        """Add a membership change to the job's history (``dashrun status JOB`` lists it)."""
        self._request(lambda ch: ch.call(Kind.MEMBER_EVENT, {"job": job, "event": event.to_body()}))

    def membership(self, job: str) -> list[MembershipEvent]:
        """The job's membership history, oldest first (the newest 1000; fewer if their text is very long)."""
        return self.membership_view(job)[0]

    def live_members(self, job: str) -> int | None:
        """How many nodes of the job heartbeat in its rendezvous now; None where it has none (not elastic)."""
        return self.membership_view(job)[1]

    def membership_view(self, job: str) -> tuple[list[MembershipEvent], int | None]:
        """:meth:`membership` and :meth:`live_members` in one request."""
        events, live, _ = self.fleet_view(job)
        return events, live

    def fleet_view(self, job: str) -> tuple[list[MembershipEvent], int | None, list[NodeView]]:
        """:meth:`membership_view`, and what each node holds in its own RAM (from its newest announcement)."""
        body = self._request(lambda ch: ch.call(Kind.MEMBERSHIP, {"job": job}).body)
        raw, live, held = body.get("events"), body.get("live"), body.get("holdings", [])
        if not isinstance(raw, list) or (live is not None and (not isinstance(live, int) or isinstance(live, bool)
                                                               or live < 0)):
            raise ProtocolError("malformed MEMBERSHIP reply")
        if not isinstance(held, list) or len(held) > MAX_MEMBERS:
            raise ProtocolError("malformed MEMBERSHIP reply: its holdings")
        return [MembershipEvent.from_body(event) for event in raw], live, [NodeView.from_body(n) for n in held]

    def run_history(self, job: str) -> tuple[list[MembershipEvent], RunHistory | None]:
        """The job's membership events and its run history (None: dash-memd keeps none of it)."""
        body = self._request(lambda ch: ch.call(Kind.MEMBERSHIP, {"job": job}).body)
        raw = body.get("events")
        if not isinstance(raw, list):
            raise ProtocolError("malformed MEMBERSHIP reply")
        history = body.get("history")
        return ([MembershipEvent.from_body(event) for event in raw],
                None if history is None else RunHistory.from_body(history))

    # --- the job's key/value store ---------------------------------------------------------------

    def store_set(self, job: str, key: str, value: bytes) -> None:
        self.store_multi_set(job, [key], [value])

    def store_multi_set(self, job: str, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Set every key to its value: all, or (NoSpaceError past the store's bounds) none."""
        if len(keys) != len(values):
            raise ValueError("store_multi_set needs one value per key")
        body = {"job": job, "keys": list(keys), "values": [_b64(v) for v in values]}
        self._request(lambda ch: ch.call(Kind.STORE_SET, body))

    def store_get(self, job: str, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set; StoreTimeoutError if not."""
        return self.store_multi_get(job, [key], timeout)[0]

    def store_multi_get(self, job: str, keys: Sequence[str], timeout: float) -> list[bytes]:
        """The values of ``keys``, once all exist (waiting up to ``timeout`` seconds; StoreTimeoutError if not)."""
        reply, data = self._store_wait(Kind.STORE_GET, job, keys, timeout)
        lengths = reply.get("lengths")
        if (not isinstance(lengths, list) or len(lengths) != len(keys)
                or not all(type(n) is int and 0 <= n <= MAX_STORE_VALUE for n in lengths) or sum(lengths) != len(data)):
            raise ProtocolError("malformed STORE_GET reply")
        values, offset = [], 0
        for n in lengths:
            values.append(data[offset:offset + n])
            offset += n
        return values

    def store_wait(self, job: str, keys: Sequence[str], timeout: float) -> None:
        """Return once every key exists; StoreTimeoutError if some do not within ``timeout`` seconds."""
        self._store_wait(Kind.STORE_WAIT, job, keys, timeout)

    def store_check(self, job: str, keys: Sequence[str]) -> bool:
        """Whether every key exists now."""
        return self._request(lambda ch: ch.call(Kind.STORE_CHECK, {"job": job, "keys": list(keys)})
                             .body.get("exist")) is True

    def store_add(self, job: str, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal number ``key`` holds (0 if missing; kept as ASCII, as TCPStore does)."""
        value = self._request(lambda ch: ch.call(Kind.STORE_ADD, {"job": job, "key": key, "amount": amount})
                              .body.get("value"))
        if type(value) is not int:
            raise ProtocolError("malformed STORE_ADD reply")
        return value

    def store_compare_set(self, job: str, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare_set: set ``desired`` iff ``key`` holds ``expected`` (or is missing and ``expected``
        is empty); returns the value now held (``expected`` when the key is missing and it is not empty)."""
        def run(ch: Channel):
            body = {"job": job, "key": key, "expected": _b64(expected), "desired": _b64(desired)}
            return ch.recv_data(ch.call(Kind.STORE_COMPARE_SET, body, max_data=max(MAX_STORE_VALUE, len(expected))))
        return self._request(run)

    def store_delete(self, job: str, key: str) -> bool:
        """Delete ``key``; whether it existed."""
        return self._request(lambda ch: ch.call(Kind.STORE_DELETE, {"job": job, "key": key})
                             .body.get("deleted")) is True

    def store_num_keys(self, job: str) -> int:
        count = self._request(lambda ch: ch.call(Kind.STORE_NUM_KEYS, {"job": job}).body.get("count"))
        if type(count) is not int or count < 0:
            raise ProtocolError("malformed STORE_NUM_KEYS reply")
        return count

    def store_delete_prefix(self, job: str, prefix: str) -> int:
        """Delete every key that starts with ``prefix``; how many there were."""
        count = self._request(lambda ch: ch.call(Kind.STORE_DELETE_PREFIX, {"job": job, "prefix": prefix})
                              .body.get("deleted"))
        if type(count) is not int or count < 0:
            raise ProtocolError("malformed STORE_DELETE_PREFIX reply")
        return count

    def _store_wait(self, kind: Kind, job: str, keys: Sequence[str], timeout: float) -> tuple[dict, bytes]:
        """STORE_GET or STORE_WAIT until every key exists: one request per MAX_STORE_WAIT seconds at most (dash-memd
        bounds how long one request blocks); returns the last reply's body and data."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            wait = min(max(0.0, deadline - time.monotonic()), MAX_STORE_WAIT)

            def run(ch: Channel) -> tuple[Frame, bytes]:
                ch.settimeout(self.timeout + wait)  # the reply comes once the keys exist, or after ``wait``
                try:
                    reply = ch.call(kind, {"job": job, "keys": list(keys), "timeout": wait},
                                    max_data=MAX_STORE_JOB_BYTES)
                    return reply, ch.recv_data(reply)
                finally:
                    ch.settimeout(self.timeout)

            reply, data = self._request(run)
            missing = reply.body.get("missing") or []
            if not missing:
                return reply.body, data
            if time.monotonic() >= deadline:
                count = reply.body.get("missing_count", len(missing))
                shown = ", ".join(repr(str(k))[:100] for k in missing[:3]) + (", ..." if count > 3 else "")
                what = f"key {shown}" if count == 1 else f"{count} keys ({shown})"
                raise StoreTimeoutError(f"{what} of job {job}'s store not set within {timeout:g} s",
                                        hint="the process that sets them is late, or gone")


def _updated(summary: dict[str, Any]) -> float:
    """When a job's summary says it last changed (the newest first in a listing)."""
    updated = summary.get("updated")
    return float(updated) if type(updated) in (int, float) else 0.0


def _token(value: Any, low: int = 1) -> int:
    if type(value) is not int or not low <= value <= MAX_STEP:
        raise ProtocolError("malformed token or generation in a reply")
    return value


def memd_from_env() -> Callable[[], MemdClient] | None:
    """New clients of dash-memd as dashrun's launcher tells the ranks it (``DASH_MEMD``, ``DASH_TOKEN_FILE``,
    ``DASH_NO_TLS``, ``DASH_TLS_CA``); None where they do not say or the token cannot be read."""
    address, token_file = env.get(env.MEMD), env.get(env.TOKEN_FILE)
    if not address or not token_file:
        return None
    try:
        host, port = parse_address(address, default_port=env.DEFAULT_PORT, what="memd")
        token = read_token(token_file, warn=False)  # a rank: its launcher warned of a weak token already
        tls = TlsSettings.from_env()
    except (DashError, OSError, ValueError) as e:
        log.warning("dashrun: cannot reach dash-memd as %s=%s says (%s)", env.MEMD.name, address, e)
        return None
    return lambda: MemdClient(host, port, token, tls=tls)

