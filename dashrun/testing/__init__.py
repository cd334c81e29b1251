"""The harness the tests and the scripts start real parts with, and stop them with.

Each module gives one kind of part: :mod:`~dashrun.testing.processes` (poll
with a deadline, free ports, killing a process tree, a registry that stops
what it started), :mod:`~dashrun.testing.memd` and
:mod:`~dashrun.testing.agent` (a dash-memd, a dash-agent),
:mod:`~dashrun.testing.daemons` (the pair a benchmark runs, pinned),
:mod:`~dashrun.testing.s3` (moto's S3 server), :mod:`~dashrun.testing.sshd`
(an OpenSSH server on loopback), :mod:`~dashrun.testing.netns` (network
namespaces, a loopback relay) and :mod:`~dashrun.testing.leaks` (every
process a test started is gone after it). No product package imports it
(tests/test_imports.py); it imports no pytest.
"""

__all__: list[str] = []
