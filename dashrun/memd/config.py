"""dash-memd's configuration: one frozen dataclass, validated once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dashrun.errors import UsageError


@dataclasses.dataclass(frozen=True)
class MemdConfig:
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
    #: uploads waiting at most; a full queue drops its oldest
    upload_queue: int = 8
    #: clients served at once; more are refused with BUSY
    max_connections: int = 256
    #: seconds a new connection has to authenticate
    auth_timeout: float = 10.0
    #: seconds an authenticated connection may stay silent
    idle_timeout: float = 300.0
    #: seconds to finish pending disk writes on SIGTERM before exiting
    shutdown_timeout: float = 60.0
    #: file that receives "HOST:PORT" once the server accepts connections
    ready_file: Path | None = None

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
        if self.max_connections < 1:
            raise UsageError("--max-connections must be at least 1")
        if min(self.auth_timeout, self.idle_timeout) <= 0:
            raise UsageError("timeouts must be positive")
