"""What dashrun takes only from someone who holds the cluster's token, with real processes.

A token file that group or others may open is refused by every command that
reads one, as ssh refuses a private key others may read. A stored launch spec
runs only with a valid MAC under the token: write access to where dash-memd
keeps specs (its disk, the bucket) is not enough to make a node run a command.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Memd, kill_tree

from dashrun.errors import UsageError
from dashrun.memd.store.tiers.base import SPEC
from dashrun.util import tokens
from dashrun.util.tokens import read_token, write_token
from dashrun.wire.messages import JobSpec
from dashrun.wire.operator import SeenSpecs, load_private_key, write_key_pair


def resume(memd, job: str, *extra: str, cwd: Path) -> subprocess.Popen:
    """``dashrun resume`` of ``job`` against ``memd``, started (many run side by side: each takes a while to start)."""
    return subprocess.Popen([sys.executable, "-m", "dashrun", "resume", "--job-id", job, "--memd", memd.address,
                             "--token-file", str(memd.token_file), *memd.tls_args, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)


def finish(proc: subprocess.Popen) -> tuple[int | None, str, str]:
    """Exit code and output of a command expected to end by itself; None if it was still running after 30 s."""
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        return None, "", "still running after 30 s"
    return proc.returncode, out, err


def stop_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc)
        proc.communicate()


# --- the token file --------------------------------------------------------------------------


def test_a_token_file_group_or_others_may_open_is_refused_with_the_chmod_hint(tmp_path):
    path = tmp_path / "token"
    token = write_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_token(path) == token
    path.chmod(0o400)
    assert read_token(path) == token
    for mode in (0o640, 0o604, 0o620, 0o602, 0o610, 0o644, 0o660, 0o666, 0o777):
        path.chmod(mode)
        with pytest.raises(UsageError) as refused:
            read_token(path)
        assert refused.value.message == f"token file {path} is open to group or others (mode {mode:04o})"
        assert refused.value.hint == f"chmod 600 {path}"
    # A pipe (--token-file <(vault read ...)) holds the token in transit only: read as before.
    r, w = os.pipe()
    try:
        os.write(w, token + b"\n")
        os.close(w)
        assert read_token(f"/dev/fd/{r}") == token
    finally:
        os.close(r)


def test_every_command_refuses_a_token_file_others_may_read(tmp_path, short_tmp):
    """dash-memd, dash-agent and dashrun's commands (the launcher reads it with the same read_token, once it parsed
    torchrun's flags with torch's own parser: not started here, torch takes long to import)."""
    token = tmp_path / "token"
    write_token(token)
    token.chmod(0o644)
    py = sys.executable
    nowhere = ["--memd", "127.0.0.1:1", "--token-file", str(token)]
    commands = {
        "dash-memd": [py, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
                      "--token-file", str(token)],
        "dash-agent": [py, "-m", "dashrun.agent", *nowhere, "--socket", str(short_tmp / "a.sock")],
        "dashrun status": [py, "-m", "dashrun", "status", *nowhere],
        "dashrun resume": [py, "-m", "dashrun", "resume", "--job-id", "j", *nowhere, "--operator-pubkey",
                           str(write_key_pair(tmp_path / "operator"))],
    }
    running = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
               for name, cmd in commands.items()}
    try:
        for name, proc in running.items():
            code, _, err = finish(proc)
            assert code == 2, f"{name} exited {code}: {err[-2000:]}"
            assert f"token file {token} is open to group or others (mode 0644)" in err, (name, err)
            assert f"hint: chmod 600 {token}" in err, (name, err)
            assert "Traceback" not in err, (name, err)
    finally:
        stop_all(running.values())
    assert not (short_tmp / "a.sock").exists() and not (tmp_path / "d").exists()


# --- a weak token ----------------------------------------------------------------------------------


def private_token(path: Path, token: bytes) -> Path:
    path.write_bytes(token + b"\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize("token, why", [
    (b"0123456789abcdef0123", "20 characters of its alphabet hold 80 bits at best, fewer than 256"),
    (b"a" * 64, "it uses only 1 distinct characters"),
    (b"0123456789abcdef" * 4, "it repeats a block of 16 characters"),
], ids=["short", "one-character", "repeated"])
def test_a_weak_token_is_refused_unless_weak_token_ok_then_taken_with_one_warning(tmp_path, caplog, monkeypatch,
                                                                                  token, why):
    monkeypatch.setattr(tokens, "_warned", set())  # what this process warned about already
    monkeypatch.delenv("DASH_WEAK_TOKEN_OK", raising=False)
    path = private_token(tmp_path / "token", token)
    with pytest.raises(UsageError) as refused:
        read_token(path)
    assert refused.value.message == f"token in {path} is not 32 random bytes as 64 hex digits"
    assert "dash-memd token --out FILE" in refused.value.hint and "--weak-token-ok" in refused.value.hint
    monkeypatch.setenv("DASH_WEAK_TOKEN_OK", "1")
    with caplog.at_level(logging.WARNING, logger=tokens.__name__):
        assert read_token(path) == token
        assert read_token(path) == token  # every command and link reads it: one warning still
        assert read_token(path, warn=False) == token
    (warning,) = [r.getMessage() for r in caplog.records if r.name == tokens.__name__]
    assert f"the token in {path} is weak: {why}" in warning and "dash-memd token --out" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=tokens.__name__):
        assert read_token(path) == token  # not again
        strong = write_token(tmp_path / "strong")
        assert read_token(tmp_path / "strong") == strong and tokens.token_weakness(strong) is None
    assert not caplog.records


def test_dash_memd_and_dashrun_s_commands_refuse_a_weak_token_or_warn_of_it_at_start(tmp_path):
    token = private_token(tmp_path / "weak-token", b"0123456789abcdeffedcba9876543210")  # 128 bits
    refused = subprocess.run([sys.executable, "-m", "dashrun.memd", "start", "--listen", "127.0.0.1:0", "--data-dir",
                              str(tmp_path / "data"), "--token-file", str(token)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "is not 32 random bytes as 64 hex digits" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "data" / "LOCK").exists()
    memd = Memd(tmp_path / "data", token, "--weak-token-ok", log_path=tmp_path / "memd.log").start()
    try:
        assert memd.log().count("is weak: 32 characters of its alphabet hold 128 bits at best") == 1
        command = [sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file", str(token)]
        status = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert status.returncode == 2 and "is not 32 random bytes" in status.stderr
        status = subprocess.run(command, capture_output=True, text=True, timeout=60,
                                env={**os.environ, "DASH_WEAK_TOKEN_OK": "1"})
        assert status.returncode == 0, status.stderr[-2000:]
        assert status.stderr.count(f"the token in {token} is weak") == 1
    finally:
        memd.stop()


# --- the launch spec -----------------------------------------------------------------------------


def plant(data_dir: Path, job: str, body: dict) -> None:
    """Write a job's spec where dash-memd keeps it, as someone with write access to its disk (or the bucket)."""
    (data_dir / "jobs" / job).mkdir(parents=True, exist_ok=True)
    (data_dir / "jobs" / job / SPEC).write_text(json.dumps(body))


def resume_as_node(memd, job: str, *extra: str, cwd: Path, cache: Path) -> subprocess.Popen:
    """``dashrun resume`` as a replacement node runs it: with the operator's public key, and a state of its own."""
    return subprocess.Popen([sys.executable, "-m", "dashrun", "resume", "--job-id", job, "--memd", memd.address,
                             "--token-file", str(memd.token_file), "--operator-pubkey", str(memd.operator_pubkey),
                             *memd.tls_args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env={**os.environ, "XDG_CACHE_HOME": str(cache)})


@pytest.mark.slow
def test_resume_runs_only_a_spec_the_operator_signed(memd_factory, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "it-ran"
    script = work / "planted.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    argv = ("--nproc-per-node", "1", "--max-restarts", "0", str(script))

    memd = memd_factory("--memory-limit", "64MiB")
    operator = load_private_key(memd.operator_key)
    good = JobSpec(argv, str(work), "node-1", 1.7e9).signed("good", operator)
    with memd.client() as client:  # stored as the launcher stores it
        client.put_spec("good", good)
    memd.stop()
    write_key_pair(tmp_path / "node-key")  # a key pair of a node's own: not the operator's
    node_key = load_private_key(tmp_path / "node-key")
    plant(memd.data_dir, "unsigned", JobSpec(argv, str(work), "node-1", 1.7e9).to_body())  # as before specs were signed
    plant(memd.data_dir, "by-a-node", JobSpec(argv, str(work), "node-1", 1.7e9).signed("by-a-node",
                                                                                       node_key).to_body())
    plant(memd.data_dir, "tampered", {**good.to_body(), "argv": [*argv, "--evil"]})
    plant(memd.data_dir, "copied", good.to_body())  # a valid spec of another job
    memd = memd_factory("--memory-limit", "64MiB", data_dir=memd.data_dir)

    cache = tmp_path / "node-cache"
    refusals = {(job, extra): resume_as_node(memd, job, *extra, cwd=tmp_path, cache=cache) for job, extra in (
        ("unsigned", ()), ("by-a-node", ()), ("tampered", ()), ("copied", ()), ("unsigned", ("--dry-run",)))}
    dry_run = resume_as_node(memd, "good", "--dry-run", cwd=tmp_path, cache=cache)
    try:
        for (job, extra), proc in refusals.items():
            code, out, err = finish(proc)
            why = "is not signed by the operator" if job == "unsigned" else "does not carry a valid signature"
            assert code == 1, (job, extra, out, err[-2000:])
            assert f"the launch spec of job {job!r} {why}" in err, (job, err)
            assert "hint: " in err and "launch the job once more" in err
            assert "Traceback" not in err and out == ""
        code, out, err = finish(dry_run)
    finally:
        stop_all([*refusals.values(), dry_run])
    assert not marker.exists()

    # --dry-run of the good one: what would run, where, with which options and environment; nothing runs.
    assert code == 0, err[-2000:]
    lines = out.splitlines()
    assert lines[0].startswith("job good: launch spec stored from node-1 ") and "signed by the operator" in lines[0]
    assert lines[1:3] == [f"would run in {work}:", f"  dashrun --nproc-per-node 1 --max-restarts 0 {script}"]
    assert "job_id=good" in lines[3] and "fresh=False" in lines[3] and f"memd={memd.address}" in lines[3]
    assert "failure_domain=None" in lines[3]  # a stored --failure-domain named the node that launched the job
    assert lines[4].startswith("environment: this shell's")
    assert not marker.exists()


def test_resume_refuses_a_signed_spec_older_than_one_the_node_ran(memd, tmp_path):
    """A replay: the operator's own signature, on a spec the operator has since replaced."""
    operator = load_private_key(memd.operator_key)
    argv = ("--nproc-per-node", "1", "train.py")
    old = JobSpec(argv, str(tmp_path), "node-1", 1.7e9).signed("job", operator)
    new = JobSpec((*argv, "--lr", "1e-4"), str(tmp_path), "node-1", 1.7e9 + 60).signed("job", operator)
    cache = tmp_path / "node-cache"
    seen = SeenSpecs(cache / "dashrun" / "resumed")
    with memd.client() as client:
        client.put_spec("job", new)
        code, out, err = finish(resume_as_node(memd, "job", "--dry-run", cwd=tmp_path, cache=cache))
        assert code == 0 and "--lr 1e-4" in out, err
        assert seen.newest("job") is None  # a dry run remembers nothing
        seen.check("job", new.created)  # as a resume that ran it would have
        client.put_spec("job", old)  # someone with the token stores the old one again
        code, out, err = finish(resume_as_node(memd, "job", "--dry-run", cwd=tmp_path, cache=cache))
    assert code == 1 and out == "", err
    assert "the launch spec of job 'job' is older than one this node ran already (a replay)" in err
