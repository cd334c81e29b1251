"""The node-local data cache (dashrun.data): a real moto S3 server, real directories, a real HTTP server, real
processes racing for one object."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import kill_tree, wait_for
from dashrun.data.cache import Cache
from dashrun.data.files import CachedFiles
from dashrun.errors import ChecksumError, NoSpaceError, SourceChangedError, UnavailableError, UsageError
from dashrun.testing.processes import free_port


def payload(i: int, size: int = 4096) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32) + bytes([i % 256]) * (size % 32)


def files_of(url, cache_dir, **kw) -> CachedFiles:
    return CachedFiles(url, cache_dir=cache_dir, remote=None, providers=[], **kw)


@pytest.fixture
def shards(s3_bucket):
    """Five objects under shards/ (two with S3 checksums, one written in pieces), and one
    object outside the prefix."""
    c = s3_bucket.client
    objects = {f"part-{i:03d}.bin": payload(i, 4096 + i) for i in range(4)}
    objects["sub/big.bin"] = payload(99, 9 << 20)
    for n, (key, body) in enumerate(sorted(objects.items())):
        extra = {"ChecksumAlgorithm": ["CRC32", "SHA256"][n]} if n < 2 else {}
        c.put_object(Bucket=s3_bucket.name, Key=f"shards/{key}", Body=body, **extra)
    c.put_object(Bucket=s3_bucket.name, Key="elsewhere.bin", Body=b"not in the data set")
    return s3_bucket, objects


def test_s3_objects_cached_once_and_verified(shards, tmp_path):
    bucket, objects = shards
    with files_of(bucket.url("shards/"), tmp_path / "cache") as files:
        assert files.keys() == sorted(objects)
        for key in files.keys():
            with open(files.local_path(key), "rb") as f:
                assert f.read() == objects[key]
        assert files.fetched == {"source": len(objects)}
        checks = {e.key: e.checked_by for e in files.cache.entries()}
        assert checks["part-000.bin"] == "crc32" and checks["part-001.bin"] == "sha256"
        assert "size" not in checks.values()  # each checked against S3's checksum or its single-part ETag (MD5)
    # another job on the node: the stored listing and the entries, nothing from the bucket
    with files_of(bucket.url("shards"), tmp_path / "cache") as again:
        assert again.keys() == sorted(objects)
        assert all(open(again.local_path(k), "rb").read() == objects[k] for k in again.keys())
        assert again.fetched == {}


def test_a_changed_object_is_noticed_on_refresh(shards, tmp_path):
    bucket, objects = shards
    url = bucket.url("shards/")
    with files_of(url, tmp_path / "cache") as files:
        old = open(files.local_path("part-002.bin"), "rb").read()
    bucket.client.put_object(Bucket=bucket.name, Key="shards/part-002.bin", Body=b"new bytes")
    bucket.client.put_object(Bucket=bucket.name, Key="shards/part-003.bin", Body=b"also new")
    with files_of(url, tmp_path / "cache") as stale:  # the stored listing: the version it names
        assert open(stale.local_path("part-002.bin"), "rb").read() == old
        with pytest.raises(SourceChangedError, match="refresh"):  # not cached, and changed since listed
            stale.local_path("part-003.bin")
    with files_of(url, tmp_path / "cache", refresh=True) as fresh:
        assert open(fresh.local_path("part-002.bin"), "rb").read() == b"new bytes"
        assert open(fresh.local_path("part-003.bin"), "rb").read() == b"also new"
    with files_of(url, tmp_path / "cache") as later:  # the refreshed listing is the stored one now
        assert later.info("part-002.bin").size == len(b"new bytes")


def test_a_corrupt_cache_file_is_detected_and_replaced(shards, tmp_path):
    bucket, objects = shards
    with files_of(bucket.url("shards/"), tmp_path / "cache") as files:
        path = files.local_path("part-001.bin")
        files.release()
        with open(path, "r+b") as f:  # rewritten in place: its mtime no longer matches the record
            f.write(b"\0" * 100)
        assert open(files.local_path("part-001.bin"), "rb").read() == objects["part-001.bin"]
        assert files.fetched == {"source": 2}
        # a flipped byte with size and mtime put back: found by verify(), which removes the entry
        path = files.local_path("part-002.bin")
        files.release()
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.seek(10)
            f.write(bytes([objects["part-002.bin"][10] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert [e.key for e in files.cache.verify()] == ["part-002.bin"]
        assert open(files.local_path("part-002.bin"), "rb").read() == objects["part-002.bin"]
        assert files.cache.verify() == []


def test_lru_eviction_within_the_limit_skips_pinned_entries(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.bin").write_bytes(payload(i, 1000))
    (src / "huge.bin").write_bytes(b"x" * 5000)
    with files_of(str(src), tmp_path / "cache", limit=3000) as files:
        for key in ("0.bin", "1.bin", "2.bin"):
            files.local_path(key)
        files.release()
        files.local_path("0.bin")  # used again: 1.bin is now the least recently used
        files.release()
        files.local_path("3.bin")
        assert sorted(e.key for e in files.cache.entries()) == ["0.bin", "2.bin", "3.bin"]
        files.local_path("2.bin")
        files.local_path("0.bin")  # all three pinned now: nothing may go
        with pytest.raises(NoSpaceError, match="in use"):
            files.local_path("4.bin")
        with pytest.raises(UsageError, match="larger than the data cache's limit"):
            files.local_path("huge.bin")
        files.release("3.bin")
        assert open(files.local_path("4.bin"), "rb").read() == payload(4, 1000)
        assert sorted(e.key for e in files.cache.entries()) == ["0.bin", "2.bin", "4.bin"]
        assert files.cache.usage() == 3000


def test_directory_source_and_its_changes(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.bin").write_bytes(b"x" * 10)
    (src / "y.bin").write_bytes(b"y" * 20)
    with files_of(str(src), tmp_path / "cache") as files:
        assert files.keys() == ["a/x.bin", "y.bin"]
        assert open(files.local_path("a/x.bin"), "rb").read() == b"x" * 10
        assert files.cache.entries()[0].checked_by == "size"  # a directory's file is not hashed at list time
    (src / "y.bin").write_bytes(b"Y" * 21)
    with files_of(str(src), tmp_path / "cache") as files:
        with pytest.raises(SourceChangedError):
            files.local_path("y.bin")
    with files_of(str(src), tmp_path / "cache", refresh=True) as files:
        assert open(files.local_path("y.bin"), "rb").read() == b"Y" * 21
    (src / "a" / "x.bin").unlink()
    (src / "y.bin").unlink()
    (src / "a").rmdir()
    src.rmdir()  # the file system gone: the stored listing and the entries still serve
    with files_of(str(src), tmp_path / "cache") as files:
        assert files.keys() == ["a/x.bin", "y.bin"]
        assert open(files.local_path("y.bin"), "rb").read() == b"Y" * 21
    with pytest.raises(UnavailableError, match="no listing of it is stored"):
        files_of(str(tmp_path / "never-listed"), tmp_path / "cache")


@pytest.fixture
def http_dir(tmp_path):
    """A real HTTP server (python -m http.server) serving a directory; stopped after the test."""
    root = tmp_path / "www"
    root.mkdir()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                             "--directory", str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    def answers():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1):
                return True
        except OSError:
            return False

    try:
        wait_for(answers, 30, "the HTTP server to answer")
        yield root, f"http://127.0.0.1:{port}"
    finally:
        kill_tree(proc, signal.SIGTERM)


def test_https_manifest_source_verifies_its_sha256(http_dir, tmp_path):
    root, base = http_dir
    objects = {"a.bin": payload(1, 3000), "dir/b.bin": payload(2, 5000)}
    (root / "dir").mkdir()
    for key, body in objects.items():
        (root / key).write_bytes(body)
    manifest = {"objects": [{"key": k, "size": len(v), "sha256": hashlib.sha256(v).hexdigest()}
                            for k, v in objects.items()]}
    manifest["objects"].append({"key": "lying.bin", "size": 4, "sha256": "0" * 64})
    (root / "lying.bin").write_bytes(b"abcd")
    (root / "manifest.json").write_text(json.dumps(manifest))
    with files_of(f"{base}/manifest.json", tmp_path / "cache") as files:
        assert files.keys() == ["a.bin", "dir/b.bin", "lying.bin"]
        for key, body in objects.items():
            assert open(files.local_path(key), "rb").read() == body
        with pytest.raises(ChecksumError, match="SHA-256"):
            files.local_path("lying.bin")
        assert sorted(e.key for e in files.cache.entries()) == ["a.bin", "dir/b.bin"]
        assert list((files.cache.root / "tmp").iterdir()) == []


RACER = textwrap.dedent("""
    import json, sys
    from dashrun.data.files import CachedFiles
    files = CachedFiles(sys.argv[1], cache_dir=sys.argv[2], remote=None, providers=[])
    print("ready", flush=True)
    sys.stdin.readline()
    data = open(files.local_path(sys.argv[3]), "rb").read()
    print(json.dumps({"fetched": files.fetched, "size": len(data)}), flush=True)
""")


def test_two_processes_reading_one_key_download_it_once(shards, tmp_path):
    bucket, objects = shards
    url = bucket.url("shards/")
    files_of(url, tmp_path / "cache").close()  # the listing, stored
    racers = [subprocess.Popen([sys.executable, "-c", RACER, url, str(tmp_path / "cache"), "sub/big.bin"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for racer in racers:
            assert racer.stdout.readline().strip() == "ready"
        for racer in racers:  # both go at once
            racer.stdin.write("\n")
            racer.stdin.flush()
        results = [json.loads(racer.communicate(timeout=120)[0]) for racer in racers]
    finally:
        for racer in racers:
            kill_tree(racer)
    assert [r["size"] for r in results] == [len(objects["sub/big.bin"])] * 2
    assert sum(r["fetched"].get("source", 0) for r in results) == 1


HOLDER = textwrap.dedent("""
    import sys
    from dashrun.data.cache import Cache
    cache = Cache(sys.argv[1])
    with cache._download_lock(sys.argv[2]):
        open(cache.root / "tmp" / (sys.argv[2] + ".100.1.0"), "wb").write(b"partial")
        print("holding", flush=True)
        sys.stdin.readline()
""")


def test_a_lock_left_by_a_crashed_download_is_broken(shards, tmp_path):
    bucket, objects = shards
    url = bucket.url("shards/")
    with files_of(url, tmp_path / "cache") as files:
        ident = files.info("part-000.bin").identity(files.url)
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cache"), ident],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "holding"
            holder.kill()  # dies holding the lock, its partial file left behind
            holder.wait(timeout=30)
        finally:
            kill_tree(holder)
        assert open(files.local_path("part-000.bin"), "rb").read() == objects["part-000.bin"]
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []


@pytest.mark.slow
def test_dataset_through_dataloader_workers(shards, tmp_path):
    torch = pytest.importorskip("torch")
    bucket, objects = shards
    with files_of(bucket.url("shards/"), tmp_path / "cache") as files:
        loader = torch.utils.data.DataLoader(files.dataset(), batch_size=None, num_workers=2)
        seen = {key: open(path, "rb").read() for key, path in loader}
    assert seen == objects
    assert len(Cache(tmp_path / "cache").entries()) == len(objects)
