"""A dash-memd and a dash-agent for a benchmark: each pinned to a core, serving when started, stopped with the
:class:`~dashrun.testing.processes.Processes` that started them."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from dashrun.testing.agent import Agent
from dashrun.testing.memd import Memd
from dashrun.testing.processes import Processes
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
    directory.mkdir(parents=True, exist_ok=True)
    token_file = directory / "token"
    write_token(token_file)
    memd = Memd(directory / "memd-data", token_file, "--memory-limit", "4GiB", *tls.args(),
                log_path=directory / "memd.log", core=core, timeout=60, cwd=cwd, env=env).start(port=0)
    procs.add("dash-memd", memd.proc)
    agent = Agent(memd, directory / "agent.sock", directory / "agent.log", env, options=(), core=agent_core,
                  timeout=60, cwd=cwd)
    procs.add("dash-agent", agent.proc)
    return DashDaemons(memd.host, memd.port, str(token_file), str(agent.socket_path), plaintext, memd.proc,
                       agent.proc, memd.log_path, agent.log_path)
