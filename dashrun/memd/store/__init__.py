"""dash-memd's store: which checkpoints exist, in which state, and where their bytes are.

* :mod:`.catalogue` — the checkpoints of every job, and the one lock over them; it builds the parts below
  and the server calls them, and the catalogue itself, through it.
* :mod:`.entry` — a checkpoint's states (receiving, committed, on disk, in the bucket).
* :mod:`.ledger` — the bookkeeping they share: the entries, the specs, the RAM reservations.
* :mod:`.receiver` — a checkpoint's shards arriving, committed once every rank's is in.
* :mod:`.retention` — which checkpoints each tier keeps, and what makes room in RAM.
* :mod:`.disk_writer` — committed checkpoints to disk, failed writes tried again; :mod:`.verifier` — disk
  copies checked against their CRC-32C; :mod:`.uploader` — disk copies to the bucket; :mod:`.downloads` —
  the bucket's copies read back once per shard.
* :mod:`.tombstones` — deletions that survive a crash; :mod:`.listing` — the pages of ``dashrun status``.
* :mod:`.tiers` — where the bytes are: RAM, disk, an S3 bucket.
"""

__all__: list[str] = []
