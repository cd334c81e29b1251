"""dashrun as a torchrun drop-in, and its job commands, with real processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TRAIN, dashrun_cmd

from dashrun.errors import UsageError
from dashrun.launch import cli, fanout, launcher
from dashrun.launch.checks import check_values
from dashrun.launch.options import build_parser, require_script

ENVDUMP = REPO / "tests" / "bin" / "envdump.py"


def run(cmd, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def dashrun(*args, **kwargs) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "dashrun", *args], **kwargs)


# --- torchrun parity -----------------------------------------------------------------


def _actions(parser):
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def test_every_torchrun_flag_is_accepted_with_the_same_meaning():
    from torch.distributed.run import get_args_parser

    theirs, ours = _actions(get_args_parser()), _actions(build_parser())
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"torchrun flags dashrun does not accept: {missing}"
    for dest, action in theirs.items():
        mine = ours[dest]
        assert set(action.option_strings) == set(mine.option_strings), dest   # both spellings
        for attribute in ("default", "nargs", "choices", "const", "required"):
            assert getattr(action, attribute) == getattr(mine, attribute), f"{dest}.{attribute}"
        assert getattr(action.type, "__qualname__", action.type) == getattr(mine.type, "__qualname__", mine.type)
        assert type(action) is type(mine), dest  # same action class: env twins (PET_*) behave the same
    own = sorted(set(ours) - set(theirs))
    assert own == ["agent_cpus", "cloud", "data_cache", "data_cache_limit", "failure_domain", "fresh", "hostfile",
                   "instance_type", "job_id", "log_format", "log_level", "market", "memd", "memd_wait",
                   "metadata_endpoint", "no_tls", "operator_key", "peer_memory_limit", "peer_port", "poll_interval",
                   "remote_python", "replicas", "ssh_config", "tls_ca", "tls_fingerprint", "token_file", "version",
                   "weak_token_ok"]


def test_pet_environment_twins_work_as_in_torchrun(monkeypatch):
    from torch.distributed.run import get_args_parser

    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    monkeypatch.setenv("DASH_JOB_ID", "from-env")
    theirs = get_args_parser().parse_args(["x.py"])
    ours = build_parser().parse_args(["x.py"])
    assert (ours.nproc_per_node, ours.max_restarts) == (theirs.nproc_per_node, theirs.max_restarts) == ("3", 4)
    assert ours.job_id == "from-env"


@pytest.mark.slow
def test_ranks_get_the_environment_torchrun_gives_them(tmp_path):
    torchrun_out, dashrun_out = tmp_path / "torchrun", tmp_path / "dashrun"
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    assert run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(ENVDUMP),
                str(torchrun_out)]).returncode == 0
    result = dashrun("--nproc-per-node", "2", "--job-id", "envdump", str(ENVDUMP), str(dashrun_out), env=cache)
    assert result.returncode == 0, result.stderr[-2000:]
    for rank in (0, 1):
        theirs = json.loads((torchrun_out / f"env-rank{rank}.json").read_text())
        mine = json.loads((dashrun_out / f"env-rank{rank}.json").read_text())
        torch_vars = {k for k in theirs if k not in os.environ or theirs[k] != os.environ[k]}
        assert torch_vars <= mine.keys(), sorted(torch_vars - mine.keys())
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
                     "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "MASTER_ADDR"):
            assert mine[name] == theirs[name], name
        assert mine["DASH_JOB_ID"] == "envdump" and Path(mine["DASH_AGENT_SOCKET"]).name == "agent.sock"
        # dash-memd (here the private one), its token and TLS, under the names dashrun.dcp.Reader() reads
        assert mine["DASH_MEMD"].rpartition(":")[2].isdigit() and Path(mine["DASH_TOKEN_FILE"]).is_absolute()
        assert mine.get("DASH_NO_TLS") == ("1" if os.environ.get("DASH_NO_TLS") == "1" else None)


# --- the private dash-memd ---------------------------------------------------------


@pytest.mark.slow
def test_without_memd_a_private_one_keeps_the_job_across_invocations(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = tmp_path / "out"
    cmd = ["--nproc-per-node", "2", str(TRAIN), "--steps", "20", "--interval", "5", "--out", str(out)]
    crashed = dashrun(*cmd, env={**env, "DASH_CRASH_AT": "rank.staging@rank=0,step=14"})
    assert crashed.returncode == 1
    resumed = dashrun(*cmd, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = [line for line in (out / "rank0.log").read_text().splitlines() if line.startswith("start")]
    assert starts == ["start 0", "start 10"]
    status = dashrun("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    assert len(jobs) == 1 and jobs[0]["job"].startswith("train-") and jobs[0]["newest"]["step"] == 19
    assert oct((tmp_path / "cache" / "dashrun" / "memd" / "token").stat().st_mode & 0o777) == "0o600"


def test_a_mistyped_command_is_named_with_the_one_meant(tmp_path):
    typo = dashrun("stauts", "--json", cwd=tmp_path)
    assert typo.returncode == 2 and typo.stderr.splitlines() == [
        "dashrun: error: 'stauts' is neither a dashrun command nor a script here",
        "dashrun: hint: did you mean: dashrun status --json"]
    (tmp_path / "stauts").write_text("")  # a script of that name is launched, not corrected
    assert "did you mean" not in dashrun("stauts", "--nproc-per-node", "x", cwd=tmp_path).stderr


def test_a_missing_script_or_program_stops_the_launch_in_one_line(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    missing = dashrun("--nproc-per-node", "2", "no_such_train.py", "--steps", "3", env=env, cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        f"dashrun: error: training script no_such_train.py not found (in {tmp_path})",
        "dashrun: hint: give its path, or -m for a module, as to torchrun"]
    assert not (tmp_path / "cache").exists()  # nothing started: no private dash-memd made its directory
    with pytest.raises(UsageError, match="program no-such-program-dashrun not found"):
        require_script(build_parser().parse_args(["--no-python", "no-such-program-dashrun"]))
    require_script(build_parser().parse_args(["--no-python", "true"]))
    require_script(build_parser().parse_args(["-m", "no_such_module"]))  # the ranks' path may have it


#: A bad value of each option that takes one, torchrun's and dashrun's, and how the error line begins. The
#: command runs in a directory with train.py, a token file "token" and a two-host hostfile "hosts".
MEMD = ["--memd", "127.0.0.1:7070", "--token-file", "token"]
HOSTS = ["--hostfile", "hosts", *MEMD]
BAD_VALUES = [
    # torchrun's
    (["--nnodes", "x"], "--nnodes 'x' is not N or MIN:MAX"),
    (["--nnodes", "3:1"], "--nnodes '3:1' is not N or MIN:MAX"),
    (["--nnodes", "0"], "--nnodes '0' is not N or MIN:MAX"),
    (["--nnodes", "1:2:3"], "--nnodes '1:2:3' is not N or MIN:MAX"),
    (["--nproc-per-node", "two"], "--nproc-per-node 'two' is not a number of ranks"),
    (["--nproc-per-node", "0"], "--nproc-per-node '0' is not a number of ranks"),
    (["--rdzv-backend", "carrier-pigeon"], "--rdzv-backend 'carrier-pigeon' is not a rendezvous backend"),
    (["--rdzv-endpoint", "host:port"], "--rdzv-endpoint 'host:port' is not a host name or address"),
    (["--rdzv-conf", "garbage"], "--rdzv-conf 'garbage': 'garbage' is not KEY=VALUE"),
    (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf 'join_timeout=soon': join_timeout is 'soon'"),
    (["--rdzv-conf", "is_host=maybe"], "--rdzv-conf 'is_host=maybe': is_host is 'maybe', not a boolean"),
    (["--max-restarts", "-1"], "--max-restarts -1 is not a whole number >= 0"),
    (["--max-restarts", "x"], "argument --max-restarts/--max_restarts: invalid int value: 'x'"),
    (["--monitor-interval", "abc"], "argument --monitor-interval/--monitor_interval: invalid float value"),
    (["--monitor-interval", "-1"], "--monitor-interval -1.0 is not a number of seconds"),
    (["--start-method", "thread"], "argument --start-method/--start_method: invalid choice"),
    (["--event-log-handler", "nope"], "--event-log-handler 'nope' is not an event handler"),
    (["-m", "--no-python"], "-m and --no-python exclude each other"),
    (["--log-dir", "/dev/null/logs"], "--log-dir '/dev/null/logs' cannot be made in /dev/null"),
    (["--log-dir", "token"], "--log-dir 'token' is not a directory"),
    (["--redirects", "9"], "--redirects '9' is not a stream mask"),
    (["--tee", "x"], "--tee 'x' is not a stream mask"),
    (["--local-ranks-filter", "0,one"], "--local-ranks-filter '0,one' is not a list of local ranks"),
    (["--node-rank", "-1"], "--node-rank -1 is not a whole number >= 0"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 is not below the number of nodes (2)"),
    (["--master-addr", "no such host"], "--master-addr 'no such host' is not a host name or address"),
    (["--master-port", "70000"], "--master-port 70000 is not a whole number from 0 to 65535"),
    (["--logs-specs", "nope"], "--logs-specs 'nope' names no installed"),
    (["--numa-binding", "nope"], "argument --numa-binding/--numa_binding: invalid choice"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE"], "--signals-to-handle 'SIGTERM,SIGNOPE': 'SIGNOPE' is not a signal"),
    (["--signals-to-handle", "SIGKILL"], "--signals-to-handle 'SIGKILL': 'SIGKILL' is not a signal"),
    (["--shutdown-timeout", "-5"], "--shutdown-timeout -5 is not a whole number >= 0"),
    # dashrun's
    (["--memd", "host:port", "--token-file", "token"], "--memd 'host:port' has an invalid port"),
    (["--memd", "127.0.0.1:7070"], "--memd needs --token-file"),
    (["--memd", "127.0.0.1:7070", "--token-file", "no-such-token"], "cannot read token file no-such-token"),
    (["--job-id", "../up"], "--job-id '../up' is not a valid job id"),
    (["--job-id", ""], "--job-id is empty"),
    (["--operator-key", "no-such-key"], "cannot read --operator-key no-such-key"),
    (["--operator-key", "hosts"], "operator key hosts is open to group or others"),
    (["--cloud", "moon"], "argument --cloud: invalid choice: 'moon'"),
    (["--metadata-endpoint", "ftp://169.254.169.254"], "--metadata-endpoint 'ftp://169.254.169.254' is not an"),
    (["--metadata-endpoint", "http://169.254.169.254:99999"], "--metadata-endpoint 'http://169.254.169.254:99999'"),
    (["--poll-interval", "soon"], "argument --poll-interval/--poll_interval: invalid float value: 'soon'"),
    (["--poll-interval", "-1"], "--poll-interval -1.0 is not a number of seconds"),
    (["--failure-domain", "us east"], "--failure-domain 'us east' is not ZONE or ZONE/POOL"),
    (["--failure-domain", "a/b/c"], "--failure-domain 'a/b/c' is not ZONE or ZONE/POOL"),
    (["--instance-type", "g5 big"], "--instance-type 'g5 big' is not an instance type"),
    (["--market", "cheap"], "argument --market: invalid choice: 'cheap'"),
    (["--replicas", "1"], "--replicas 1 needs 1 other nodes to hold each node's copies, and --nnodes 1:1 gives a "
                          "node 0 others at most"),
    (["--replicas", "2", "--nnodes", "1:2", *MEMD], "--replicas 2 needs 2 other nodes to hold each node's copies, and "
                                                    "--nnodes 1:2 gives a node 1 other at most"),
    (["--replicas", "-1"], "--replicas -1 is not a whole number >= 0"),
    (["--peer-port", "70000"], "--peer-port 70000 is not a whole number from 0 to 65535"),
    (["--peer-memory-limit", "lots"], "--peer-memory-limit: not a size: 'lots'"),
    (["--peer-memory-limit", "1PiB"], "--peer-memory-limit 1PiB is more than this node's"),
    (["--memd-wait", "-1", *MEMD], "--memd-wait -1.0 is not a number of seconds"),
    (["--agent-cpus", "many"], "--agent-cpus 'many'"),
    (["--tls-ca", "no-such-ca.pem"], "cannot load --tls-ca"),
    (["--tls-ca", "token"], "cannot load --tls-ca"),  # not PEM certificates
    (["--tls-ca", "token", "--no-tls"], "--tls-ca and --no-tls exclude each other"),
    (["--tls-fingerprint", "SHA256:nope"], "--tls-fingerprint 'SHA256:nope' is not a SHA-256 fingerprint"),
    (["--tls-fingerprint", "AB:CD"], "--tls-fingerprint 'AB:CD' is not a SHA-256 fingerprint"),
    (["--tls-fingerprint", "SHA256:" + "A" * 43, "--no-tls"], "--tls-fingerprint and --no-tls exclude each other"),
    (["--hostfile", "no-such-hosts", *MEMD], "cannot read hostfile no-such-hosts"),
    # through the SSH fan-out, which decides some of these for every host itself
    ([*HOSTS, "--nnodes", "x"], "--nnodes 'x' is not N or MIN:MAX"),
    ([*HOSTS, "--nnodes", "3:1"], "--nnodes '3:1' is not N or MIN:MAX"),
    ([*HOSTS, "--max-restarts", "-1"], "--max-restarts -1 is not a whole number >= 0"),
    ([*HOSTS, "--rdzv-conf", "garbage"], "--rdzv-conf 'garbage': 'garbage' is not KEY=VALUE"),
    ([*HOSTS, "--memd", "host:port"], "--memd 'host:port' has an invalid port"),
    ([*HOSTS, "--tls-fingerprint", "SHA256:nope"], "--tls-fingerprint 'SHA256:nope' is not a SHA-256"),
    ([*HOSTS, "--failure-domain", "zone/"], "--failure-domain 'zone/' is not ZONE or ZONE/POOL"),
    ([*HOSTS, "--ssh-config", "no-such-config"], "cannot read ssh config"),
]


@pytest.fixture
def launch_dir(tmp_path, token_file, monkeypatch):
    """A directory with train.py, a token file and a hostfile, as the working directory; no DASH_*/PET_* variable
    set (each is an option's twin)."""
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    assert token_file == tmp_path / "token"
    for name in list(os.environ):
        if name.startswith(("DASH_", "PET_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("options, begins", BAD_VALUES, ids=[" ".join(o) for o, _ in BAD_VALUES])
def test_a_bad_value_of_any_option_is_one_line_and_exit_2_before_anything_starts(options, begins, launch_dir,
                                                                                monkeypatch, capsys):
    started = []
    monkeypatch.setattr(launcher, "run", started.append)
    monkeypatch.setattr(fanout, "run", started.append)
    with pytest.raises(SystemExit) as exited:  # anything else escaping main() would be a traceback
        cli.main([*options, "train.py", "--steps", "3"])
    err = capsys.readouterr().err
    assert (exited.value.code, started) == (2, []), err
    error, hint = err.splitlines()  # the error in one line, and what to do about it
    assert error.startswith(f"dashrun: error: {begins}"), error
    assert hint.startswith("dashrun: hint: ") and len(hint) > len("dashrun: hint: "), hint


@pytest.mark.parametrize("options", [["--nnodes", "3:1"], ["--max-restarts", "x"]], ids=" ".join)
def test_a_bad_value_stops_the_dashrun_command_in_one_line(options, launch_dir):
    """The command itself, as a user runs it: exit 2 and the two lines, no traceback, nothing started."""
    result = dashrun(*options, "train.py", env={"XDG_CACHE_HOME": str(launch_dir / "cache")}, cwd=launch_dir)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert [line.split(":")[:2] for line in result.stderr.splitlines()] == [["dashrun", " error"],
                                                                             ["dashrun", " hint"]], result.stderr
    assert not (launch_dir / "cache").exists()  # no private dash-memd made its directory


def test_a_launch_that_cannot_reach_dash_memd_says_how_long_it_keeps_trying(launch_dir):
    """One line that says for how long more, not one every 2 s; then the error, with what to do."""
    with socket.socket() as probe:  # a port nothing listens on once it is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = dashrun("--memd", f"127.0.0.1:{port}", "--token-file", "token", "--memd-wait", "3",
                     "--nproc-per-node", "1", "train.py", cwd=launch_dir, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    waits = [line for line in result.stderr.splitlines() if "retrying" in line]
    assert len(waits) == 1 and waits[0].endswith("; retrying for 3 s more"), result.stderr[-3000:]
    assert f"127.0.0.1:{port}" in waits[0]
    assert result.stderr.splitlines()[-1] == "dashrun: hint: start dash-memd first, or check --memd and the network"


def test_a_failed_rank_is_reported_by_what_it_said(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from dashrun.launch.launcher import _report_child_failure

    said = tmp_path / "error.json"
    said.write_text(json.dumps({"message": {"message": "ValueError: bad batch\n", "extraInfo": {"timestamp": "1"}}}))
    failures = {0: ProcessFailure(0, 100, 1, str(said)), 1: ProcessFailure(1, 101, -15, str(tmp_path / "none"))}
    failures[1].timestamp = failures[0].timestamp + 5  # killed well after rank 0 raised
    _report_child_failure(ChildFailedError("train.py", failures))
    assert capsys.readouterr().err.splitlines() == [
        "dashrun: error: rank 0 failed first (exit code 1): ValueError: bad batch",
        "dashrun: rank 1 failed after it"]
    # No error file (sys.exit(2), or a Python that could not open the script): torch's message is a link only.
    _report_child_failure(ChildFailedError("train.py", {3: ProcessFailure(3, 103, 2, str(tmp_path / "none"))}))
    assert capsys.readouterr().err.splitlines() == [
        "dashrun: error: rank 3 failed first (exit code 2): see its output above"]
    silent = {r: ProcessFailure(r, 110 + r, -9, str(tmp_path / "none")) for r in (0, 1, 2)}
    _report_child_failure(ChildFailedError("train.py", silent))
    assert capsys.readouterr().err.splitlines()[1] == "dashrun: ranks 1, 2 failed after it"


# --- commands against a shared dash-memd --------------------------------------------


@pytest.fixture
def finished_job(memd, tmp_path):
    """A 2-rank job of 10 steps checkpointed at steps 4 and 9; its final state is step 9's."""
    out = tmp_path / "job-out"
    result = run(dashrun_cmd(memd, str(TRAIN), "--steps", "10", "--interval", "5", "--out", str(out), job="cli"))
    assert result.returncode == 0, result.stderr[-3000:]
    return memd, out


def memd_args(memd) -> list[str]:
    return ["--memd", memd.address, "--token-file", str(memd.token_file)]


@pytest.mark.slow
def test_status_and_ls(finished_job):
    memd, _ = finished_job
    status = dashrun("status", *memd_args(memd), "--json")
    assert status.returncode == 0, status.stderr
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["job"] == "cli" and job["newest"]["step"] == 9 and job["newest"]["world"] == 2
    assert "ram" in job["newest"]["tiers"] and len(job["nodes"]) == 1
    assert job["spec"]["argv"][-1].endswith("job-out")
    listing = dashrun("ls", "cli", *memd_args(memd), "--json")
    assert [c["step"] for c in json.loads(listing.stdout)["checkpoints"]] == [4, 9]
    table = dashrun("status", *memd_args(memd))
    assert table.returncode == 0 and "cli" in table.stdout
    missing = dashrun("ls", "nope", *memd_args(memd))
    assert missing.returncode == 1 and "knows no job" in missing.stderr
    jobs = dashrun("ls", *memd_args(memd), "--json")
    assert jobs.returncode == 0, jobs.stderr
    assert json.loads(jobs.stdout)["jobs"] == [{"job": "cli", "checkpoints": 2, "newest_step": 9}]
    plain = dashrun("ls", *memd_args(memd))
    assert plain.returncode == 0 and "cli" in plain.stdout and "9" in plain.stdout


@pytest.mark.slow
def test_status_says_a_finished_job_finished_and_a_failing_one_failed(memd, tmp_path):
    """The launcher records how each launch ended in dash-memd's membership history; status reads it."""
    job = "a-job-id-long-enough-to-be-cut-in-a-narrow-table-0123456789"
    done = run(dashrun_cmd(memd, str(TRAIN), "--steps", "10", "--interval", "5", "--out", str(tmp_path / "a"),
                           job=job))
    assert done.returncode == 0, done.stderr[-3000:]
    failing = run(dashrun_cmd(memd, str(TRAIN), "--steps", "20", "--interval", "5", "--out", str(tmp_path / "b"),
                              "--delay", "0.1", job="crashes"),  # time per step: the checkpoint of step 14 is due
                  env={"DASH_CRASH_AT": "rank.staging@rank=1,step=14"})
    assert failing.returncode == 1, failing.stderr[-3000:]
    status = dashrun("status", *memd_args(memd), "--json")
    assert status.returncode == 0, status.stderr
    jobs = {j["job"]: j for j in json.loads(status.stdout)["jobs"]}
    assert (jobs[job]["state"], jobs["crashes"]["state"]) == ("finished", "failed")
    assert jobs[job]["restarts"] == 0 and jobs[job]["steps_per_second"] > 0
    one = json.loads(dashrun("status", job, *memd_args(memd), "--json").stdout)
    assert [e["change"] for e in one["membership"]] == ["joined", "finished"] and one["membership"][-1]["step"] == 9
    history = dashrun("status", "crashes", *memd_args(memd))
    assert history.returncode == 0 and "failed" in history.stdout and "exit code 1" in history.stdout
    for columns in ("60", "200"):  # the job id whole, however narrow the terminal: the other columns wrap
        table = dashrun("status", *memd_args(memd), env={"COLUMNS": columns})
        assert table.returncode == 0 and job in table.stdout and "finished" in table.stdout, table.stdout
    wide = dashrun("status", *memd_args(memd), "--wide", env={"COLUMNS": "60"})
    assert wide.returncode == 0 and job in wide.stdout
    assert any("last notice" in line and "restarts" in line for line in wide.stdout.splitlines()), wide.stdout
    relaunched = run(dashrun_cmd(memd, str(TRAIN), "--steps", "20", "--interval", "5", "--out", str(tmp_path / "b"),
                                 job="crashes"))
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    again = {j["job"]: j for j in json.loads(dashrun("status", *memd_args(memd), "--json").stdout)["jobs"]}
    assert (again["crashes"]["state"], again["crashes"]["restarts"]) == ("finished", 1)


@pytest.mark.parametrize("command", [["status", ""], ["ls", ""], ["rm", "", "--yes"], ["gc", "", "--keep", "1"],
                                     ["export", "", "out.pt"], ["resume", ""], ["resume", "--job-id", ""]],
                         ids=" ".join)
def test_an_empty_job_id_is_a_usage_error(command, tmp_path):
    result = dashrun(*command, "--memd", "127.0.0.1:1", "--token-file", "token", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "the job id is empty" in result.stderr.splitlines()[-1] and "Traceback" not in result.stderr


def test_an_empty_job_id_stops_a_launch(tmp_path):
    result = dashrun("--job-id", "", "--nproc-per-node", "1", str(TRAIN), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.splitlines()[0] == "dashrun: error: --job-id is empty"


def _strip_ddp(state: dict) -> dict:
    return {k.removeprefix("module."): v for k, v in state.items()}


@pytest.mark.slow
def test_export_reads_back_with_plain_torch_and_dcp(finished_job, tmp_path):
    import torch.distributed.checkpoint as dcp

    memd, out = finished_job
    final = {rank: torch.load(out / f"final-rank{rank}.pt", weights_only=False) for rank in (0, 1)}
    exported = tmp_path / "step9.pt"
    result = dashrun("export", "cli", str(exported), "--format", "torch", *memd_args(memd))
    assert result.returncode == 0, result.stderr
    state = torch.load(exported)  # weights_only: no pickle of arbitrary objects needed
    assert state["dashrun"] == {"job": "cli", "step": 9, "world": 2}
    for key, tensor in _strip_ddp(state["model"]).items():
        assert torch.equal(tensor, final[0]["model"][key]), key
    for index, per_param in final[0]["optimizer"]["state"].items():
        for name, value in per_param.items():
            assert torch.equal(state["optimizer"]["state"][index][name], value)
    assert state["scheduler"] == final[0]["scheduler"]
    for rank in (0, 1):
        assert state["per_rank"][str(rank)]["data"] == final[rank]["cursor"]
        assert torch.equal(state["per_rank"][str(rank)]["$rng"]["torch"], final[rank]["rng"])

    directory = tmp_path / "step9.dcp"
    result = dashrun("export", "cli", str(directory), "--format", "dcp", "--step", "9", *memd_args(memd))
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr  # one process writes it, as the user asked
    template = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
                "optimizer": {"state": {i: {n: torch.zeros_like(v) for n, v in s.items()}
                                        for i, s in state["optimizer"]["state"].items()}}}
    dcp.load(template, checkpoint_id=str(directory), no_dist=True)
    for key, tensor in state["model"].items():
        assert torch.equal(template["model"][key], tensor), key
    for index, per_param in state["optimizer"]["state"].items():
        for name, value in per_param.items():
            assert torch.equal(template["optimizer"]["state"][index][name], value)

    again = dashrun("export", "cli", str(exported), *memd_args(memd))
    assert again.returncode == 2 and "never overwrites" in again.stderr
    older = dashrun("export", "cli", str(tmp_path / "old.pt"), "--step", "3", *memd_args(memd))
    assert older.returncode == 1 and "no committed checkpoint of step 3" in older.stderr


@pytest.mark.slow
def test_gc_and_rm(finished_job):
    memd, _ = finished_job
    assert dashrun("gc", "cli", "--keep", "1", *memd_args(memd)).returncode == 0
    listing = json.loads(dashrun("ls", "cli", *memd_args(memd), "--json").stdout)
    assert [c["step"] for c in listing["checkpoints"]] == [9]
    assert dashrun("rm", "cli", *memd_args(memd)).returncode == 0
    assert json.loads(dashrun("status", *memd_args(memd), "--json").stdout)["jobs"] == []
    assert not (memd.data_dir / "jobs" / "cli" / "0000000000000009").exists()
    gone = dashrun("resume", "--job-id", "cli", *memd_args(memd), "--operator-pubkey", str(memd.operator_pubkey))
    assert gone.returncode == 1 and "no launch spec" in gone.stderr


def test_rm_of_a_job_that_does_not_exist_says_so_in_one_line(memd):
    result = dashrun("rm", "nope", "--yes", *memd_args(memd))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == ["dashrun: error: dash-memd knows no job 'nope': nothing to remove",
                                          "dashrun: hint: see the jobs with: dashrun ls"]


@pytest.mark.slow
def test_rm_asks_on_a_terminal_and_yes_skips_the_question(finished_job):
    memd, _ = finished_job
    controller, terminal = os.openpty()
    try:
        asked = subprocess.Popen([sys.executable, "-m", "dashrun", "rm", "cli", *memd_args(memd)], stdin=terminal,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(controller, b"n\n")
        out, err = asked.communicate(timeout=120)
    finally:
        os.close(controller)
        os.close(terminal)
    assert asked.returncode == 1 and "delete every checkpoint of cli?" in out, (out, err)
    assert [j["job"] for j in json.loads(dashrun("status", *memd_args(memd), "--json").stdout)["jobs"]] == ["cli"]
    controller, terminal = os.openpty()
    try:
        yes = subprocess.run([sys.executable, "-m", "dashrun", "rm", "cli", "--yes", *memd_args(memd)],
                             stdin=terminal, capture_output=True, text=True, timeout=120)
    finally:
        os.close(controller)
        os.close(terminal)
    assert yes.returncode == 0 and "?" not in yes.stdout and "removed cli (2 checkpoints)" in yes.stdout, yes
    assert json.loads(dashrun("status", *memd_args(memd), "--json").stdout)["jobs"] == []


@pytest.mark.slow
def test_resume_relaunches_the_stored_spec_from_another_directory(memd, tmp_path):
    workdir, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    workdir.mkdir()
    elsewhere.mkdir()
    shutil.copy(TRAIN, workdir / "train.py")
    launch = [sys.executable, "-m", "dashrun", *memd_args(memd), "--operator-key", str(memd.operator_key),
              "--job-id", "spec", "--nproc-per-node", "2",
              "train.py", "--steps", "20", "--interval", "5", "--out", "out"]  # all relative to workdir
    # a little time per step, so the snapshot of step 14 (where rank 1 crashes) is not skipped on a loaded machine
    crashing = [*launch, "--delay", "0.05"]
    crashed = run(crashing, cwd=workdir, env={"DASH_CRASH_AT": "rank.staging@rank=1,step=14"})
    assert crashed.returncode == 1
    resumed = dashrun("resume", "spec", *memd_args(memd), "--operator-pubkey", str(memd.operator_pubkey),
                      cwd=elsewhere, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = [line for line in (workdir / "out" / "rank1.log").read_text().splitlines() if line.startswith("start")]
    assert starts == ["start 0", "start 10"]


@pytest.mark.slow
def test_fresh_starts_over(finished_job):
    memd, out = finished_job
    result = run(dashrun_cmd(memd, "--fresh", str(TRAIN), "--steps", "3", "--interval", "5", "--out", str(out),
                             job="cli"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "rank0.log").read_text().splitlines().count("start 0") == 2
    listing = json.loads(dashrun("ls", "cli", *memd_args(memd), "--json").stdout)
    assert listing["checkpoints"] == []


def test_the_failure_domain_reaches_dash_agent_and_its_env_twin_works(launch_dir, monkeypatch):
    from dashrun.launch.options import options_from_args
    from dashrun.wire.domain import FailureDomain

    def agent_command(*options: str) -> list[str]:
        args = build_parser().parse_args(["--memd", "127.0.0.1:7070", "--token-file", "token", *options, "train.py"])
        agent = launcher.AgentProcess(options_from_args(args))
        try:
            return agent.command(listen_fd=5)
        finally:
            shutil.rmtree(agent.socket_path.parent)

    command = agent_command("--failure-domain", "us-east-1a/g5.12xlarge:spot")
    assert command[command.index("--failure-domain") + 1] == "us-east-1a/g5.12xlarge:spot"
    assert "--failure-domain" not in agent_command()  # dash-agent reads it from the metadata service
    monkeypatch.setenv("DASH_FAILURE_DOMAIN", "rack-3")
    command = agent_command()
    assert command[command.index("--failure-domain") + 1] == "rack-3"
    args = build_parser().parse_args(["--failure-domain", "z/p:on-demand", "train.py"])
    assert options_from_args(args).failure_domain == FailureDomain("z", "p:on-demand", "on-demand")
    command = agent_command("--instance-type", "g5.xlarge", "--market", "on-demand")
    assert command[command.index("--instance-type") + 1:command.index("--instance-type") + 4] == [
        "g5.xlarge", "--market", "on-demand"]
    assert "--instance-type" not in agent_command() and "--market" not in agent_command()
    monkeypatch.setenv("DASH_MARKET", "spot")
    command = agent_command()
    assert command[command.index("--market") + 1] == "spot"
    monkeypatch.setenv("DASH_MARKET", "cheap")  # an env twin's value is checked as the option's is
    with pytest.raises(UsageError, match="--market 'cheap' is not one of spot, on-demand"):
        check_values(build_parser().parse_args(["train.py"]))


def test_replicas_default_to_one_on_two_nodes_and_reach_dash_agent_with_the_peer_options(launch_dir, monkeypatch):
    from dashrun.launch.options import options_from_args

    def agent_command(*options: str) -> list[str]:
        args = build_parser().parse_args(["--memd", "127.0.0.1:7070", "--token-file", "token", *options, "train.py"])
        agent = launcher.AgentProcess(options_from_args(args))
        try:
            command = agent.command(listen_fd=5)
        finally:
            shutil.rmtree(agent.socket_path.parent)
        return command

    def value(command: list[str], option: str) -> str | None:
        return command[command.index(option) + 1] if option in command else None

    assert value(agent_command(), "--replicas") == "0"  # one node: no other holds a copy
    assert value(agent_command("--nnodes", "1:4"), "--replicas") == "1"
    command = agent_command("--nnodes", "3", "--replicas", "2", "--peer-port", "0", "--peer-memory-limit", "2GiB")
    assert [value(command, o) for o in ("--replicas", "--peer-port", "--peer-memory-limit")] == ["2", "0", "2GiB"]
    monkeypatch.setenv("DASH_REPLICAS", "0")
    assert value(agent_command("--nnodes", "2"), "--replicas") == "0"


def test_dash_agent_refuses_a_bad_failure_domain_in_one_line(tmp_path, token_file):
    result = run([sys.executable, "-m", "dashrun.agent", "--memd", "127.0.0.1:1", "--token-file", str(token_file),
                  "--socket", str(tmp_path / "agent.sock"), "--cloud", "none"], env={"DASH_FAILURE_DOMAIN": "a b"},
                 timeout=60)
    assert result.returncode == 2, result.stderr
    error, hint = result.stderr.splitlines()
    assert error.startswith("dash-agent: error: --failure-domain 'a b' is not ZONE or ZONE/POOL"), error
    assert hint.startswith("dash-agent: hint: ZONE or ZONE/POOL"), hint
    assert not (tmp_path / "agent.sock").exists()
