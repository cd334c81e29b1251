"""dash-agent's configuration: one frozen dataclass, built by the command line (or a test) and read by the rest."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from dashrun.env import DEFAULT_PEER_PORT, PreemptionRecord
from dashrun.errors import UsageError
from dashrun.util.metrics import MetricsSettings
from dashrun.wire.domain import FailureDomain
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.tls import TlsSettings

__all__ = ["DEFAULT_PEER_MEMORY", "AgentConfig"]

#: Bytes of shards an agent keeps in its own memory when it keeps replicas and is not told how many.
DEFAULT_PEER_MEMORY = 8 << 30


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    memd_host: str
    memd_port: int
    token: bytes = dataclasses.field(repr=False)
    socket_path: Path = Path("agent.sock")
    #: a listening socket at ``socket_path`` inherited from the launcher, which made it before starting the agent
    #: (None: the agent makes its own)
    listen_fd: int | None = None
    #: seconds one request to dash-memd may stay silent before it counts as lost
    memd_timeout: float = 60.0
    #: seconds a fetched restore image is kept for the node's other ranks
    restore_ttl: float = 120.0
    #: connections a restore reads from dash-memd at once (one large shard is split between them)
    restore_streams: int = dataclasses.field(default_factory=lambda: min(4, max(2, os.cpu_count() or 1)))
    #: fetch the job's newest checkpoint as soon as the agent starts, ahead of its ranks' restore()
    prefetch: bool = True
    #: seconds to finish handed-over shards on SIGTERM
    drain_timeout: float = 60.0
    #: this node's name, as dash-memd lists it among the job's nodes
    node: str = dataclasses.field(default_factory=socket.gethostname)
    #: the job this agent serves (its notices are recorded on it in dash-memd)
    job: str | None = None
    #: where interruption notices come from: auto, aws, gcp, azure or none; and an endpoint override
    cloud: str = "none"
    metadata_endpoint: str | None = None
    #: seconds between polls of the metadata service (None: each cloud's own default)
    poll_interval: float | None = None
    #: this node's failure domain as --failure-domain names it (None: read from the metadata service,
    #: dashrun.agent.identity.this_domain)
    failure_domain: FailureDomain | None = None
    #: this node's instance type and market as --instance-type/--market name them, in place of the metadata
    #: service's (None: its, or the pool of --failure-domain)
    instance_type: str | None = None
    market: str | None = None
    #: the launcher's pid: once it is gone the agent delivers what was handed over and exits (None: never)
    parent_pid: int | None = None
    #: TLS to dash-memd (or plaintext with --no-tls), and a CA to verify it with
    tls: TlsSettings = TlsSettings()
    #: other nodes that keep a copy of this node's snapshot (and whose copies this one keeps)
    replicas: int = 0
    #: TCP port of the peer link (0: any free port); the agent listens with a job and replicas only
    peer_port: int = DEFAULT_PEER_PORT
    #: address the peer link listens on (None: the one this node's connections to dash-memd go out from)
    peer_host: str | None = None
    #: bytes of shards kept in the agent's memory (None: DEFAULT_PEER_MEMORY with replicas, else 0: none kept)
    peer_memory_limit: int | None = None
    #: (node, host, port) of the agents this node's replicas go to, given by hand (tests: --peer)
    peers: tuple[tuple[str, str, int], ...] = ()
    #: the Prometheus /metrics endpoint (--metrics-listen, its TLS and token); None: none served
    metrics: MetricsSettings | None = None

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise UsageError(f"--replicas {self.replicas} is negative", hint="give 0 (no copies) or more")
        if not 0 <= self.peer_port <= 65535:
            raise UsageError(f"--peer-port {self.peer_port} is not a TCP port", hint="give 0..65535 (0: any free)")
        if self.peer_memory_limit is not None and self.peer_memory_limit < 0:
            raise UsageError("--peer-memory-limit is negative")

    @property
    def store_limit(self) -> int:
        """Bytes the agent's store may hold (0: the agent keeps no shards of its own)."""
        if self.peer_memory_limit is not None:
            return self.peer_memory_limit
        return DEFAULT_PEER_MEMORY if self.replicas > 0 else 0

    @property
    def preempted_file(self) -> Path:
        """Written when this node must stop: its notice arrived, or its ranks took an emergency checkpoint."""
        return self.socket_path.parent / PreemptionRecord.FILE

    def memd_client(self) -> MemdClient:
        """A new client of dash-memd (the caller closes it)."""
        return MemdClient(self.memd_host, self.memd_port, self.token, timeout=self.memd_timeout, tls=self.tls)
