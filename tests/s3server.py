"""A real S3 API for tests: moto's server as a process on a free loopback port.

A test module uses the fixtures with ``pytest_plugins = ("s3server",)``:

- ``s3_server`` (module scope): one moto server, stopped when the module's tests are done.
- ``s3_bucket`` (function scope): a fresh bucket on it, and the environment of the
  standard AWS chain pointed at it (dummy credentials, ``AWS_ENDPOINT_URL``),
  isolated from any ``~/.aws`` of the machine running the tests.

moto keeps everything in memory: a restarted server (``S3Server.restart``,
same port) starts empty.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from conftest import wait_for

from dashrun.memd.store.tiers.signing import manifest_key

ACCESS_KEY = "testing-access-key"
SECRET_KEY = "testing-secret-key"
REGION = "us-east-1"
#: The manifest key of the tests that make an ObjectTier themselves (a dash-memd derives its own from its token).
KEY = manifest_key(b"the token of the tests that make an ObjectTier themselves")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``python -m moto.server`` on 127.0.0.1; started and stopped by the test that made it."""

    def __init__(self, log_path: Path, port: int | None = None):
        self.log_path = log_path
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
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
    """Point the standard AWS chain of this process (and its children) at ``endpoint``, and only there."""
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


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path) -> Bucket:
    use_endpoint(monkeypatch, s3_server.endpoint, tmp_path)
    return make_bucket(s3_server)
