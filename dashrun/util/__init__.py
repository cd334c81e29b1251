"""Small mechanisms every process shares, one helper each: atomic files, tokens, sizes and addresses, stop
signals, console output, JSON parsed with its nesting bounded, crash points for tests, retry with backoff,
log-once, starting a daemon, and the copy-with-checksum C helper (``_ntcopy``, optional: built at install
where a C compiler is present)."""

__all__: list[str] = []
