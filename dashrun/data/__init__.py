"""The training data's side of a job: its position across world sizes, and the data set cached on the nodes.

* :mod:`dashrun.data.sampler` — :class:`ElasticSampler`, a DistributedSampler whose
  position is one value for the whole job, saved and restored by the Checkpointer.
  Imports torch (rank side only).
* :mod:`dashrun.data.files` — :class:`CachedFiles`: a data set's objects (S3 prefix,
  directory, HTTP(S) manifest) read through the node-local cache
  (:mod:`dashrun.data.cache`, :mod:`dashrun.data.sources`, :mod:`dashrun.data.listings`).
  No torch until ``dataset()``: dash-agent and the ``dashrun data`` commands use it too.

Names load on first use, so importing the cache does not import torch.
"""

from __future__ import annotations

__all__ = ["CachedFiles", "ElasticSampler"]


def __getattr__(name: str):
    if name == "ElasticSampler":
        from dashrun.data.sampler import ElasticSampler

        return ElasticSampler
    if name == "CachedFiles":
        from dashrun.data.files import CachedFiles

        return CachedFiles
    raise AttributeError(f"module 'dashrun.data' has no attribute {name!r}")
