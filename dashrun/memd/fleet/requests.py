"""dash-memd's requests of the fleet view: rendezvous states, world generations, membership histories, stores.

:class:`FleetRequests` owns the records behind them (:mod:`.rendezvous`,
:mod:`.membership`, :mod:`.kvstore`) and answers their requests for the
server (:mod:`dashrun.memd.server`), which dispatches to :meth:`FleetRequests.handlers`
as to its own. Rendezvous states are sent as base64 in the request's body and
come back as the reply's data; so do store values. A MEMBERSHIP reply also
counts the job's members that heartbeat now (``live``; None without a
rendezvous), from which ``dashrun status`` tells a running job. ``dashrun rm`` of a job
(DELETE of all its checkpoints) removes its records here too
(:meth:`FleetRequests.delete_job`), as it removes the job's launch spec and
notices; it is refused while nodes of the job are alive, by the heartbeats in
its rendezvous states and the job's own heartbeat settings, unless forced
(:meth:`FleetRequests.refuse_if_live`): a node launched with ``--fresh``
while the job runs elsewhere must not wipe the running job.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from dashrun.errors import ConflictError, ProtocolError, UnavailableError
from dashrun.memd.fleet.holdings import Registry
from dashrun.memd.fleet.kvstore import KeyValueStore
from dashrun.memd.fleet.membership import MEMBERSHIP, Membership
from dashrun.memd.fleet.rendezvous import RENDEZVOUS, RendezvousStates
from dashrun.wire.channel import Channel, Frame
from dashrun.wire.history import Restored
from dashrun.wire.domain import FailureDomain
from dashrun.wire.holdings import Holdings, field_domain, holders_to_body
from dashrun.wire.messages import (MAX_RDZV_WAIT, MAX_STORE_KEYS, MAX_STORE_WAIT, CheckpointInfo, MembershipEvent,
                                   ShardHeader)
from dashrun.wire.protocol import (
    MAX_BODY,
    MAX_STEP,
    Kind,
    encode_body,
    field_b64,
    field_float,
    field_int,
    field_job,
    field_run_id,
    field_str,
)

if TYPE_CHECKING:
    from dashrun.memd.store.uploader import Uploader

__all__ = ["MAX_MEMBERSHIP_REPLY", "FleetRequests"]

#: Most bytes of membership events one MEMBERSHIP reply carries (the newest that fit; typically all 1000).
MAX_MEMBERSHIP_REPLY = MAX_BODY // 2
#: Most bytes of the nodes' holdings it carries besides (the first nodes, by name, that fit).
MAX_HOLDINGS_REPLY = MAX_BODY // 4


class FleetRequests:
    """The fleet view's records under ``data_dir`` and the handlers of their requests."""

    def __init__(self, data_dir: Path, uploader: Uploader | None = None):
        self.rendezvous = RendezvousStates(data_dir / RENDEZVOUS)
        self.membership = Membership(data_dir / MEMBERSHIP)
        if uploader is not None:  # the bucket keeps a copy of each job's membership record
            uploader.keep_records(self.membership)
        self.store = KeyValueStore()
        self.holdings = Registry()
        #: The catalogue's newest committed checkpoint of a job (or of a step), which the server sets: a LATEST
        #: answer is the newer of it and the fleet's (:meth:`locate`).
        self.catalogued: Callable[[str, int | None], CheckpointInfo | None] = lambda job, step=None: None

    @staticmethod
    def shard_notes(body: dict) -> tuple[Restored | None, FailureDomain | None]:
        """What a PUT_SHARD ``body`` tells the run history (how its rank's run began, the node's failure domain),
        checked before the shard is taken: a malformed one is refused then, not after the shard's reply."""
        restored = Restored.from_body(body["restored"]) if body.get("restored") is not None else None
        return restored, field_domain(body)

    def shard_stored(self, header: ShardHeader, restored: Restored | None, domain: FailureDomain | None,
                     node: str | None) -> None:
        """A shard (from ``node``, where said) is stored: the job's run history notes the snapshot, how its
        rank's run began, and the node's failure domain (as :meth:`shard_notes` read them)."""
        self.membership.note_snapshot(header, restored)
        if node is not None:
            self.membership.note_domain(header.job, node, domain)

    def load(self) -> None:
        """Read what an earlier dash-memd left in the data dir (which the caller holds locked)."""
        self.rendezvous.load()
        self.membership.load()

    def close(self) -> None:
        """dash-memd is stopping: requests waiting for store keys return now, and rendezvous state files a
        failing disk kept behind RAM get a last try (the failure is logged if it persists)."""
        self.store.close()
        self.rendezvous.flush()

    def refuse_if_live(self, job: str) -> None:
        """ConflictError if a member of one of ``job``'s rendezvous heartbeats within the lapse its own settings
        allow (the job's nodes are running it). The advice is in the message: a hint does not cross the wire."""
        live = [found for found in self.rendezvous.liveness(job) if found.live]
        if not live:
            return
        count = sum(found.live for found in live)
        newest = min(found.newest_age for found in live)
        raise ConflictError(f"{job} has {count} live node{'' if count == 1 else 's'} (last heartbeat {newest:.0f}s "
                            f"ago): stop them first, or delete it anyway with: dashrun rm {job} --force-live")

    def delete_job(self, job: str) -> None:
        self.rendezvous.delete_job(job)
        self.membership.delete_job(job)
        self.store.delete_job(job)
        self.holdings.delete_job(job)

    def handlers(self) -> dict[Kind, Callable[[Channel, Frame], None]]:
        return {
            Kind.RDZV_GET: self._rdzv_get,
            Kind.RDZV_SET: self._rdzv_set,
            Kind.GENERATION: self._generation,
            Kind.MEMBER_EVENT: self._member_event,
            Kind.MEMBERSHIP: self._membership,
            Kind.HOLDINGS: self._holdings,
            Kind.STORE_SET: self._store_set,
            Kind.STORE_GET: self._store_get,
            Kind.STORE_ADD: self._store_add,
            Kind.STORE_COMPARE_SET: self._store_compare_set,
            Kind.STORE_CHECK: self._store_check,
            Kind.STORE_WAIT: self._store_wait,
            Kind.STORE_DELETE: self._store_delete,
            Kind.STORE_NUM_KEYS: self._store_num_keys,
            Kind.STORE_DELETE_PREFIX: self._store_delete_prefix,
        }

    # --- rendezvous, generation, membership -----------------------------------------------------

    def _rdzv_get(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        unlike = None if body.get("unlike") is None else field_int(body, "unlike", 1, MAX_STEP)
        held = self.rendezvous.get(field_job(body), field_run_id(body), unlike,
                                   field_float(body, "wait", 0.0, MAX_RDZV_WAIT) if "wait" in body else 0.0)
        if held is None:
            ch.send(Kind.OK, {"token": None})
        else:
            ch.send(Kind.OK, {"token": held[1]}, data=[held[0]])

    def _rdzv_set(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        token = None if body.get("token") is None else field_int(body, "token", 1, MAX_STEP)
        result = self.rendezvous.set(field_job(body), field_run_id(body), field_b64(body, "state", MAX_BODY),
                                     token)
        if result is None:
            ch.send(Kind.OK, {"token": None, "set": False})
        else:
            ch.send(Kind.OK, {"token": result[1], "set": result[2]}, data=[result[0]])

    def _generation(self, ch: Channel, frame: Frame) -> None:
        job, generation = field_job(frame.body), field_int(frame.body, "generation", 0, MAX_STEP)
        ch.send(Kind.OK, {"generation": self.membership.raise_generation(job, generation)})

    def _member_event(self, ch: Channel, frame: Frame) -> None:
        event = MembershipEvent.from_body(frame.body.get("event"))
        job = field_job(frame.body)
        self.membership.record(job, event)
        if event.change in ("left", "died"):
            self.holdings.forget(job, event.node)
        ch.send(Kind.OK)

    def _membership(self, ch: Channel, frame: Frame) -> None:
        job = field_job(frame.body)
        history = self.membership.history(job)
        events, size = [], 0
        for event in reversed(history):  # the newest that fit in one reply
            encoded = event.to_body()
            size += len(encode_body(encoded)) + 1
            if size > MAX_MEMBERSHIP_REPLY:
                break
            events.append(encoded)
        ch.send(Kind.OK, {"events": events[::-1], "omitted": len(history) - len(events),
                          "generation": self.membership.generation(job), "live": self.live_members(job),
                          "history": self.membership.run_history(job),
                          "holdings": _first_that_fit(self.holdings.view(job), MAX_HOLDINGS_REPLY)})

    def _holdings(self, ch: Channel, frame: Frame) -> None:
        holdings = Holdings.from_body(frame.body)
        members = self.holdings.announce(holdings)
        self.membership.note_domain(holdings.job, holdings.node, holdings.domain)
        try:
            newest = self.locate(holdings.job, None)["checkpoint"]
        except UnavailableError:  # the bucket is not listed yet: the agent hears of the commit next time
            newest = None
        ch.send(Kind.OK, {"members": [member.to_body() for member in members],
                          "committed": newest["step"] if newest else None})

    def locate(self, job: str, step: int | None, fleet: bool = True) -> dict:
        """LATEST's answer: the newest committed checkpoint of ``job`` (or ``step``) — the catalogue's, or, asked
        for ``fleet``, one committed on the fleet (held by R+1 nodes) that dash-memd does not hold whole yet —
        whether dash-memd holds it, and the nodes that hold each shard in their own RAM (a restore reads from
        them first). A client that reads from dash-memd alone (an export, dashrun.dcp) does not ask for it."""
        fleet = self.holdings.committed(job, step, self.membership.generation(job)) if fleet else None
        try:
            info = self.catalogued(job, step)
        except UnavailableError:  # the bucket, not listed yet, may hold newer ones than the fleet's
            if fleet is None:
                raise
            info = None
        in_memd = info is not None and (fleet is None or info.step >= fleet.step)
        if not in_memd:
            info = fleet
        if info is None:
            return {"checkpoint": None}
        return {"checkpoint": info.to_body(), "in_memd": in_memd,
                "holders": holders_to_body(self.holdings.holders(info))}

    def live_members(self, job: str) -> int | None:
        """How many members of ``job``'s rendezvous heartbeat now; None where it has no rendezvous of dashrun's
        (a job that is not elastic: nothing here says whether it runs)."""
        found = self.rendezvous.liveness(job)
        return sum(f.live for f in found) if found else None

    # --- the jobs' key/value stores ---------------------------------------------------------

    # Values are bounded by the body here, and by the store (a refusal that keeps the connection) there.

    def _store_set(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        keys = _field_keys(body)
        values = body.get("values")
        if not isinstance(values, list) or len(values) != len(keys):
            raise ProtocolError("field 'values' must list one value per key")
        items = [(key, field_b64({"value": value}, "value", MAX_BODY)) for key, value in zip(keys, values)]
        self.store.set(field_job(body), items)
        ch.send(Kind.OK)

    def _store_get(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        values, missing = self.store.get(field_job(body), _field_keys(body), _field_wait(body))
        if missing:
            ch.send(Kind.OK, {"missing": missing[:16], "missing_count": len(missing)})
        else:
            ch.send(Kind.OK, {"lengths": [len(v) for v in values]}, data=values)

    def _store_add(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        total = self.store.add(field_job(body), field_str(body, "key", MAX_BODY),
                               field_int(body, "amount", -(1 << 63), (1 << 63) - 1))
        ch.send(Kind.OK, {"value": total})

    def _store_compare_set(self, ch: Channel, frame: Frame) -> None:
        body = frame.body
        held = self.store.compare_set(field_job(body), field_str(body, "key", MAX_BODY),
                                      field_b64(body, "expected", MAX_BODY),
                                      field_b64(body, "desired", MAX_BODY))
        ch.send(Kind.OK, {}, data=[held])

    def _store_check(self, ch: Channel, frame: Frame) -> None:
        ch.send(Kind.OK, {"exist": self.store.check(field_job(frame.body), _field_keys(frame.body))})

    def _store_wait(self, ch: Channel, frame: Frame) -> None:
        missing = self.store.wait(field_job(frame.body), _field_keys(frame.body), _field_wait(frame.body))
        ch.send(Kind.OK, {"missing": missing[:16], "missing_count": len(missing)})

    def _store_delete(self, ch: Channel, frame: Frame) -> None:
        deleted = self.store.delete(field_job(frame.body), field_str(frame.body, "key", MAX_BODY))
        ch.send(Kind.OK, {"deleted": deleted})

    def _store_num_keys(self, ch: Channel, frame: Frame) -> None:
        ch.send(Kind.OK, {"count": self.store.num_keys(field_job(frame.body))})

    def _store_delete_prefix(self, ch: Channel, frame: Frame) -> None:
        count = self.store.delete_prefix(field_job(frame.body), field_str(frame.body, "prefix", MAX_BODY))
        ch.send(Kind.OK, {"deleted": count})


def _first_that_fit(items: list, most: int) -> list:
    """The first of ``items`` whose JSON takes at most ``most`` bytes together."""
    kept, size = [], 0
    for item in items:
        size += len(encode_body(item)) + 1
        if size > most:
            break
        kept.append(item)
    return kept


def _field_keys(body: dict) -> list[str]:
    """A store request's ``keys``: a list of strings, at most as many as a store holds (each key's own bound is
    the store's to check, with a refusal rather than a broken connection)."""
    keys = body.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_STORE_KEYS or not all(isinstance(k, str) for k in keys):
        raise ProtocolError(f"field 'keys' must be a list of at most {MAX_STORE_KEYS} strings")
    return keys


def _field_wait(body: dict) -> float:
    return field_float(body, "timeout", 0.0, MAX_STORE_WAIT)
