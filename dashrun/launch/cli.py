"""The ``dashrun`` command: a torchrun drop-in launcher, and the job commands beside it.

``dashrun status|ls|export|gc|rm|resume ...`` are the job commands
(:mod:`dashrun.launch.commands`); anything else is a launch command line
(:mod:`dashrun.launch.dispatch`). Errors are rendered here, once, as one line
and an exit code.
"""

from __future__ import annotations

import sys

from dashrun.errors import DashError
from dashrun.launch import dispatch
from dashrun.util.console import report, run_click, setup_logging

__all__ = ["COMMANDS", "main"]

PROGRAM = "dashrun"
#: The job commands of :mod:`dashrun.launch.commands`, named here so that a launch does not import them: their
#: rich and click would cost every launch about 0.2 s before its ranks start.
COMMANDS = frozenset({"resume", "status", "ls", "export", "gc", "rm"})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging(PROGRAM)
    if argv and argv[0] in COMMANDS:
        from dashrun.launch import commands

        run_click(commands.cli, PROGRAM, argv)
    try:
        sys.exit(dispatch.launch(argv))
    except DashError as e:
        sys.exit(report(PROGRAM, e))
