"""A real dash-memd on a free port, started and stopped by the test or script that made it.

On loopback by default; with ``netns=node`` (a :class:`dashrun.testing.netns.Node`) inside that node's network
namespace, on its address, so that its link can be cut or shaped like any node's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from dashrun.errors import UnavailableError
from dashrun.testing.pinning import pinned
from dashrun.testing.processes import NotServing
from dashrun.util import daemon
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.operator import write_key_pair
from dashrun.wire.tls import TlsSettings

__all__ = ["Memd", "dashrun_cmd"]

#: The interpreter's arguments that run dash-memd's command line.
ENTRY = ("-m", "dashrun.memd")


class Memd:
    """A dash-memd process; :meth:`start` returns once it serves, :meth:`stop` or :meth:`kill` ends it.

    ``extra``: its options beyond where it listens, its data, token and ready file. ``core``: pinned to that CPU
    (:func:`~dashrun.testing.pinning.pinned`). ``timeout``: seconds it may take to serve. ``entry``: the
    interpreter's arguments that run its command line (a variant of dash-memd: ``("-c", code)``). Other keywords
    go to :class:`subprocess.Popen` (``cwd``, ``env``). A failed start raises :class:`NotServing` (an
    AssertionError) with the end of its log, so that a test shows why.
    """

    def __init__(self, data_dir: Path, token_file: Path, *extra: str, log_path: Path, core: int | None = None,
                 timeout: float = 30, entry: Sequence[str] = ENTRY, netns=None, **popen_kwargs):
        self.data_dir, self.token_file, self.extra, self.log_path = data_dir, token_file, extra, log_path
        self.core, self.timeout, self.entry, self.popen_kwargs = core, timeout, tuple(entry), popen_kwargs
        self.netns = netns  # a fleet node (dashrun.testing.netns) whose namespace it runs in; None: this one
        self.proc: subprocess.Popen | None = None
        self.host, self.port = ("127.0.0.1" if netns is None else netns.address), 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def token(self) -> bytes:
        return self.token_file.read_bytes().strip()

    @property
    def operator_key(self) -> Path:
        """The operator's private key of this cluster (made beside the token file the first time it is asked
        for); its public key is :attr:`operator_pubkey`."""
        key = self.token_file.with_name(self.token_file.name + ".operator")
        if not key.exists():
            write_key_pair(key)
        return key

    @property
    def operator_pubkey(self) -> Path:
        return self.operator_key.with_name(self.operator_key.name + ".pub")

    def start(self, port: int | None = None) -> Memd:
        """Start it (again, on its previous port unless ``port`` says another; 0 is any free one)."""
        ready = self.data_dir.parent / f"memd-ready-{os.getpid()}-{time.monotonic_ns()}"
        listen = f"{self.host}:{self.port if port is None else port}"
        cmd = [sys.executable, *self.entry, "start", "--listen", listen, "--data-dir", str(self.data_dir),
               "--token-file", str(self.token_file), "--ready-file", str(ready), *self.extra]
        if self.core is not None:
            cmd = pinned(cmd, self.core)
        if self.netns is not None:
            cmd = self.netns.command(cmd)
        try:
            self.proc = daemon.start(cmd, ready=daemon.file_written(ready), what="dash-memd", log=self.log_path,
                                     timeout=self.timeout, **self.popen_kwargs)
        except UnavailableError as e:
            raise NotServing(str(e), self.log()[-2000:]) from None
        self.host, port = ready.read_text().strip().rsplit(":", 1)
        self.port = int(port)
        ready.unlink()
        return self

    @property
    def tls_args(self) -> list[str]:
        """The options a client of this dash-memd needs: --no-tls if it was started with it."""
        return ["--no-tls"] if "--no-tls" in self.extra else []

    def client(self, **kwargs) -> MemdClient:
        kwargs.setdefault("tls", TlsSettings(plaintext=bool(self.tls_args)))
        return MemdClient(self.host, self.port, self.token, **kwargs)

    def stop(self, timeout: float = 30) -> int | None:
        """SIGTERM (it finishes its work), then SIGKILL after ``timeout`` s; its exit code."""
        return daemon.stop(self.proc, timeout=timeout) if self.proc is not None else None

    def kill(self) -> None:
        daemon.stop(self.proc, timeout=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def dashrun_cmd(memd: Memd, *args: str, job: str, nproc: int = 2) -> list[str]:
    """A launch as the operator runs it: with the cluster's token and the key that signs its launch spec."""
    key = getattr(memd, "operator_key", None)  # a relay in front of dash-memd stands in for it, keyless
    return [sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(memd.token_file),
            *(["--operator-key", str(key)] if key else []), *memd.tls_args, "--job-id", job,
            "--nproc-per-node", str(nproc), *args]
