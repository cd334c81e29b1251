"""The ``dashrun`` command: torchrun's launcher, with a node agent and the job commands beside it.

* :mod:`~dashrun.launch.cli` — the entry point: a job command, or a launch.
* :mod:`~dashrun.launch.options` — the command line: torchrun's parser with
  dashrun's options (each with a ``DASH_*`` twin), and the checks both launch
  paths share.
* :mod:`~dashrun.launch.dispatch` — parses a launch once and runs it on this
  node or, with ``--hostfile``, on every host.
* :mod:`~dashrun.launch.launcher` — one node: dash-memd reached (or the
  private one started, :mod:`~dashrun.launch.private_memd`), the node's
  dash-agent started and supervised, the ranks under ``elastic_launch``;
  :mod:`~dashrun.launch.preemption` watches for a notice and reports exit 75.
* :mod:`~dashrun.launch.fanout` and :mod:`~dashrun.launch.hostfile` — several
  hosts: the hostfile and ssh config read, one SSH session per host.
* :mod:`~dashrun.launch.commands` and :mod:`~dashrun.launch.export` — ``dashrun
  status|ls|export|gc|rm|resume``.

The launcher starts dash-memd and dash-agent as processes
(``python -m dashrun.memd``, ``python -m dashrun.agent``) and never imports them.
"""

__all__ = []  # the modules are the interface
