"""The one boto3 S3 client set-up of dashrun: dash-memd's object tier and the data cache's S3 sources.

Credentials, region and endpoint come from the standard AWS chain
(environment, ``~/.aws`` files, instance role); ``AWS_ENDPOINT_URL`` points at
an S3-compatible store. boto3 loads only when this module does.
"""

from __future__ import annotations

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

__all__ = ["error_code", "make_client"]


def make_client(*, connect_timeout: float, read_timeout: float, request_attempts: int, connections: int):
    """A boto3 S3 client (thread-safe) from the standard AWS chain, with bounded requests.

    botocore retries every request (standard mode: connection errors, 5xx,
    throttling, with backoff) up to ``request_attempts`` calls in all; the
    timeouts make a dead store fail a call instead of hanging it.
    """
    return boto3.session.Session().client("s3", config=Config(
        connect_timeout=connect_timeout, read_timeout=read_timeout, tcp_keepalive=True,
        retries={"mode": "standard", "total_max_attempts": request_attempts}, max_pool_connections=connections))


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
