"""Who this VM is, as its cloud's metadata service says: the one place that reads its zone, instance type and market.

    identity = read_identity("auto", metadata_endpoint)   # Identity(cloud, zone, instance_type, market) or None
    domain = this_domain(config.failure_domain, config.cloud, config.metadata_endpoint)

What is read (facts: shared/reference/cloud-metadata.md):

- AWS: ``meta-data/placement/availability-zone``, ``meta-data/instance-type``,
  ``meta-data/instance-life-cycle`` (spot | on-demand), with an IMDSv2 token
  as the notice poller gets one (:class:`dashrun.agent.pollers.AwsPoller`).
- GCP: ``instance/zone`` and ``instance/machine-type`` (the last part of
  ``projects/N/zones/ZONE``), ``instance/scheduling/provisioning-model``
  (SPOT is spot; a legacy preemptible VM, ``scheduling/preemptible`` TRUE, too).
- Azure: ``/metadata/instance/compute``: ``location`` and ``zone`` (the zone
  is LOCATION-ZONE, eastus-1, since Azure numbers zones within a region; the
  location alone where the VM has no zone), ``vmSize``, ``priority`` (Spot, or
  the older Low, is spot).

Contracts: every answer is bounded (a value at most :data:`MAX_VALUE`
characters of printable text, else refused); a service that is absent, slow,
refusing or talking nonsense never raises out of :func:`read_identity`: it
returns None and logs one WARNING. Nothing here imports torch. The cost ledger
reads the same record, from dash-memd's registry, where the agent announces it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping

from dashrun.agent.pollers.aws import AwsPoller
from dashrun.agent.pollers.azure import AzurePoller
from dashrun.agent.pollers.base import MetadataError, Poller, json_object
from dashrun.agent.pollers.detect import resolve_cloud
from dashrun.agent.pollers.endpoints import AZURE_INSTANCE_VERSION
from dashrun.agent.pollers.gcp import GcpPoller
from dashrun.wire.domain import MARKETS, MAX_DOMAIN_PART, FailureDomain
from dashrun.wire.messages import CLOUDS

__all__ = ["MAX_VALUE", "Identity", "bought_as", "read_identity", "this_domain"]

log = logging.getLogger(__name__)

#: The longest value read from a metadata service (zones and instance types are a few dozen characters).
MAX_VALUE = 255
#: What a zone or an instance type may be: it becomes part of a failure domain's label (room for ":on-demand").
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+@-]{0,%d}" % (MAX_DOMAIN_PART - len(":on-demand") - 1))


@dataclasses.dataclass(frozen=True)
class Identity:
    """This VM as its cloud describes it: ``cloud`` (aws, gcp, azure), ``zone``, ``instance_type`` and
    ``market`` (spot or on-demand)."""

    cloud: str
    zone: str
    instance_type: str
    market: str

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ValueError(f"cloud must be one of {', '.join(CLOUDS)}, not {self.cloud!r}")
        if self.market not in MARKETS:
            raise ValueError(f"market must be one of {', '.join(MARKETS)}, not {self.market!r}")
        for name in ("zone", "instance_type"):
            if not _NAME.fullmatch(getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)[:80]!r} is not a name of letters, digits and . _ + @ -")

    @property
    def domain(self) -> FailureDomain:
        """Its failure domain: the zone, and the pool ``INSTANCE_TYPE:MARKET``."""
        return FailureDomain.of(self)


def _value(text: str | None, what: str) -> str:
    """One value as served: short printable text (one line, trimmed), else MetadataError."""
    if text is None:
        raise MetadataError("missing", f"{what}: the service has no such value (404)")
    text = text.strip()
    if not text or len(text) > MAX_VALUE or not text.isprintable():
        raise MetadataError("garbage", f"{what} is not a short printable value: {text[:40]!r}")
    return text


def _last_part(text: str, what: str) -> str:
    """``projects/N/zones/us-central1-a`` -> ``us-central1-a``, as GCP names its zones and machine types."""
    part = text.rsplit("/", 1)[-1]
    if not _NAME.fullmatch(part):
        raise MetadataError("garbage", f"{what} does not end in a name: {text[:80]!r}")
    return part


def _aws(poller: Poller) -> Identity:
    def value(path: str) -> str:
        return _value(poller.read(f"latest/meta-data/{path}", limit=MAX_VALUE + 2), path)

    market = value("instance-life-cycle")
    if market not in MARKETS:  # "scheduled" (Scheduled Instances) is bought ahead like on-demand capacity
        market = "on-demand"
    return Identity("aws", value("placement/availability-zone"), value("instance-type"), market)


def _gcp(poller: Poller) -> Identity:
    def value(path: str, required: bool = True) -> str | None:
        text = poller.read(f"computeMetadata/v1/instance/{path}", limit=MAX_VALUE + 2)
        return _value(text, path) if required or text is not None else None

    zone = _last_part(value("zone"), "zone")
    machine = _last_part(value("machine-type"), "machine-type")
    model = (value("scheduling/provisioning-model", required=False) or "").upper()
    spot = model == "SPOT" or (value("scheduling/preemptible", required=False) or "").upper() == "TRUE"
    return Identity("gcp", zone, machine, "spot" if spot else "on-demand")


def _azure(poller: Poller) -> Identity:
    body = poller.read("metadata/instance/compute", params={"api-version": AZURE_INSTANCE_VERSION})
    if body is None:
        raise MetadataError("missing", "compute: the service has no such document (404)")
    doc = json_object(body, "compute")

    def field(name: str) -> str:
        raw = doc.get(name)
        if raw is None:
            return ""
        if not isinstance(raw, str):
            raise MetadataError("garbage", f"compute/{name} is not text: {str(raw)[:40]!r}")
        return _value(raw, f"compute/{name}") if raw.strip() else ""

    location, zone, size = field("location"), field("zone"), field("vmSize")
    if not location or not size:
        raise MetadataError("garbage", "compute lacks location or vmSize")
    priority = field("priority").lower()
    return Identity("azure", f"{location}-{zone}" if zone else location, size,
                    "spot" if priority in ("spot", "low") else "on-demand")


_READERS: dict[str, tuple[type[Poller], Callable[[Poller], Identity]]] = {
    "aws": (AwsPoller, _aws), "gcp": (GcpPoller, _gcp), "azure": (AzurePoller, _azure)}


def read_identity(cloud: str, endpoint: str | None = None, timeout: float = 2.0, *,
                  env: Mapping[str, str] | None = None) -> Identity | None:
    """This VM's identity from ``cloud``'s metadata service (auto: the one that answers, as detected for the
    notices; none: no service, None) at ``endpoint`` (None: the SDK's variable, else the well-known address).

    None, with one WARNING, where the service cannot tell: unreachable, slow past ``timeout`` seconds a
    request, refusing, or answering what is not a zone, an instance type and a market. Raises only UsageError
    for a ``cloud`` that is no cloud.
    """
    cloud = resolve_cloud(cloud, endpoint, env=env, timeout=min(timeout, 1.0))
    if cloud == "none":
        return None
    poller_class, reader = _READERS[cloud]
    poller = poller_class(endpoint, timeout=timeout, env=env)
    try:
        identity = reader(poller)
    except (MetadataError, ValueError) as e:
        log.warning("cannot read this VM's zone and instance type from the %s metadata service at %s: %s (its "
                    "failure domain is unknown; --failure-domain names it)", cloud, poller.base_url, e)
        return None
    except Exception as e:  # a surprise of a flaky service must not stop the agent's start
        log.debug("reading the %s identity failed", cloud, exc_info=True)
        log.warning("cannot read this VM's zone and instance type from the %s metadata service at %s: unexpected "
                    "%s: %s (its failure domain is unknown; --failure-domain names it)", cloud, poller.base_url,
                    type(e).__name__, e)
        return None
    finally:
        poller.close()
    log.info("this VM: %s %s in %s (%s)", cloud, identity.instance_type, identity.zone, identity.market)
    return identity


def this_domain(label: FailureDomain | None, cloud: str, endpoint: str | None = None, timeout: float = 2.0, *,
                instance_type: str | None = None, market: str | None = None,
                env: Mapping[str, str] | None = None) -> FailureDomain:
    """This node's failure domain: ``label`` (``--failure-domain``) where given, else what the metadata service
    says, else the unknown domain (which placement never counts as another); its pool then names
    ``instance_type`` and ``market`` (``--instance-type``, ``--market``) where given."""
    if label is None:
        identity = read_identity(cloud, endpoint, timeout, env=env)
        label = identity.domain if identity is not None else FailureDomain()
    return bought_as(label, instance_type, market)


def bought_as(domain: FailureDomain, instance_type: str | None, market: str | None) -> FailureDomain:
    """``domain`` with its pool ``INSTANCE_TYPE:MARKET`` naming ``instance_type`` and ``market`` where given (each
    left as the pool had it where not): what the cost ledger reads a node's kind from."""
    if not instance_type and not market:
        return domain
    suffix = f":{domain.market}"
    kind = domain.pool[:-len(suffix)] if domain.market and domain.pool.endswith(suffix) else domain.pool
    kind, market = instance_type or kind, market or domain.market
    return FailureDomain(zone=domain.zone, pool=f"{kind}:{market}" if kind and market else kind, market=market)

