"""Interruption notices from the cloud's metadata service, for dash-agent.

One small API for three clouds::

    cloud = resolve_cloud("auto", metadata_endpoint)       # "aws" | "gcp" | "azure" | "none"
    poller = make_poller(cloud, metadata_endpoint)          # None for "none"
    poller.start(on_notice)                                  # a daemon thread; poller.stop() ends it
    ...                                                      # on_notice(Notice) once per distinct notice
    poller.acknowledge(notice)                               # Azure: let the event start now (state is safe)

or ``poller.run(on_notice, stop_event)`` in a thread of one's own, or
``poller.poll_once()`` for one round; ``poller.read(path)`` for one value of the
service, bounded (how :mod:`dashrun.agent.identity` reads the VM's zone and type).

What each poller watches (facts: shared/reference/cloud-metadata.md):

- AWS (``AwsPoller``): ``meta-data/spot/instance-action`` (404 until the instance
  is marked: terminate/stop/hibernate with the action's time, about 2 minutes
  ahead) and ``events/recommendations/rebalance`` (an early warning), every
  ``interval`` seconds (5). IMDSv2 as aws-node-termination-handler does it: a
  token asked for ``token_ttl`` seconds, renewed when 15 s or less remain, and
  dropped and renewed on a 401; IMDSv1 only for a round whose token PUT itself
  failed.
- GCP (``GcpPoller``): ``instance/preempted`` with the hanging GET
  (``wait_for_change``/``last_etag``/``timeout_sec``), so TRUE is seen the moment
  it is set; the deadline is 30 s after it was first seen (a configured
  metadata-only preemption notice makes the value flip earlier, and the
  real deadline is then later, never sooner). ``instance/maintenance-event``
  TERMINATE_ON_HOST_MAINTENANCE is an early warning with about an hour's lead
  (GPU VMs cannot migrate). ``retry`` seconds (5) of sleep after an error, as
  Google's own client does.
- Azure (``AzurePoller``): Scheduled Events every ``interval`` seconds (1),
  only events whose ``Resources`` name this VM. Preempt and Terminate are
  notices with ``NotBefore`` as the deadline; Reboot, Redeploy and Freeze are
  early warnings (a Reboot or Redeploy still ends the processes at NotBefore).

Modules: :mod:`.base` (MetadataError, the Poller loop), :mod:`.aws`,
:mod:`.gcp`, :mod:`.azure`, :mod:`.endpoints` (where each service is
reached), :mod:`.detect` (detect_cloud, resolve_cloud, make_poller,
CHOICES). The notices are :class:`dashrun.wire.messages.Notice`, the one
type the ranks receive too.

Contracts: a poller never dies on a bad answer (timeouts, 5xx, throttling,
garbage, an expired token, a refused header): it retries with a doubling
back-off (``retry`` .. ``max_retry`` seconds) and logs each kind of problem
once at WARNING until the service answers again, and then once that it does;
a notice served afterwards is still seen. Each distinct notice is handed to ``on_notice`` once. Detection is
quick and quiet (nothing above DEBUG). Nothing here imports torch.
"""

from dashrun.agent.pollers.aws import AwsPoller
from dashrun.agent.pollers.azure import AzurePoller
from dashrun.agent.pollers.base import MetadataError, Poller
from dashrun.agent.pollers.detect import CHOICES, detect_cloud, make_poller, resolve_cloud
from dashrun.agent.pollers.endpoints import (
    AWS_DEFAULT,
    AWS_ENDPOINT_ENV,
    AZURE_DEFAULT,
    AZURE_EVENTS_VERSION,
    AZURE_INSTANCE_VERSION,
    GCE_HOST_ENV,
    GCE_IP_ENV,
    GCP_DEFAULT,
    GCP_PROBE_DEFAULT,
    endpoint_for,
)
from dashrun.agent.pollers.gcp import GcpPoller
from dashrun.wire.messages import CLOUDS, Notice, NoticeKind

__all__ = ["AWS_DEFAULT", "AWS_ENDPOINT_ENV", "AZURE_DEFAULT", "AZURE_EVENTS_VERSION", "AZURE_INSTANCE_VERSION",
           "CHOICES", "CLOUDS", "GCE_HOST_ENV", "GCE_IP_ENV", "GCP_DEFAULT", "GCP_PROBE_DEFAULT", "AwsPoller",
           "AzurePoller", "GcpPoller", "MetadataError", "Notice", "NoticeKind", "Poller", "detect_cloud",
           "endpoint_for", "make_poller", "resolve_cloud"]
