"""One launch command line, parsed once, run on this node or on every host of a hostfile.

``dashrun [options] [torchrun flags] script.py [args]`` and ``dashrun resume``
(which re-runs a stored command line) both come here: ``--hostfile`` (or
``DASH_HOSTFILE``) sends the command to every host over SSH
(:mod:`dashrun.launch.fanout`); without it, the ranks of this node run under
torch's elastic launcher (:mod:`dashrun.launch.launcher`).
"""

from __future__ import annotations

from dashrun.launch import launcher
from dashrun.launch.options import build_parser

__all__ = ["launch"]


def launch(argv: list[str], overrides: dict | None = None) -> int:
    """Run the command line ``argv`` (torchrun flags, dashrun options, script, args); returns the exit code.

    ``overrides`` replace parsed options (``dashrun resume`` points a stored
    command line at this node's dash-memd).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (overrides or {}).items():
        setattr(args, name, value)
    if args.hostfile:
        from dashrun.launch import fanout  # SSH (paramiko): only for a hostfile

        return fanout.run(fanout.config_from_args(argv, args, parser))
    return launcher.run(launcher.config_from_args(argv, args))
