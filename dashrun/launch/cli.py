"""The ``dashrun`` command: a torchrun drop-in launcher, and the job commands beside it."""

from __future__ import annotations

import sys

from dashrun.errors import DashError
from dashrun.util.console import report, run_click, setup_logging

PROGRAM = "dashrun"
COMMANDS = frozenset({"resume", "status", "ls", "export", "gc", "rm"})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging(PROGRAM)
    if argv and argv[0] in COMMANDS:
        from dashrun.launch.commands import cli

        run_click(cli, PROGRAM, argv)
    from dashrun.launch.launcher import launch

    try:
        sys.exit(launch(argv))
    except DashError as e:
        sys.exit(report(PROGRAM, e))
