"""dash-memd: checkpoints of many jobs in RAM, persisted to disk and optionally to an S3 bucket.

* :mod:`.cli` — the ``dash-memd`` command (parse, config, run); :mod:`.config` — its frozen config.
* :mod:`.server` — the network server: authenticated clients, one thread each.
* :mod:`.catalogue` — which checkpoints exist, in which state and tiers; the facade the server calls,
  over :mod:`.entry` (the states), :mod:`.ledger` (the shared bookkeeping), :mod:`.retention`,
  :mod:`.disk_writer` and :mod:`.uploader`.
* :mod:`.tiers` — where the bytes are: RAM, disk, object storage.
* :mod:`.fleet` — the requests of the fleet view, over :mod:`.rendezvous` (torch's rendezvous states, on a
  fencing token), :mod:`.membership` (the world generation fence and the membership history) and
  :mod:`.kvstore` (each job's key/value store for the rendezvous's bootstrap).
"""

__all__ = []
