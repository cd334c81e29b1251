"""What the three commands print: logging set-up and one-line errors with a hint.

Only entry points call these; library code logs through
``logging.getLogger(__name__)`` and raises :mod:`dashrun.errors`.
"""

from __future__ import annotations

import logging
import sys

from dashrun.errors import DashError, ExitCode

__all__ = ["report", "run_click", "setup_logging"]


def setup_logging(program: str, level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {program} %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def report(program: str, err: BaseException) -> int:
    """Print an error once, as one line (plus a hint line), and return the exit code for it."""
    if isinstance(err, DashError):
        print(f"{program}: error: {err.message}", file=sys.stderr)
        if err.hint:
            print(f"{program}: hint: {err.hint}", file=sys.stderr)
        return int(err.exit_code)
    print(f"{program}: internal error: {type(err).__name__}: {err}", file=sys.stderr)
    return int(ExitCode.FAILED)


def run_click(command, program: str, argv: list[str] | None = None) -> None:
    """Run a click command with dashrun's error rendering and exit codes; never returns."""
    import click

    try:
        command.main(args=argv, prog_name=program, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(ExitCode.USAGE)
    except click.exceptions.Abort:
        sys.exit(ExitCode.FAILED)
    except DashError as e:
        sys.exit(report(program, e))
    sys.exit(ExitCode.OK)
