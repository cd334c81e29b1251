"""The rank side: the only part of dashrun that runs in training processes and imports torch.

* :mod:`~dashrun.rank.checkpointer` — :class:`Checkpointer`, the facade a
  training script uses (``dashrun.Checkpointer``).
* :mod:`~dashrun.rank.snapshot` — what ``save()`` captures, the staging buffer.
* :mod:`~dashrun.rank.stager` — the background stager: layout, copy, hand-off.
* :mod:`~dashrun.rank.staging` — the staging copy (streaming stores, CRC-32C).
* :mod:`~dashrun.rank.statetree` — state dicts as JSON skeletons and tensors.
* :mod:`~dashrun.rank.restore` — restore through the agent; decoding an image.
* :mod:`~dashrun.rank.notices` — interruption notices, agreed on by every rank.

Importing the package imports nothing; it talks to dash-agent only through
:mod:`dashrun.wire` and never imports :mod:`dashrun.launch` or :mod:`dashrun.memd`.
"""

__all__ = []
