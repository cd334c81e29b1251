"""What Spot cost and saved: a job's run history read as a report, and a simulator to plan the next run.

* :mod:`.report` — ``dashrun report JOB``: node-hours, goodput, steps redone, time lost and cost, computed from
  the run history dash-memd keeps with each job (:mod:`dashrun.memd.fleet.membership`).
* :mod:`.prices` — the price file (CSV ``instance_type,market,usd_per_hour``).
* :mod:`.sim` — ``dashrun sim``: a discrete-event simulation of a job on Spot nodes, swept over checkpoint
  intervals.

Pure modules: nothing here talks to dash-memd or imports torch.
"""

__all__: list[str] = []
