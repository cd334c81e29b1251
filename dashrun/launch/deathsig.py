"""A rank's first moments: ask Linux to kill it when its launcher dies, then become the rank's own command.

``python -S deathsig.py LAUNCHER_PID COMMAND [ARGS...]`` — the launcher puts
this in front of the command torch's elastic agent starts for each rank. torch
starts every rank in a session of its own, so a launcher killed outright
(``kill -9``, the OOM killer) would leave its ranks training on, with nothing
to store their checkpoints. ``PR_SET_PDEATHSIG`` makes the kernel send the
rank SIGKILL when the thread that started it ends: torch's agent starts (and
restarts) the ranks from the launcher's main thread, which ends only with the
launcher. The setting survives ``execvp`` (the rank keeps its pid, so torch
sees the process it started), and a launcher that died before it was made is
caught by comparing the parent's pid with the one it was given.

Run by path with ``-S``: it imports nothing of dashrun or site-packages and costs
the rank a few milliseconds.
"""

import ctypes
import os
import signal
import sys

__all__ = ["ORPHANED", "main"]

PR_SET_PDEATHSIG = 1
#: The exit code of a rank whose launcher was gone before it could start (128 + SIGKILL, as if it was killed).
ORPHANED = 128 + signal.SIGKILL


def main(argv: list[str]) -> None:
    launcher, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"dashrun: cannot tie rank {os.environ.get('RANK', '?')} to its launcher: {os.strerror(err)}",
              file=sys.stderr)
    elif os.getppid() != launcher:
        os._exit(ORPHANED)  # the launcher died between starting this process and the line above
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
