"""A data source's listing kept by dash-memd for the cluster, and the ``dashrun data`` commands: a real dash-memd,
a real moto server (stopped mid-test), the real command line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from dashrun.data.cache import Cache
from dashrun.data.files import CachedFiles
from dashrun.data.peers import MemdListings
from dashrun.errors import ChecksumError, ProtocolError, UnavailableError
from dashrun.testing.s3 import S3Server, make_bucket, use_endpoint
from dashrun.wire.credentials import Credential
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.tls import TlsSettings


def test_the_listing_lives_in_memd_so_a_new_node_lists_a_bucket_that_is_down(memd, tmp_path, monkeypatch):
    server = S3Server(tmp_path / "moto.log").start()
    try:
        use_endpoint(monkeypatch, server.endpoint, tmp_path)
        bucket = make_bucket(server)
        for i in range(3):
            bucket.client.put_object(Bucket=bucket.name, Key=f"ds/{i}.bin", Body=bytes([i]) * 1000)
        url = bucket.url("ds/")
        job_credential = Credential.parse(memd.token).for_job("job-a").file_bytes().strip()  # a rank's: its job's only
        with MemdClient(memd.host, memd.port, job_credential, tls=TlsSettings(plaintext=bool(memd.tls_args))) \
                as rank_client, \
                CachedFiles(url, cache_dir=tmp_path / "node-a", remote=MemdListings(lambda: rank_client),
                            providers=[]) as files:
            assert files.keys() == ["0.bin", "1.bin", "2.bin"]
            assert [open(files.local_path(k), "rb").read() for k in files.keys()] == [bytes([i]) * 1000
                                                                                     for i in range(3)]
    finally:
        server.stop()  # the bucket unreachable from now on
    with memd.client() as client:
        with CachedFiles(url, cache_dir=tmp_path / "node-b", remote=MemdListings(lambda: client),
                         providers=[]) as fresh:
            assert fresh.keys() == ["0.bin", "1.bin", "2.bin"]  # from dash-memd: another job's listing
            assert fresh.info("2.bin").size == 1000
            with pytest.raises(UnavailableError):  # no peer holds it yet, and the bucket is down
                fresh.local_path("0.bin")
        with pytest.raises(UnavailableError):  # a refresh must reach the source
            CachedFiles(url, cache_dir=tmp_path / "node-b", remote=MemdListings(lambda: client), providers=[],
                        refresh=True)
        # a listing of another URL, or not a listing, is refused and nothing stored
        with pytest.raises(ProtocolError):
            client.put_data_listing("s3://other/", json.dumps({"url": url, "objects": []}).encode())
        assert client.data_listing("s3://other/", 1 << 20) is None
    with CachedFiles(url, cache_dir=tmp_path / "node-a", remote=None, providers=[]) as again:  # node a's own
        assert open(again.local_path("1.bin"), "rb").read() == bytes([1]) * 1000


def dashrun_data(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", "data", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def test_dashrun_data_stage_status_clear(memd, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.bin").write_bytes(bytes([i]) * 2048)
    cache = str(tmp_path / "cache")
    staged = dashrun_data("stage", str(src), "--data-cache", cache, "--memd", memd.address, "--token-file",
                          str(memd.token_file), *memd.tls_args)
    assert staged.returncode == 0, staged.stderr
    assert "4 objects" in staged.stdout and "4 fetched" in staged.stdout
    again = dashrun_data("stage", str(src), "--data-cache", cache)
    assert again.returncode == 0 and "0 fetched, 4 already there" in again.stdout
    with memd.client() as client:
        assert json.loads(client.data_listing(str(src), 1 << 20))["url"] == str(src)
    shown = dashrun_data("status", "--json", "--data-cache", cache)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["sources"] == [{"url": str(src), "objects": 4, "bytes": 8192, "listed_objects": 4,
                                  "listed_bytes": 8192}]
    assert "4 objects, 8.0 KiB of 4 listed" in dashrun_data("status", "--data-cache", cache).stdout
    cleared = dashrun_data("clear", "--yes", "--data-cache", cache)
    assert cleared.returncode == 0 and "removed 4 objects" in cleared.stdout
    assert json.loads(dashrun_data("status", "--json", "--data-cache", cache).stdout)["sources"] == []
    # user mistakes: one line and a hint, exit 2, no traceback
    bad = dashrun_data("stage", "ftp://x/y", "--data-cache", cache)
    assert bad.returncode == 2 and "hint:" in bad.stderr and "Traceback" not in bad.stderr
    limit = dashrun_data("stage", str(src), "--data-cache", cache, "--data-cache-limit", "1KiB")
    assert limit.returncode == 2 and "larger than the data cache's limit" in limit.stderr
    assert "Traceback" not in limit.stderr


def test_a_fresh_node_refills_from_memds_data_cache_with_the_bucket_down(memd_factory, tmp_path, monkeypatch):
    memd = memd_factory("--memory-limit", "256MiB", "--data-cache", str(tmp_path / "memd-cache"))
    server = S3Server(tmp_path / "moto.log").start()
    objects = {f"{i:02d}.bin": bytes([i]) * (1000 + i) for i in range(6)}
    try:
        use_endpoint(monkeypatch, server.endpoint, tmp_path)
        bucket = make_bucket(server)
        for key, body in objects.items():
            bucket.client.put_object(Bucket=bucket.name, Key=f"ds/{key}", Body=body)
        url = bucket.url("ds/")

        def node(name: str) -> CachedFiles:
            remote = MemdListings(memd.client)
            return CachedFiles(url, cache_dir=tmp_path / name, remote=remote, providers=[("dash-memd", remote)])

        staged = subprocess.run([sys.executable, "-m", "dashrun", "data", "stage", url, "--data-cache",
                                 str(tmp_path / "node-a"), "--memd", memd.address, "--token-file",
                                 str(memd.token_file), *memd.tls_args], capture_output=True, text=True, timeout=120)
        assert staged.returncode == 0, staged.stderr
        with node("node-a") as a:  # staged: every object read from the node's own cache
            assert {k: open(a.local_path(k), "rb").read() for k in a.keys()} == objects and a.fetched == {}
        Cache(tmp_path / "memd-cache").clear()  # as if it had been too small: node b reads the bucket again
        with node("node-b") as b:  # the second node: from the source, each handed on to dash-memd
            assert {k: open(b.local_path(k), "rb").read() for k in b.keys()} == objects
            assert b.fetched == {"source": len(objects)}
    finally:
        server.stop()  # the bucket unreachable from now on
    with node("node-c") as c:  # a replacement node with an empty cache: everything from the stable VM
        assert c.keys() == sorted(objects)
        assert {k: open(c.local_path(k), "rb").read() for k in c.keys()} == objects
        assert c.fetched == {"dash-memd": len(objects)}
    # a planted copy (bytes that are not the listed object's, whatever SHA-256 it claims) is refused
    with memd.client() as client, node("node-d") as d:
        info = d.info("03.bin")
        forged = b"x" * info.size
        assert client.data_object(url, info.to_json(), info.size)[1] == objects["03.bin"]
        Cache(tmp_path / "memd-cache").clear()  # what it holds, gone: an offer is taken again, if it checks out
        with pytest.raises(ChecksumError, match="MD5"):  # the listed ETag fixes the bytes
            client.put_data_object(url, info.to_json(), hashlib.sha256(forged).hexdigest(), forged)
        assert client.data_object(url, info.to_json(), info.size) is None
