"""dash-memd's configuration: one frozen dataclass, validated once, and the default memory limit.

The default ``--memory-limit`` is half of the memory this process may use:
the smaller of the machine's RAM and its cgroup's (container's) memory limit,
so that dash-memd in a container does not plan for RAM it would be killed
for touching.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from pathlib import Path

import psutil

from dashrun.errors import UsageError
from dashrun.util.metrics import MetricsSettings

__all__ = ["V1_UNLIMITED", "MemdConfig", "cgroup_memory_limit", "default_memory_limit", "loopback"]

#: A cgroup v1 limit at least this large is no limit (the kernel writes "unlimited" as a number near 2**63).
V1_UNLIMITED = 1 << 60


@dataclasses.dataclass(frozen=True)
class MemdConfig:
    """Everything dash-memd runs with; raises UsageError for values it cannot run with."""

    host: str
    port: int
    data_dir: Path
    memory_limit: int
    token: bytes = dataclasses.field(repr=False)
    #: committed checkpoints per job kept in RAM (older ones are evicted once on disk)
    keep_ram: int = 2
    #: committed checkpoints per job kept on disk
    keep_disk: int = 3
    #: s3://bucket/prefix of the object tier; None: no object tier
    s3: str | None = None
    #: committed checkpoints per job kept in the object store
    keep_object: int = 20
    #: dash-memd's own data set cache (dashrun.memd.datasets), behind the nodes'; None: none
    data_cache: Path | None = None
    #: bytes it may hold; None: the default of dashrun.data.cache.Cache
    data_cache_limit: int | None = None
    #: uploads waiting at most; a full queue drops its oldest
    upload_queue: int = 8
    #: clients served at once; more are refused with BUSY
    max_connections: int = 256
    #: connections that have not logged in yet, at once; a new one beyond drops the oldest of them
    max_unauthenticated: int = 32
    #: seconds a new connection has to authenticate
    auth_timeout: float = 10.0
    #: seconds an authenticated connection may stay silent
    idle_timeout: float = 300.0
    #: seconds to finish pending disk writes on SIGTERM before exiting
    shutdown_timeout: float = 60.0
    #: file that receives "HOST:PORT" once the server accepts connections
    ready_file: Path | None = None
    #: plaintext TCP (--no-tls); every client must say --no-tls too
    no_tls: bool = False
    #: --no-tls on an address beyond loopback, asked for by name (--insecure-plaintext)
    insecure_plaintext: bool = False
    #: the operator's certificate (chain, leaf first) and key; None: dash-memd's own, kept in its data dir
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: the process that started this one (dashrun's private dash-memd: the launcher); once it is gone, dash-memd
    #: stops as on SIGTERM, its disk writes finished first (None: it runs until told to stop)
    parent_pid: int | None = None
    #: the Prometheus /metrics endpoint (--metrics-listen, its TLS and token); None: none served
    metrics: MetricsSettings | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise UsageError(f"port {self.port} out of range")
        if self.memory_limit < 1 << 20:
            raise UsageError("--memory-limit must be at least 1MiB", hint="e.g. --memory-limit 48GiB")
        if min(self.keep_ram, self.keep_disk, self.keep_object, self.upload_queue) < 1:
            raise UsageError("--keep-ram, --keep-disk, --keep-object and --upload-queue must be at least 1")
        if self.s3 is not None and not (self.s3.startswith("s3://") and self.s3[5:].split("/", 1)[0]):
            raise UsageError(f"--s3 {self.s3!r} is not of the form s3://bucket/prefix",
                             hint="e.g. --s3 s3://my-bucket/dashrun")
        if min(self.max_connections, self.max_unauthenticated) < 1:
            raise UsageError("--max-connections and --max-unauthenticated must be at least 1")
        if min(self.auth_timeout, self.idle_timeout) <= 0:
            raise UsageError("timeouts must be positive")
        if self.tls_key is not None and self.tls_cert is None:
            raise UsageError("--tls-key needs --tls-cert", hint="give the certificate the key belongs to")
        if self.no_tls and self.tls_cert is not None:
            raise UsageError("--tls-cert and --no-tls exclude each other", hint="drop one of them")
        if self.insecure_plaintext and not self.no_tls:
            raise UsageError("--insecure-plaintext goes with --no-tls only", hint="drop it: with TLS it says nothing")
        # Checked before anything listens: plaintext beyond this machine must be asked for by name.
        if self.no_tls and not self.insecure_plaintext and not loopback(self.host):
            raise UsageError(f"--no-tls on --listen {self.host}, beyond loopback: every checkpoint would cross the "
                             "network unencrypted", hint="drop --no-tls, or add --insecure-plaintext if every "
                                                         "network on the way is yours")


def loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name, resolved here) is this machine's loopback alone: every address a
    name resolves to, and never ``0.0.0.0``, ``::`` or an empty host (every interface)."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP) if host else []
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%", 1)[0]).is_loopback for info in infos)


def _read_limit(path: Path) -> int | None:
    """The byte count in a cgroup limit file; None if absent, unreadable, "max" or not a number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max": no limit
    return int(text)


def cgroup_memory_limit(root: str | Path = "/") -> int | None:
    """The memory limit of this process's cgroup in bytes, or None if it has none.

    ``root`` is where the file system starts (``/``; a test points it at a
    directory laid out like ``/proc`` and ``/sys/fs/cgroup``). cgroup v2: the
    ``memory.max`` of the process's cgroup (``0::PATH`` in ``/proc/self/cgroup``)
    and of its ancestors, "max" meaning none. cgroup v1: ``memory.limit_in_bytes``
    of the process's memory cgroup and of the hierarchy's root (a container's
    own cgroup is mounted there), huge values meaning none. The smallest
    limit found wins.
    """
    root = Path(root)
    fs = root / "sys/fs/cgroup"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    found: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        if hierarchy == "0" and controllers == "":
            for depth in range(len(parts), -1, -1):  # the process's cgroup, then its ancestors
                limit = _read_limit(fs.joinpath(*parts[:depth], "memory.max"))
                if limit is not None:
                    found.append(limit)
        elif "memory" in controllers.split(","):
            limit = _read_limit(fs.joinpath("memory", *parts, "memory.limit_in_bytes"))
            if limit is not None and limit < V1_UNLIMITED:
                found.append(limit)
    v1_root = _read_limit(fs / "memory/memory.limit_in_bytes")
    if v1_root is not None and v1_root < V1_UNLIMITED:
        found.append(v1_root)
    return min(found, default=None)


def default_memory_limit(root: str | Path = "/", *, host_total: int | None = None) -> int:
    """Half of the smaller of the machine's RAM (``host_total``, else psutil's) and the cgroup's memory limit."""
    total = psutil.virtual_memory().total if host_total is None else host_total
    limit = cgroup_memory_limit(root)
    return (total if limit is None else min(total, limit)) // 2
