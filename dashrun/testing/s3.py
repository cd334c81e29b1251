"""A real S3 API: moto's server as a process on a free loopback port, and buckets on it.

The tests' fixtures (tests/conftest.py): ``s3_server`` (module scope, one moto
server) and ``s3_bucket`` (a fresh bucket on it, and the environment of the
standard AWS chain pointed at it with :func:`use_endpoint`, isolated from any
``~/.aws`` of the machine). moto keeps everything in memory: a restarted
server (:meth:`S3Server.restart`, same port) starts empty. A server keeps the
leak tag of the scope that made it (:mod:`dashrun.testing.leaks`), so one
restarted inside a test is still its fixture's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config

from dashrun.memd.store.tiers.signing import manifest_key
from dashrun.testing import leaks
from dashrun.testing.processes import free_port, wait_for

__all__ = ["ACCESS_KEY", "KEY", "REGION", "SECRET_KEY", "Bucket", "S3Server", "make_bucket", "use_endpoint"]

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"
#: The manifest key of the tests that make an ObjectTier themselves (a dash-memd derives its own from its token).
KEY = manifest_key(b"the token of the tests that make an ObjectTier themselves")


class S3Server:
    """``python -m moto.server`` on 127.0.0.1; started and stopped by the test that made it."""

    def __init__(self, log_path: Path, port: int | None = None):
        self.log_path = log_path
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.leak_tag = os.environ.get(leaks.TAG)  # the scope that made it owns its processes, restarts included

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        with open(self.log_path, "ab") as log:
            env = leaks.untagged_env()
            if self.leak_tag is not None:
                env[leaks.TAG] = self.leak_tag
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        if self.leak_tag != os.environ.get(leaks.TAG):
            leaks.exempt(self.proc.pid)  # a wider scope's server, restarted inside a test
        wait_for(lambda: self._answers() or self.proc.poll() is not None, 60, "the moto S3 server to answer")
        assert self.proc.poll() is None, f"moto server exited: {self.log_path.read_text()[-2000:]}"
        return self

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=1) as reply:  # ListBuckets
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self) -> S3Server:
        """A new server on the same port (and so the same endpoint); it holds nothing."""
        self.stop()
        return self.start()

    def client(self):
        """A boto3 client for the test's own direct access (not through the chain under test)."""
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY,
                            config=Config(retries={"mode": "standard", "max_attempts": 2}))


@dataclass
class Bucket:
    """A bucket on ``server``, with a client for the test's own direct access."""

    server: S3Server
    name: str
    client: object

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.name}/{prefix}"

    def keys(self) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def uploads(self) -> list[dict]:
        return self.client.list_multipart_uploads(Bucket=self.name).get("Uploads", [])


def use_endpoint(monkeypatch, endpoint: str, tmp_path: Path) -> None:
    """Point the standard AWS chain of this process (and its children) at ``endpoint``, and only there.

    ``monkeypatch``: anything with ``setenv``/``delenv`` as pytest's has, which puts the environment back.
    """
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                 "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def make_bucket(server: S3Server, name: str | None = None) -> Bucket:
    client = server.client()
    name = name or f"dash-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return Bucket(server, name, client)
