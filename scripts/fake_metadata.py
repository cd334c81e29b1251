#!/usr/bin/env python3
"""A faithful fake of the clouds' metadata services, for tests and demos.

    python scripts/fake_metadata.py --cloud aws|gcp|azure [--port 0] [--imdsv2 required|optional]
                                    [--ready-file F] [--vm-name NAME] [--life-cycle spot|on-demand]
                                    [--zone ZONE] [--instance-type TYPE] [--region REGION]
                                    [--notice KIND [--notice-after SECONDS]]

It speaks, on 127.0.0.1 only, what a client on a Spot VM meets (see
shared/reference/cloud-metadata.md for the facts it honours):

- ``aws``: EC2 IMDS. ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``
  1..21600 (400 otherwise) returns a token; a GET with an invalid or expired token
  is 401, a GET without one is 401 in ``--imdsv2 required`` mode.
  ``meta-data/spot/instance-action`` and the legacy ``spot/termination-time`` are
  404 until a notice is scheduled, ``events/recommendations/rebalance`` 404 until a
  recommendation; JSON is served as text/plain. Enough of the rest (instance-id,
  instance-type, instance-life-cycle, placement, the identity document, an IAM
  role's credentials) for botocore.
- ``gcp``: the metadata server. ``Metadata-Flavor: Google`` is required (403
  without); answers carry ``Metadata-Flavor`` and ``ETag``; ``instance/preempted``
  (FALSE/TRUE) and every other value support the hanging GET
  ``?wait_for_change=true&last_etag=..&timeout_sec=..``; ``instance/maintenance-event``,
  ``instance/scheduling/provisioning-model``, ``instance/zone`` and ``instance/machine-type``
  (``projects/N/zones/ZONE``, ``projects/N/machineTypes/TYPE``).
- ``azure``: IMDS with Scheduled Events. ``Metadata: true`` is required (400
  without); ``/metadata/scheduledevents?api-version=2020-07-01`` answers
  ``DocumentIncarnation`` (grows on every change) and ``Events``; a POST with
  ``{"StartRequests": [{"EventId": ...}]}`` acknowledges (400 when malformed) and is
  recorded; ``/metadata/instance/compute?api-version=..`` describes the VM (``name``,
  ``location``, ``zone``, ``vmSize``, ``priority`` Spot or Regular, ...), and each leaf
  with ``format=text`` (``/metadata/instance/compute/name``).

Where the VM stands (``zone``, ``instance_type``, ``region``; ``--zone`` ...) is
settable per fake; the defaults are one cloud's GPU Spot VM each: AWS
g5.12xlarge in us-east-1a (region us-east-1), GCP a2-highgpu-1g in
us-central1-a, Azure Standard_NC24ads_A100_v4 in zone 1 of eastus (the region is
Azure's ``location``; ``zone=""`` is a VM without a zone). A region not given is
the zone's (AWS: without its last letter; GCP: without its last ``-part``).

From a test (import this file)::

    with FakeMetadata("aws", imdsv2="required") as fake:    # fake.url == "http://127.0.0.1:PORT"
        fake.notice("terminate", lead=120)                  # or fake.early() for a rebalance
        fake.fail_next(3, status=503); fake.throttle(2); fake.expire_tokens()

From the command line, a control interface on the same port (no cloud
headers needed, never subject to injected faults)::

    curl -X POST 'http://127.0.0.1:PORT/_control/notice?kind=terminate&lead=120'
    curl -X POST 'http://127.0.0.1:PORT/_control/early'            # rebalance / maintenance / Redeploy event
    curl -X POST 'http://127.0.0.1:PORT/_control/fail?n=3&status=503'
    curl -X POST 'http://127.0.0.1:PORT/_control/throttle?n=3'      # 429
    curl -X POST 'http://127.0.0.1:PORT/_control/delay?n=2&seconds=5'
    curl -X POST 'http://127.0.0.1:PORT/_control/hang?n=1'          # until clear-faults or stop
    curl -X POST 'http://127.0.0.1:PORT/_control/garbage?n=2'
    curl -X POST 'http://127.0.0.1:PORT/_control/refuse?n=2'        # as if the cloud's header were missing
    curl -X POST 'http://127.0.0.1:PORT/_control/expire-tokens'
    curl -X POST 'http://127.0.0.1:PORT/_control/clear-faults'
    curl -X POST 'http://127.0.0.1:PORT/_control/clear'             # withdraw every notice
    curl 'http://127.0.0.1:PORT/_control/state'                     # JSON: notices, acknowledgements, faults

``n=all`` makes a fault stick until ``clear-faults``. Only the standard library
is used, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import email.utils
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("fake_metadata")

CLOUDS = ("aws", "gcp", "azure")
HOST = "127.0.0.1"  # loopback, unless a test gives the address of a network it made itself

AWS_TOKEN_PATH = "/latest/api/token"
AWS_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
AWS_TOKEN_HEADER = "X-aws-ec2-metadata-token"
AWS_MAX_TTL = 21600
AWS_ACTIONS = ("terminate", "stop", "hibernate")
AWS_ROLE = "dash-node-role"

#: where each cloud's fake VM stands unless told otherwise: (zone, instance type, region)
PLACEMENT = {"aws": ("us-east-1a", "g5.12xlarge", "us-east-1"),
             "gcp": ("us-central1-a", "a2-highgpu-1g", "us-central1"),
             "azure": ("1", "Standard_NC24ads_A100_v4", "eastus")}
#: how the clouds spell zones, regions and instance types (Azure's zone may be empty: a VM in no zone)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

GCP_PREFIX = "/computeMetadata/v1/"
GCP_MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")

AZURE_EVENTS_VERSIONS = frozenset({"2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-08-01",
                                   "2020-07-01"})
AZURE_INSTANCE_VERSIONS = frozenset({
    "2017-03-01", "2017-04-02", "2017-08-01", "2017-10-01", "2017-12-01", "2018-02-01", "2018-04-02",
    "2018-10-01", "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01", "2019-06-04", "2019-08-01",
    "2019-08-15", "2019-11-01", "2020-06-01", "2020-07-15", "2020-09-01", "2020-10-01", "2020-12-01",
    "2021-01-01", "2021-02-01", "2021-03-01", "2021-05-01", "2021-08-01", "2021-10-01", "2021-11-01",
    "2021-11-15", "2021-12-13", "2023-07-01", "2023-11-15", "2024-03-15"})
AZURE_EVENT_TYPES = ("Preempt", "Terminate", "Reboot", "Redeploy", "Freeze")
#: lead times the Azure docs give per event type (Preempt: at least 30 s)
AZURE_LEADS = {"Preempt": 30.0, "Terminate": 300.0, "Reboot": 900.0, "Redeploy": 600.0, "Freeze": 900.0}

MAX_BODY = 1 << 20
GARBAGE = b"\xde\xad\xbe\xef<html><body>502 upstream \x00 garbage{{{"


def aws_time(epoch: float) -> str:
    """``2026-11-29T08:22:00Z``, as IMDS writes times."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def azure_time(epoch: float) -> str:
    """``Mon, 19 Sep 2016 18:29:47 GMT``, as Scheduled Events writes NotBefore."""
    return email.utils.formatdate(epoch, usegmt=True)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as the fake saw it (control requests are not recorded)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    status: int
    at: float

    def header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value
        return None


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # "status" | "delay" | "garbage" | "refuse"
    status: int = 503
    seconds: float | None = None  # delay; None: hang until clear_faults() or stop()


@dataclasses.dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = True  # server_close() joins the handler threads
    allow_reuse_address = True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real services speak
    timeout = 120  # an idle kept-alive connection is dropped after this

    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, False)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        fake: FakeMetadata = self.server.fake
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self._send(Reply(400 if length < 0 else 413, b"bad Content-Length\n",
                             {"Content-Type": "text/plain"}), close=True)
            return
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        headers = {k: v for k, v in self.headers.items()}
        if url.path.startswith("/_control/"):
            reply = fake._control(method, url.path[len("/_control/"):], query)
        else:
            reply = fake._serve(method, url.path, query, headers, body)
            fake._record(Request(method, url.path, query, headers, reply.status, time.time()))
        self._send(reply)

    def _send(self, reply: Reply, close: bool = False) -> None:
        try:
            self.send_response(reply.status)
            for key, value in reply.headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(reply.body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(reply.body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client gave up (a timeout): nothing to tell it

    def version_string(self) -> str:
        return {"aws": "EC2ws", "gcp": "Metadata Server for VM", "azure": "Microsoft-IIS/10.0"}[
            self.server.fake.cloud]

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class FakeMetadata:
    """One cloud's metadata service on ``127.0.0.1:port``, controlled from the test that started it.

    ``host``: another local address to listen on, for nodes in network namespaces a test made (the bridge's).

    Every control method is thread-safe and takes effect for the next request.
    ``stop()`` releases hanging answers, closes kept-alive connections and joins
    every thread the fake started.
    """

    def __init__(self, cloud: str, *, port: int = 0, imdsv2: str = "optional", vm_name: str = "dash-spot-0",
                 instance_id: str = "i-0a1b2c3d4e5f67890", life_cycle: str = "spot", host: str = HOST,
                 zone: str | None = None, instance_type: str | None = None, region: str | None = None):
        if cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {', '.join(CLOUDS)}, not {cloud!r}")
        if imdsv2 not in ("required", "optional"):
            raise ValueError(f"imdsv2 must be 'required' or 'optional', not {imdsv2!r}")
        if life_cycle not in ("spot", "on-demand"):
            raise ValueError(f"life_cycle must be 'spot' or 'on-demand', not {life_cycle!r}")
        self.cloud, self.imdsv2, self.vm_name = cloud, imdsv2, vm_name
        self.instance_id, self.life_cycle = instance_id, life_cycle
        default_zone, default_type, default_region = PLACEMENT[cloud]
        self.zone = default_zone if zone is None else zone
        self.instance_type = default_type if instance_type is None else instance_type
        if region is None:
            region = default_region if zone is None else _region_of(cloud, self.zone)
        self.region = region
        for name in ("zone", "instance_type", "region"):
            value = getattr(self, name)
            if not (NAME.fullmatch(value) or (cloud == "azure" and name == "zone" and value == "")):
                raise ValueError(f"{name} {value!r} is not a name of letters, digits and . _ -")
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # GCP hanging GETs wait on it
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._hangs: set[threading.Event] = set()
        self._faults: collections.deque[Fault] = collections.deque()
        self._sticky: Fault | None = None
        self._requests: list[Request] = []
        # AWS
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.tokens_issued = 0
        self._spot_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        # GCP
        self._gcp: dict[str, str] = {"instance/preempted": "FALSE", "instance/maintenance-event": "NONE"}
        self._hanging = 0
        # Azure
        self._incarnation = 1
        self._events: list[dict[str, Any]] = []
        self._acks: list[str] = []

    # -- life cycle ------------------------------------------------------------------------------------

    def start(self) -> FakeMetadata:
        server = _Server((self._host, self._port), _Handler)
        server.fake = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-{self.cloud}-metadata", daemon=True)
        self._thread.start()
        log.info("fake %s metadata service on %s", self.cloud, self.url)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._stopping.set()
        self._server.shutdown()  # no new connections from here on
        with self._lock:
            self._changed.notify_all()  # hanging GETs answer now
            for hang in self._hangs:
                hang.set()
            connections = list(self._connections)
        for conn in connections:  # wake handlers waiting for the next request on a kept-alive connection
            _shut(conn)
        self._server.server_close()  # joins the handler threads
        self._thread.join()
        self._server = None

    def __enter__(self) -> FakeMetadata:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("the fake is not started")
        return self._server.server_address[:2]

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def url(self) -> str:
        """The base URL a client uses as its metadata endpoint: ``http://127.0.0.1:PORT``."""
        return f"http://{self._host}:{self.port}"

    # -- notices ---------------------------------------------------------------------------------------

    def notice(self, kind: str | None = None, *, lead: float | None = None, at: float | None = None,
               resources: list[str] | None = None) -> str:
        """Schedule an interruption notice; returns its identity (AWS time, ``preempted``, Azure EventId).

        aws: ``kind`` terminate (default) | stop | hibernate, the action ``lead`` seconds
        from now (default 120, hibernate 0) or at epoch ``at``. gcp: ``preempt`` (the
        default): ``instance/preempted`` flips to TRUE. azure: preempt (default) |
        terminate | reboot | redeploy | freeze, an event with NotBefore ``lead``
        seconds ahead (default the type's usual lead, 30 s for Preempt) for
        ``resources`` (default: this VM).
        """
        if self.cloud == "aws":
            action = kind or "terminate"
            if action not in AWS_ACTIONS:
                raise ValueError(f"AWS spot actions are {', '.join(AWS_ACTIONS)}, not {action!r}")
            if at is None:
                at = time.time() + (lead if lead is not None else (0.0 if action == "hibernate" else 120.0))
            stamp = aws_time(at)
            with self._lock:
                self._spot_action = {"action": action, "time": stamp}
            return stamp
        if self.cloud == "gcp":
            if (kind or "preempt") != "preempt":
                raise ValueError(f"a GCP notice is 'preempt', not {kind!r}")
            self._set_gcp("instance/preempted", "TRUE")
            return "preempted"
        return self.add_event(_azure_type(kind or "preempt"), lead=lead, not_before=at, resources=resources)

    def early(self, kind: str | None = None, *, lead: float | None = None, resources: list[str] | None = None,
              at: float | None = None) -> str:
        """An early warning: AWS rebalance recommendation, GCP maintenance event, Azure early event.

        gcp: ``kind`` is the maintenance-event value (default TERMINATE_ON_HOST_MAINTENANCE).
        azure: ``kind`` is the event type (default Redeploy), NotBefore ``lead`` seconds ahead.
        """
        if self.cloud == "aws":
            return self.rebalance(at=at)
        if self.cloud == "gcp":
            return self.maintenance(kind or "TERMINATE_ON_HOST_MAINTENANCE")
        return self.add_event(_azure_type(kind or "redeploy"), lead=lead, not_before=at, resources=resources)

    def rebalance(self, at: float | None = None) -> str:
        """AWS: a rebalance recommendation noticed at ``at`` (default now)."""
        self._need("aws")
        stamp = aws_time(time.time() if at is None else at)
        with self._lock:
            self._rebalance = {"noticeTime": stamp}
        return stamp

    def preempt(self) -> str:
        """GCP: ``instance/preempted`` becomes TRUE (waking hanging GETs)."""
        self._need("gcp")
        return self.notice("preempt")

    def maintenance(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> str:
        """GCP: set ``instance/maintenance-event`` (NONE ends the event)."""
        self._need("gcp")
        if value not in GCP_MAINTENANCE_VALUES:
            raise ValueError(f"maintenance-event is one of {', '.join(GCP_MAINTENANCE_VALUES)}, not {value!r}")
        self._set_gcp("instance/maintenance-event", value)
        return value

    def set_value(self, key: str, value: str) -> None:
        """GCP: serve ``value`` at ``key`` (``instance/zone`` ...) from now on, whatever the VM's settings say: an
        odd answer for a test (waking hanging GETs on it)."""
        self._need("gcp")
        self._set_gcp(key, value)

    def add_event(self, event_type: str = "Preempt", *, lead: float | None = None, not_before: float | None = None,
                  resources: list[str] | None = None, status: str = "Scheduled", source: str = "Platform",
                  description: str | None = None, duration: int = -1, event_id: str | None = None) -> str:
        """Azure: add a scheduled event; returns its EventId. DocumentIncarnation grows."""
        self._need("azure")
        if event_type not in AZURE_EVENT_TYPES:
            raise ValueError(f"Azure event types are {', '.join(AZURE_EVENT_TYPES)}, not {event_type!r}")
        if not_before is None:
            not_before = time.time() + (lead if lead is not None else AZURE_LEADS[event_type])
        event = {
            "EventId": event_id or str(uuid.uuid4()).upper(),
            "EventType": event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(resources) if resources is not None else [self.vm_name],
            "EventStatus": status,
            "NotBefore": "" if status == "Started" else azure_time(not_before),
            "Description": description or _AZURE_DESCRIPTIONS[event_type],
            "EventSource": source,
            "DurationInSeconds": duration,
        }
        with self._lock:
            self._events.append(event)
            self._incarnation += 1
        return event["EventId"]

    def remove_event(self, event_id: str) -> None:
        self._need("azure")
        with self._lock:
            before = len(self._events)
            self._events = [e for e in self._events if e["EventId"] != event_id]
            if len(self._events) != before:
                self._incarnation += 1

    def clear(self) -> None:
        """Withdraw every notice and early warning (the VM is fine again)."""
        with self._lock:
            self._spot_action = self._rebalance = None
            if self._events:
                self._events = []
                self._incarnation += 1
        if self.cloud == "gcp":
            self._set_gcp("instance/preempted", "FALSE")
            self._set_gcp("instance/maintenance-event", "NONE")

    # -- what a test asserts ---------------------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    @property
    def acknowledgements(self) -> list[str]:
        """Azure: the EventIds POSTed in StartRequests, in order."""
        with self._lock:
            return list(self._acks)

    @property
    def incarnation(self) -> int:
        with self._lock:
            return self._incarnation

    @property
    def hanging_gets(self) -> int:
        """GCP: hanging GETs (wait_for_change) waiting for a change right now."""
        with self._lock:
            return self._hanging

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return json.loads(json.dumps(self._events))

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {
                "cloud": self.cloud, "url": self.url if self._server else None, "imdsv2": self.imdsv2,
                "vm_name": self.vm_name, "zone": self.zone, "instance_type": self.instance_type,
                "region": self.region, "requests": len(self._requests), "tokens_issued": self.tokens_issued,
                "spot_action": self._spot_action, "rebalance": self._rebalance, "gcp": dict(self._gcp),
                "incarnation": self._incarnation, "events": json.loads(json.dumps(self._events)),
                "acknowledgements": list(self._acks),
                "faults": [dataclasses.asdict(f) for f in self._faults],
                "sticky_fault": dataclasses.asdict(self._sticky) if self._sticky else None,
            }

    # -- fault injection -------------------------------------------------------------------------------

    def fail_next(self, n: int | None = 1, status: int = 503) -> None:
        """The next ``n`` requests answer ``status`` (``n=None``: every request until clear_faults())."""
        self._add_fault(Fault("status", status=status), n)

    def throttle(self, n: int | None = 1) -> None:
        """The next ``n`` requests are throttled: 429 Too Many Requests."""
        self._add_fault(Fault("status", status=429), n)

    def delay_next(self, n: int | None = 1, seconds: float | None = 5.0) -> None:
        """The next ``n`` requests are answered (normally) after ``seconds``; None: they hang until released."""
        self._add_fault(Fault("delay", seconds=seconds), n)

    def hang_next(self, n: int | None = 1) -> None:
        """The next ``n`` requests get no answer until clear_faults() or stop()."""
        self.delay_next(n, None)

    def garbage_next(self, n: int | None = 1) -> None:
        """The next ``n`` requests answer 200 with a body that is no valid answer."""
        self._add_fault(Fault("garbage", status=200), n)

    def refuse_next(self, n: int | None = 1) -> None:
        """The next ``n`` requests are refused as if the cloud's header were missing (AWS 403, GCP 403, Azure 400)."""
        self._add_fault(Fault("refuse"), n)

    def expire_tokens(self) -> None:
        """AWS: every IMDSv2 token issued so far is expired (GETs carrying one answer 401)."""
        with self._lock:
            self._tokens.clear()

    def clear_faults(self) -> None:
        """Forget pending faults and release hanging answers."""
        with self._lock:
            self._faults.clear()
            self._sticky = None
            for hang in self._hangs:
                hang.set()

    def _add_fault(self, fault: Fault, n: int | None) -> None:
        with self._lock:
            if n is None:
                self._sticky = fault
            else:
                self._faults.extend([fault] * n)

    def _take_fault(self) -> Fault | None:
        with self._lock:
            if self._faults:
                return self._faults.popleft()
            return self._sticky

    # -- serving ---------------------------------------------------------------------------------------

    def _track(self, conn: socket.socket, alive: bool) -> None:
        with self._lock:
            if not alive:
                self._connections.discard(conn)
            elif self._stopping.is_set():
                _shut(conn)  # accepted just as stop() began: it will not be served
            else:
                self._connections.add(conn)

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)
            del self._requests[:-5000]

    def _need(self, cloud: str) -> None:
        if self.cloud != cloud:
            raise ValueError(f"this is a fake {self.cloud} metadata service, not {cloud}")

    def _serve(self, method: str, path: str, query: dict[str, list[str]], headers: dict[str, str],
               body: bytes) -> Reply:
        fault = self._take_fault()
        if fault is not None:
            if fault.kind == "delay":
                self._wait(fault.seconds)
                if self._stopping.is_set():
                    return Reply(503, b"stopping\n", self._base_headers())
            elif fault.kind == "status":
                return self._error(fault.status)
            elif fault.kind == "garbage":
                return Reply(200, GARBAGE, {**self._base_headers(), "Content-Type": "text/plain",
                                            "ETag": "0badc0ffee0ddf00"})
            elif fault.kind == "refuse":
                return self._refuse()
        headers = _Headers(headers)
        if self.cloud == "aws":
            return self._aws(method, path, headers)
        if self.cloud == "gcp":
            return self._gcp_answer(method, path, query, headers)
        return self._azure(method, path, query, headers, body)

    def _wait(self, seconds: float | None) -> None:
        hang = threading.Event()
        with self._lock:
            if self._stopping.is_set():
                return
            self._hangs.add(hang)
        try:
            hang.wait(seconds)
        finally:
            with self._lock:
                self._hangs.discard(hang)

    def _base_headers(self) -> dict[str, str]:
        return {"Metadata-Flavor": "Google"} if self.cloud == "gcp" else {}

    def _error(self, status: int, message: str | None = None) -> Reply:
        reason = _REASONS.get(status, "Error")
        if self.cloud == "aws":  # IMDS error pages are small XHTML documents
            page = (f'<?xml version="1.0" encoding="iso-8859-1"?>\n<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 '
                    f'Transitional//EN"\n\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n<html '
                    f'xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">\n <head>\n  <title>{status} - '
                    f'{reason}</title>\n </head>\n <body>\n  <h1>{status} - {reason}</h1>\n </body>\n</html>\n')
            return Reply(status, page.encode(), {"Content-Type": "text/html"})
        if self.cloud == "gcp":
            text = message or f"{status} {reason}"
            return Reply(status, f"{text}\n".encode(), {**self._base_headers(), "Content-Type": "text/html"})
        body = json.dumps({"error": message or reason}).encode()
        return Reply(status, body, {"Content-Type": "application/json; charset=utf-8"})

    def _refuse(self) -> Reply:
        if self.cloud == "aws":
            return self._error(403)  # IMDS disabled / forwarded request
        if self.cloud == "gcp":
            return self._error(403, "Your client does not have permission to get URL from this server. "
                                    "Missing Metadata-Flavor:Google header.")
        return self._error(400, "Bad request. Required metadata header not specified")

    # -- AWS -------------------------------------------------------------------------------------------

    def _aws(self, method: str, path: str, headers: _Headers) -> Reply:
        if headers.get("X-Forwarded-For") is not None:
            return self._error(403)  # IMDS refuses requests that went through a proxy
        if path == AWS_TOKEN_PATH:
            if method != "PUT":
                return self._error(405)
            raw = headers.get(AWS_TTL_HEADER)
            ttl = int(raw) if raw is not None and re.fullmatch(r"[0-9]{1,6}", raw.strip()) else 0
            if not 1 <= ttl <= AWS_MAX_TTL:
                return self._error(400)
            token = base64.b64encode(b"\x01\x00\x04\x00" + os.urandom(38)).decode()
            with self._lock:
                self._tokens[token] = time.monotonic() + ttl
                self.tokens_issued += 1
            return Reply(200, token.encode(), {"Content-Type": "text/plain", AWS_TTL_HEADER: str(ttl)})
        if method != "GET":
            return self._error(405)
        token = headers.get(AWS_TOKEN_HEADER)
        if token is not None:
            with self._lock:
                expiry = self._tokens.get(token)
            if expiry is None or expiry <= time.monotonic():
                return self._error(401)
        elif self.imdsv2 == "required":
            return self._error(401)
        m = re.fullmatch(r"/(latest|1\.0|\d{4}-\d{2}-\d{2})(/.*)?", path)
        if path == "/":
            return _text("1.0\n2007-01-19\n2016-09-02\n2021-07-15\nlatest")
        if m is None:
            return self._error(404)
        value = _lookup(self._aws_tree(), (m.group(2) or "/").strip("/"))
        return self._error(404) if value is None else _text(value)

    def _aws_tree(self) -> dict[str, str]:
        now = time.time()
        with self._lock:
            spot, rebalance = self._spot_action, self._rebalance
        md = {
            "ami-id": "ami-0abcdef1234567890", "ami-launch-index": "0",
            "hostname": "ip-10-0-0-12.ec2.internal", "local-hostname": "ip-10-0-0-12.ec2.internal",
            "local-ipv4": "10.0.0.12", "mac": "0e:49:61:0f:c3:11",
            "instance-id": self.instance_id, "instance-type": self.instance_type,
            "instance-life-cycle": self.life_cycle, "instance-action": "none",
            "placement/availability-zone": self.zone, "placement/region": self.region,
            "services/domain": "amazonaws.com", "events/maintenance/scheduled": "[]",
            "iam/info": json.dumps({"Code": "Success", "LastUpdated": aws_time(now),
                                    "InstanceProfileArn": f"arn:aws:iam::123456789012:instance-profile/{AWS_ROLE}",
                                    "InstanceProfileId": "AIPAEXAMPLEPROFILEID00"}, indent=2),
            f"iam/security-credentials/{AWS_ROLE}": json.dumps({
                "Code": "Success", "LastUpdated": aws_time(now), "Type": "AWS-HMAC",
                "AccessKeyId": "ASIAFAKEFAKEFAKEFAKE", "SecretAccessKey": "fake/secret/key/for/tests/only0000000000",
                "Token": "fake-session-token", "Expiration": aws_time(now + 6 * 3600)}, indent=2),
        }
        if self.life_cycle == "spot" and spot is not None:
            md["spot/instance-action"] = json.dumps(spot)
            md["spot/termination-time"] = spot["time"]
        if rebalance is not None:
            md["events/recommendations/rebalance"] = json.dumps(rebalance)
        tree = {f"meta-data/{k}": v for k, v in md.items()}
        tree["dynamic/instance-identity/document"] = json.dumps({
            "accountId": "123456789012", "architecture": "x86_64", "availabilityZone": self.zone,
            "imageId": "ami-0abcdef1234567890", "instanceId": self.instance_id, "instanceType": self.instance_type,
            "pendingTime": "2026-01-01T00:00:00Z", "privateIp": "10.0.0.12", "region": self.region,
            "version": "2017-09-30"}, indent=2)
        return tree

    # -- GCP -------------------------------------------------------------------------------------------

    def _set_gcp(self, key: str, value: str) -> None:
        with self._lock:
            if self._gcp.get(key) != value:
                self._gcp[key] = value
                self._changed.notify_all()

    def _gcp_tree(self) -> dict[str, str]:
        spot = self.life_cycle == "spot"
        tree = {
            "instance/id": "4520031799277581759", "instance/name": self.vm_name,
            "instance/hostname": f"{self.vm_name}.{self.zone}.c.dash-project.internal",
            "instance/zone": f"projects/123456789012/zones/{self.zone}",
            "instance/machine-type": f"projects/123456789012/machineTypes/{self.instance_type}",
            "instance/scheduling/provisioning-model": "SPOT" if spot else "STANDARD",
            "instance/scheduling/preemptible": "TRUE" if spot else "FALSE",
            "instance/scheduling/on-host-maintenance": "TERMINATE",
            "instance/scheduling/automatic-restart": "FALSE" if spot else "TRUE",
            "project/project-id": "dash-project", "project/numeric-project-id": "123456789012",
        }
        tree.update(self._gcp)  # the caller holds the lock
        return tree

    def _gcp_answer(self, method: str, path: str, query: dict[str, list[str]], headers: _Headers) -> Reply:
        if headers.get("X-Forwarded-For") is not None:
            return self._error(403, "Your client does not have permission to get URL from this server.")
        if (headers.get("Metadata-Flavor") or "") != "Google":
            return self._refuse()
        if method != "GET":
            return self._error(405)
        if path in ("/", ""):
            return self._gcp_reply("computeMetadata/")
        if path.rstrip("/") == "/computeMetadata":
            return self._gcp_reply("v1/")
        if not (path + "/").startswith(GCP_PREFIX):
            return self._error(404)
        key = path[len(GCP_PREFIX):].strip("/") if len(path) > len(GCP_PREFIX) else ""
        wait = _param(query, "wait_for_change", "false").lower() == "true"
        timeout = _param(query, "timeout_sec")
        try:
            timeout_sec = float(timeout) if timeout is not None else None
        except ValueError:
            return self._error(400, "timeout_sec must be a number")
        if timeout_sec is not None and timeout_sec <= 0:
            return self._error(400, "timeout_sec must be positive")
        last_etag = _param(query, "last_etag")
        with self._lock:
            value = _lookup(self._gcp_tree(), key)
            if value is None:
                return self._error(404)
            if wait:
                start = last_etag or _etag(key, value)
                deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
                self._hanging += 1
                try:
                    while _etag(key, value) == start and not self._stopping.is_set():
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            break
                        self._changed.wait(remaining)
                        value = _lookup(self._gcp_tree(), key) or ""
                finally:
                    self._hanging -= 1
        return self._gcp_reply(value, key)

    def _gcp_reply(self, value: str, key: str = "") -> Reply:
        return Reply(200, value.encode(), {**self._base_headers(), "Content-Type": "application/text",
                                           "ETag": _etag(key, value)})

    # -- Azure -----------------------------------------------------------------------------------------

    def _azure(self, method: str, path: str, query: dict[str, list[str]], headers: _Headers, body: bytes) -> Reply:
        if headers.get("X-Forwarded-For") is not None:
            return self._error(400, "Bad request. Requests with X-Forwarded-For are not allowed")
        if (headers.get("Metadata") or "").lower() != "true":
            return self._refuse()
        version = _param(query, "api-version")
        path = path.rstrip("/")
        if path == "/metadata/scheduledevents":
            if version not in AZURE_EVENTS_VERSIONS:
                return self._bad_version(AZURE_EVENTS_VERSIONS)
            if method == "GET":
                with self._lock:
                    doc = {"DocumentIncarnation": self._incarnation, "Events": json.loads(json.dumps(self._events))}
                return _json(doc)
            if method == "POST":
                return self._acknowledge(body)
            return self._error(405, "Method not allowed")
        if path == "/metadata/instance" or path.startswith("/metadata/instance/"):
            if method != "GET":
                return self._error(405, "Method not allowed")
            if version not in AZURE_INSTANCE_VERSIONS:
                return self._bad_version(AZURE_INSTANCE_VERSIONS)
            node: Any = self._azure_instance()
            for part in filter(None, path[len("/metadata/instance"):].split("/")):
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    return self._error(404, "Not found")
            fmt = _param(query, "format", "json")
            if fmt == "text":
                if isinstance(node, (dict, list)):
                    return self._error(400, "Bad request. Format text is only supported for leaf nodes")
                return Reply(200, str(node).encode(), {"Content-Type": "text/plain; charset=utf-8"})
            if fmt != "json":
                return self._error(400, "Bad request. Unsupported format")
            return _json(node)
        return self._error(404, "Not found")

    def _bad_version(self, versions: frozenset[str]) -> Reply:
        body = json.dumps({"error": "Bad request. api-version is invalid or was not specified in the request. "
                                    "For more information refer to aka.ms/azureimds",
                           "newest-versions": sorted(versions, reverse=True)[:3]}).encode()
        return Reply(400, body, {"Content-Type": "application/json; charset=utf-8"})

    def _acknowledge(self, body: bytes) -> Reply:
        try:
            doc = json.loads(body)
            requests = doc["StartRequests"]
            if not isinstance(requests, list) or not requests:
                raise ValueError("StartRequests must be a non-empty list")
            ids = [r["EventId"] for r in requests]
            if not all(isinstance(i, str) and i for i in ids):
                raise ValueError("EventId must be a string")
        except (ValueError, KeyError, TypeError):
            return self._error(400, "Bad request. The request body is malformed")
        with self._lock:
            self._acks.extend(ids)
            changed = False
            for event in self._events:
                if event["EventId"] in ids and event["EventStatus"] != "Started":
                    event["EventStatus"], event["NotBefore"] = "Started", ""  # blank once started
                    changed = True
            if changed:
                self._incarnation += 1
        return Reply(200, b"", {"Content-Type": "application/json; charset=utf-8"})

    def _azure_instance(self) -> dict[str, Any]:
        spot = self.life_cycle == "spot"
        return {
            "compute": {
                "azEnvironment": "AzurePublicCloud", "location": self.region, "name": self.vm_name,
                "osType": "Linux", "priority": "Spot" if spot else "Regular",
                "evictionPolicy": "Delete" if spot else "", "provider": "Microsoft.Compute",
                "resourceGroupName": "dash-rg", "subscriptionId": "00000000-0000-0000-0000-000000000000",
                "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6", "vmSize": self.instance_type,
                "zone": self.zone,
            },
            "network": {"interface": [{"ipv4": {"ipAddress": [{"privateIpAddress": "10.0.0.4",
                                                                "publicIpAddress": ""}]},
                                       "macAddress": "000D3AF806EC"}]},
        }

    # -- control interface -----------------------------------------------------------------------------

    def _control(self, method: str, action: str, query: dict[str, list[str]]) -> Reply:
        try:
            if action == "state" and method == "GET":
                return _json(self.state())
            if method != "POST":
                return _json({"error": "use POST (GET only for state)"}, 405)
            result = self._control_action(action, query)
        except (ValueError, TypeError) as e:
            return _json({"error": str(e)}, 400)
        if result is None:
            return _json({"error": f"unknown control action {action!r}"}, 404)
        return _json({"ok": True, **result})

    def _control_action(self, action: str, query: dict[str, list[str]]) -> dict[str, Any] | None:
        def number(name: str, default: float | None) -> float | None:
            raw = _param(query, name)
            return default if raw is None else float(raw)

        def count() -> int | None:
            raw = _param(query, "n", "1")
            return None if raw == "all" else int(raw)

        if action in ("notice", "early"):
            method = self.notice if action == "notice" else self.early
            ident = method(_param(query, "kind"), lead=number("lead", None), at=number("at", None),
                           resources=query.get("resource"))
            return {"id": ident}
        simple = {
            "clear": self.clear, "expire-tokens": self.expire_tokens, "clear-faults": self.clear_faults,
            "fail": lambda: self.fail_next(count(), status=int(number("status", 503))),
            "throttle": lambda: self.throttle(count()),
            "delay": lambda: self.delay_next(count(), number("seconds", 5.0)),
            "hang": lambda: self.hang_next(count()),
            "garbage": lambda: self.garbage_next(count()),
            "refuse": lambda: self.refuse_next(count()),
        }
        if action not in simple:
            return None
        simple[action]()
        return {}


class _Headers:
    """Case-insensitive header look-up."""

    def __init__(self, headers: dict[str, str]):
        self._h = {k.lower(): v for k, v in headers.items()}

    def get(self, name: str) -> str | None:
        return self._h.get(name.lower())


_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
            429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}

_AZURE_DESCRIPTIONS = {
    "Preempt": "Virtual machine is being preempted.",
    "Terminate": "Virtual machine is being deleted.",
    "Reboot": "Virtual machine is going to be restarted as requested by authorized user.",
    "Redeploy": "Virtual machine is going to be redeployed to another host.",
    "Freeze": "Host server is undergoing maintenance.",
}


def _azure_type(kind: str) -> str:
    for event_type in AZURE_EVENT_TYPES:
        if kind.lower() == event_type.lower():
            return event_type
    raise ValueError(f"Azure event types are {', '.join(AZURE_EVENT_TYPES)}, not {kind!r}")


def _region_of(cloud: str, zone: str) -> str:
    """The region a zone lies in: AWS us-west-2b -> us-west-2, GCP europe-west4-a -> europe-west4; Azure's
    zones are numbers within a region (its location), so the default one."""
    if cloud == "aws":
        return zone[:-1] if len(zone) > 1 and zone[-1].isalpha() else zone
    if cloud == "gcp":
        return zone.rsplit("-", 1)[0] if "-" in zone else zone
    return PLACEMENT["azure"][2]


def _param(query: dict[str, list[str]], name: str, default: str | None = None) -> str | None:
    values = query.get(name)
    return values[-1] if values else default


def _lookup(tree: dict[str, str], key: str) -> str | None:
    """A leaf's value, or a directory's listing (children, directories with a trailing slash)."""
    if key in tree:
        return tree[key]
    prefix = f"{key}/" if key else ""
    children: list[str] = []
    for path in tree:
        if path.startswith(prefix):
            head, sep, _ = path[len(prefix):].partition("/")
            child = head + ("/" if sep else "")
            if child not in children:
                children.append(child)
    return "\n".join(sorted(children)) if children else None


def _etag(key: str, value: str) -> str:
    return hashlib.sha256(f"{key}\0{value}".encode()).hexdigest()[:16]


def _text(value: str) -> Reply:
    return Reply(200, value.encode(), {"Content-Type": "text/plain"})


def _json(doc: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(doc).encode(), {"Content-Type": "application/json; charset=utf-8"})


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _write_ready(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cloud", choices=CLOUDS, required=True)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--imdsv2", choices=("required", "optional"), default="optional",
                        help="aws: whether GETs without a token are refused (401)")
    parser.add_argument("--vm-name", default="dash-spot-0")
    parser.add_argument("--life-cycle", choices=("spot", "on-demand"), default="spot")
    parser.add_argument("--zone", default=None,
                        help="the VM's zone (default: us-east-1a, us-central1-a, Azure 1; Azure '': no zone)")
    parser.add_argument("--instance-type", default=None,
                        help="the VM's instance type (default: g5.12xlarge, a2-highgpu-1g, Standard_NC24ads_A100_v4)")
    parser.add_argument("--region", default=None, help="the VM's region (default: the zone's; Azure: eastus)")
    parser.add_argument("--ready-file", type=Path, default=None, help="write 127.0.0.1:PORT here once listening")
    parser.add_argument("--notice", metavar="KIND", default=None,
                        help="schedule this notice (terminate, preempt, ...) --notice-after seconds after start")
    parser.add_argument("--notice-after", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s fake-metadata %(levelname)s: %(message)s", datefmt="%H:%M:%S")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())  # record only; the loop below acts
    try:
        fake = FakeMetadata(args.cloud, port=args.port, imdsv2=args.imdsv2, vm_name=args.vm_name,
                            life_cycle=args.life_cycle, zone=args.zone, instance_type=args.instance_type,
                            region=args.region).start()
    except (ValueError, OSError) as e:
        print(f"fake_metadata: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.ready_file is not None:
            _write_ready(args.ready_file, f"{HOST}:{fake.port}\n")
        print(f"fake {args.cloud} metadata service on {fake.url} (control: {fake.url}/_control/state)", flush=True)
        notice_at = time.monotonic() + args.notice_after if args.notice else None
        while not stop.wait(0.2):
            if notice_at is not None and time.monotonic() >= notice_at:
                log.info("scheduling a %s notice: %s", args.notice, fake.notice(args.notice))
                notice_at = None
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
