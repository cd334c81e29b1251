"""The daemons as commands: clean shutdown on signals, one-line errors with hints, exit codes."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest


def memd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dashrun.memd", *args]


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT], [signal.SIGTERM] * 5])
def test_memd_stops_cleanly_on_signals(memd, signals):
    for sig in signals:  # a burst of signals must not deadlock the shutdown
        memd.proc.send_signal(sig)
    assert memd.proc.wait(timeout=60) == 0
    assert "shutting down" in memd.log()


def test_agent_stops_cleanly_and_when_its_launcher_dies(memd, agent_factory):
    agent = agent_factory(memd)
    for _ in range(3):
        agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=60) == 0
    assert not agent.socket_path.exists()


def test_token_command_writes_a_private_token_and_never_overwrites(tmp_path):
    path = tmp_path / "tok"
    assert subprocess.run(memd_cmd("token", "--out", str(path)), capture_output=True).returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(path.read_text().strip()) == 64
    again = subprocess.run(memd_cmd("token", "--out", str(path)), capture_output=True, text=True)
    assert again.returncode != 0


@pytest.mark.parametrize("args, message", [
    (["--memory-limit", "lots"], "not a size"),
    (["--listen", "127.0.0.1:notaport"], "invalid port"),
    (["--keep-ram", "0"], "--keep-ram"),
])
def test_memd_usage_errors_are_one_line_with_exit_code_2(tmp_path, token_file, args, message):
    result = subprocess.run(memd_cmd("start", "--data-dir", str(tmp_path / "d"), "--token-file", str(token_file),
                                     *args), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_memd_refuses_a_missing_or_weak_token(tmp_path):
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    for token in (tmp_path / "missing", weak):
        result = subprocess.run(memd_cmd("start", "--data-dir", str(tmp_path / "d"), "--token-file", str(token)),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "hint: create" in result.stderr and "Traceback" not in result.stderr


def test_memd_reports_a_busy_port(memd, tmp_path, token_file):
    result = subprocess.run(memd_cmd("start", "--listen", memd.address, "--data-dir", str(tmp_path / "other"),
                                     "--token-file", str(token_file)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "cannot listen" in result.stderr


def test_dashrun_usage_errors(tmp_path, token_file):
    base = [sys.executable, "-m", "dashrun", "--memd", "127.0.0.1:1", "--token-file"]
    bad_id = subprocess.run(base + [str(token_file), "--job-id", "../x", "train.py"], capture_output=True,
                            text=True, timeout=60)
    assert bad_id.returncode == 2 and "not a valid job id" in bad_id.stderr
    no_token = subprocess.run(base + [str(tmp_path / "nope"), "train.py"], capture_output=True, text=True,
                              timeout=60)
    assert no_token.returncode == 2 and "cannot read token file" in no_token.stderr
    assert "Traceback" not in bad_id.stderr + no_token.stderr



def test_dashrun_refuses_to_start_with_a_token_memd_does_not_accept(memd, tmp_path):
    from dashrun.util.tokens import write_token

    other = tmp_path / "other-token"
    write_token(other)
    result = subprocess.run([sys.executable, "-m", "dashrun", "--memd", memd.address, "--token-file", str(other),
                             "--nproc-per-node", "1", "train.py"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "refused this node's token" in result.stderr and "Traceback" not in result.stderr
