"""Interruption notices from the cloud's metadata service, for dash-agent.

One small API for three clouds::

    cloud = resolve_cloud("auto", metadata_endpoint)       # "aws" | "gcp" | "azure" | "none"
    poller = make_poller(cloud, metadata_endpoint)          # None for "none"
    poller.start(on_notice)                                  # a daemon thread; poller.stop() ends it
    ...                                                      # on_notice(Notice) once per distinct notice
    poller.acknowledge(notice)                               # Azure: let the event start now (state is safe)

or ``poller.run(on_notice, stop_event)`` in a thread of one's own, or
``poller.poll_once()`` for one round.

What each poller watches (facts: shared/reference/cloud-metadata.md):

- AWS (``AwsPoller``): ``meta-data/spot/instance-action`` (404 until the instance
  is marked: terminate/stop/hibernate with the action's time, about 2 minutes
  ahead) and ``events/recommendations/rebalance`` (an early warning), every
  ``interval`` seconds (5). IMDSv2 as aws-node-termination-handler does it: a
  token asked for ``token_ttl`` seconds, renewed when 15 s or less remain, and
  dropped and renewed on a 401; IMDSv1 only for a round whose token PUT itself
  failed.
- GCP (``GcpPoller``): ``instance/preempted`` with the hanging GET
  (``wait_for_change``/``last_etag``/``timeout_sec``), so TRUE is seen the moment
  it is set; the deadline is 30 s after it was first seen (a configured
  metadata-only preemption notice makes the value flip earlier, and the
  real deadline is then later, never sooner). ``instance/maintenance-event``
  TERMINATE_ON_HOST_MAINTENANCE is an early warning with about an hour's lead
  (GPU VMs cannot migrate). ``retry`` seconds (5) of sleep after an error, as
  Google's own client does.
- Azure (``AzurePoller``): Scheduled Events every ``interval`` seconds (1),
  only events whose ``Resources`` name this VM. Preempt and Terminate are
  notices with ``NotBefore`` as the deadline; Reboot, Redeploy and Freeze are
  early warnings (a Reboot or Redeploy still ends the processes at NotBefore).

Contracts: a poller never dies on a bad answer (timeouts, 5xx, throttling,
garbage, an expired token, a refused header): it retries with a doubling
back-off (``retry`` .. ``max_retry`` seconds) and logs each kind of problem
once at WARNING, and once that it answers again; a notice served afterwards is
still seen. Each distinct notice is handed to ``on_notice`` once. Detection is
quick and quiet (nothing above DEBUG). Nothing here imports torch.
"""

from __future__ import annotations

import abc
import email.utils
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, ClassVar

import requests

from dashrun.errors import UnavailableError, UsageError
from dashrun.wire.messages import CLOUDS, Notice, NoticeKind

log = logging.getLogger(__name__)

CHOICES = ("auto", *CLOUDS, "none")

#: the clouds' own SDK variables for the metadata service's address
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # a URL: http://169.254.169.254/
GCE_HOST_ENV = "GCE_METADATA_HOST"  # host[:port]: metadata.google.internal
GCE_IP_ENV = "GCE_METADATA_IP"  # host[:port] google-auth pings: 169.254.169.254

AWS_DEFAULT = "http://169.254.169.254"
GCP_DEFAULT = "http://metadata.google.internal"
GCP_PROBE_DEFAULT = "http://169.254.169.254"  # no DNS look-up while detecting
AZURE_DEFAULT = "http://169.254.169.254"

AZURE_EVENTS_VERSION = "2020-07-01"
AZURE_INSTANCE_VERSION = "2021-02-01"


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


# -- endpoints and detection --------------------------------------------------------------------------------


def _base_url(endpoint: str) -> str:
    endpoint = endpoint.strip()
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint.rstrip("/")


def endpoint_for(cloud: str, metadata_endpoint: str | None = None, env: Mapping[str, str] | None = None,
                 *, probe: bool = False) -> str:
    """The base URL a cloud's metadata service is reached at: the override, the SDK variable, the default."""
    env = os.environ if env is None else env
    if metadata_endpoint:
        return _base_url(metadata_endpoint)
    if cloud == "aws":
        return _base_url(env.get(AWS_ENDPOINT_ENV) or AWS_DEFAULT)
    if cloud == "gcp":
        host = env.get(GCE_HOST_ENV) or (env.get(GCE_IP_ENV) if probe else None)
        return _base_url(host) if host else (GCP_PROBE_DEFAULT if probe else GCP_DEFAULT)
    if cloud == "azure":
        return AZURE_DEFAULT
    raise ValueError(f"no metadata service for cloud {cloud!r}")


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # never through an HTTP proxy: IMDS refuses forwarded requests
    return session


def _probe(cloud: str, base: str, timeout: float) -> bool:
    """Whether ``base`` is this cloud's metadata service; quiet, at most a few short requests."""
    with _session() as s:
        try:
            if cloud == "gcp":
                r = s.get(f"{base}/", headers={"Metadata-Flavor": "Google"}, timeout=timeout)
                return r.headers.get("Metadata-Flavor") == "Google"
            if cloud == "azure":
                r = s.get(f"{base}/metadata/instance", params={"api-version": AZURE_INSTANCE_VERSION},
                          headers={"Metadata": "true"}, timeout=timeout)
                return r.status_code == 200 and isinstance(r.json().get("compute"), dict)
            r = s.put(f"{base}/latest/api/token", headers={AwsPoller.TTL_HEADER: "60"}, timeout=timeout)
            if r.status_code == 200 and _TOKEN_RE.fullmatch(r.text or ""):
                return True
            r = s.get(f"{base}/latest/meta-data/instance-id", timeout=timeout)  # IMDSv1 only
            return r.status_code == 200 and r.text.startswith("i-")
        except (requests.RequestException, ValueError, AttributeError):
            return False


def detect_cloud(metadata_endpoint: str | None = None, *, timeout: float = 1.0,
                 env: Mapping[str, str] | None = None, clouds: Iterable[str] = CLOUDS) -> str:
    """Which cloud's metadata service answers: "aws", "gcp", "azure", or "none" within ``timeout``.

    The clouds are probed in parallel, each at ``metadata_endpoint`` or its SDK
    variable or its default address, and the first to recognise its service
    wins. Nothing is logged above DEBUG: on a laptop the answer is "none".
    """
    clouds = [c for c in clouds if c in CLOUDS]
    results: queue.Queue[tuple[str, bool]] = queue.Queue()
    deadline = time.monotonic() + timeout

    def probe(cloud: str) -> None:
        base = endpoint_for(cloud, metadata_endpoint, env, probe=True)
        found = _probe(cloud, base, timeout)
        log.debug("metadata probe %s at %s: %s", cloud, base, found)
        results.put((cloud, found))

    for cloud in clouds:  # daemon threads: a DNS look-up that hangs cannot hold the caller
        threading.Thread(target=probe, args=(cloud,), name=f"probe-{cloud}", daemon=True).start()
    for _ in clouds:
        try:
            cloud, found = results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if found:
            return cloud
    return "none"


def resolve_cloud(cloud: str, metadata_endpoint: str | None = None, *, env: Mapping[str, str] | None = None,
                  timeout: float = 1.0) -> str:
    """``--cloud`` as given: auto (detect), aws, gcp, azure or none."""
    cloud = (cloud or "auto").lower()
    if cloud not in CHOICES:
        raise UsageError(f"unknown cloud {cloud!r}", hint=f"use one of {', '.join(CHOICES)}")
    if cloud == "auto":
        cloud = detect_cloud(metadata_endpoint, timeout=timeout, env=env)
        log.info("cloud: %s", cloud if cloud != "none" else "none detected (no interruption notices)")
    return cloud


def make_poller(cloud: str, metadata_endpoint: str | None = None, *, env: Mapping[str, str] | None = None,
                **options: Any) -> Poller | None:
    """The poller for ``cloud`` (auto is detected first); None for "none"."""
    cloud = resolve_cloud(cloud, metadata_endpoint, env=env)
    if cloud == "none":
        return None
    cls = {"aws": AwsPoller, "gcp": GcpPoller, "azure": AzurePoller}[cloud]
    return cls(metadata_endpoint, env=env, **options)


# -- the common loop -----------------------------------------------------------------------------------------


class _Problems:
    """Log each kind of problem once at WARNING (then DEBUG), and once that the service answers again."""

    def __init__(self, what: str):
        self.what = what
        self._seen: set[str] = set()
        self._loud = False

    def problem(self, err: MetadataError) -> None:
        if err.problem not in self._seen:
            self._seen.add(err.problem)
            self._loud = True
            log.warning("%s: %s (retrying; this kind of problem is logged once)", self.what, err,
                        extra={"metadata_problem": err.problem})
        else:
            log.debug("%s: %s", self.what, err, extra={"metadata_problem": err.problem})

    def ok(self) -> None:
        if self._loud:
            self._loud = False
            log.info("%s answers again", self.what)


class Poller(abc.ABC):
    """Watches one cloud's metadata service for interruption notices."""

    cloud: ClassVar[str]

    def __init__(self, metadata_endpoint: str | None = None, *, interval: float, timeout: float = 2.0,
                 retry: float = 1.0, max_retry: float = 5.0, env: Mapping[str, str] | None = None):
        if interval < 0 or timeout <= 0 or retry <= 0 or max_retry < retry:
            raise ValueError("need interval >= 0, timeout > 0, 0 < retry <= max_retry")
        self.base_url = endpoint_for(self.cloud, metadata_endpoint, env)
        self.interval, self.timeout, self.retry, self.max_retry = interval, timeout, retry, max_retry
        self._session = _session()
        self._reported: set[str] = set()
        self._problems = _Problems(f"{self.cloud} metadata service at {self.base_url}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: rounds that got a good answer, and when the last one did (time.monotonic())
        self.rounds_ok = 0
        self.last_ok: float | None = None

    @abc.abstractmethod
    def poll_once(self) -> list[Notice]:
        """One round: every notice the service serves now (reported or not); MetadataError on a bad answer."""

    def acknowledge(self, notice: Notice) -> bool:
        """Tell the cloud the VM is ready for ``notice``'s event; False where there is nothing to tell."""
        return False

    def run(self, on_notice: Callable[[Notice], Any], stop_event: threading.Event) -> None:
        """Poll until ``stop_event`` is set, handing each distinct notice to ``on_notice`` once.

        Never raises: a bad answer is retried with back-off, an exception from
        ``on_notice`` is logged.
        """
        failures = 0
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
                failures = 0
                self.rounds_ok += 1
                self.last_ok = time.monotonic()
                self._problems.ok()
                delay = self._idle_delay()
            else:
                failures += 1
                self._problems.problem(error)
                delay = min(self.max_retry, self.retry * 2 ** min(failures - 1, 16))
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
            raise MetadataError("timeout", f"no answer within {timeout or self.timeout:g} s ({_short(e)})") from e
        except requests.ConnectionError as e:
            raise MetadataError("unreachable", f"cannot reach it ({_short(e)})") from e
        except requests.RequestException as e:
            raise MetadataError("http", f"request failed ({_short(e)})") from e

    @staticmethod
    def _check(r: requests.Response, what: str) -> None:
        if r.status_code == 429:
            raise MetadataError("throttled", f"{what}: throttled (429)")
        if r.status_code != 200:
            raise MetadataError(f"http {r.status_code}", f"{what}: HTTP {r.status_code}")


def _short(err: BaseException) -> str:
    text = str(err)
    return text if len(text) <= 160 else text[:157] + "..."


# -- AWS ---------------------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"[A-Za-z0-9+/=_.\-]{1,512}")


class AwsPoller(Poller):
    """EC2 IMDS: spot/instance-action and rebalance recommendations."""

    cloud = "aws"
    TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
    TOKEN_HEADER = "X-aws-ec2-metadata-token"
    ACTION_PATH = "latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "latest/meta-data/events/recommendations/rebalance"
    #: renew a token when this few seconds remain (aws-node-termination-handler)
    REFRESH_BEFORE = 15.0

    def __init__(self, metadata_endpoint: str | None = None, *, interval: float = 5.0, timeout: float = 2.0,
                 retry: float = 1.0, max_retry: float = 5.0, token_ttl: int = 21600,
                 env: Mapping[str, str] | None = None):
        super().__init__(metadata_endpoint, interval=interval, timeout=timeout, retry=retry, max_retry=max_retry,
                         env=env)
        if not 1 <= token_ttl <= 21600:
            raise ValueError("token_ttl must be 1..21600 seconds")
        self.token_ttl = token_ttl
        self._token: str | None = None
        self._token_expiry = 0.0

    def _get_token(self) -> str | None:
        """A valid IMDSv2 token, or None when the PUT fails (this round then uses IMDSv1)."""
        if self._token is not None and self._token_expiry - time.monotonic() > self.REFRESH_BEFORE:
            return self._token
        self._token = None
        try:
            r = self._request("PUT", f"{self.base_url}/latest/api/token",
                              headers={self.TTL_HEADER: str(self.token_ttl)})
        except MetadataError as e:
            log.debug("IMDSv2 token PUT failed (%s); this round uses IMDSv1", e)
            return None
        token = r.text.strip() if r.status_code == 200 else ""
        if not _TOKEN_RE.fullmatch(token):
            log.debug("IMDSv2 token PUT answered HTTP %d%s; this round uses IMDSv1", r.status_code,
                      " with no valid token" if r.status_code == 200 else "")
            return None
        try:
            ttl = float(r.headers.get(self.TTL_HEADER) or self.token_ttl)
        except ValueError:
            ttl = float(self.token_ttl)
        self._token, self._token_expiry = token, time.monotonic() + min(ttl, self.token_ttl)
        return token

    def _get(self, path: str) -> str | None:
        """The body at ``path``; None for 404 (nothing there)."""
        url = f"{self.base_url}/{path}"
        token = self._get_token()
        r = self._request("GET", url, headers={self.TOKEN_HEADER: token} if token else {})
        if r.status_code == 401 and token is not None:
            # expired or revoked: drop it, get a new one, try once more (not a reason for IMDSv1)
            self._token = None
            token = self._get_token()
            r = self._request("GET", url, headers={self.TOKEN_HEADER: token} if token else {})
        if r.status_code == 401:
            if token is None:
                raise MetadataError("no token", f"{path}: IMDSv2 is required and no token could be had")
            self._token = None
            raise MetadataError("unauthorized", f"{path}: a fresh token was refused (401)")
        if r.status_code == 404:
            return None
        self._check(r, path)
        return r.text

    def poll_once(self) -> list[Notice]:
        notices: list[Notice] = []
        try:
            body = self._get(self.ACTION_PATH)
            if body is not None:
                notices.append(self._instance_action(body))
            body = self._get(self.REBALANCE_PATH)
            if body is not None:
                notices.append(self._rebalance(body))
        except MetadataError as e:
            e.notices[:0] = notices
            raise
        return notices

    def _instance_action(self, body: str) -> Notice:
        doc = _json_object(body, "spot/instance-action")
        action, when = doc.get("action"), doc.get("time")
        if action not in ("terminate", "stop", "hibernate") or not isinstance(when, str):
            raise MetadataError("garbage", f"spot/instance-action is not an action: {body[:80]!r}")
        return Notice("aws", NoticeKind(action), _aws_time(when, "spot/instance-action"),
                      id=f"instance-action/{action}/{when}", detail=doc)

    def _rebalance(self, body: str) -> Notice:
        doc = _json_object(body, "rebalance recommendation")
        when = doc.get("noticeTime")
        if not isinstance(when, str):
            raise MetadataError("garbage", f"rebalance recommendation without noticeTime: {body[:80]!r}")
        _aws_time(when, "rebalance noticeTime")
        return Notice("aws", NoticeKind.REBALANCE, None, early_warning=True, id=f"rebalance/{when}", detail=doc)


def _json_object(body: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise MetadataError("garbage", f"{what} is not a JSON object: {body[:80]!r}")
    return doc


def _aws_time(text: str, what: str) -> float:
    try:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise MetadataError("garbage", f"{what}: not a time: {text[:40]!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


# -- GCP ---------------------------------------------------------------------------------------------------------


class GcpPoller(Poller):
    """GCE metadata server: instance/preempted (hanging GET) and instance/maintenance-event."""

    cloud = "gcp"
    PREEMPTED = "computeMetadata/v1/instance/preempted"
    MAINTENANCE = "computeMetadata/v1/instance/maintenance-event"

    def __init__(self, metadata_endpoint: str | None = None, *, watch_timeout: float = 10.0, interval: float = 0.0,
                 timeout: float = 2.0, retry: float = 5.0, max_retry: float = 5.0, preempt_lead: float = 30.0,
                 maintenance_lead: float = 3600.0, env: Mapping[str, str] | None = None):
        # interval: a pause between hanging GETs; 0, since each one waits for a change itself
        super().__init__(metadata_endpoint, interval=interval, timeout=timeout, retry=retry, max_retry=max_retry,
                         env=env)
        if watch_timeout < 1:
            raise ValueError("watch_timeout must be at least 1 s (the server's timeout_sec)")
        #: timeout_sec of the hanging GET: how long one round waits for a change (and how
        #: often the maintenance event is read, and stop() may have to wait)
        self.watch_timeout = watch_timeout
        self.preempt_lead, self.maintenance_lead = preempt_lead, maintenance_lead
        self._etag: str | None = None
        self._hasty = False  # the last round's hanging GET returned at once with nothing changed
        self._preempted_since: float | None = None
        self._maintenance_since: float | None = None

    def _get(self, path: str, params: dict[str, str] | None = None, read_timeout: float | None = None,
             ) -> tuple[str, str | None]:
        r = self._request("GET", f"{self.base_url}/{path}", headers={"Metadata-Flavor": "Google"}, params=params,
                          timeout=read_timeout)
        name = path.rsplit("/", 1)[-1]
        self._check(r, name)
        if r.headers.get("Metadata-Flavor") != "Google":
            raise MetadataError("garbage", f"{name}: the answer is not from a GCP metadata server")
        return r.text.strip(), r.headers.get("ETag")

    def poll_once(self) -> list[Notice]:
        notices: list[Notice] = []
        try:
            started, last_etag = time.monotonic(), self._etag
            if last_etag is None:
                value, etag = self._get(self.PREEMPTED)
            else:  # returns at once if the value changed since last_etag, else when it changes or times out
                value, etag = self._get(self.PREEMPTED, {"wait_for_change": "true", "last_etag": last_etag,
                                                         "timeout_sec": str(int(self.watch_timeout))},
                                        read_timeout=self.watch_timeout + self.timeout)
            if value not in ("TRUE", "FALSE"):
                raise MetadataError("garbage", f"preempted is neither TRUE nor FALSE: {value[:40]!r}")
            # a server that neither hangs nor sends an ETag must not be polled in a tight loop
            self._hasty = etag is None or (etag == last_etag and time.monotonic() - started < 0.5)
            self._etag = etag
            if value == "TRUE":
                self._preempted_since = self._preempted_since or time.time()
                notices.append(Notice("gcp", NoticeKind.PREEMPT, self._preempted_since + self.preempt_lead,
                                      id=f"preempted/{self._preempted_since}", detail={"preempted": value}))
            else:
                self._preempted_since = None
            value, _ = self._get(self.MAINTENANCE)
            if not re.fullmatch(r"[A-Z_]{1,64}", value):
                raise MetadataError("garbage", f"maintenance-event is not a value: {value[:40]!r}")
            if value == "TERMINATE_ON_HOST_MAINTENANCE":
                self._maintenance_since = self._maintenance_since or time.time()
                notices.append(Notice("gcp", NoticeKind.MAINTENANCE, self._maintenance_since + self.maintenance_lead,
                                      early_warning=True, id=f"maintenance/{self._maintenance_since}",
                                      detail={"maintenance-event": value}))
            else:  # NONE, or MIGRATE_ON_HOST_MAINTENANCE: live migration keeps memory
                self._maintenance_since = None
        except MetadataError as e:
            e.notices[:0] = notices
            raise
        return notices

    def _idle_delay(self) -> float:
        return max(self.interval, 1.0 if self._hasty else 0.0)


# -- Azure -------------------------------------------------------------------------------------------------------


class AzurePoller(Poller):
    """Azure Scheduled Events for this VM; acknowledge() lets an event start early."""

    cloud = "azure"
    EVENTS = "metadata/scheduledevents"
    NAME = "metadata/instance/compute/name"
    KINDS = {"Preempt": NoticeKind.PREEMPT, "Terminate": NoticeKind.TERMINATE}

    def __init__(self, metadata_endpoint: str | None = None, *, vm_name: str | None = None, interval: float = 1.0,
                 timeout: float = 2.0, first_timeout: float = 120.0, retry: float = 1.0, max_retry: float = 5.0,
                 env: Mapping[str, str] | None = None):
        super().__init__(metadata_endpoint, interval=interval, timeout=timeout, retry=retry, max_retry=max_retry,
                         env=env)
        self.vm_name = vm_name
        #: the first Scheduled Events call after a long idle can take up to 2 minutes
        self.first_timeout = max(first_timeout, timeout)
        self._answered = False
        self._incarnation: int | None = None
        self._ignored: set[str] = set()

    def _headers(self) -> dict[str, str]:
        return {"Metadata": "true"}

    def _vm(self) -> str:
        if self.vm_name is None:
            r = self._request("GET", f"{self.base_url}/{self.NAME}", headers=self._headers(),
                              params={"api-version": AZURE_INSTANCE_VERSION, "format": "text"})
            self._check(r, "compute/name")
            name = r.text.strip()
            if not re.fullmatch(r"[\w.\-]{1,80}", name):
                raise MetadataError("garbage", f"compute/name is not a VM name: {name[:40]!r}")
            self.vm_name = name
        return self.vm_name

    def poll_once(self) -> list[Notice]:
        vm = self._vm().casefold()
        r = self._request("GET", f"{self.base_url}/{self.EVENTS}", headers=self._headers(),
                          params={"api-version": AZURE_EVENTS_VERSION},
                          timeout=self.timeout if self._answered else self.first_timeout)
        self._check(r, "scheduledevents")
        self._answered = True
        doc = _json_object(r.text, "scheduledevents")
        incarnation, events = doc.get("DocumentIncarnation"), doc.get("Events")
        if not isinstance(incarnation, int) or not isinstance(events, list):
            raise MetadataError("garbage", f"scheduledevents lacks DocumentIncarnation or Events: {r.text[:80]!r}")
        if incarnation != self._incarnation:
            log.debug("scheduled events incarnation %d: %d events", incarnation, len(events))
            self._incarnation = incarnation
        notices = []
        for event in events:
            if not isinstance(event, dict) or not isinstance(event.get("EventId"), str):
                raise MetadataError("garbage", f"scheduled event without EventId: {str(event)[:80]!r}")
            resources = event.get("Resources") or []
            if not isinstance(resources, list) or vm not in {str(x).casefold() for x in resources}:
                if event["EventId"] not in self._ignored:  # another VM's event
                    self._ignored.add(event["EventId"])
                    log.debug("ignoring %s event %s for %s", event.get("EventType"), event["EventId"], resources)
                continue
            notices.append(self._notice(event))
        return notices

    def _notice(self, event: dict[str, Any]) -> Notice:
        event_type = str(event.get("EventType") or "")
        not_before = event.get("NotBefore") or ""
        if not_before:
            try:
                deadline = email.utils.parsedate_to_datetime(not_before).timestamp()
            except (TypeError, ValueError):
                raise MetadataError("garbage", f"NotBefore is not a time: {str(not_before)[:40]!r}") from None
        else:  # blank once the event has started
            deadline = time.time()
        kind = self.KINDS.get(event_type, NoticeKind.MAINTENANCE)
        return Notice("azure", kind, deadline, early_warning=kind == NoticeKind.MAINTENANCE,
                      id=event["EventId"], detail=event)

    def acknowledge(self, notice: Notice) -> bool:
        """POST StartRequests for the notice's EventId: the event may start now. Raises MetadataError."""
        if notice.cloud != "azure" or not notice.id:
            return False
        with _session() as s:  # not the poll thread's session: this runs on the caller's thread
            try:
                r = s.post(f"{self.base_url}/{self.EVENTS}", params={"api-version": AZURE_EVENTS_VERSION},
                           headers=self._headers(), json={"StartRequests": [{"EventId": notice.id}]},
                           timeout=self.timeout)
            except requests.RequestException as e:
                raise MetadataError("unreachable", f"acknowledging {notice.id} failed ({_short(e)})") from e
        self._check(r, f"acknowledging {notice.id}")
        log.info("acknowledged scheduled event %s", notice.id)
        return True
