"""dash-agent: the sidecar on every node of a dashrun job.

It receives staged shards from the node's ranks over a Unix socket (the
bytes stay in shared memory), streams them to dash-memd, and fetches
checkpoints for the ranks to restore. It imports no torch, and nothing
outside it imports it: it is its own process (``python -m dashrun.agent``).

- :mod:`~dashrun.agent.cli`: the command: options (each with its ``DASH_*``
  twin) -> :class:`~dashrun.agent.config.AgentConfig` -> run -> exit code.
- :mod:`~dashrun.agent.service`: :class:`AgentServer`: the socket, the
  notices to the ranks and to dash-memd, the preemption record, stopping.
- :mod:`~dashrun.agent.ranks`: one rank's connection, and the sender that
  streams its shards to dash-memd.
- :mod:`~dashrun.agent.restores`: a checkpoint fetched once per node for
  all its ranks to restore from.
- :mod:`~dashrun.agent.pollers`: interruption notices from the cloud's
  metadata service (AWS, GCP, Azure).
"""

__all__ = []
