"""``python -m dashrun.agent``: the dash-agent command (:mod:`dashrun.agent.cli`)."""

from dashrun.agent.cli import main

__all__ = []

main()
