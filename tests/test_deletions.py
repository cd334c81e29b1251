"""Deletions that last: ``rm`` and ``gc`` answer only once the deletion is durable, and a start never brings back
what they deleted (the tombstones, :mod:`dashrun.memd.store.tombstones`, applied to the disk's scan).

One catalogue is driven by hand over a real disk tier; a "restart" is a new catalogue over the same data dir.
Faults are injected in-process: the tombstones' file write, a step directory's removal. The same with an object
tier and the bucket unreachable at the restart is in test_object_store.py.
"""

from __future__ import annotations

import errno

import pytest
from test_catalogue import deliver, headers

from dashrun.memd.store import tombstones
from dashrun.memd.store.catalogue import Catalogue
from dashrun.memd.store.tiers import DiskTier, RamTier
from dashrun.memd.store.tombstones import TOMBSTONES


def committed_on_disk(tmp_path, steps) -> tuple[Catalogue, dict[int, list[bytes]]]:
    cat = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"), keep_ram=1, keep_disk=len(steps))
    payloads = {}
    for step in steps:
        payloads[step] = [deliver(cat, header)[1] for header in headers(step=step)]
        assert cat.disk_writer.persist_next(timeout=0)
    return cat, payloads


def restarted(tmp_path) -> Catalogue:
    reborn = Catalogue(RamTier(1 << 20), DiskTier(tmp_path / "d"))
    reborn.load_disk()
    return reborn


def failing(error: int):
    def fail(*args, **kwargs):
        raise OSError(error, "injected by the test")
    return fail


@pytest.mark.parametrize("keep", [0, 1], ids=["rm", "gc"])
def test_a_deletion_whose_tombstone_cannot_be_saved_is_refused_and_deletes_nothing(tmp_path, monkeypatch, keep):
    cat, payloads = committed_on_disk(tmp_path, (1, 2, 3))
    monkeypatch.setattr(tombstones, "write_atomic", failing(errno.ENOSPC))  # the data dir's disk is full
    with pytest.raises(OSError):
        cat.delete("j", keep)  # dash-memd answers the request with a refusal (its server turns OSError into one)
    assert sorted(cat.ledger.committed["j"]) == [1, 2, 3] and cat.latest("j").step == 3
    assert sorted(p.name for p in (tmp_path / "d" / "jobs" / "j").iterdir()) == [f"{s:016d}" for s in (1, 2, 3)]
    monkeypatch.undo()

    reborn = restarted(tmp_path)  # all there, consistently: nothing of the refused deletion comes up either
    assert sorted(reborn.ledger.committed["j"]) == [1, 2, 3]
    for rank, payload in enumerate(payloads[1]):
        with reborn.open_shard("j", 1, rank) as (view, _crc, _marks):
            assert bytes(view) == payload
    assert not (tmp_path / "d" / TOMBSTONES).exists()

    assert cat.delete("j", keep) == [1, 2, 3][:3 - keep]  # once the disk takes the record, it deletes and lasts
    assert sorted(restarted(tmp_path).ledger.committed.get("j", {})) == [3][:keep]


@pytest.mark.parametrize("keep", [0, 1], ids=["rm", "gc"])
def test_a_deleted_step_the_disk_still_holds_is_never_loaded_again_and_is_removed_at_the_start(tmp_path,
                                                                                               monkeypatch, keep):
    cat, _ = committed_on_disk(tmp_path, (1, 2))
    monkeypatch.setattr(DiskTier, "delete", failing(errno.EIO))  # the removals fail: the directories stay
    assert cat.delete("j", keep) == [1, 2][:2 - keep]  # deleted all the same: the tombstone makes it last
    monkeypatch.undo()
    assert cat.latest("j", 1) is None
    assert cat.disk.step_dir("j", 1).exists() and (tmp_path / "d" / TOMBSTONES).exists()
    after = 1 if keep == 0 else 3  # what the job commits after the deletion (rm: a new run) is not deleted
    for header in headers(step=after):
        deliver(cat, header)
    assert cat.disk_writer.persist_next(timeout=0)

    reborn = restarted(tmp_path)
    assert sorted(reborn.ledger.committed["j"]) == ([1] if keep == 0 else [2, 3])
    assert reborn.latest("j").step == after
    assert not reborn.disk.step_dir("j", 1 if keep else 2).exists()  # a deleted one, removed at the start
    assert not (tmp_path / "d" / TOMBSTONES).exists()                 # the disk has caught up: no tier is behind


def test_a_crash_after_the_tombstone_was_saved_finishes_the_deletion_at_the_start(tmp_path, monkeypatch):
    cat, _ = committed_on_disk(tmp_path, (1, 2))

    def crash(*args, **kwargs):
        raise SystemExit("dash-memd dies here")  # the tombstone saved, RAM changed, nothing removed from disk

    monkeypatch.setattr(cat.disk_writer, "delete_steps", crash)
    with pytest.raises(SystemExit):
        cat.delete("j")
    monkeypatch.undo()
    assert restarted(tmp_path).latest("j") is None  # never answered, and gone: not half there
