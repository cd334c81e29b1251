"""The typed messages: between a rank and its agent, and the one notice type from the pollers to the ranks.

Their bodies are the JSON objects the frames carry (the same keys as before they
were typed, so the wire does not change); every field a peer sends is checked.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from dashrun.errors import AuthError, ProtocolError
from dashrun.wire.agent_messages import (
    Progress,
    RestoreReply,
    RestoreRequest,
    SnapshotReply,
    SnapshotRequest,
    WaitReply,
    WaitRequest,
)
from dashrun.wire.messages import CheckpointInfo, JobSpec, Notice, NoticeKind, ShardHeader

LAYOUT = "ab" * 32


def shard(rank=0, world=2, start=0, end=64, private=16, meta=10) -> ShardHeader:
    return ShardHeader("job-1", 7, rank, world, 128, start, end, private, meta, LAYOUT)


def info() -> CheckpointInfo:
    return CheckpointInfo("job-1", 7, 2, 128, LAYOUT, 1.7e9, (shard(0, 2, 0, 64), shard(1, 2, 64, 128)))


@pytest.mark.parametrize("message", [
    SnapshotRequest(shard(), ready=40, emergency=True, checksum=True),
    SnapshotRequest(shard(), ready=40, skipped=3, stall_s=0.25),
    SnapshotReply(committed=True, crc=0xDEADBEEF), SnapshotReply(committed=False),
    Progress(3, ready=90), Progress(3, ready=90, crc=17), Progress(4, failed=True),
    RestoreRequest("job-1", None, 8), RestoreRequest("job-1", 7, 1), RestoreRequest("job-1", 7, 4, first_rank=8),
    RestoreRequest("job-1", None, 1, 0, direct=True),
    RestoreReply(found=False), RestoreReply(found=True, checkpoint=info(), tails=(192, 320)),
    RestoreReply(found=True, checkpoint=info(), tails=(192, 320), direct=True),
    WaitRequest("job-1", 7, 30.0), WaitReply(committed=True),
])
def test_every_message_round_trips_through_its_body(message):
    assert type(message).from_body(message.to_body()) == message


def test_the_bodies_keep_the_keys_the_wire_carried_before_they_were_typed():
    assert SnapshotRequest(shard(), ready=0).to_body() == {"shard": shard().to_body(), "ready": 0,
                                                           "emergency": False, "checksum": False}
    assert Progress(5, ready=10, crc=1).to_body() == {"id": 5, "ready": 10, "crc": 1}
    assert Progress(5, failed=True).to_body() == {"id": 5, "failed": True}
    assert RestoreRequest("job-1", None, 2).to_body() == {"job": "job-1", "step": None, "local_ranks": 2,
                                                         "first_rank": None}
    assert WaitRequest("job-1", 7, 3.0).to_body() == {"job": "job-1", "step": 7, "timeout": 3.0}
    assert RestoreReply(found=False).to_body() == {"found": False}


@pytest.mark.parametrize("cls,body,nbytes", [
    (SnapshotRequest, {"shard": shard().to_body(), "ready": shard().nbytes + 1}, None),  # more ready than the shard
    (SnapshotRequest, {"shard": "not an object"}, None),
    (SnapshotRequest, {"shard": shard().to_body(), "emergency": 1}, None),  # a number is not a bool
    (SnapshotRequest, {"shard": shard().to_body(), "skipped": -1}, None),
    (SnapshotRequest, {"shard": shard().to_body(), "stall_s": 1e300}, None),
    (Progress, {"id": 1, "ready": 91}, 90),
    (Progress, {"id": -1, "ready": 1}, 90),
    (Progress, {"id": 1, "crc": 1 << 32}, 90),
    (RestoreRequest, {"job": "../etc", "step": None}, None),
    (RestoreRequest, {"job": "job-1", "local_ranks": 0}, None),
    (RestoreReply, {"found": True, "checkpoint": info().to_body(), "tails": [0]}, None),  # one tail per rank
    (RestoreReply, {"found": True, "checkpoint": info().to_body(), "tails": [0, True]}, None),
    (RestoreReply, {"found": True, "checkpoint": info().to_body(), "tails": [0, -1]}, None),
    (RestoreReply, {"found": True}, None),
    (RestoreRequest, {"job": "job-1", "direct": "yes"}, None),
    (WaitRequest, {"job": "job-1", "step": 7, "timeout": 1e9}, None),
    (WaitReply, {}, None),
])
def test_a_malformed_message_is_refused(cls, body, nbytes):
    with pytest.raises(ProtocolError):
        cls.from_body(body, nbytes) if nbytes is not None else cls.from_body(body)


def test_one_notice_type_from_the_pollers_to_the_ranks():
    seen = Notice("aws", "terminate", 1.7e9, id="i-1", detail={"action": "terminate"})
    stamped = Notice.from_body({**seen.to_body(), "node": "node-a"})
    # The wire carries what the ranks and dash-memd need; id and detail stay on the node.
    assert seen.to_body() == {"kind": "terminate", "cloud": "aws", "early": False, "deadline": 1.7e9, "node": ""}
    assert (stamped.kind, stamped.cloud, stamped.deadline, stamped.node) == (NoticeKind.TERMINATE, "aws", 1.7e9,
                                                                             "node-a")
    early = Notice("gcp", NoticeKind.MAINTENANCE, None, early_warning=True)
    assert early.severity < seen.severity and seen.outranks(early) and not early.outranks(seen)
    assert early.outranks(None) and not seen.outranks(stamped)


@pytest.mark.parametrize("body", [
    {"kind": "explode", "cloud": "aws", "early": False},
    {"kind": "terminate", "cloud": "oci", "early": False},
    {"kind": "terminate", "cloud": "aws", "early": "no"},
    {"kind": "terminate", "cloud": "aws", "early": False, "deadline": float("inf")},
    {"kind": "terminate", "cloud": "aws", "early": False, "node": "n" * 256},
])
def test_a_notice_a_peer_made_up_is_refused(body):
    with pytest.raises(ProtocolError):
        Notice.from_body(body)


def test_a_launch_spec_is_signed_for_its_job_by_the_operator_and_verified_after_a_round_trip():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    public = key.public_key()
    spec = JobSpec(("--nproc-per-node", "2", "train.py", "--lr", "3e-4"), "/work", "node-1", 1.7e9 + 0.123)
    signed = spec.signed("gpt-1", key)
    assert len(signed.signature) == 128 and not spec.signature
    again = JobSpec.from_body(json.loads(json.dumps(signed.to_body())))  # as stored on disk or in the bucket
    assert again == signed
    again.verify("gpt-1", public)
    with pytest.raises(AuthError, match="not signed"):  # stored before specs were signed
        JobSpec.from_body(spec.to_body()).verify("gpt-1", public)
    for forged in (signed.signed("gpt-1", other),                                    # another key (a node's)
                   dataclasses.replace(signed, argv=("train.py", "--evil")),          # the command changed
                   dataclasses.replace(signed, cwd="/tmp"),                            # the directory changed
                   dataclasses.replace(signed, created=signed.created + 1e-6)):
        with pytest.raises(AuthError, match="valid signature"):
            forged.verify("gpt-1", public)
    with pytest.raises(AuthError, match="valid signature"):  # another job's valid spec, copied over
        signed.verify("gpt-2", public)
    for signature in ("", "zz" * 64, "ab" * 63, 5):
        with pytest.raises(ProtocolError):
            JobSpec.from_body({**signed.to_body(), "signature": signature})
