"""dash-memd's fleet view: which nodes a job has, in which generation, and what they agree on.

* :mod:`.requests` — the fleet view's requests (:class:`~dashrun.memd.fleet.requests.FleetRequests`), which
  the server dispatches to as to its own.
* :mod:`.rendezvous` — torch's rendezvous states, each replaced only on its fencing token.
* :mod:`.membership` — the world generation fence and each job's membership history.
* :mod:`.kvstore` — each job's key/value store for the rendezvous's bootstrap.
"""

__all__: list[str] = []
