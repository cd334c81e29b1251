"""Least authority: a job's credential reaches that job and nothing else; only the cluster's token launches
specs and deletes whole jobs; a launched job's agent and ranks never hold the token; a source guessing
tokens is slowed down and cannot push other hosts' logins out."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from test_hostile import IO_TIMEOUT, headers, read_back, store

from dashrun.errors import AuthError, BusyError, ForbiddenError, UsageError
from dashrun.memd.admission import FAILED_LOGIN_BURST, Admission, FailedLogins
from dashrun.wire.credentials import Credential, job_key
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import JobSpec, MembershipEvent, Notice, NoticeKind
from dashrun.wire.tls import TlsSettings


def job_credential(memd, job: str, out: Path) -> Path:
    """``dash-memd token --job JOB``, as the operator runs it."""
    made = subprocess.run([sys.executable, "-m", "dashrun.memd", "token", "--job", job, "--token-file",
                           str(memd.token_file), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert f"wrote job {job}'s credential to {out}" in made.stdout
    return out


def client_of(memd, credential: Path) -> MemdClient:
    return MemdClient(memd.host, memd.port, credential.read_bytes().strip(), timeout=IO_TIMEOUT,
                      tls=TlsSettings(plaintext=bool(memd.tls_args)))


def test_a_job_credential_is_derived_from_the_token_and_names_its_job(tmp_path):
    token = b"ab" * 32
    credential = Credential.parse(token).for_job("gpt-1")
    assert credential.job == "gpt-1" and credential.key == job_key(token, "gpt-1") != job_key(token, "gpt-2")
    assert Credential.parse(credential.file_bytes().strip()) == credential
    assert credential.for_job("gpt-1") is credential
    with pytest.raises(UsageError, match="holds the credential of job 'gpt-1', not of 'gpt-2'"):
        credential.for_job("gpt-2")
    for malformed in (b"dashrun-job-v1 gpt-1", b"dashrun-job-v1 ../x " + b"ab" * 32, b"dashrun-job-v1 j abcd",
                      b"dashrun-job-v1 j " + b"zz" * 32):
        with pytest.raises(UsageError, match="malformed job credential"):
            Credential.parse(malformed)


@pytest.mark.parametrize("mode", ["tls", "no-tls"])
def test_a_job_credential_is_refused_everything_of_another_job(memd_factory, tmp_path, mode):
    memd = memd_factory("--memory-limit", "64MiB", *(["--no-tls"] if mode == "no-tls" else []))
    with memd.client(timeout=IO_TIMEOUT) as operator:
        theirs = store(operator, "theirs", 1)
        operator.rendezvous_set("theirs", "run", b"round 0", None)
        operator.store_set("theirs", "key", b"value")
    path = job_credential(memd, "mine", tmp_path / "mine.credential")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().split()[:2] == ["dashrun-job-v1", "mine"]

    with client_of(memd, path) as rank:
        # Its own job: everything a rank and its launcher do.
        mine = store(rank, "mine", 1)
        assert read_back(rank, "mine", 1, 2) == mine
        rank.rendezvous_set("mine", "run", b"round 0", None)
        rank.store_set("mine", "key", b"v")
        assert rank.store_get("mine", "key", 1.0) == b"v"
        rank.notice("mine", Notice("aws", NoticeKind.TERMINATE, 1.7e9, id="i-1"))
        rank.record_membership("mine", MembershipEvent(1.7e9, "node-a", "joined", "", 1, 1))
        assert [j["job"] for j in rank.list()["jobs"]] == ["mine"]  # status shows its own job only
        # Another job's: read, write, delete, rendezvous, store, generation - each refused, the link kept.
        refused = {
            "latest": lambda: rank.latest("theirs"),
            "read": lambda: rank.get_shard_into("theirs", 1, 0, [memoryview(bytearray(len(theirs[0])))]),
            "write": lambda: rank.put_shard(headers("theirs", 2, world=1)[0], [bytes(headers("theirs", 2,
                                                                                             world=1)[0].nbytes)]),
            "delete": lambda: rank.delete("theirs", keep=1),
            "rendezvous": lambda: rank.rendezvous_get("theirs", "run"),
            "store": lambda: rank.store_get("theirs", "key", 0.0),
            "generation": lambda: rank.set_generation("theirs", 5),
            "spec": lambda: rank.get_spec("theirs"),
        }
        for name, request in refused.items():
            with pytest.raises(ForbiddenError, match="holds the credential of job mine, not of theirs"):
                request()
        # What only the operator may do, even for its own job.
        with pytest.raises(ForbiddenError, match="PUT_SPEC needs the cluster's token"):
            rank.put_spec("mine", JobSpec(("x.py",), "/", "node", 1.7e9))
        for keep in (0, 1):  # rm and gc: both purge the bucket too
            with pytest.raises(ForbiddenError, match="DELETE needs the cluster's token"):
                rank.delete("mine", keep=keep, force_live=True)
        assert rank.ping()  # still logged in: refusals keep the stream in step
    with memd.client(timeout=IO_TIMEOUT) as operator:
        assert read_back(operator, "theirs", 1, 2) == theirs  # untouched
        assert operator.generation("theirs") == 0
        assert sorted(j["job"] for j in operator.list()["jobs"]) == ["mine", "theirs"]
    assert memd.log().count("refused") >= len(refused) + 2


def test_a_credential_for_a_job_under_another_token_does_not_log_in(memd_factory, tmp_path):
    memd = memd_factory("--memory-limit", "64MiB")
    forged = tmp_path / "forged"
    forged.write_bytes(Credential.parse(b"cd" * 32).for_job("mine").file_bytes())
    forged.chmod(0o600)
    with client_of(memd, forged) as client:
        with pytest.raises(AuthError, match="does not hold the credential of job mine"):
            client.ping()


def test_dash_memd_token_makes_a_job_credential_only_from_the_cluster_token(memd, tmp_path):
    first = job_credential(memd, "a", tmp_path / "a")
    again = subprocess.run([sys.executable, "-m", "dashrun.memd", "token", "--job", "b", "--token-file", str(first),
                            "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "holds a job's credential, not the cluster's token" in again.stderr
    assert not (tmp_path / "b").exists()
    twice = subprocess.run([sys.executable, "-m", "dashrun.memd", "token", "--job", "a", "--token-file",
                            str(memd.token_file), "--out", str(first)], capture_output=True, text=True, timeout=60)
    assert twice.returncode == 2 and "exists already" in twice.stderr


RANK_PROBE = """
import json, os, sys
from dashrun.errors import ForbiddenError
from dashrun.wire.memd_client import memd_from_env
path = os.environ["DASH_TOKEN_FILE"]
seen = {"path": path, "words": open(path).read().split()[:2]}
with memd_from_env()() as client:
    try:
        client.latest("theirs")
        seen["theirs"] = "read"
    except ForbiddenError as e:
        seen["theirs"] = "forbidden"
    seen["mine"] = client.latest(os.environ["DASH_JOB_ID"]) is None
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.slow
def test_a_launched_job_s_agent_and_ranks_hold_its_credential_not_the_token(memd, tmp_path):
    with memd.client(timeout=IO_TIMEOUT) as operator:
        store(operator, "theirs", 1)
    probe, out = tmp_path / "probe.py", tmp_path / "out"
    probe.write_text(RANK_PROBE)
    out.mkdir()
    launched = subprocess.run([sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file",
                               str(memd.token_file), *memd.tls_args, "--job-id", "mine", "--nproc-per-node", "2",
                               str(probe), str(out)], capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["words"] == ["dashrun-job-v1", "mine"] and seen["path"] != str(memd.token_file)
        assert seen["theirs"] == "forbidden" and seen["mine"] is True
        assert not Path(seen["path"]).exists()  # removed with the launcher's end
    assert "no launch spec stored (no --operator-key)" in launched.stderr


@pytest.mark.slow
def test_a_launcher_with_a_job_credential_runs_that_job_only_and_cannot_start_it_over(memd, tmp_path):
    credential = job_credential(memd, "mine", tmp_path / "mine")
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    base = [sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(credential),
            *memd.tls_args, "--nproc-per-node", "1"]
    other = subprocess.run([*base, "--job-id", "theirs", str(script)], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2, other.stderr[-2000:]
    assert "the token file holds the credential of job 'mine', not of 'theirs'" in other.stderr
    fresh = subprocess.run([*base, "--job-id", "mine", "--fresh", str(script)], capture_output=True, text=True,
                           timeout=300)
    assert fresh.returncode == 2 and "--fresh deletes every checkpoint of mine" in fresh.stderr
    assert "Traceback" not in other.stderr + fresh.stderr
    ran = subprocess.run([*base, "--job-id", "mine", str(script)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "a job's credential cannot store one" in ran.stderr


# --- logins: per source, and failures -------------------------------------------------------


def _pair():
    a, b = socket.socketpair()
    b.close()
    return a


def test_one_source_cannot_push_out_the_logins_of_others():
    admission = Admission(max_authenticated=8, max_unauthenticated=8)  # 2 per source
    socks = [_pair() for _ in range(6)]
    try:
        other = admission.admit(socks[0], "10.0.0.2")
        flood = [admission.admit(sock, "10.0.0.9") for sock in socks[1:5]]
        assert [s.state.value for s in flood] == ["dropped", "dropped", "logging in", "logging in"]
        assert other.state.value == "logging in"  # another host's login is never the one dropped
        local = [admission.admit(_pair(), "127.0.0.1") for _ in range(4)]  # loopback: the host itself
        assert all(s.state.value == "logging in" for s in local)
        for slot in (other, *flood, *local):
            slot.release()
    finally:
        for sock in socks:
            sock.close()


def test_a_source_whose_logins_fail_is_slowed_down_and_earns_tries_back():
    now = [0.0]
    failures = FailedLogins(clock=lambda: now[0])
    for _ in range(FAILED_LOGIN_BURST):
        assert failures.allowed("10.0.0.9")
        failures.failed("10.0.0.9")
    assert not failures.allowed("10.0.0.9") and failures.allowed("10.0.0.2")
    now[0] += failures.period
    assert failures.allowed("10.0.0.9")  # one try more per period
    failures.failed("10.0.0.9")
    assert not failures.allowed("10.0.0.9")
    for _ in range(100):
        failures.failed("127.0.0.1")
    assert failures.allowed("127.0.0.1")
    admission = Admission(8, 8)
    admission.failed_logins = failures
    with pytest.raises(BusyError, match="too many failed logins"):
        admission.admit(_pair(), "10.0.0.9")
