"""The checkpoint's byte layout (dashrun.wire.layout): golden bytes, and a newer layout refused by every reader."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from runs import Cursor
from test_checkpointer import fresh_objects, save_world, trained_objects
from torch.distributed.checkpoint.api import CheckpointException

from dashrun import dcp as ddcp
from dashrun.errors import ProtocolError, UsageError
from dashrun.launch import export
from dashrun.wire import layout
from dashrun.wire.messages import CheckpointInfo, ShardHeader
from dashrun.wire.tls import TlsSettings

REPLICATED = b'{"tree":{"model":{"w":{"$T":0}}},"tensors":[["t","float32",[2],0,"cpu"]],"total":64}'
PRIVATE = b'{"tree":{"$rng":{"torch":{"$T":0}}},"tensors":[["t","uint8",[16],0,"cpu"]]}'
#: Saved rank 0's description of step 7 of a world of 2, byte for byte as dashrun writes format 1.
GOLDEN = b'{"format":1,"step":7,"rank":0,"world":2,"replicated":' + REPLICATED + b',"private":' + PRIVATE + b"}"


def test_a_description_golden_bytes():
    assert layout.FORMAT == 1 and layout.ALIGN == 64
    replicated = layout.replicated_part({"model": {"w": {"$T": 0}}}, [["t", "float32", [2], 0, "cpu"]], 64)
    assert replicated == REPLICATED
    # What every rank's layout digest is taken of, pinned too: a change in the encoding changes the digest.
    assert hashlib.sha256(replicated).hexdigest() == "578ab0458d9fc469b8a57b07e058d8ac10a07225a50504ba25b3f950992f0daf"
    private = layout.private_part({"$rng": {"torch": {"$T": 0}}}, [["t", "uint8", [16], 0, "cpu"]])
    assert layout.encode(step=7, rank=0, world=2, private=private, replicated=replicated) == GOLDEN
    # Another rank: no replicated description, its pieces of sharded state; and a description dcp.save wrote.
    pieces = layout.private_part({}, [], [[0, [4, 0], [4, 8], 64]])
    assert layout.encode(step=7, rank=1, world=2, private=pieces) == (
        b'{"format":1,"step":7,"rank":1,"world":2,"replicated":null,'
        b'"private":{"tree":{},"tensors":[],"pieces":[[0,[4,0],[4,8],64]]}}')
    assert layout.encode(step=3, rank=0, world=1, private=layout.private_part({}, []),
                         replicated=layout.replicated_part({}, [], 0), dcp={"format": 1, "items": []}) == (
        b'{"format":1,"step":3,"rank":0,"world":1,"replicated":{"tree":{},"tensors":[],"total":0},'
        b'"private":{"tree":{},"tensors":[]},"dcp":{"format":1,"items":[]}}')
    with pytest.raises(ValueError):  # never a NaN in a description (statetree tags them): not standard JSON
        layout.encode(step=1, rank=0, world=1, private=layout.private_part({"x": float("nan")}, []))


def test_a_golden_description_decodes():
    assert layout.decode(GOLDEN, "golden") == {
        "format": 1, "step": 7, "rank": 0, "world": 2,
        "replicated": {"tree": {"model": {"w": {"$T": 0}}}, "tensors": [["t", "float32", [2], 0, "cpu"]],
                       "total": 64},
        "private": {"tree": {"$rng": {"torch": {"$T": 0}}}, "tensors": [["t", "uint8", [16], 0, "cpu"]]}}


def _info(private: list[int], meta: list[int], rep_total: int) -> CheckpointInfo:
    world = len(private)
    shards = tuple(ShardHeader("j", 1, rank, world, rep_total, *layout.split(rep_total, rank, world),
                               private[rank], meta[rank], "0" * 64) for rank in range(world))
    return CheckpointInfo("j", 1, world, rep_total, "0" * 64, 0.0, shards)


def test_the_replicated_state_is_cut_and_an_image_laid_out_at_aligned_offsets():
    assert [layout.split(1000, r, 3) for r in range(3)] == [(0, 384), (384, 704), (704, 1000)]
    assert [layout.split(10, r, 4) for r in range(4)] == [(0, 10), (10, 10), (10, 10), (10, 10)]
    info = _info(private=[100, 0, 7], meta=[300, 30, 1], rep_total=1000)
    assert layout.image_tails(info) == ([1024, 1472, 1536], 1600)
    tails, size = layout.image_tails(info)
    image = bytearray(size)
    image[1536 + 7:1536 + 8] = b"{"  # saved rank 2's description, its one byte after its private part
    with pytest.raises(ProtocolError, match="saved rank 2's shard of j step 1: unreadable description"):
        layout.description_in(image, info, tails, 2)
    image[1472:1472 + 30] = b'{"format":2}'.ljust(30)  # saved rank 1's, where its tail begins (no private part)
    with pytest.raises(UsageError, match="saved rank 1's shard of j step 1 is in layout format 2"):
        layout.description_in(image, info, tails, 1)


@pytest.mark.parametrize("raw, refused, message", [
    (GOLDEN.replace(b'"format":1', b'"format":2'), UsageError, "layout format 2; this dashrun reads format 1"),
    (GOLDEN.replace(b'"format":1', b'"format":0'), UsageError, "layout format 0"),
    (GOLDEN.replace(b'"format":1', b'"format":true'), ProtocolError, "names no layout format"),
    (GOLDEN.replace(b'"format":1,', b""), ProtocolError, "names no layout format"),
    (b"[1, 2]", ProtocolError, "names no layout format"),
    (b'{"format":1', ProtocolError, "unreadable description"),
    (b"\xff", ProtocolError, "unreadable description"),
    (b'{"format":1,"private":' + b"[" * 3000 + b"]" * 3000 + b"}", ProtocolError, "deeper than 2048"),
    (GOLDEN.replace(b',"tensors":[["t","uint8",[16],0,"cpu"]]', b""), ProtocolError, "malformed description"),
    (GOLDEN.replace(b'"replicated":' + REPLICATED, b'"replicated":[]'), ProtocolError, "malformed description"),
])
def test_a_description_of_another_format_or_malformed_is_refused_with_one_line(raw, refused, message):
    with pytest.raises(refused, match=message) as caught:
        layout.decode(raw, "j step 7")
    assert "\n" not in str(caught.value)
    if refused is UsageError:
        newer = "format 2" in message
        assert caught.value.hint == ("it was written by a newer dashrun: upgrade dashrun to read it" if newer else
                                     "it was written by an older dashrun: read it with that version")


# --- every reader, on a checkpoint a newer dashrun wrote -------------------------------------------------------

NEWER = "layout format 2; this dashrun reads format 1"


def _saved_by_a_newer_dashrun(monkeypatch, save) -> None:
    """``save()`` runs as a dashrun whose layout is format 2 would: the real writers, writing format 2."""
    with monkeypatch.context() as newer:
        newer.setattr(layout, "FORMAT", 2)
        save()


def test_what_the_stager_writes_is_the_layout(stack, rank_env):
    memd, agent = stack
    model, opt, sched = trained_objects()
    save_world(rank_env, agent, "golden", 2, 6, model, opt, sched, [3, 4])
    with memd.client() as client:
        info = client.latest("golden")
        descriptions = []
        for shard in info.shards:
            raw = bytearray(shard.meta_len)
            client.get_shard_into("golden", 6, shard.rank, [memoryview(raw)],
                                  offset=shard.rep_end - shard.rep_start + shard.private_len)
            descriptions.append(bytes(raw))
    assert descriptions[0].startswith(b'{"format":1,"step":6,"rank":0,"world":2,"replicated":{"tree":{"model":')
    assert descriptions[1].startswith(b'{"format":1,"step":6,"rank":1,"world":2,"replicated":null,"private":')
    replicated = layout.decode(descriptions[0], "rank 0")["replicated"]
    assert info.layout == hashlib.sha256(layout.replicated_part(**replicated)).hexdigest()


def test_a_restore_from_the_node_image_refuses_a_newer_layout(stack, rank_env, monkeypatch):
    memd, agent = stack
    model, opt, sched = trained_objects()
    _saved_by_a_newer_dashrun(monkeypatch, lambda: save_world(rank_env, agent, "newer", 2, 6, model, opt, sched,
                                                              [3, 4]))
    model2, opt2, sched2 = fresh_objects()
    ckpt = rank_env(agent, "newer", 0, 2, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    try:
        with pytest.raises(UsageError, match=f"saved rank 0's shard of newer step 6 is in {NEWER}") as caught:
            ckpt.restore()
        assert "upgrade dashrun" in caught.value.hint
    finally:
        ckpt.close()


def test_a_direct_read_refuses_a_newer_layout_and_does_not_try_the_node_image(stack, rank_env, monkeypatch,
                                                                               caplog):
    memd, agent = stack
    model, opt, sched = trained_objects()
    _saved_by_a_newer_dashrun(monkeypatch, lambda: save_world(rank_env, agent, "newer-direct", 1, 2, model, opt,
                                                              sched, [0]))
    model2, opt2, sched2 = trained_objects(seed=99, steps=1)
    before = [t.clone() for t in model2.state_dict().values()]
    ckpt = rank_env(agent, "newer-direct", 0, 1, model=model2, optimizer=opt2, scheduler=sched2, data=Cursor())
    caplog.set_level(logging.WARNING)
    try:
        with pytest.raises(UsageError, match=NEWER):
            ckpt.restore()
    finally:
        ckpt.close()
    assert "from the node's image" not in caplog.text
    with memd.client() as client:
        info = client.latest("newer-direct")
    tails = sum(s.nbytes - (s.rep_end - s.rep_start) for s in info.shards)
    assert any(f"({tails} bytes from dash-memd)" in line for line in agent.log().splitlines())  # a direct read's
    assert all(torch.equal(a, b) for a, b in zip(before, model2.state_dict().values()))  # nothing was loaded


def _tls(memd) -> TlsSettings:
    return TlsSettings(plaintext=bool(memd.tls_args))


def test_dcp_load_and_export_refuse_a_newer_layout(memd, monkeypatch, tmp_path):
    state = {"model": {"weight": torch.arange(6.0)}}
    writer = ddcp.Writer("newer-dcp", memd.address, memd.token_file, tls=_tls(memd))
    _saved_by_a_newer_dashrun(monkeypatch, lambda: dcp.save(state, checkpoint_id=3, storage_writer=writer,
                                                            no_dist=True))
    writer.close()
    reader = ddcp.Reader("newer-dcp", memd=memd.address, token_file=memd.token_file, tls=_tls(memd))
    with pytest.raises(CheckpointException, match=f"newer-dcp step 3 is in {NEWER}"):
        dcp.load({"model": {"weight": torch.zeros(6)}}, storage_reader=reader, no_dist=True)
    reader.close()
    with memd.client() as client, pytest.raises(UsageError, match=NEWER):
        export.fetch_state(client, "newer-dcp", None)


def test_an_export_refuses_a_newer_layout_in_one_line(stack, rank_env, monkeypatch, tmp_path):
    memd, agent = stack
    model, opt, sched = trained_objects()
    _saved_by_a_newer_dashrun(monkeypatch, lambda: save_world(rank_env, agent, "newer-export", 2, 6, model, opt,
                                                              sched, [3, 4]))
    with memd.client() as client, pytest.raises(UsageError, match=f"saved rank 0's shard of newer-export step 6 "
                                                                  f"is in {NEWER}"):
        export.fetch_state(client, "newer-export", None)
    out = tmp_path / "out.pt"
    result = subprocess.run([sys.executable, "-m", "dashrun", "export", "--memd", memd.address, "--token-file",
                             str(memd.token_file), *memd.tls_args, "newer-export", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not out.exists(), result.stderr
    assert result.stderr.splitlines() == [
        f"dashrun: error: saved rank 0's shard of newer-export step 6 is in {NEWER}",
        "dashrun: hint: it was written by a newer dashrun: upgrade dashrun to read it"]
