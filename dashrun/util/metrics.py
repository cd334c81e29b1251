"""The Prometheus endpoint dash-memd and dash-agent serve with ``--metrics-listen``: where, how, and its server.

Each process builds its own :class:`prometheus_client.CollectorRegistry`
(never the library's global one: two daemons in one test process, or a
restart, must not share counters) and hands it to :class:`MetricsEndpoint`,
which serves it at ``/metrics`` with prometheus-client's own WSGI app. The
names and labels are listed in docs/metrics.md.

Bound to loopback unless an address is named. Off loopback an operator
gives it what a Prometheus scrape config asks for: HTTPS
(``--metrics-tls-cert``, ``--metrics-tls-key``: ``scheme: https``) and a
bearer token (``--metrics-token-file``: ``authorization: {credentials_file:
...}``), checked in constant time before anything is collected.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import socket
import socketserver
import ssl
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from dashrun.errors import UsageError
from dashrun.util.tokens import read_token
from dashrun.util.units import parse_address

__all__ = ["MetricsEndpoint", "MetricsSettings", "metrics_access_options", "metrics_settings", "parse_metrics_listen"]

log = logging.getLogger(__name__)

#: Where ``--metrics-listen PORT`` (no host) binds: the endpoint is open to whoever reaches it, so nothing
#: beyond this machine sees it unless the operator names an address.
LOOPBACK = "127.0.0.1"
#: Seconds a scraper has for its TLS handshake and its request, and for reading the answer.
REQUEST_TIMEOUT = 10.0


def parse_metrics_listen(text: str, option: str = "--metrics-listen") -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT``, ``:PORT`` or ``PORT`` -> (host, port), loopback when no host is named."""
    text = text.strip()
    if text.isdigit():
        text = f"{LOOPBACK}:{text}"
    host, port = parse_address(text, what=option)
    if not host:
        host = LOOPBACK
    return host, port


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    """Where the endpoint listens, its TLS (None: plain HTTP) and the bearer token a scrape must show (None:
    none asked for)."""

    host: str
    port: int
    tls: ssl.SSLContext | None = None
    token: bytes | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"


def metrics_settings(listen: str | None, tls_cert: str | None = None, tls_key: str | None = None,
                     token_file: str | None = None) -> MetricsSettings | None:
    """``--metrics-listen``, ``--metrics-tls-cert``/``--metrics-tls-key`` and ``--metrics-token-file`` as typed
    (None: no endpoint; the others then unused, since their env twins are shared by dash-memd and dash-agent);
    UsageError, one line with a hint, for what cannot be served."""
    if not listen:
        return None
    host, port = parse_metrics_listen(listen)
    if tls_key is not None and tls_cert is None:
        raise UsageError("--metrics-tls-key needs --metrics-tls-cert", hint="give the certificate the key is for")
    context = None
    if tls_cert is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(tls_cert, tls_key, password=lambda: b"")  # a passphrase fails, not prompts
        except (OSError, ssl.SSLError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else getattr(e, "reason", None) or str(e)
            raise UsageError(f"cannot load --metrics-tls-cert {tls_cert}"
                             + (f" / --metrics-tls-key {tls_key}" if tls_key else "") + f": {reason}",
                             hint="give a PEM certificate (chain, leaf first) and its unencrypted key") from None
    token = read_token(token_file) if token_file is not None else None
    return MetricsSettings(host, port, context, token)


def metrics_access_options(command):
    """``--metrics-tls-cert``, ``--metrics-tls-key`` and ``--metrics-token-file`` for a click command (with their
    twins), read by :func:`metrics_settings`."""
    import click

    from dashrun import env

    for name, var, helped in (
            ("--metrics-token-file", env.METRICS_TOKEN_FILE,
             "Ask every scrape for the bearer token in this file (mode 0600; Prometheus: "
             "authorization.credentials_file)."),
            ("--metrics-tls-key", env.METRICS_TLS_KEY, "The unencrypted PEM key of --metrics-tls-cert (default: in "
                                                       "its file)."),
            ("--metrics-tls-cert", env.METRICS_TLS_CERT, "Serve /metrics over HTTPS with this PEM certificate "
                                                         "(chain, leaf first).")):
        command = click.option(name, envvar=var.name, show_envvar=True, type=click.Path(dir_okay=False),
                               default=None, help=helped)(command)
    return command


def _bearer(app, token: bytes):
    """``app`` behind a check of ``Authorization: Bearer TOKEN`` (401 otherwise, nothing collected)."""
    expected = b"Bearer " + token

    def checked(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                                ("WWW-Authenticate", 'Bearer realm="dashrun metrics"')])
            return [b"a bearer token is needed (--metrics-token-file)\n"]
        return app(environ, start_response)
    return checked


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow or silent client holds up no other."""

    daemon_threads = True
    tls: ssl.SSLContext | None = None

    def get_request(self):
        sock, address = super().get_request()
        if self.tls is not None:  # the handshake is the request's thread's, under its timeout (see _Handler)
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request, client_address) -> None:
        log.debug("metrics request from %s failed", client_address, exc_info=True)  # a scraper's problem


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT

    def setup(self) -> None:
        super().setup()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()

    def log_message(self, format, *args) -> None:  # not one stderr line per scrape
        log.debug("metrics %s: " + format, self.address_string(), *args)


class MetricsEndpoint:
    """``registry`` served at ``scheme://host:port/metrics`` from a daemon thread until :meth:`close`."""

    def __init__(self, registry, settings: MetricsSettings, *, program: str):
        from prometheus_client import make_wsgi_app

        app = make_wsgi_app(registry)
        if settings.token is not None:
            app = _bearer(app, settings.token)
        server_class = _Server6 if ":" in settings.host else _Server
        try:
            self._httpd = make_server(settings.host, settings.port, app, server_class=server_class,
                                      handler_class=_Handler)
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {settings.host}:{settings.port}: {e.strerror}",
                             hint="pick another --metrics-listen address or stop what holds the port") from None
        self._httpd.tls = settings.tls
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=f"{program}-metrics", daemon=True)
        self._thread.start()
        self.address: tuple[str, int] = self._httpd.server_address[:2]
        log.info("%s metrics at %s://%s:%d/metrics%s", program, settings.scheme, *self.address,
                 " (bearer token asked for)" if settings.token is not None else "")
        if not settings.loopback and settings.token is None:
            log.warning("%s metrics on %s are open to whoever reaches it (job ids and counts, no checkpoint "
                        "bytes); --metrics-token-file asks for a bearer token, --metrics-tls-cert serves HTTPS",
                        program, settings.host)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
