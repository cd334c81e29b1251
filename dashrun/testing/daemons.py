"""A dash-memd and a dash-agent for a benchmark: each pinned to a core, serving when started, stopped with the
:class:`~dashrun.testing.processes.Processes` that started them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from dashrun.testing.pinning import pinned
from dashrun.testing.processes import Processes
from dashrun.util import daemon
from dashrun.util.tokens import write_token
from dashrun.wire.tls import TlsSettings

__all__ = ["DashDaemons", "start_dash_daemons"]


@dataclasses.dataclass(frozen=True)
class DashDaemons:
    """A dash-memd and a dash-agent started for a dashrun variant (plain data: it travels to rank processes)."""

    host: str
    port: int
    token_file: str
    socket: str
    plaintext: bool
    memd: subprocess.Popen | None = dataclasses.field(default=None, compare=False, repr=False)
    agent: subprocess.Popen | None = dataclasses.field(default=None, compare=False, repr=False)
    memd_log: Path | None = None
    agent_log: Path | None = None

    def to_json(self) -> dict:
        return {"host": self.host, "port": self.port, "token_file": self.token_file, "socket": self.socket,
                "plaintext": self.plaintext}


def start_dash_daemons(directory: Path, procs: Processes, core: int, agent_core: int, *,
                       plaintext: bool = False, cwd: Path | None = None, env: dict | None = None) -> DashDaemons:
    """A real dash-memd pinned to ``core`` and a real dash-agent pinned to ``agent_core``, serving when it returns.

    ``cwd`` and ``env`` are both daemons' (default: this process's).
    """
    env = dict(os.environ if env is None else env)
    tls = TlsSettings(plaintext=plaintext)

    tls = TlsSettings(plaintext=plaintext)
    directory.mkdir(parents=True, exist_ok=True)
    token_file = directory / "token"
    write_token(token_file)
    ready = directory / "memd.ready"
    memd_log = directory / "memd.log"
    memd = procs.start_daemon("dash-memd", pinned(
        [sys.executable, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir",
         str(directory / "memd-data"), "--memory-limit", "4GiB", "--token-file", str(token_file),
         "--ready-file", str(ready), *tls.args()], core), ready=daemon.file_written(ready), log=memd_log,
        cwd=cwd, env=env)
    host, port = ready.read_text().strip().rsplit(":", 1)
    sock_path = directory / "agent.sock"
    agent_log = directory / "agent.log"
    agent = procs.start_daemon("dash-agent", pinned(
        [sys.executable, "-m", "dashrun.agent", "--memd", f"{host}:{port}", "--token-file", str(token_file),
         "--socket", str(sock_path), *tls.args()], agent_core), ready=daemon.accepting(sock_path),
        log=agent_log,
        cwd=cwd, env=env)
    return DashDaemons(host, int(port), str(token_file), str(sock_path), plaintext, memd, agent, memd_log, agent_log)
