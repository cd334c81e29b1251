"""dashrun: PyTorch distributed training on Spot VMs, checkpointed to remote memory.

The data path::

    rank (Checkpointer) --memfd + Unix socket--> dash-agent --TCP--> dash-memd
                                                                 RAM -> disk

* :mod:`dashrun.rank.checkpointer` — the rank side: stages state into reused shared
  memory beside the next forward/backward, hands it to the node's agent,
  restores the newest committed checkpoint. The only part that imports torch.
* :mod:`dashrun.dcp` — ``Writer``/``Reader``: dash-memd as the storage of
  ``torch.distributed.checkpoint`` (``dcp.save``/``dcp.load``).
* :mod:`dashrun.data` — ``ElasticSampler``: a data position that survives any change of
  world size.
* :mod:`dashrun.wire.protocol`, :mod:`dashrun.wire.channel` — the one wire format.
* :mod:`dashrun.memd` — dash-memd: catalogue, tiers, server.
* :mod:`dashrun.launch.launcher`, :mod:`dashrun.launch.cli` — the ``dashrun`` command, a
  torchrun drop-in built on torch's own elastic launcher; :mod:`dashrun.launch.elastic`,
  :mod:`dashrun.launch.rendezvous` — a fleet that changes under the job.
* :mod:`dashrun.env` — every ``DASH_*`` variable the processes exchange.
* :mod:`dashrun.errors` — exceptions and exit codes.

``import dashrun`` does not import torch; ``dashrun.Checkpointer`` and
``dashrun.dcp`` do, on first use, so dash-agent and dash-memd run on machines
without torch.
"""

from __future__ import annotations

__all__ = ["Checkpointer", "ElasticSampler", "ExitCode", "__version__", "dcp"]

from dashrun.errors import ExitCode
from dashrun.version import __version__


def __getattr__(name: str):
    if name == "Checkpointer":
        from dashrun.rank.checkpointer import Checkpointer

        return Checkpointer
    if name == "ElasticSampler":
        from dashrun.data.sampler import ElasticSampler

        return ElasticSampler
    if name == "dcp":  # a submodule, loaded on first use: it imports torch.distributed.checkpoint
        import dashrun.dcp as dcp

        return dcp
    raise AttributeError(f"module 'dashrun' has no attribute {name!r}")
