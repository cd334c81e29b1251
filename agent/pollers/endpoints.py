"""Where each cloud's metadata service is reached: the SDKs' own variables, the default addresses, the API versions.

Pollers and detection both ask :func:`endpoint_for`; the order is the
``--metadata-endpoint`` override, then the cloud SDK's variable, then the
well-known address.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["AWS_DEFAULT", "AWS_ENDPOINT_ENV", "AZURE_DEFAULT", "AZURE_EVENTS_VERSION", "AZURE_INSTANCE_VERSION",
           "GCE_HOST_ENV", "GCE_IP_ENV", "GCP_DEFAULT", "GCP_PROBE_DEFAULT", "base_url", "endpoint_for"]

#: the clouds' own SDK variables for the metadata service's address
AWS_ENDPOINT_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"  # a URL: http://169.254.169.254/
GCE_HOST_ENV = "GCE_METADATA_HOST"  # host[:port]: metadata.google.internal
GCE_IP_ENV = "GCE_METADATA_IP"  # host[:port] google-auth pings: 169.254.169.254

AWS_DEFAULT = "http://169.254.169.254"
GCP_DEFAULT = "http://metadata.google.internal"
GCP_PROBE_DEFAULT = "http://169.254.169.254"  # no DNS look-up while detecting
AZURE_DEFAULT = "http://169.254.169.254"

AZURE_EVENTS_VERSION = "2020-07-01"
AZURE_INSTANCE_VERSION = "2021-02-01"


def base_url(endpoint: str) -> str:
    """``endpoint`` as a base URL: a scheme (http if none), no trailing slash."""
    endpoint = endpoint.strip()
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    return endpoint.rstrip("/")


def endpoint_for(cloud: str, metadata_endpoint: str | None = None, env: Mapping[str, str] | None = None,
                 *, probe: bool = False) -> str:
    """The base URL a cloud's metadata service is reached at: the override, the SDK variable, the default."""
    env = os.environ if env is None else env
    if metadata_endpoint:
        return base_url(metadata_endpoint)
    if cloud == "aws":
        return base_url(env.get(AWS_ENDPOINT_ENV) or AWS_DEFAULT)
    if cloud == "gcp":
        host = env.get(GCE_HOST_ENV) or (env.get(GCE_IP_ENV) if probe else None)
        return base_url(host) if host else (GCP_PROBE_DEFAULT if probe else GCP_DEFAULT)
    if cloud == "azure":
        return AZURE_DEFAULT
    raise ValueError(f"no metadata service for cloud {cloud!r}")
