"""The common part of every poller: one round's errors (:class:`MetadataError`) and the loop that survives them.

:class:`Poller` runs ``poll_once`` until stopped, hands each distinct notice
to its callback once, and retries a bad answer with a doubling back-off
(:class:`dashrun.util.retry.Backoff`, ``retry`` .. ``max_retry`` seconds, no
jitter), logging each kind of problem once at WARNING until the service
answers again (:class:`dashrun.util.problems.ProblemLog`), and then once that
it does. A cloud's poller says how to read its service (``poll_once``) and,
where the cloud listens, how to tell it the VM is ready (``acknowledge``).
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import requests

from dashrun.agent.pollers.endpoints import endpoint_for
from dashrun.errors import UnavailableError
from dashrun.util.boundedjson import loads_bounded
from dashrun.util.problems import ProblemLog
from dashrun.util.retry import Backoff
from dashrun.wire.messages import Notice

__all__ = ["MAX_READ", "MetadataError", "Poller", "json_object", "new_session", "short_error"]

log = logging.getLogger(__name__)

#: The most bytes :meth:`Poller.read` takes from a service by default: Azure's compute document is the
#: largest answer read so; a value (a zone, an instance type) is far shorter.
MAX_READ = 64 << 10


class MetadataError(UnavailableError):
    """The metadata service did not give a usable answer this round.

    ``problem`` names the kind of problem ("timeout", "http 503", "garbage",
    ...) so it is logged once per kind; ``notices`` holds what the round did
    read before failing.
    """

    def __init__(self, problem: str, message: str, notices: Iterable[Notice] = ()):
        super().__init__(message)
        self.problem = problem
        self.notices = list(notices)


def new_session() -> requests.Session:
    """An HTTP session for a metadata service: never through an HTTP proxy (IMDS refuses forwarded requests)."""
    session = requests.Session()
    session.trust_env = False
    return session


def short_error(err: BaseException) -> str:
    """``err`` as text of at most 160 characters."""
    text = str(err)
    return text if len(text) <= 160 else text[:157] + "..."


def json_object(body: str, what: str) -> dict[str, Any]:
    """``body`` parsed as a JSON object; MetadataError("garbage") if it is not one."""
    try:
        doc = loads_bounded(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise MetadataError("garbage", f"{what} is not a JSON object: {body[:80]!r}")
    return doc


class Poller(abc.ABC):
    """Watches one cloud's metadata service for interruption notices."""

    cloud: ClassVar[str]

    def __init__(self, metadata_endpoint: str | None = None, *, interval: float, timeout: float = 2.0,
                 retry: float = 1.0, max_retry: float = 5.0, env: Mapping[str, str] | None = None):
        if interval < 0 or timeout <= 0 or retry <= 0 or max_retry < retry:
            raise ValueError("need interval >= 0, timeout > 0, 0 < retry <= max_retry")
        self.base_url = endpoint_for(self.cloud, metadata_endpoint, env)
        self.interval, self.timeout, self.retry, self.max_retry = interval, timeout, retry, max_retry
        self._session = new_session()
        self._reported: set[str] = set()
        self._what = f"{self.cloud} metadata service at {self.base_url}"
        self._problems = ProblemLog(log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rounds that got a good answer, and when the last one did (time.monotonic())
        self.rounds_ok = 0
        self.last_ok: float | None = None

    @abc.abstractmethod
    def poll_once(self) -> list[Notice]:
        """One round: every notice the service serves now (reported or not); MetadataError on a bad answer."""

    def read(self, path: str, *, params: Mapping[str, str] | None = None, limit: int = MAX_READ) -> str | None:
        """The text at ``path`` (below the base URL), asked with this cloud's headers: one value, for callers
        other than the watch (``dashrun.agent.identity``). None where the service has nothing there (404);
        MetadataError for anything else, an answer longer than ``limit`` bytes included."""
        r = self._request("GET", f"{self.base_url}/{path}", headers=self._headers(), params=params, stream=True)
        return self._bounded_body(r, path, limit)

    def _headers(self) -> dict[str, str]:
        """The headers this cloud's service wants on every request."""
        return {}

    def _bounded_body(self, r: requests.Response, what: str, limit: int) -> str | None:
        """``r``'s body (a streamed response, closed here) as text of at most ``limit`` bytes; None for 404."""
        try:
            if r.status_code == 404:
                return None
            self._check(r, what)
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise MetadataError("too long", f"{what}: an answer of {length} bytes (at most {limit} taken)")
            body = bytearray()
            try:
                for chunk in r.iter_content(4096):
                    body += chunk
                    if len(body) > limit:
                        raise MetadataError("too long", f"{what}: an answer longer than {limit} bytes")
            except requests.RequestException as e:
                raise MetadataError("unreachable", f"{what}: the answer broke off ({short_error(e)})") from e
            try:
                return body.decode()
            except UnicodeDecodeError:
                raise MetadataError("garbage", f"{what}: the answer is not UTF-8 text") from None
        finally:
            r.close()

    def acknowledge(self, notice: Notice) -> bool:
        """Tell the cloud the VM is ready for ``notice``'s event; False where there is nothing to tell."""
        return False

    def run(self, on_notice: Callable[[Notice], Any], stop_event: threading.Event) -> None:
        """Poll until ``stop_event`` is set, handing each distinct notice to ``on_notice`` once.

        Never raises: a bad answer is retried with back-off, an exception from
        ``on_notice`` is logged.
        """
        backoff = Backoff(first=self.retry, longest=self.max_retry, jitter=0.0)
        log.debug("%s poller watching %s", self.cloud, self.base_url)
        while not stop_event.is_set():
            error: MetadataError | None = None
            try:
                notices = self.poll_once()
            except MetadataError as e:
                notices, error = e.notices, e
            except Exception as e:  # a surprise must not end the watch
                log.debug("%s poller: unexpected error", self.cloud, exc_info=True)
                notices, error = [], MetadataError("unexpected", f"unexpected {type(e).__name__}: {e}")
            for notice in notices:
                self._report(notice, on_notice)
            if error is not None and stop_event.is_set():
                break  # a round cut short by stopping is no problem of the service
            if error is None:
                backoff.reset()
                self.rounds_ok += 1
                self.last_ok = time.monotonic()
                self._problems.ok(self._what, "%s answers again", self._what)
                delay = self._idle_delay()
            else:
                self._problems.problem(self._what, error.problem,
                                       "%s: %s (retrying; this kind of problem is logged once)", self._what, error,
                                       extra={"metadata_problem": error.problem})
                delay = backoff.next_delay()
            stop_event.wait(delay)

    def _idle_delay(self) -> float:
        """Seconds to wait after a good round."""
        return self.interval

    def _report(self, notice: Notice, on_notice: Callable[[Notice], Any]) -> None:
        if notice.id in self._reported:
            return
        self._reported.add(notice.id)
        log.warning("%s", notice.describe())
        try:
            on_notice(notice)
        except Exception:
            log.exception("handling a %s notice failed", notice.cloud)

    def start(self, on_notice: Callable[[Notice], Any]) -> Poller:
        """Run in a daemon thread until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("poller already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, args=(on_notice, self._stop),
                                        name=f"{self.cloud}-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread :meth:`start` began; a round in flight (a GCP hanging GET: up to
        ``watch_timeout``) finishes first. Closes the HTTP session once the thread is gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
            self._thread = None
        self.close()

    def close(self) -> None:
        """Close the HTTP session (for callers of :meth:`run` in a thread of their own)."""
        self._session.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _request(self, method: str, url: str, *, timeout: float | None = None, **kwargs: Any) -> requests.Response:
        """One request; transport failures become MetadataError with a problem kind."""
        try:
            return self._session.request(method, url, timeout=timeout or self.timeout, **kwargs)
        except requests.Timeout as e:
            raise MetadataError("timeout", f"no answer within {timeout or self.timeout:g} s ({short_error(e)})") from e
        except requests.ConnectionError as e:
            raise MetadataError("unreachable", f"cannot reach it ({short_error(e)})") from e
        except requests.RequestException as e:
            raise MetadataError("http", f"request failed ({short_error(e)})") from e

    @staticmethod
    def _check(r: requests.Response, what: str) -> None:
        if r.status_code == 429:
            raise MetadataError("throttled", f"{what}: throttled (429)")
        if r.status_code != 200:
            raise MetadataError(f"http {r.status_code}", f"{what}: HTTP {r.status_code}")
