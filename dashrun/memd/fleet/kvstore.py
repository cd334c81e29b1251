"""Each job's key/value store, in RAM: what a torch.distributed.Store over dash-memd keeps.

The elastic launcher's rendezvous needs a small store for each round's
bootstrap (who is rank 0, where its TCPStore listens, a few keys a round);
:mod:`dashrun.launch.rendezvous` makes a ``torch.distributed.Store`` of these
requests. The semantics are ``TCPStore``'s: ``get`` and ``wait`` block until
every key exists (here up to :data:`~dashrun.wire.messages.MAX_STORE_WAIT` per
request), ``add`` keeps a decimal number as ASCII bytes, ``compare_set`` sets
``desired`` iff the value held is ``expected`` (a missing key counts as held
by ``expected`` only when that is empty) and answers the value now held.

Nothing here is persisted: a round's keys are rewritten by the next round,
and a restarted dash-memd starts a new round. Every job's store is bounded
(:data:`~dashrun.wire.messages.MAX_STORE_KEYS` keys,
:data:`~dashrun.wire.messages.MAX_STORE_JOB_BYTES` of keys and values), and
so are all of them together; a request past a bound is refused whole with
NoSpaceError and changes nothing. A blocked request blocks only its own
connection's thread; a change wakes only the waiters of its job.
"""

from __future__ import annotations

import re
import threading
import time

from dashrun.errors import ConflictError, NoSpaceError, ProtocolError
from dashrun.wire.messages import MAX_STORE_JOB_BYTES, MAX_STORE_KEY, MAX_STORE_KEYS, MAX_STORE_VALUE

__all__ = ["MAX_STORE_BYTES", "MAX_STORE_JOBS", "KeyValueStore", "check_key"]

#: Jobs with a store at once, and bytes of keys and values of all jobs together.
MAX_STORE_JOBS = 256
MAX_STORE_BYTES = 256 << 20
_INTEGER = re.compile(rb"[+-]?[0-9]{1,19}")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def check_key(key: str) -> int:
    """The size ``key`` counts for (its UTF-8 bytes); refuses a key that is not a string or too long."""
    if not isinstance(key, str):
        raise ProtocolError("a store key must be a string")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ProtocolError("a store key must be valid Unicode") from None
    if size > MAX_STORE_KEY:
        raise NoSpaceError(f"a store key of {size} bytes exceeds the {MAX_STORE_KEY} allowed")
    return size


def _check_value(key: str, value: bytes) -> None:
    if len(value) > MAX_STORE_VALUE:
        raise NoSpaceError(f"a store value of {len(value)} bytes (key {key[:80]!r}) exceeds the {MAX_STORE_VALUE} "
                           "allowed")


class _JobStore:
    def __init__(self, lock: threading.Lock):
        self.values: dict[str, bytes] = {}
        self.bytes = 0
        self.waiters = 0
        #: Notified at every change of this job's keys (on the store's one lock).
        self.changed = threading.Condition(lock)


class KeyValueStore:
    """The stores of every job; every method is safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobStore] = {}
        self._bytes = 0
        self._closed = False

    def close(self) -> None:
        """dash-memd is stopping: every waiting request returns (as timed out) at once."""
        with self._lock:
            self._closed = True
            for store in self._jobs.values():
                store.changed.notify_all()

    # --- writes ---------------------------------------------------------------------------

    def set(self, job: str, items: list[tuple[str, bytes]]) -> None:
        """Set every key to its value, all or (past a bound) none."""
        sizes = [check_key(key) for key, _ in items]
        for key, value in items:
            _check_value(key, value)
        with self._lock:
            store = self._store(job)
            try:
                merged = dict(zip((k for k, _ in items), (v for _, v in items)))
                size = dict(zip((k for k, _ in items), sizes))
                grown = sum(size[k] + len(v) - self._cost(store, k) for k, v in merged.items())
                added = sum(1 for k in merged if k not in store.values)
                self._admit(job, store, added, grown)
                for key, value in merged.items():
                    store.values[key] = bytes(value)
                self._account(store, grown)
            finally:
                self._drop_if_unused(job, store)

    def add(self, job: str, key: str, amount: int) -> int:
        """Add ``amount`` to the decimal number ``key`` holds (0 if missing); returns the sum."""
        key_size = check_key(key)
        with self._lock:
            store = self._store(job)
            try:
                old = store.values.get(key)
                if old is not None and not _INTEGER.fullmatch(old):
                    raise ConflictError(f"store key {key[:80]!r} holds no decimal number: add cannot change it")
                total = (int(old) if old is not None else 0) + amount
                if not _INT64[0] <= total <= _INT64[1]:
                    raise ConflictError(f"adding {amount} to store key {key[:80]!r} overflows 64 bits")
                value = str(total).encode()
                grown = key_size + len(value) - self._cost(store, key)
                self._admit(job, store, old is None, grown)
                store.values[key] = value
                self._account(store, grown)
                return total
            finally:
                self._drop_if_unused(job, store)

    def compare_set(self, job: str, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare_set: set ``desired`` iff ``key`` holds ``expected``, or is missing and ``expected``
        is empty; returns the value now held (``expected`` itself when the key is missing and it is not empty,
        as TCPStore answers)."""
        key_size = check_key(key)
        _check_value(key, desired)
        with self._lock:
            store = self._store(job)
            try:
                old = store.values.get(key)
                if old is None and expected:
                    return bytes(expected)
                if old is not None and old != expected:
                    return old
                grown = key_size + len(desired) - self._cost(store, key)
                self._admit(job, store, old is None, grown)
                store.values[key] = bytes(desired)
                self._account(store, grown)
                return store.values[key]
            finally:
                self._drop_if_unused(job, store)

    def delete(self, job: str, key: str) -> bool:
        check_key(key)
        with self._lock:
            store = self._jobs.get(job)
            if store is None or key not in store.values:
                return False
            self._account(store, -self._cost(store, key))
            del store.values[key]
            self._drop_if_unused(job, store)
            return True

    def delete_prefix(self, job: str, prefix: str) -> int:
        """Delete every key of ``job`` that starts with ``prefix``; returns how many."""
        check_key(prefix)
        with self._lock:
            store = self._jobs.get(job)
            if store is None:
                return 0
            doomed = [key for key in store.values if key.startswith(prefix)]
            self._account(store, -sum(self._cost(store, key) for key in doomed))
            for key in doomed:
                del store.values[key]
            self._drop_if_unused(job, store)
            return len(doomed)

    def delete_job(self, job: str) -> None:
        """Forget every key of ``job`` (``dashrun rm``)."""
        with self._lock:
            store = self._jobs.get(job)
            if store is not None:
                self._account(store, -store.bytes)
                store.values.clear()
                self._drop_if_unused(job, store)

    # --- reads ------------------------------------------------------------------------------

    def get(self, job: str, keys: list[str], timeout: float) -> tuple[list[bytes], list[str]]:
        """The values of ``keys``, once every one exists, and ``[]``; or, if some are still missing after
        ``timeout`` seconds, ``[]`` and the missing keys."""
        for key in keys:
            check_key(key)
        with self._lock:
            missing = self._wait(job, keys, timeout)
            if missing:
                return [], missing
            store = self._jobs[job]
            return [store.values[key] for key in keys], []

    def wait(self, job: str, keys: list[str], timeout: float) -> list[str]:
        """Block until every key exists or ``timeout`` passes; returns the keys still missing."""
        for key in keys:
            check_key(key)
        with self._lock:
            return self._wait(job, keys, timeout)

    def check(self, job: str, keys: list[str]) -> bool:
        for key in keys:
            check_key(key)
        with self._lock:
            store = self._jobs.get(job)
            return all(key in store.values for key in keys) if store else not keys

    def num_keys(self, job: str) -> int:
        with self._lock:
            store = self._jobs.get(job)
            return len(store.values) if store else 0

    # --- plumbing (the lock held) ------------------------------------------------------------

    def _wait(self, job: str, keys: list[str], timeout: float) -> list[str]:
        store = self._jobs.get(job)
        if store is not None and all(key in store.values for key in keys):
            return []
        store = self._store(job)
        store.waiters += 1
        try:
            deadline = time.monotonic() + timeout
            while True:
                missing = [key for key in keys if key not in store.values]
                left = deadline - time.monotonic()
                if not missing or left <= 0 or self._closed:
                    return missing
                store.changed.wait(left)
        finally:
            store.waiters -= 1
            self._drop_if_unused(job, store)

    def _store(self, job: str) -> _JobStore:
        store = self._jobs.get(job)
        if store is None:
            if len(self._jobs) >= MAX_STORE_JOBS:
                raise NoSpaceError(f"dash-memd holds key/value stores of {MAX_STORE_JOBS} jobs already",
                                   hint="remove finished jobs with: dashrun rm JOB")
            store = self._jobs[job] = _JobStore(self._lock)
        return store

    @staticmethod
    def _cost(store: _JobStore, key: str) -> int:
        value = store.values.get(key)
        return 0 if value is None else len(key.encode()) + len(value)

    def _admit(self, job: str, store: _JobStore, added: int, grown: int) -> None:
        if len(store.values) + added > MAX_STORE_KEYS:
            raise NoSpaceError(f"job {job}'s store holds {len(store.values)} keys; {added} more exceed the "
                               f"{MAX_STORE_KEYS} allowed", hint="delete keys of finished rounds")
        if store.bytes + grown > MAX_STORE_JOB_BYTES:
            raise NoSpaceError(f"job {job}'s store would hold more than {MAX_STORE_JOB_BYTES} bytes",
                               hint="delete keys of finished rounds")
        if self._bytes + grown > MAX_STORE_BYTES:
            raise NoSpaceError(f"dash-memd's key/value stores would hold more than {MAX_STORE_BYTES} bytes",
                               hint="remove finished jobs with: dashrun rm JOB")

    def _account(self, store: _JobStore, grown: int) -> None:
        store.bytes += grown
        self._bytes += grown
        store.changed.notify_all()

    def _drop_if_unused(self, job: str, store: _JobStore) -> None:
        if not store.values and not store.waiters and self._jobs.get(job) is store:
            del self._jobs[job]
