"""Azure: Scheduled Events of the instance metadata service.

:class:`AzurePoller` reads the events every ``interval`` seconds and keeps
only those whose ``Resources`` name this VM. Preempt and Terminate are
notices with ``NotBefore`` as the deadline; Reboot, Redeploy and Freeze are
early warnings (a Reboot or Redeploy still ends the processes at NotBefore).
:meth:`AzurePoller.acknowledge` lets an event start before its NotBefore.
"""

from __future__ import annotations

import email.utils
import logging
import re
import time
from collections.abc import Mapping
from typing import Any

import requests

from dashrun.agent.pollers.base import MetadataError, Poller, json_object, new_session, short_error
from dashrun.agent.pollers.endpoints import AZURE_EVENTS_VERSION, AZURE_INSTANCE_VERSION
from dashrun.wire.messages import Notice, NoticeKind

__all__ = ["AzurePoller"]

log = logging.getLogger(__name__)


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
        doc = json_object(r.text, "scheduledevents")
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
        with new_session() as s:  # not the poll thread's session: this runs on the caller's thread
            try:
                r = s.post(f"{self.base_url}/{self.EVENTS}", params={"api-version": AZURE_EVENTS_VERSION},
                           headers=self._headers(), json={"StartRequests": [{"EventId": notice.id}]},
                           timeout=self.timeout)
            except requests.RequestException as e:
                raise MetadataError("unreachable", f"acknowledging {notice.id} failed ({short_error(e)})") from e
        self._check(r, f"acknowledging {notice.id}")
        log.info("acknowledged scheduled event %s", notice.id)
        return True
