"""The training data's side of an elastic job: what the job has consumed, whatever its world size.

* :mod:`dashrun.data.sampler` — :class:`ElasticSampler`, a DistributedSampler whose
  position is one value for the whole job, saved and restored by the Checkpointer.

Imports torch (rank side only).
"""

from __future__ import annotations

__all__ = ["ElasticSampler"]

from dashrun.data.sampler import ElasticSampler
