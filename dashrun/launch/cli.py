"""The ``dashrun`` command: a torchrun drop-in launcher, and the job commands beside it.

``dashrun status|ls|export|gc|rm|resume ...`` are the job commands
(:mod:`dashrun.launch.commands`), ``dashrun data ...`` the data cache's
(:mod:`dashrun.launch.data_commands`); anything else is a launch command line
(:mod:`dashrun.launch.dispatch`). Errors are rendered here, once, as one line
and an exit code.
"""

from __future__ import annotations

import difflib
import os
import sys

from dashrun.errors import DashError, UsageError
from dashrun.launch import dispatch
from dashrun.util.console import report, run_click, setup_logging

__all__ = ["COMMANDS", "main"]

PROGRAM = "dashrun"
#: The job commands of :mod:`dashrun.launch.commands`, named here so that a launch does not import them: their
#: rich and click would cost every launch about 0.2 s before its ranks start.
COMMANDS = frozenset({"resume", "status", "ls", "export", "gc", "rm", "sim", "report"})
#: The data cache's commands (dashrun.launch.data_commands), a group of their own: ``dashrun data stage ...``.
DATA = "data"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging(PROGRAM)
    if argv and argv[0] == DATA:
        from dashrun.launch import data_commands

        run_click(data_commands.data, f"{PROGRAM} data", argv[1:])
    if argv and argv[0] in COMMANDS:
        from dashrun.launch import commands

        run_click(commands.cli, PROGRAM, argv)
    try:
        _refuse_a_mistyped_command(argv)
        sys.exit(dispatch.launch(argv))
    except DashError as e:
        sys.exit(report(PROGRAM, e))


def _refuse_a_mistyped_command(argv: list[str]) -> None:
    """``dashrun stauts``: a word like a command's, and no file of that name to launch, is a typo."""
    if not argv or argv[0].startswith("-") or os.path.exists(argv[0]):
        return
    close = difflib.get_close_matches(argv[0], sorted(COMMANDS | {DATA}), n=1, cutoff=0.75)
    if close:
        raise UsageError(f"{argv[0]!r} is neither a dashrun command nor a script here",
                         hint=f"did you mean: dashrun {close[0]} {' '.join(argv[1:])}".rstrip())
