"""dash-memd's Prometheus metrics (``dash-memd start --metrics-listen``); docs/metrics.md lists them.

Two kinds, in one registry of this server's own:

* events the server sees once and no record keeps — a commit (and how long
  it took from its first shard's announcement), a request served (a restore's
  read, a notice) — are counted as they happen, by :meth:`MemdMetrics.committed`
  (the receiver's ``on_commit``) and :meth:`~MemdMetrics.handled`;
* everything the server already keeps — bytes per tier, the memory limit,
  pending writes, connections, failures — is read from it when Prometheus
  scrapes (:class:`ServerState`), so there is no second bookkeeping to drift.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dashrun.util.metrics import MetricsEndpoint, MetricsSettings
from dashrun.wire.protocol import Kind

if TYPE_CHECKING:
    from dashrun.memd.server import MemdServer
    from dashrun.memd.store.entry import Entry
    from dashrun.wire.channel import Frame

__all__ = ["COMMIT_BUCKETS", "MemdMetrics", "ServerState"]

#: Seconds from a checkpoint's first shard to its commit: a few ms for a small one over loopback, minutes for
#: hundreds of GiB over a thin link.
COMMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Seconds to serve one read of a restore (a shard or a byte range of one).
READ_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class MemdMetrics:
    """``server``'s metrics, served at ``http://host:port/metrics`` until :meth:`close`. :meth:`committed` and
    :meth:`handled` are safe from any thread and never block (a commit calls the first with the catalogue's
    lock held)."""

    def __init__(self, server: MemdServer, settings: MetricsSettings):
        self.registry = CollectorRegistry()
        self._committed = Counter("dash_memd_checkpoints_committed", "Checkpoints committed (every rank's shard "
                                  "arrived and verified), per job.", ["job"], registry=self.registry)
        self._commit_seconds = Histogram("dash_memd_commit_seconds", "Seconds from a checkpoint's first shard "
                                         "announced to its commit in RAM.", buckets=COMMIT_BUCKETS,
                                         registry=self.registry)
        self._restore_seconds = Histogram("dash_memd_restore_seconds", "Seconds to serve one read of a restore "
                                          "(GET_SHARD: a shard or a byte range of one), from its request to its "
                                          "last byte sent.", buckets=READ_BUCKETS, registry=self.registry)
        self._requests = Counter("dash_memd_requests", "Requests served (answered OK), per kind.", ["kind"],
                                 registry=self.registry)
        self._notices = Counter("dash_memd_notices", "Interruption notices the job's agents reported, per job and "
                                "cloud.", ["job", "cloud"], registry=self.registry)
        self.registry.register(ServerState(server))
        server.catalogue.receiver.on_commit = self.committed
        self._endpoint = MetricsEndpoint(self.registry, settings, program="dash-memd")
        self.address = self._endpoint.address

    def close(self) -> None:
        self._endpoint.close()

    def committed(self, entry: Entry) -> None:
        self._committed.labels(job=entry.job).inc()
        self._commit_seconds.observe(entry.commit_seconds or 0.0)

    def handled(self, frame: Frame, seconds: float) -> None:
        """A request was answered OK in ``seconds``: its fields were checked by the handler that served it."""
        self._requests.labels(kind=frame.kind.name).inc()
        if frame.kind == Kind.GET_SHARD:
            self._restore_seconds.observe(seconds)
        elif frame.kind == Kind.NOTICE:
            self._notices.labels(job=frame.body["job"], cloud=frame.body["cloud"]).inc()


class ServerState(Collector):
    """What the server keeps, read at each scrape (under the catalogue's lock, briefly)."""

    def __init__(self, server: MemdServer):
        self.server = server

    def describe(self) -> list[Metric]:
        return []  # the families are made at each scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        server = self.server
        catalogue = server.catalogue
        held = {"disk": 0, "object": 0}
        newest: dict[str, tuple[int, float]] = {}
        with catalogue.ledger.cond:
            for job, steps in catalogue.ledger.committed.items():
                for step, entry in steps.items():
                    for tier in held.keys() & entry.tiers:
                        held[tier] += entry.info.nbytes
                if steps:
                    top = steps[max(steps)]
                    newest[job] = (top.step, top.info.committed_at)
            disk_failures = sum(catalogue.disk_writer.failure_counts.values())
            disk_failing = len(catalogue.disk_writer.failures)
            object_failing = len(catalogue.uploader.failures) if catalogue.uploader is not None else 0
            quarantined = sum(catalogue.disk.quarantined.values())
            bad_ram = sum(catalogue.ledger.bad_ram.values())
            ledger = catalogue.ledger
            pressure = (ledger.evictions, ledger.room_waits, ledger.room_wait_s)
            uploads = catalogue.uploader.pending_uploads() if catalogue.uploader is not None else 0

        tiers = GaugeMetricFamily("dash_memd_bytes", "Checkpoint bytes held, per tier (RAM: the bytes its buffers "
                                  "hold, those being received included).", labels=["tier"])
        tiers.add_metric(["ram"], catalogue.ram.used)
        tiers.add_metric(["disk"], held["disk"])
        tiers.add_metric(["object"], held["object"])
        yield tiers
        yield GaugeMetricFamily("dash_memd_memory_limit_bytes", "--memory-limit: checkpoint bytes RAM may hold.",
                                value=catalogue.ram.limit)
        pending = GaugeMetricFamily("dash_memd_pending", "Committed checkpoints waiting for a tier: disk writes, "
                                    "uploads.", labels=["queue"])
        pending.add_metric(["disk"], catalogue.disk_writer.pending())
        pending.add_metric(["object"], uploads)
        yield pending
        failing = GaugeMetricFamily("dash_memd_failing_jobs", "Jobs whose last write to the tier failed (tried "
                                    "again with backoff).", labels=["tier"])
        failing.add_metric(["disk"], disk_failing)
        failing.add_metric(["object"], object_failing)
        yield failing
        errors = CounterMetricFamily("dash_memd_errors", "Problems since dash-memd started, by kind.",
                                     labels=["kind"])
        errors.add_metric(["disk_write"], disk_failures)
        errors.add_metric(["disk_checksum"], quarantined)
        errors.add_metric(["ram_checksum"], bad_ram)
        errors.add_metric(["record_tag"], server.tag_failures)
        errors.add_metric(["forbidden"], server.forbidden)
        yield errors
        yield CounterMetricFamily("dash_memd_ram_evictions", "RAM copies freed (kept on disk, or superseded) to make "
                                  "room for a receive.", value=pressure[0])
        yield CounterMetricFamily("dash_memd_ram_room_waits", "Receives that found RAM full of checkpoints not yet "
                                  "safe on disk and waited for room.", value=pressure[1])
        yield CounterMetricFamily("dash_memd_ram_room_wait_seconds", "Seconds those receives waited.",
                                  value=pressure[2])
        yield GaugeMetricFamily("dash_memd_connections", "Client connections open (logged in or logging in).",
                                value=server.connections())
        step = GaugeMetricFamily("dash_memd_newest_step", "Each job's newest committed step.", labels=["job"])
        when = GaugeMetricFamily("dash_memd_newest_commit_timestamp_seconds", "When each job's newest committed "
                                 "checkpoint committed (Unix time).", labels=["job"])
        for job, (number, committed_at) in sorted(newest.items()):
            step.add_metric([job], number)
            when.add_metric([job], committed_at)
        yield step
        yield when
