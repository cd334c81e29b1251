"""Where dash-memd keeps committed checkpoints: one small interface, one module per tier.

Every tier stores whole committed checkpoints (all shards of one step of one
job), hands out one shard's bytes for reading, deletes, and lists what it
holds. A checkpoint becomes visible in a tier only once it is complete and
verified there. The conformance suite in ``tests/test_tiers.py`` runs the same
tests against each tier.

* :mod:`.base` — the :class:`Tier` interface and the manifest format.
* :mod:`.ram` — :class:`RamTier`, shards in reused anonymous memory.
* :mod:`.disk` — :class:`DiskTier`, ``fsync always``: a checkpoint it lists has
  been fsynced (files, manifest, directories) before it was renamed into
  place, so a crash loses at most the checkpoint being written.
* :mod:`.object` — ``ObjectTier``, an S3 bucket (:mod:`.s3`: the boto3 client
  and its errors). Not imported here: boto3 is loaded only when dash-memd has
  an object tier.
"""

from __future__ import annotations

from dashrun.memd.store.tiers.base import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, SPEC, Tier
from dashrun.memd.store.tiers.disk import DiskTier
from dashrun.memd.store.tiers.ram import RamTier

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "MANIFEST_VERSION", "SPEC", "DiskTier", "RamTier", "Tier"]
