"""The private dash-memd a laptop user gets without ``--memd``.

It lives in ``$XDG_CACHE_HOME/dashrun/memd`` (``~/.cache/dashrun/memd``) with
a token generated there on first use, listens on loopback only, and runs for
the duration of one ``dashrun`` command; its disk tier keeps the checkpoints
between commands, so the next run with the same job id resumes. dash-memd
locks its data dir, so one private daemon serves one launcher at a time;
the inspection commands (``status``, ``ls``, ``export``, ...) attach to the
running one, or start their own for the length of the command.

It runs in a session of its own (terminal signals reach the launcher only)
and watches its launcher (``--parent-pid``): a launcher killed outright
(``kill -9``) leaves it to finish its disk writes and exit by itself, and the
next command waits for that instead of finding the data dir in use.
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
from dashrun.wire.operator import write_key_pair
from dashrun.util.units import parse_address

__all__ = ["ADDRESS_FILE", "PrivateMemd", "home", "resumed_home"]

START_TIMEOUT = 60.0
#: Seconds dash-memd gets to finish its disk writes when stopped.
STOP_TIMEOUT = 120.0
ADDRESS_FILE = "memd.addr"
#: dash-memd's lock file in its data dir, with its pid (``dashrun.memd.server.LOCK_FILE``, spelled here so that a
#: launch does not import dash-memd)
LOCK_FILE = "LOCK"


def home() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dashrun" / "memd"


def resumed_home() -> Path:
    """Where ``dashrun resume`` keeps the newest launch spec of each job this node ran (replays are refused)."""
    return home().parent / "resumed"


def _holder(data_dir: Path) -> psutil.Process | None:
    """The dash-memd that holds the data dir's lock, as the pid it wrote in the lock file says (None: unknown)."""
    try:
        pid = int((data_dir / LOCK_FILE).read_text().strip())
        return psutil.Process(pid)
    except (OSError, ValueError, psutil.Error):
        return None


def _launcher_gone(holder: psutil.Process | None) -> bool:
    """Whether ``holder`` is a private dash-memd whose launcher (its ``--parent-pid``) is gone: it is writing
    what it holds to disk before it exits by itself."""
    try:
        argv = holder.cmdline() if holder is not None else []
        parent = int(argv[argv.index("--parent-pid") + 1])
        return holder.ppid() != parent
    except (ValueError, IndexError, psutil.Error):
        return False


def _in_use(data_dir: Path, holder: psutil.Process | None) -> str:
    """Who holds the private dash-memd, for a message: its pid and the pid of the dashrun it serves."""
    if holder is None:
        return f"the private dash-memd ({data_dir}) is in use by another dashrun on this machine"
    try:
        parent = holder.ppid()
    except psutil.Error:
        parent = None
    by = f", started by pid {parent}" if parent and parent != 1 else ""
    return (f"the private dash-memd ({data_dir}) is in use by another dashrun on this machine (dash-memd pid "
            f"{holder.pid}{by})")


def _locked(data_dir: Path) -> bool:
    path = data_dir / LOCK_FILE
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
        self.operator_key = self.root / "operator.key"  # the user is this dash-memd's operator
        self.operator_pubkey = self.root / "operator.key.pub"
        self.attach = attach
        self.address: tuple[str, int] | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrivateMemd:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.token_file.exists():
            write_token(self.token_file)
        if not self.operator_key.exists():
            try:
                write_key_pair(self.operator_key)
            except (UsageError, FileExistsError):  # another launcher made it just now
                pass
        address_file = self.root / ADDRESS_FILE
        if _locked(self.root):
            holder = _holder(self.root)
            if _launcher_gone(holder):
                self._wait_for_exit(holder)
        if _locked(self.root):
            if not self.attach:
                raise UsageError(_in_use(self.root, _holder(self.root)), hint="to run jobs side by side, start one "
                                 "with 'dash-memd start' and pass --memd to both")
            self.address = parse_address(address_file.read_text(), what="private dash-memd address")
            return self
        address_file.unlink(missing_ok=True)
        memory = min(psutil.virtual_memory().total // 4, 16 << 30)
        self.proc = daemon.start(
            [sys.executable, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir", str(self.root),
             "--token-file", str(self.token_file), "--memory-limit", str(memory), "--ready-file", str(address_file),
             "--parent-pid", str(os.getpid()), *(["--no-tls"] if self.no_tls else [])],
            ready=daemon.file_written(address_file), what="the private dash-memd", timeout=START_TIMEOUT,
            log=self.root / "memd.log", start_new_session=True)
        try:
            self.address = parse_address(address_file.read_text(), what="private dash-memd address")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_for_exit(self, holder: psutil.Process) -> None:
        """The private dash-memd of a dashrun that died (``kill -9``) finishes its disk writes, then exits: wait for
        it (up to its own stop timeout), so that this command resumes from everything it held."""
        print(f"dashrun: the private dash-memd of a dashrun that is gone (pid {holder.pid}) is writing its "
              "checkpoints to disk; waiting for it to exit", file=sys.stderr)
        try:
            holder.wait(timeout=STOP_TIMEOUT)
        except psutil.TimeoutExpired:
            pass  # still there: the lock says so, and the caller names the pid

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        daemon.stop(self.proc, timeout=STOP_TIMEOUT)  # SIGTERM: it finishes its disk writes first
        (self.root / ADDRESS_FILE).unlink(missing_ok=True)
