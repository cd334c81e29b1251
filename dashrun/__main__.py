"""``python -m dashrun``: the ``dashrun`` command."""

from dashrun.launch.cli import main

main()
