"""dash-memd: checkpoints of many jobs in RAM, persisted to disk and optionally to an S3 bucket.

* :mod:`.cli` — the ``dash-memd`` command (parse, config, run); :mod:`.config` — its frozen config.
* :mod:`.server` — the network server: authenticated clients, one thread each; :mod:`.admission` — who may
  hold a connection; :mod:`.scope` — what a job's credential may ask.
* :mod:`.store` — the checkpoints: the catalogue, its tiers (RAM, disk, bucket), the disk writer, the
  uploader, retention and deletions.
* :mod:`.fleet` — the fleet view: rendezvous states, world generations and membership histories, and each
  job's key/value store.
"""

__all__: list[str] = []
