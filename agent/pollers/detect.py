"""Which cloud this VM runs in, and the poller for it.

:func:`detect_cloud` probes the three metadata services at once, quickly and
quietly (nothing above DEBUG: on a laptop the answer is "none");
:func:`resolve_cloud` turns ``--cloud`` (one of :data:`CHOICES`) into a cloud;
:func:`make_poller` builds that cloud's poller.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import requests

from dashrun.agent.pollers.aws import TOKEN_RE, AwsPoller
from dashrun.agent.pollers.azure import AzurePoller
from dashrun.agent.pollers.base import Poller, new_session
from dashrun.agent.pollers.endpoints import AZURE_INSTANCE_VERSION, endpoint_for
from dashrun.agent.pollers.gcp import GcpPoller
from dashrun.errors import UsageError
from dashrun.wire.messages import CLOUDS

__all__ = ["CHOICES", "detect_cloud", "make_poller", "resolve_cloud"]

log = logging.getLogger(__name__)

#: what ``--cloud`` accepts
CHOICES = ("auto", *CLOUDS, "none")


def _probe(cloud: str, base: str, timeout: float) -> bool:
    """Whether ``base`` is this cloud's metadata service; quiet, at most a few short requests."""
    with new_session() as s:
        try:
            if cloud == "gcp":
                r = s.get(f"{base}/", headers={"Metadata-Flavor": "Google"}, timeout=timeout)
                return r.headers.get("Metadata-Flavor") == "Google"
            if cloud == "azure":
                r = s.get(f"{base}/metadata/instance", params={"api-version": AZURE_INSTANCE_VERSION},
                          headers={"Metadata": "true"}, timeout=timeout)
                return r.status_code == 200 and isinstance(r.json().get("compute"), dict)
            r = s.put(f"{base}/latest/api/token", headers={AwsPoller.TTL_HEADER: "60"}, timeout=timeout)
            if r.status_code == 200 and TOKEN_RE.fullmatch(r.text or ""):
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
