"""What the three commands print: logging set-up and one-line errors with a hint.

Only entry points call these; library code logs through
``logging.getLogger(__name__)`` and raises :mod:`dashrun.errors`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

from dashrun.errors import DashError, ExitCode, UsageError

__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "check_log_format", "check_log_level", "log_options",
           "report",
           "run_click", "setup_logging"]

#: The levels ``--log-level`` takes (any case), quietest last.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: ``--log-format``: text for people, json (one object a line) for log shippers.
LOG_FORMATS = ("text", "json")


def check_log_level(value: str, option: str = "--log-level") -> str:
    """``value`` as a level name; UsageError naming the valid ones for anything else (a typo must not silently
    log at INFO)."""
    level = (value or "").strip().upper()
    if level not in LOG_LEVELS:
        raise UsageError(f"{option} {value!r} is not a log level", hint=f"give one of {', '.join(LOG_LEVELS)}")
    return level


def check_log_format(value: str, option: str = "--log-format") -> str:
    fmt = (value or "").strip().lower()
    if fmt not in LOG_FORMATS:
        raise UsageError(f"{option} {value!r} is not a log format", hint=f"give one of {', '.join(LOG_FORMATS)}")
    return fmt


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``program``, and
    ``job``/``rank`` where known (a record's own ``job``/``rank`` extras, else this process's DASH_JOB_ID and
    RANK); ``exception`` holds a traceback, when there is one, as one string."""

    def __init__(self, program: str, job: str | None = None):
        super().__init__()
        self.program = program
        self.job = job or os.environ.get("DASH_JOB_ID") or None
        rank = os.environ.get("RANK")
        self.rank = int(rank) if rank and rank.isdigit() else None

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "program": self.program,
        }
        job, rank = getattr(record, "job", self.job), getattr(record, "rank", self.rank)
        if job is not None:
            out["job"] = job
        if rank is not None:
            out["rank"] = rank
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(program: str, level: str = "INFO", fmt: str = "text", job: str | None = None) -> None:
    """Configure the root logger once for an entry point (again, replacing the first set-up, where a launch
    learns its options after it started); ``job``: the one job this process serves, in every JSON line (else
    DASH_JOB_ID's). UsageError for a level or format that is not one of ours."""
    level, fmt = check_log_level(level), check_log_format(fmt)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(program, job))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {program} %(levelname)s %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)


def log_options(command):
    """``--log-level`` and ``--log-format`` for a click command, with their twins DASH_LOG_LEVEL and
    DASH_LOG_FORMAT, each checked as click parses it (a typo: one line naming the valid values, exit 2)."""
    import click

    from dashrun import env

    command = click.option("--log-format", envvar=env.LOG_FORMAT.name, show_envvar=True, default="text",
                           show_default=True, callback=lambda _ctx, _param, value: check_log_format(value),
                           help=f"{' or '.join(LOG_FORMATS)}: json prints one object a line (time, level, logger, "
                                "message, job and rank where known), for log shippers.")(command)
    return click.option("--log-level", envvar=env.LOG_LEVEL.name, show_envvar=True, default="INFO",
                        show_default=True, callback=lambda _ctx, _param, value: check_log_level(value),
                        help=f"{', '.join(LOG_LEVELS)} (any case).")(command)


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
