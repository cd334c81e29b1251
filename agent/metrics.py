"""dash-agent's Prometheus metrics: this node's saves, skipped snapshots, stall, stream bandwidth, notices.

Counted as they happen, in a registry of this agent's own, and served at
``/metrics`` only with ``--metrics-listen`` (:meth:`AgentMetrics.serve`);
docs/metrics.md lists them. The ranks' skipped snapshots and stall are what
each rank reports with every snapshot it hands over (its totals since it
started, :class:`dashrun.wire.agent_messages.SnapshotRequest`): the agent adds
up each rank's increase, so a rank that restarts (and counts from 0 again)
moves no counter back. Every method is safe from any thread.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dashrun.util.metrics import MetricsEndpoint, MetricsSettings
from dashrun.wire.messages import Notice

__all__ = ["AgentMetrics", "SAVE_BUCKETS"]

#: Seconds from a rank's hand-over of a shard to its being stored: ms on loopback, minutes for big state.
SAVE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class AgentMetrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self._saves = Counter("dash_agent_snapshots", "Shards this node's ranks handed over, by how they ended: "
                              "stored (in dash-memd, or on the fleet's rule) or failed.", ["outcome"],
                              registry=registry)
        self._emergency = Counter("dash_agent_emergency_snapshots", "Emergency snapshots (after a notice) stored.",
                                  registry=registry)
        self._save_seconds = Histogram("dash_agent_snapshot_seconds", "Seconds from a rank's hand-over of a shard "
                                       "to its being stored.", buckets=SAVE_BUCKETS, registry=registry)
        self._skipped = Counter("dash_agent_skipped_snapshots", "Snapshots this node's ranks skipped (due while "
                                "their two buffers were still on their way).", registry=registry)
        self._stall = Counter("dash_agent_stall_seconds", "Seconds this node's ranks' training was blocked by "
                              "saves.", registry=registry)
        self._stream_bytes = Counter("dash_agent_stream_bytes", "Shard bytes streamed to dash-memd.",
                                     registry=registry)
        self._stream_seconds = Counter("dash_agent_stream_seconds", "Seconds spent streaming shards to dash-memd "
                                       "(waits for the rank's staging included): bytes over seconds is the "
                                       "stream's bandwidth.", registry=registry)
        self._last_bandwidth = Gauge("dash_agent_stream_bytes_per_second", "The last shard's stream to dash-memd, "
                                     "bytes per second.", registry=registry)
        self._notices = Counter("dash_agent_notices", "Interruption notices this node's cloud served, by cloud and "
                                "kind.", ["cloud", "kind"], registry=registry)
        self._ranks = Gauge("dash_agent_ranks", "Rank connections open.", registry=registry)
        for outcome in ("stored", "failed"):  # both series exist from the start: a rate of 0 is a fact too
            self._saves.labels(outcome=outcome)
        self._endpoint: MetricsEndpoint | None = None

    def serve(self, settings: MetricsSettings) -> tuple[str, int]:
        self._endpoint = MetricsEndpoint(self.registry, settings, program="dash-agent")
        return self._endpoint.address

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()

    def rank_reported(self, skipped_more: int, stall_more: float) -> None:
        """A rank skipped ``skipped_more`` snapshots and stalled ``stall_more`` s more since its last report."""
        if skipped_more > 0:
            self._skipped.inc(skipped_more)
        if stall_more > 0:
            self._stall.inc(stall_more)

    def streamed(self, nbytes: int, seconds: float) -> None:
        self._stream_bytes.inc(nbytes)
        self._stream_seconds.inc(seconds)
        if seconds > 0:
            self._last_bandwidth.set(nbytes / seconds)

    def stored(self, seconds: float, emergency: bool) -> None:
        self._saves.labels(outcome="stored").inc()
        self._save_seconds.observe(seconds)
        if emergency:
            self._emergency.inc()

    def failed(self) -> None:
        self._saves.labels(outcome="failed").inc()

    def notice(self, notice: Notice) -> None:
        self._notices.labels(cloud=notice.cloud, kind=notice.kind.value).inc()

    def rank_connected(self, change: int) -> None:
        self._ranks.inc(change)
