"""A real dash-agent in front of a :class:`~dashrun.testing.memd.Memd`, serving on a Unix socket once made."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dashrun.errors import UnavailableError
from dashrun.util import daemon

__all__ = ["Agent"]


class Agent:
    """A dash-agent process; serving when the constructor returns, ended by :meth:`stop`.

    ``socket_path`` must be short (Unix socket paths max out near 107 bytes). A failed start raises
    AssertionError with the end of its log. With ``netns=node`` (a :class:`dashrun.testing.netns.Node`) it runs
    in that node's network namespace; its ranks reach it all the same (a Unix socket is a file, in no namespace).
    """

    def __init__(self, memd, socket_path: Path, log_path: Path, env: dict | None = None, netns=None):
        self.memd, self.socket_path, self.log_path, self.netns = memd, socket_path, log_path, netns
        cmd = [sys.executable, "-m", "dashrun.agent", "--memd", memd.address, "--token-file", str(memd.token_file),
               "--socket", str(socket_path), "--memd-timeout", "10", "--drain-timeout", "10", *memd.tls_args]
        try:
            self.proc = daemon.start(cmd if netns is None else netns.command(cmd),
                                     ready=daemon.accepting(socket_path), what="dash-agent", log=log_path, timeout=30,
                                     env={**os.environ, **(env or {})})
        except UnavailableError as e:
            raise AssertionError(f"{e}: {self.log()[-2000:]}") from None

    def stop(self) -> None:
        daemon.stop(self.proc, timeout=30)

    def kill(self) -> None:
        """SIGKILL: the node's agent dies with its node, its memory with it."""
        daemon.stop(self.proc, timeout=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")
