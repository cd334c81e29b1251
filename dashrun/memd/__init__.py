"""dash-memd: checkpoints of many jobs in RAM, persisted to disk (see :mod:`.catalogue`)."""
