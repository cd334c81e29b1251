"""One launch command line, parsed once, run on this node or on every host of a hostfile.

``dashrun [options] [torchrun flags] script.py [args]`` and ``dashrun resume``
(which re-runs a stored command line) both come here: ``--hostfile`` (or
``DASH_HOSTFILE``) sends the command to every host over SSH
(:mod:`dashrun.launch.fanout`); without it, the ranks of this node run under
torch's elastic launcher (:mod:`dashrun.launch.launcher`).
"""

from __future__ import annotations

import os

from dashrun import env
from dashrun.launch import launcher
from dashrun.launch.options import build_parser
from dashrun.util.console import check_log_format, check_log_level, setup_logging

__all__ = ["configure_logging", "launch"]


def configure_logging(level: str, fmt: str) -> None:
    """The launch's ``--log-level``/``--log-format``, checked (UsageError naming the valid values), for this
    process and, through their twins in the environment, for the dash-agent, private dash-memd and hosts it
    starts."""
    level, fmt = check_log_level(level), check_log_format(fmt)
    setup_logging("dashrun", level, fmt)
    os.environ[env.LOG_LEVEL.name], os.environ[env.LOG_FORMAT.name] = level, fmt


def launch(argv: list[str], overrides: dict | None = None) -> int:
    """Run the command line ``argv`` (torchrun flags, dashrun options, script, args); returns the exit code.

    ``overrides`` replace parsed options (``dashrun resume`` points a stored
    command line at this node's dash-memd).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (overrides or {}).items():
        setattr(args, name, value)
    configure_logging(args.log_level, args.log_format)
    if args.hostfile:
        from dashrun.launch import fanout  # SSH (paramiko): only for a hostfile

        return fanout.run(fanout.config_from_args(argv, args, parser))
    return launcher.run(launcher.config_from_args(argv, args))
