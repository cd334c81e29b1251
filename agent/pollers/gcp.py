"""GCP: the GCE metadata server.

:class:`GcpPoller` watches ``instance/preempted`` with the hanging GET
(``wait_for_change``/``last_etag``/``timeout_sec``), so TRUE is seen the
moment it is set; the deadline is ``preempt_lead`` seconds after it was first
seen (a configured metadata-only preemption notice makes the value flip
earlier, and the real deadline is then later, never sooner).
``instance/maintenance-event`` TERMINATE_ON_HOST_MAINTENANCE is an early
warning with about an hour's lead (GPU VMs cannot migrate). ``retry``
seconds of sleep after an error, as Google's own client does.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

from dashrun.agent.pollers.base import MAX_READ, MetadataError, Poller
from dashrun.wire.messages import Notice, NoticeKind

__all__ = ["GcpPoller"]


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

    def _headers(self) -> dict[str, str]:
        return {"Metadata-Flavor": "Google"}

    def read(self, path: str, *, params: Mapping[str, str] | None = None, limit: int = MAX_READ) -> str | None:
        r = self._request("GET", f"{self.base_url}/{path}", headers=self._headers(), params=params, stream=True)
        if r.status_code == 200 and r.headers.get("Metadata-Flavor") != "Google":
            r.close()
            raise MetadataError("garbage", f"{path}: the answer is not from a GCP metadata server")
        return self._bounded_body(r, path, limit)

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
