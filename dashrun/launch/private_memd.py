"""The private dash-memd a laptop user gets without ``--memd``.

It lives in ``$XDG_CACHE_HOME/dashrun/memd`` (``~/.cache/dashrun/memd``) with
a token generated there on first use, listens on loopback only, and runs for
the duration of one ``dashrun`` command; its disk tier keeps the checkpoints
between commands, so the next run with the same job id resumes. dash-memd
locks its data dir, so one private daemon serves one launcher at a time;
the inspection commands (``status``, ``ls``, ``export``, ...) attach to the
running one, or start their own for the length of the command.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import psutil

from dashrun.errors import UsageError
from dashrun.util import daemon
from dashrun.util.tokens import write_token
from dashrun.util.units import parse_address

__all__ = ["ADDRESS_FILE", "PrivateMemd", "home"]

START_TIMEOUT = 60.0
#: Seconds dash-memd gets to finish its disk writes when stopped.
STOP_TIMEOUT = 120.0
ADDRESS_FILE = "memd.addr"


def home() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dashrun" / "memd"


def _locked(data_dir: Path) -> bool:
    path = data_dir / "LOCK"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class PrivateMemd:
    """A context manager giving ``address`` and ``token_file`` of the private dash-memd."""

    def __init__(self, root: Path | None = None, *, attach: bool, no_tls: bool = False):
        self.root = root or home()
        self.no_tls = no_tls  # start it with --no-tls (one already running keeps how it was started)
        self.token_file = self.root / "token"
        self.attach = attach
        self.address: tuple[str, int] | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrivateMemd:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.token_file.exists():
            write_token(self.token_file)
        address_file = self.root / ADDRESS_FILE
        if _locked(self.root):
            if not self.attach:
                raise UsageError(
                    f"the private dash-memd ({self.root}) is in use by another dashrun on this machine",
                    hint="to run jobs side by side, start one with 'dash-memd start' and pass --memd to both")
            self.address = parse_address(address_file.read_text(), what="private dash-memd address")
            return self
        address_file.unlink(missing_ok=True)
        memory = min(psutil.virtual_memory().total // 4, 16 << 30)
        self.proc = daemon.start(
            [sys.executable, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir", str(self.root),
             "--token-file", str(self.token_file), "--memory-limit", str(memory), "--ready-file", str(address_file),
             *(["--no-tls"] if self.no_tls else [])],
            ready=daemon.file_written(address_file), what="the private dash-memd", timeout=START_TIMEOUT,
            log=self.root / "memd.log", start_new_session=True)
        try:
            self.address = parse_address(address_file.read_text(), what="private dash-memd address")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        daemon.stop(self.proc, timeout=STOP_TIMEOUT)  # SIGTERM: it finishes its disk writes first
        (self.root / ADDRESS_FILE).unlink(missing_ok=True)
