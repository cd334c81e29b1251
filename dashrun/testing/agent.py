"""A real dash-agent in front of a :class:`~dashrun.testing.memd.Memd`, serving on a Unix socket once made."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from dashrun.errors import UnavailableError
from dashrun.testing.pinning import pinned
from dashrun.testing.processes import NotServing
from dashrun.util import daemon

__all__ = ["TEST_OPTIONS", "Agent"]

#: A test's agent gives up on an unreachable dash-memd, and on a drain, after 10 s.
TEST_OPTIONS = ("--memd-timeout", "10", "--drain-timeout", "10")


class Agent:
    """A dash-agent process; serving when the constructor returns, ended by :meth:`stop`.

    ``socket_path`` must be short (Unix socket paths max out near 107 bytes). ``env``: variables set on top of
    this process's environment. ``options``: its options beyond dash-memd, the token, the socket and TLS (a
    test's deadlines unless told; a benchmark passes ``()`` for dash-agent's own). ``core``: pinned to that CPU.
    ``timeout``: seconds it may take to serve; ``what`` names it in a failure. With ``netns=node`` (a
    :class:`dashrun.testing.netns.Node`) it runs in that node's network namespace; its ranks reach it all the
    same (a Unix socket is a file, in no namespace). Other keywords go to :class:`subprocess.Popen` (``cwd``,
    ``start_new_session``). A failed start raises :class:`NotServing` (an AssertionError) with the end of its log.
    """

    def __init__(self, memd, socket_path: Path, log_path: Path, env: dict | None = None, *,
                 options: Sequence[str] = TEST_OPTIONS, core: int | None = None, timeout: float = 30,
                 what: str = "dash-agent", netns=None, **popen_kwargs):
        self.memd, self.socket_path, self.log_path, self.netns = memd, socket_path, log_path, netns
        cmd = [sys.executable, "-m", "dashrun.agent", "--memd", memd.address, "--token-file", str(memd.token_file),
               "--socket", str(socket_path), *options, *memd.tls_args]
        if core is not None:
            cmd = pinned(cmd, core)
        if netns is not None:
            cmd = netns.command(cmd)
        try:
            self.proc = daemon.start(cmd, ready=daemon.accepting(socket_path), what=what, log=log_path,
                                     timeout=timeout, env={**os.environ, **(env or {})}, **popen_kwargs)
        except UnavailableError as e:
            raise NotServing(str(e), self.log()[-2000:]) from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (it drains), then SIGKILL after ``timeout`` s; its exit code."""
        return daemon.stop(self.proc, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: the node's agent dies with its node, its memory with it."""
        daemon.stop(self.proc, timeout=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
