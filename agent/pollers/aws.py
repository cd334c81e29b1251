"""AWS: the EC2 instance metadata service (IMDS).

:class:`AwsPoller` reads ``meta-data/spot/instance-action`` (404 until the
instance is marked: terminate/stop/hibernate with the action's time, about 2
minutes ahead) and ``events/recommendations/rebalance`` (an early warning),
every ``interval`` seconds. IMDSv2 as aws-node-termination-handler does it: a
token asked for ``token_ttl`` seconds, renewed when ``REFRESH_BEFORE`` seconds
or less remain, and dropped and renewed on a 401; IMDSv1 only for a round
whose token PUT itself failed.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import requests

from dashrun.agent.pollers.base import MAX_READ, MetadataError, Poller, json_object
from dashrun.wire.messages import Notice, NoticeKind

__all__ = ["TOKEN_RE", "AwsPoller"]

log = logging.getLogger(__name__)

#: what an IMDSv2 token looks like (anything else is not one)
TOKEN_RE = re.compile(r"[A-Za-z0-9+/=_.\-]{1,512}")


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
        if not TOKEN_RE.fullmatch(token):
            log.debug("IMDSv2 token PUT answered HTTP %d%s; this round uses IMDSv1", r.status_code,
                      " with no valid token" if r.status_code == 200 else "")
            return None
        try:
            ttl = float(r.headers.get(self.TTL_HEADER) or self.token_ttl)
        except ValueError:
            ttl = float(self.token_ttl)
        self._token, self._token_expiry = token, time.monotonic() + min(ttl, self.token_ttl)
        return token

    def _authorized_get(self, path: str, **kwargs: Any) -> requests.Response:
        """GET ``path`` with a token (IMDSv1 where none could be had); a 401 renews the token once."""
        url = f"{self.base_url}/{path}"
        token = self._get_token()
        r = self._request("GET", url, headers={self.TOKEN_HEADER: token} if token else {}, **kwargs)
        if r.status_code == 401 and token is not None:
            # expired or revoked: drop it, get a new one, try once more (not a reason for IMDSv1)
            r.close()
            self._token = None
            token = self._get_token()
            r = self._request("GET", url, headers={self.TOKEN_HEADER: token} if token else {}, **kwargs)
        if r.status_code == 401:
            r.close()
            if token is None:
                raise MetadataError("no token", f"{path}: IMDSv2 is required and no token could be had")
            self._token = None
            raise MetadataError("unauthorized", f"{path}: a fresh token was refused (401)")
        return r

    def _get(self, path: str) -> str | None:
        """The body at ``path``; None for 404 (nothing there)."""
        r = self._authorized_get(path)
        if r.status_code == 404:
            return None
        self._check(r, path)
        return r.text

    def read(self, path: str, *, params: Mapping[str, str] | None = None, limit: int = MAX_READ) -> str | None:
        return self._bounded_body(self._authorized_get(path, params=params, stream=True), path, limit)

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
        doc = json_object(body, "spot/instance-action")
        action, when = doc.get("action"), doc.get("time")
        if action not in ("terminate", "stop", "hibernate") or not isinstance(when, str):
            raise MetadataError("garbage", f"spot/instance-action is not an action: {body[:80]!r}")
        return Notice("aws", NoticeKind(action), _aws_time(when, "spot/instance-action"),
                      id=f"instance-action/{action}/{when}", detail=doc)

    def _rebalance(self, body: str) -> Notice:
        doc = json_object(body, "rebalance recommendation")
        when = doc.get("noticeTime")
        if not isinstance(when, str):
            raise MetadataError("garbage", f"rebalance recommendation without noticeTime: {body[:80]!r}")
        _aws_time(when, "rebalance noticeTime")
        return Notice("aws", NoticeKind.REBALANCE, None, early_warning=True, id=f"rebalance/{when}", detail=doc)

def _aws_time(text: str, what: str) -> float:
    try:
        stamp = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise MetadataError("garbage", f"{what}: not a time: {text[:40]!r}") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()
