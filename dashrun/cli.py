"""The ``dashrun`` command: a torchrun drop-in launcher."""

from __future__ import annotations

import sys

from dashrun.console import report, setup_logging
from dashrun.errors import DashError

PROGRAM = "dashrun"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging(PROGRAM)
    from dashrun.launcher import launch

    try:
        sys.exit(launch(argv))
    except DashError as e:
        sys.exit(report(PROGRAM, e))
