"""The Prometheus endpoint dash-memd and dash-agent serve with ``--metrics-listen``: where, and its server.

Each process builds its own :class:`prometheus_client.CollectorRegistry`
(never the library's global one: two daemons in one test process, or a
restart, must not share counters) and hands it to :class:`MetricsEndpoint`,
which serves it at ``/metrics`` with prometheus-client's own HTTP server.
The names and labels are listed in docs/metrics.md.
"""

from __future__ import annotations

import logging

from dashrun.errors import UsageError
from dashrun.util.units import parse_address

__all__ = ["MetricsEndpoint", "parse_metrics_listen"]

log = logging.getLogger(__name__)

#: Where ``--metrics-listen PORT`` (no host) binds: the endpoint is open to whoever reaches it, so nothing
#: beyond this machine sees it unless the operator names an address.
LOOPBACK = "127.0.0.1"


def parse_metrics_listen(text: str, option: str = "--metrics-listen") -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT``, ``:PORT`` or ``PORT`` -> (host, port), loopback when no host is named."""
    text = text.strip()
    if text.isdigit():
        text = f"{LOOPBACK}:{text}"
    host, port = parse_address(text, what=option)
    if not host:
        host = LOOPBACK
    return host, port


class MetricsEndpoint:
    """``registry`` served at ``http://host:port/metrics`` from a daemon thread until :meth:`close`."""

    def __init__(self, registry, host: str, port: int, *, program: str):
        from prometheus_client import start_http_server

        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {host}:{port}: {e.strerror}",
                             hint="pick another --metrics-listen address or stop what holds the port") from None
        self.address: tuple[str, int] = self._httpd.server_address[:2]
        log.info("%s metrics at http://%s:%d/metrics", program, *self.address)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
