"""``python -m dashrun.memd``: the ``dash-memd`` command."""

from dashrun.memd.cli import main

__all__ = []

main()
