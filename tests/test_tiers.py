"""One conformance suite, run against every tier (RAM, disk, object storage)."""

import os
import time

import pytest

from dashrun.errors import NotFoundError
from dashrun.memd.objecttier import ObjectTier
from dashrun.memd.tiers import DiskTier, RamTier
from dashrun.protocol import CheckpointInfo, ShardHeader, crc32c

pytest_plugins = ("s3server",)  # s3_server, s3_bucket

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
        for step in (1, 2, 3, 4):
            info, data = make_checkpoint(step=step)
            disk.put(info, [memoryview(d) for d in data])
        step_dir = disk.step_dir("job-a", 2)
        with open(step_dir / "rank-00001.bin", "r+b") as f:  # flip one byte
            f.seek(5)
            byte = f.read(1)
            f.seek(5)
            f.write(bytes([byte[0] ^ 0xFF]))
        (disk.step_dir("job-a", 3) / "rank-00002.bin").unlink()
        (disk.step_dir("job-a", 4) / "MANIFEST.json").write_text("{not json")
        info, data = make_checkpoint(step=5)
        disk.put(info, [memoryview(d) for d in data])
        manifest = disk.step_dir("job-a", 5) / "MANIFEST.json"
        manifest.write_text(manifest.read_text().replace('"world": 3', '"world": 0'))  # valid JSON, invalid manifest
        leftover = disk.jobs / "job-a" / ".tmp-0000000000000006-deadbeef"
        leftover.mkdir()
        found, problems = DiskTier(tmp_path / "d").scan_report()
        assert [i.step for i in found] == [1]
        text = "\n".join(problems)
        assert "0000000000000002: corrupt" in text and "checksum" in text
        assert "0000000000000003: incomplete" in text
        assert "0000000000000004: corrupt" in text and "0000000000000005: corrupt" in text
        assert "interrupted write" in text and not leftover.exists()

    def test_files_are_owner_only(self, tmp_path):
        disk = DiskTier(tmp_path / "d")
        info, data = make_checkpoint()
        disk.put(info, [memoryview(d) for d in data])
        assert oct(os.stat(disk.step_dir(info.job, info.step) / "rank-00000.bin").st_mode & 0o777) == "0o600"


class TestObjectTier(TierConformance):
    """Against a real S3 API (moto's server, a process on loopback), through the standard AWS chain."""

    @pytest.fixture
    def tier(self, s3_bucket):
        tier = ObjectTier(s3_bucket.url("ckpt"))
        yield tier
        tier.close()
