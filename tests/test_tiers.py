"""One conformance suite, run against every tier (RAM, disk, object storage)."""

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dashrun.errors import ChecksumError, NotFoundError
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.memd.store.tiers import disk as disk_tier
from dashrun.memd.store.tiers.object import ObjectTier
from dashrun.memd.store.tiers.signing import manifest_key
from dashrun.util.files import write_new
from dashrun.wire.messages import CheckpointInfo, JobSpec, ShardHeader
from dashrun.wire.protocol import crc32c

KEY = manifest_key(b"test_tiers")  # the object tier's manifest key (a dash-memd derives its own from its token)

LAYOUT = "cd" * 32


def make_checkpoint(job="job-a", step=10, world=3, rep_total=3000, tail=100):
    shards, data = [], []
    cut = [rep_total * r // world for r in range(world + 1)]
    for rank in range(world):
        payload = os.urandom(cut[rank + 1] - cut[rank] + tail)
        data.append(payload)
        shards.append(ShardHeader(job, step, rank, world, rep_total, cut[rank], cut[rank + 1], tail - 20, 20,
                                  LAYOUT, crc=crc32c(payload)))
    return CheckpointInfo(job, step, world, rep_total, LAYOUT, time.time(), tuple(shards)), data


def flip_byte(path, at: int = 5) -> None:
    """Damage a file without changing its size."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def resident_pages(mapped: mmap.mmap) -> int:
    """How many pages of a mapping are in memory (mincore(2))."""
    pages = -(-len(mapped) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    anchor = ctypes.c_char.from_buffer(mapped)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(len(mapped)), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
    finally:
        del anchor
    return sum(v & 1 for v in vec)


def cached_pages(path) -> int:
    """How many of the file's pages the page cache holds."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), os.path.getsize(path), access=mmap.ACCESS_COPY)
    try:
        return resident_pages(mapped)
    finally:
        mapped.close()


def direct_io_works(where) -> bool:
    try:
        fd = os.open(where / ".direct-probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(where / ".direct-probe")
    return True


class TierConformance:
    """Subclasses provide ``tier``; every tier must pass every test."""

    @pytest.fixture
    def tier(self, tmp_path):
        raise NotImplementedError

    def test_put_then_read_every_shard(self, tier):
        info, data = make_checkpoint()
        tier.put(info, [memoryview(d) for d in data])
        for rank in range(info.world):
            with tier.open(info.job, info.step, rank) as view:
                assert bytes(view) == data[rank]

    def test_scan_lists_what_is_held(self, tier):
        first, first_data = make_checkpoint(step=1)
        second, second_data = make_checkpoint(job="job-b", step=2, world=1)
        tier.put(first, [memoryview(d) for d in first_data])
        tier.put(second, [memoryview(d) for d in second_data])
        held = {(i.job, i.step): i for i in tier.scan()}
        assert set(held) == {("job-a", 1), ("job-b", 2)}
        assert held[("job-a", 1)].shards == first.shards

    def test_delete_forgets(self, tier):
        info, data = make_checkpoint()
        tier.put(info, [memoryview(d) for d in data])
        tier.delete(info.job, info.step)
        assert tier.scan() == []
        with pytest.raises(NotFoundError):
            with tier.open(info.job, info.step, 0):
                pass
        tier.delete(info.job, info.step)  # deleting again is a no-op

    def test_bytes_that_no_longer_match_their_checksum_are_refused_and_nothing_is_stored(self, tier):
        from dashrun.memd.store.tiers.base import SourceChanged

        kept, kept_data = make_checkpoint(step=1)
        tier.put(kept, [memoryview(d) for d in kept_data])
        info, data = make_checkpoint(step=2)
        data = [bytearray(d) for d in data]
        data[1][len(data[1]) // 2] ^= 0x01  # changed where they were kept since they were committed
        with pytest.raises(SourceChanged):
            tier.put(info, [memoryview(d) for d in data])
        assert [(i.job, i.step) for i in tier.scan()] == [(kept.job, kept.step)]

    def test_missing_is_not_found(self, tier):
        with pytest.raises(NotFoundError):
            with tier.open("nothing", 1, 0):
                pass

    def test_a_new_attempt_at_the_same_step_replaces_the_old(self, tier):
        old, old_data = make_checkpoint()
        new, new_data = make_checkpoint()
        tier.put(old, [memoryview(d) for d in old_data])
        tier.put(new, [memoryview(d) for d in new_data])
        assert [i.shards for i in tier.scan()] == [new.shards]
        with tier.open(new.job, new.step, 1) as view:
            assert bytes(view) == new_data[1]


class TestRamTier(TierConformance):
    @pytest.fixture
    def tier(self, tmp_path):
        return RamTier(64 << 20)

    def test_buffers_are_reused_and_the_limit_holds(self):
        ram = RamTier(20_000)
        first = ram.reserve(12_000)
        assert len(first) == RamTier.size_class(12_000) >= 12_000
        assert ram.reserve(12_000) is None
        ram.release(first)
        again = ram.reserve(12_001)  # same size class: the same mapping, its touched pages reused
        assert again is first
        ram.release(again)
        other = ram.reserve(16_000)  # the pooled buffer goes back to the OS to make room
        assert other is not None and ram.used == RamTier.size_class(16_000)

    def test_buffers_are_touched_ahead_of_need_within_the_limit(self):
        size = 8 << 20
        ram = RamTier(3 * size)
        assert ram.prewarm([size, size - 1000]) == 2      # one size class, two shards of it
        assert ram.prewarm([size]) == 0                    # already there
        ready = [buf for bufs in ram._free.values() for buf in bufs]
        assert all(resident_pages(buf) == size // mmap.PAGESIZE for buf in ready)
        got = ram.reserve(size)
        assert any(got is buf for buf in ready) and ram.used == size
        assert ram.prewarm([size] * 3) == 1                # in use + pooled stay within the limit
        assert ram.reserve(size) is not None and ram.reserve(size) is not None and ram.reserve(size) is None

    def test_size_classes_waste_little(self):
        for nbytes in (1, 4095, 4097, 65303, 65304, 1 << 20, (256 << 20) + 12345, 10 << 30):
            size = RamTier.size_class(nbytes)
            assert nbytes <= size <= max(nbytes + 4096, nbytes * 1.07)


class TestDiskTier(TierConformance):
    @pytest.fixture
    def tier(self, tmp_path):
        return DiskTier(tmp_path / "disk")

    def test_survives_a_restart(self, tmp_path):
        info, data = make_checkpoint()
        DiskTier(tmp_path / "d").put(info, [memoryview(d) for d in data])
        assert [i.step for i in DiskTier(tmp_path / "d").scan()] == [info.step]

    def test_corrupt_or_partial_checkpoints_are_reported_not_loaded(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        for step in (1, 2, 3, 4, 7):
            info, data = make_checkpoint(step=step)
            disk.put(info, [memoryview(d) for d in data])
        flip_byte(disk.step_dir("job-a", 2) / "rank-00001.bin")
        (disk.step_dir("job-a", 3) / "rank-00002.bin").unlink()
        (disk.step_dir("job-a", 4) / "MANIFEST.json").write_text("{not json")
        with open(disk.step_dir("job-a", 7) / "rank-00000.bin", "ab") as f:
            f.write(b"!")
        info, data = make_checkpoint(step=5)
        disk.put(info, [memoryview(d) for d in data])
        manifest = disk.step_dir("job-a", 5) / "MANIFEST.json"
        manifest.write_text(manifest.read_text().replace('"world": 3', '"world": 0'))  # valid JSON, invalid manifest
        leftover = disk.jobs / "job-a" / ".tmp-0000000000000006-deadbeef"
        leftover.mkdir()
        found, problems = DiskTier(tmp_path / "d").scan_report()
        # The scan reads manifests and sizes only: damage of the same size shows when the bytes are read.
        assert [i.step for i in found] == [1, 2]
        with pytest.raises(ChecksumError, match="checksum"):
            disk.check(found[1].shards[1])
        text = "\n".join(problems)
        assert "0000000000000007: corrupt" in text and "wrong size" in text
        assert "0000000000000003: incomplete" in text
        assert "0000000000000004: corrupt" in text and "0000000000000005: corrupt" in text
        assert "interrupted write" in text and not leftover.exists()

    def test_every_host_of_a_job_may_record_its_spec_at_once(self, tmp_path):
        # Each host's launcher sends the job's spec as it starts; dash-memd writes them from concurrent threads.
        disk = DiskTier(tmp_path / "d")
        start, failures = threading.Barrier(8), []

        def host(name):
            start.wait()
            for i in range(25):
                try:
                    disk.put_spec(JobSpec(("train.py",), "/work", f"{name}-{i}", time.time()), "job-a")
                except Exception as e:  # any failure at all is what this test looks for
                    failures.append(repr(e))

        threads = [threading.Thread(target=host, args=(f"host{n}",)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[:3]
        assert disk.specs()["job-a"].host.startswith("host")
        assert not [p.name for p in (disk.jobs / "job-a").iterdir() if p.name.endswith(".tmp")]

    def test_shards_from_ram_buffers_are_written_past_the_page_cache(self, tmp_path):
        # dash-memd holds the bytes in RAM already; caching them again costs a copy into fresh pages.
        ram = RamTier(64 << 20)
        size = (4 << 20) + 4096 * 3 + 123            # an unaligned tail goes through the page cache
        buf = ram.reserve(size)
        payload = os.urandom(size)
        buf[:size] = payload
        header = ShardHeader("job-a", 7, 0, 1, size, 0, size, 0, 0, LAYOUT, crc=crc32c(payload))
        info = CheckpointInfo("job-a", 7, 1, size, LAYOUT, time.time(), (header,))
        disk = DiskTier(tmp_path / "d")
        disk.put(info, [memoryview(buf)[:size]])
        path = disk.step_dir("job-a", 7) / "rank-00000.bin"
        if not direct_io_works(tmp_path):
            pytest.skip(f"{tmp_path} has no O_DIRECT")
        assert cached_pages(path) <= 1, "the shard was written through the page cache"
        buffered = tmp_path / "buffered"
        buffered.write_bytes(payload)
        assert cached_pages(buffered) > size // 4096 // 2   # the measure sees what the page cache holds
        with disk.open("job-a", 7, 0) as view:
            assert view == payload
        assert [i.step for i in DiskTier(tmp_path / "d").scan()] == [7]

    def test_a_buffer_that_cannot_go_direct_is_written_through_the_page_cache(self, tmp_path):
        for where in (tmp_path, Path("/dev/shm")):      # an ext4 or so, and a tmpfs (no O_DIRECT at all)
            if not where.is_dir():
                continue
            target = where / f"dash-write-{os.getpid()}"
            payload = os.urandom((1 << 20) + 5)
            try:
                write_new(target, payload, bypass_cache=True)              # bytes: read-only, not aligned
                assert target.read_bytes() == payload
            finally:
                target.unlink(missing_ok=True)

    def test_files_are_owner_only(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        info, data = make_checkpoint()
        disk.put(info, [memoryview(d) for d in data])
        assert oct(os.stat(disk.step_dir(info.job, info.step) / "rank-00000.bin").st_mode & 0o777) == "0o600"

    def test_bytes_read_with_their_header_are_checked_first(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        info, data = make_checkpoint()
        disk.put(info, [memoryview(d) for d in data])
        flip_byte(disk.step_dir(info.job, info.step) / "rank-00001.bin")
        with pytest.raises(ChecksumError, match="rank 1 on disk fails its checksum"):
            with disk.open(info.job, info.step, 1, shard=info.shards[1]):
                pass
        with disk.open(info.job, info.step, 0, shard=info.shards[0]) as view:  # the other ranks are fine
            assert view == data[0]
        with open(disk.step_dir(info.job, info.step) / "rank-00002.bin", "ab") as f:
            f.write(b"!")
        with pytest.raises(ChecksumError, match="wrong size"):
            disk.check(info.shards[2])

    def test_a_quarantined_copy_is_moved_aside_kept_and_counted(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        for step in (1, 2):
            info, data = make_checkpoint(step=step)
            disk.put(info, [memoryview(d) for d in data])
        moved = disk.quarantine("job-a", 2)
        assert moved.parent == tmp_path / "d" / "quarantine" / "job-a" and moved.name.startswith(f"{2:016d}-")
        assert sorted(p.name for p in moved.iterdir()) == ["MANIFEST.json", *(f"rank-{r:05d}.bin" for r in range(3))]
        assert [i.step for i in disk.scan()] == [1] and disk.quarantined == {"job-a": 1}
        assert disk.quarantine("job-a", 2) is None                      # nothing left to move
        assert DiskTier(tmp_path / "d").quarantined == {"job-a": 1}     # counted across restarts

    def test_exchange_swaps_two_directories(self, tmp_path):
        a, b = tmp_path / "a", tmp_path / "b"
        a.mkdir()
        b.mkdir()
        (a / "from-a").touch()
        (b / "from-b").touch()
        if not disk_tier.exchange(a, b):
            pytest.skip(f"{tmp_path}'s file system has no RENAME_EXCHANGE")
        assert [p.name for p in a.iterdir()] == ["from-b"] and [p.name for p in b.iterdir()] == ["from-a"]

    def test_a_crash_while_a_step_is_replaced_leaves_it_complete(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        probe = [tmp_path / "x", tmp_path / "y"]
        for p in probe:
            p.mkdir()
        if not disk_tier.exchange(*probe):
            pytest.skip(f"{tmp_path}'s file system has no RENAME_EXCHANGE")
        old, old_data = make_checkpoint(step=4)
        disk.put(old, [memoryview(d) for d in old_data])
        new, new_data = make_checkpoint(step=4)
        (tmp_path / "new.json").write_text(json.dumps(new.to_body()))
        for rank, payload in enumerate(new_data):
            (tmp_path / f"new-{rank}").write_bytes(payload)
        writer = (
            "import json, sys; from pathlib import Path\n"
            "from dashrun.memd.store.tiers import DiskTier\n"
            "from dashrun.wire.messages import CheckpointInfo\n"
            "root = Path(sys.argv[1])\n"
            "info = CheckpointInfo.from_body(json.loads((root / 'new.json').read_text()))\n"
            "data = [memoryview((root / f'new-{r}').read_bytes()) for r in range(info.world)]\n"
            "DiskTier(root / 'd').put(info, data)\n")
        result = subprocess.run([sys.executable, "-c", writer, str(tmp_path)], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "DASH_CRASH_AT": "disk.mid_replace@step=4"})
        assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
        found, problems = DiskTier(tmp_path / "d").scan_report()
        assert [i.shards for i in found] == [new.shards]                # the new attempt, whole
        for rank, payload in enumerate(new_data):
            disk.check(new.shards[rank])
        assert any("interrupted write" in p for p in problems)          # the old attempt, cleared away

    @pytest.mark.parametrize("new_complete", [True, False], ids=["new-complete", "new-incomplete"])
    def test_without_renameat2_a_crash_between_the_renames_recovers_the_complete_copy(self, tmp_path, new_complete):
        disk = DiskTier(tmp_path / "d")
        old, old_data = make_checkpoint(step=4)
        disk.put(old, [memoryview(d) for d in old_data])
        new, new_data = make_checkpoint(step=4)
        (tmp_path / "new.json").write_text(json.dumps(new.to_body()))
        for rank, payload in enumerate(new_data):
            (tmp_path / f"new-{rank}").write_bytes(payload)
        writer = (
            "import json, sys; from pathlib import Path\n"
            "from dashrun.memd.store.tiers import DiskTier, disk\n"
            "from dashrun.wire.messages import CheckpointInfo\n"
            "disk._RENAMEAT2 = None  # a libc without renameat2: the old copy is moved aside, then the new one in\n"
            "root = Path(sys.argv[1])\n"
            "info = CheckpointInfo.from_body(json.loads((root / 'new.json').read_text()))\n"
            "data = [memoryview((root / f'new-{r}').read_bytes()) for r in range(info.world)]\n"
            "DiskTier(root / 'd').put(info, data)\n")
        result = subprocess.run([sys.executable, "-c", writer, str(tmp_path)], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "DASH_CRASH_AT": "disk.mid_replace@step=4"})
        assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
        job_dir = tmp_path / "d" / "jobs" / "job-a"
        assert not (job_dir / f"{4:016d}").exists()                     # killed between the two renames
        if not new_complete:  # the new copy lost a file (as if it had been cut short): the old one is whole
            next(job_dir.glob(".tmp-*")).joinpath("rank-00001.bin").unlink()
        found, problems = DiskTier(tmp_path / "d").scan_report()
        kept = new if new_complete else old
        assert [i.shards for i in found] == [kept.shards]
        for rank in range(kept.world):
            disk.check(kept.shards[rank])
        assert any(p.startswith("recovered") for p in problems), problems
        assert [p.name for p in job_dir.iterdir()] == [f"{4:016d}"]    # the other copy, cleared away

    def test_without_renameat2_a_new_attempt_still_replaces_the_old(self, tmp_path, monkeypatch):
        monkeypatch.setattr(disk_tier, "_RENAMEAT2", None)              # a libc without it
        self.test_a_new_attempt_at_the_same_step_replaces_the_old(DiskTier(tmp_path / "d"))
        assert [p.name for p in (tmp_path / "d" / "jobs" / "job-a").iterdir()] == [f"{10:016d}"]


class TestObjectTier(TierConformance):
    """Against a real S3 API (moto's server, a process on loopback), through the standard AWS chain."""

    @pytest.fixture
    def tier(self, s3_bucket):
        tier = ObjectTier(s3_bucket.url("ckpt"), key=KEY)
        yield tier
        tier.close()
