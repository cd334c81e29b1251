"""The nodes' data caches served to each other by their dash-agents: real agents, dash-memd and a moto server on
loopback, each node with a cache directory of its own.

Node n1 reads a data set from the bucket; each object it fetched it gives a second copy to another node (n2),
whose agent caches it. The bucket then goes down and dash-memd keeps no data cache: a replacement node with an
empty cache reads every object from n1's and n2's agents, spread over both, and a planted copy is refused.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from conftest import wait_for

from dashrun.data.cache import Cache
from dashrun.data.files import CachedFiles
from dashrun.data.objects import check_summary
from dashrun.errors import AuthError, ChecksumError, ProtocolError
from dashrun.testing.s3 import S3Server, make_bucket, use_endpoint
from dashrun.wire.credentials import Credential, write_job_credential
from dashrun.wire.peer_client import PeerClient

JOB = "datapeers"


def node_env(node: str, tmp_path) -> dict:
    """A dash-agent's environment as node ``node`` of the job (replicas on: it serves the job's other nodes)."""
    return {"DASH_JOB_ID": JOB, "DASH_REPLICAS": "1", "DASH_PEER_PORT": "0", "DASH_PEER_MEMORY_LIMIT": "64MiB",
            "DASH_NODE": node, "DASH_DATA_CACHE": str(tmp_path / node)}


def as_rank_of(monkeypatch, memd, node: str, tmp_path) -> None:
    """This process's environment as a rank of ``node``, as dashrun's launcher sets it: the job's credential
    only, never the cluster's token."""
    credential_file = tmp_path / f"{node}.credential"
    if not credential_file.exists():
        write_job_credential(Credential.parse(memd.token).for_job(JOB), credential_file)
    monkeypatch.setenv("DASH_MEMD", memd.address)
    monkeypatch.setenv("DASH_TOKEN_FILE", str(credential_file))
    monkeypatch.setenv("DASH_JOB_ID", JOB)
    monkeypatch.setenv("DASH_NODE", node)
    if memd.tls_args:
        monkeypatch.setenv("DASH_NO_TLS", "1")


def served(memd) -> set[str]:
    with memd.client() as client:
        return {view.node for view in client.fleet_view(JOB)[2] if view.port}


def test_a_replacement_node_refills_from_its_peers_with_the_bucket_down(memd, agent_factory, tmp_path, monkeypatch):
    n1_agent = agent_factory(memd, env=node_env("n1", tmp_path))
    agent_factory(memd, env=node_env("n2", tmp_path))
    wait_for(lambda: served(memd) == {"n1", "n2"}, 30, "both nodes' agents in dash-memd's fleet view")
    server = S3Server(tmp_path / "moto.log").start()
    objects = {f"{i:02d}.bin": bytes([i]) * (3000 + i) for i in range(12)}
    try:
        use_endpoint(monkeypatch, server.endpoint, tmp_path)
        bucket = make_bucket(server)
        for key, body in objects.items():
            bucket.client.put_object(Bucket=bucket.name, Key=f"ds/{key}", Body=body)
        url = bucket.url("ds/")
        as_rank_of(monkeypatch, memd, "n1", tmp_path)
        with CachedFiles(url, cache_dir=tmp_path / "n1") as first:  # the peers and dash-memd as from_env finds them
            assert [name for name, _ in first._providers] == ["peer", "dash-memd"]
            assert {k: open(first.local_path(k), "rb").read() for k in first.keys()} == objects
            assert first.fetched == {"source": len(objects)}
            first._providers[0][1].flush()
            assert first._providers[0][1].offered == len(objects)  # n2 took a second copy of each
    finally:
        server.stop()  # the bucket unreachable from now on
    n2 = Cache(tmp_path / "n2")
    assert sorted(entry.key for entry in n2.entries()) == sorted(objects)
    # what each node caches, as its agent tells it
    shown = subprocess.run([sys.executable, "-m", "dashrun", "data", "status", "--job", JOB, "--json", "--memd",
                            memd.address, "--token-file", str(memd.token_file), *memd.tls_args],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    nodes = {node["node"]: node for node in json.loads(shown.stdout)["nodes"]}
    assert set(nodes) == {"n1", "n2"}
    assert {name: node["cache"] for name, node in nodes.items()} == {n: str(tmp_path / n) for n in ("n1", "n2")}
    total = sum(map(len, objects.values()))
    held = {"url": url, "objects": len(objects), "bytes": total}
    assert nodes["n1"]["sources"] == [{**held, "listed_objects": len(objects), "listed_bytes": total}]  # it listed
    assert nodes["n2"]["sources"] == [held]  # the second copies; the source was never listed there

    as_rank_of(monkeypatch, memd, "n3", tmp_path)  # a replacement node, its cache empty, dash-memd with no data cache
    with CachedFiles(url, cache_dir=tmp_path / "n3") as fresh:
        assert fresh.keys() == sorted(objects)
        assert {k: open(fresh.local_path(k), "rb").read() for k in fresh.keys()} == objects
        assert fresh.fetched == {"peer": len(objects)}
        asked = fresh._providers[0][1]
        first_asked = {asked.order(fresh.info(k).identity(url))[0][0] for k in fresh.keys()}
        assert first_asked == {"n1", "n2"}  # a refill's reads spread over the peers

    # n1 is taken away (kill -9): dash-memd lists it a few seconds more, and a node refilling meanwhile tries it
    # once, then reads everything from n2 alone
    n1_agent.kill()
    as_rank_of(monkeypatch, memd, "n4", tmp_path)
    with CachedFiles(url, cache_dir=tmp_path / "n4") as after:
        assert {k: open(after.local_path(k), "rb").read() for k in after.keys()} == objects
        assert after.fetched == {"peer": len(objects)}
        asked = after._providers[0][1]
        assert [p[0] for p in asked._unreachable] == ["n1"] and "n1" in served(memd)

    # a copy that is not the listed object (a wrong MD5 for its ETag) is refused by the node that is offered it
    credential = Credential.parse(memd.token).for_job(JOB)
    host, port = next((v.host, v.port) for v in _views(memd) if v.node == "n2")
    info = fresh.info("03.bin")
    Cache(tmp_path / "n2").clear()
    with PeerClient(host, port, credential) as client:
        forged = b"x" * info.size
        with pytest.raises(ChecksumError, match="MD5"):
            client.put_data_object(url, info.to_json(), hashlib.sha256(forged).hexdigest(), forged)
        assert client.data_object(url, info.to_json(), info.size) is None
        assert client.put_data_object(url, info.to_json(), hashlib.sha256(objects["03.bin"]).hexdigest(),
                                      objects["03.bin"])
        assert client.data_object(url, info.to_json(), info.size)[1] == objects["03.bin"]
    other_job = Credential.parse(memd.token).for_job("another-job")
    with PeerClient(host, port, other_job) as client, pytest.raises(AuthError):
        client.data_object(url, info.to_json(), info.size)  # another job's credential is refused at the login


def _views(memd):
    with memd.client() as client:
        return client.fleet_view(JOB)[2]


@pytest.mark.parametrize("body", [None, [], {"sources": {}}, {"cache": "c", "limit_bytes": 1, "used_bytes": 1,
                                                                "sources": [{"url": "u", "objects": 1}] * 257},
                                  {"cache": "c", "limit_bytes": -1, "used_bytes": 0, "sources": []},
                                  {"cache": "c", "limit_bytes": 1, "used_bytes": 0, "sources": ["s3://b/"]},
                                  {"cache": "c", "limit_bytes": 1, "used_bytes": 0,
                                   "sources": [{"url": "u" * 3000, "objects": 1, "bytes": 1}]}])
def test_a_peers_summary_of_its_cache_is_checked_before_it_is_shown(body):
    with pytest.raises(ProtocolError):
        check_summary(body)
