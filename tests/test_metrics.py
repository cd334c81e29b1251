"""Metrics and logs: dash-memd's /metrics scraped over HTTP as real saves, restores and notices happen, and the
--log-level / --log-format of every command."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashrun.errors import ForbiddenError, UsageError
from dashrun.testing.agent import TEST_OPTIONS, Agent
from dashrun.testing.processes import free_port, wait_for
from dashrun.util.console import JsonFormatter
from dashrun.util.metrics import metrics_settings, parse_metrics_listen
from dashrun.wire.credentials import Credential, write_job_credential
from dashrun.wire.memd_client import MemdClient
from dashrun.wire.messages import MembershipEvent, Notice, NoticeKind, ShardHeader
from dashrun.wire.tls import TlsSettings

LAYOUT = "ab" * 32
SHARD = 64 * 1024


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample of ``http://address/metrics``, parsed by prometheus-client's own parser: (name, labels) ->
    value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape_until(address: str, ready, what: str) -> dict:
    """Scrape until ``ready(samples)`` holds (what the server counts on its own threads lands a moment later)."""
    def check():
        samples = scrape(address)
        return samples if ready(samples) else None
    return wait_for(check, what=what)


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def save(client: MemdClient, job: str, step: int, world: int = 2) -> None:
    """One checkpoint of ``world`` ranks, each shard SHARD bytes of the replicated state."""
    for rank in range(world):
        header = ShardHeader(job, step, rank, world, SHARD * world, SHARD * rank, SHARD * (rank + 1), 0, 0, LAYOUT)
        client.put_shard(header, [os.urandom(SHARD)], node=f"node-{rank}")


def test_dash_memd_metrics_follow_saves_restores_notices_and_refusals(memd_factory, tmp_path):
    port = free_port()
    memd = memd_factory("--memory-limit", "64MiB", "--metrics-listen", str(port), "--log-format", "json")
    address = f"127.0.0.1:{port}"
    before = scrape(address)
    assert value(before, "dash_memd_memory_limit_bytes") == 64 << 20
    assert value(before, "dash_memd_bytes", tier="ram") == 0
    assert value(before, "dash_memd_commit_seconds_count") == 0

    with memd.client() as client:
        save(client, "metered", 1)
        save(client, "metered", 2)
        assert client.wait("metered", 2, 60, on_disk=True)
        during = scrape(address)
        assert value(during, "dash_memd_connections") >= 1  # this client's
        got = bytearray(SHARD)
        client.get_shard_into("metered", 2, 1, [memoryview(got)])
        client.get_shard_into("metered", 2, 0, [memoryview(got)[:SHARD // 2]], offset=SHARD // 2)
        client.notice("metered", Notice("aws", NoticeKind.TERMINATE, 1.7e9, node="node-0"))
        client.notice("metered", Notice("gcp", NoticeKind.PREEMPT, None, node="node-1"))

    # A rank's credential asking for another job: refused, and counted.
    credential = tmp_path / "mine.credential"
    write_job_credential(Credential.parse(memd.token).for_job("mine"), credential)
    with MemdClient(memd.host, memd.port, credential.read_bytes().strip(), timeout=30,
                    tls=TlsSettings(plaintext=False)) as rank:
        with pytest.raises(ForbiddenError):
            rank.latest("metered")

    # The disk writer's last bookkeeping and the connections' ends land on their own threads: poll.
    after = scrape_until(address, lambda s: value(s, "dash_memd_pending", queue="disk") == 0
                         and value(s, "dash_memd_bytes", tier="disk") == 2 * 2 * SHARD,
                         "both checkpoints on disk, as the metrics say")
    assert value(after, "dash_memd_checkpoints_committed_total", job="metered") == 2
    assert value(after, "dash_memd_commit_seconds_count") == 2
    assert value(after, "dash_memd_commit_seconds_sum") > 0
    assert value(after, "dash_memd_commit_seconds_bucket", le="+Inf") == 2
    assert value(after, "dash_memd_restore_seconds_count") == 2
    assert value(after, "dash_memd_requests_total", kind="GET_SHARD") == 2
    assert value(after, "dash_memd_requests_total", kind="PUT_SHARD") == 4
    assert value(after, "dash_memd_notices_total", job="metered", cloud="aws") == 1
    assert value(after, "dash_memd_notices_total", job="metered", cloud="gcp") == 1
    assert value(after, "dash_memd_errors_total", kind="forbidden") == 1
    assert value(after, "dash_memd_errors_total", kind="disk_write") == 0
    assert value(after, "dash_memd_ram_evictions_total") == value(after, "dash_memd_ram_room_waits_total") == 0
    assert value(after, "dash_memd_ram_room_wait_seconds_total") == 0  # 64 MiB held both: RAM never pressed
    assert value(after, "dash_memd_bytes", tier="ram") >= 2 * 2 * SHARD  # both kept in RAM (--keep-ram 2)
    assert value(after, "dash_memd_bytes", tier="object") == 0  # no object tier
    assert value(after, "dash_memd_pending", queue="object") == 0
    assert value(after, "dash_memd_newest_step", job="metered") == 2
    assert value(after, "dash_memd_newest_commit_timestamp_seconds", job="metered") > 1.7e9
    scrape_until(address, lambda s: value(s, "dash_memd_connections") == 0, "the clients' connections closed")

    # --log-format json: every line of its log is one object with the fields a log shipper reads.
    lines = [json.loads(line) for line in memd.log().splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message", "program"} <= line.keys() for line in lines)
    assert any("metrics at http://127.0.0.1:" in line["message"] for line in lines)
    assert any(line["level"] == "WARNING" and "terminate notice" in line["message"] for line in lines)


@pytest.mark.slow
def test_dash_memd_metrics_count_the_object_tier(memd_factory, s3_bucket):
    port = free_port()
    memd = memd_factory("--memory-limit", "64MiB", "--s3", s3_bucket.url(), "--metrics-listen", f"127.0.0.1:{port}")
    with memd.client() as client:
        save(client, "uploaded", 1)
    after = scrape_until(f"127.0.0.1:{port}", lambda s: value(s, "dash_memd_bytes", tier="object") > 0,
                         "the checkpoint in the bucket, as the metrics say")
    assert value(after, "dash_memd_bytes", tier="object") == 2 * SHARD
    assert value(after, "dash_memd_pending", queue="object") == 0


def test_a_metrics_address_binds_to_loopback_unless_one_is_named():
    assert parse_metrics_listen("9100") == ("127.0.0.1", 9100)
    assert parse_metrics_listen(":9100") == ("127.0.0.1", 9100)
    assert parse_metrics_listen("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_metrics_listen("[::1]:9100") == ("::1", 9100)


def https_scrape(address: str, ca: Path, token: str | None) -> tuple[int, str]:
    """GET https://address/metrics verified against ``ca``, with ``token`` as its bearer: (status, body)."""
    import ssl
    import urllib.error

    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(f"https://{address}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_over_https_ask_for_the_bearer_token_and_a_silent_client_holds_up_no_scrape(memd_factory, tmp_path):
    from test_tls import make_ca, make_server_cert

    ca = make_ca(tmp_path, "metrics-ca")
    cert, key = make_server_cert(tmp_path, ca)
    token_file = tmp_path / "metrics.token"
    token = os.urandom(32).hex()
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    port = free_port()
    memd_factory("--metrics-listen", str(port), "--metrics-tls-cert", str(cert), "--metrics-tls-key", str(key),
                 "--metrics-token-file", str(token_file))
    address = f"127.0.0.1:{port}"
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)  # connects, never says hello
    try:
        status, body = https_scrape(address, ca[2], token)
        assert status == 200
        assert any(f.name == "dash_memd_memory_limit_bytes" for f in text_string_to_metric_families(body))
        for wrong in (None, "0" * 64, token + "0"):
            status, body = https_scrape(address, ca[2], wrong)
            assert status == 401 and "dash_memd" not in body, wrong
        with pytest.raises(OSError):  # plain HTTP gets no metrics from a TLS endpoint
            urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read()
    finally:
        silent.close()


def test_metrics_tls_and_token_mistakes_are_one_line_usage_errors(tmp_path, token_file):
    loose = tmp_path / "loose.token"
    loose.write_text(os.urandom(32).hex())
    loose.chmod(0o644)
    for given, says in (({"tls_cert": str(tmp_path / "none.pem")}, "cannot load --metrics-tls-cert"),
                        ({"tls_key": str(loose)}, "--metrics-tls-key needs --metrics-tls-cert"),
                        ({"token_file": str(loose)}, "is open to group or others")):
        with pytest.raises(UsageError, match=says):
            metrics_settings("9100", **given)
    assert metrics_settings(None, token_file=str(loose)) is None  # no endpoint: its twins' values are not read
    # dash-agent reads them too, from its twins as dashrun hands them on
    agent = subprocess.run([sys.executable, "-m", "dashrun.agent", "--memd", "127.0.0.1:1", "--token-file",
                            str(token_file), "--socket", str(tmp_path / "a.sock"), "--cloud", "none"],
                           env={**os.environ, "DASH_AGENT_METRICS_LISTEN": "9100", "DASH_METRICS_TLS_KEY": str(loose)},
                           capture_output=True, text=True, timeout=60)
    assert agent.returncode == 2
    assert agent.stderr.splitlines()[0] == "dash-agent: error: --metrics-tls-key needs --metrics-tls-cert"


COMMANDS = {
    "dash-memd": [sys.executable, "-m", "dashrun.memd", "start", "--data-dir", "/nonexistent", "--token-file", "t",
                  "..."],
    "dash-agent": [sys.executable, "-m", "dashrun.agent", "--memd", "127.0.0.1:1", "--token-file", "t", "--socket",
                   "s", "..."],
    "dashrun status": [sys.executable, "-m", "dashrun", "status", "..."],
    "dashrun (launch)": [sys.executable, "-m", "dashrun", "--nproc-per-node", "1", "...", "train.py"],
}


@pytest.mark.parametrize("command", [pytest.param(name, marks=pytest.mark.slow) if "launch" in name else name
                                     for name in sorted(COMMANDS)])  # a launch imports torch: seconds each
def test_a_mistyped_log_level_or_format_is_a_usage_error_naming_the_valid_ones(command, tmp_path):
    (tmp_path / "train.py").write_text("")  # the launch's script exists: the log options are what is wrong
    for extra, twin, said in ((["--log-level", "DEBG"], {}, "--log-level 'DEBG' is not a log level"),
                              ([], {"DASH_LOG_LEVEL": "verbose"}, "--log-level 'verbose' is not a log level"),
                              (["--log-format", "xml"], {}, "--log-format 'xml' is not a log format")):
        at = COMMANDS[command].index("...")  # the options go before a launch's script
        argv = [*COMMANDS[command][:at], *extra, *COMMANDS[command][at + 1:]]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={**os.environ, **twin})
        assert run.returncode == 2, (command, extra, run.stderr)
        assert said in run.stderr and "Traceback" not in run.stderr, (command, run.stderr)
        valid = "DEBUG, INFO, WARNING, ERROR" if "level" in said else "text, json"
        assert f"hint: give one of {valid}" in run.stderr


def test_a_json_log_line_names_the_job_and_rank_where_known(monkeypatch):
    monkeypatch.setenv("DASH_JOB_ID", "gpt-1")
    monkeypatch.setenv("RANK", "3")
    record = logging.LogRecord("dashrun.rank", logging.WARNING, __file__, 1, "step %d skipped", (7,), None)
    line = json.loads(JsonFormatter("dashrun").format(record))
    assert line["message"] == "step 7 skipped" and line["level"] == "WARNING" and line["logger"] == "dashrun.rank"
    assert line["job"] == "gpt-1" and line["rank"] == 3 and line["time"].endswith("+00:00")
    monkeypatch.delenv("RANK")
    record.job = "other"  # a record's own job wins over the process's
    line = json.loads(JsonFormatter("dash-memd").format(record))
    assert line["job"] == "other" and "rank" not in line


# --- dashrun status --watch -----------------------------------------------------------------------------


def status_cmd(memd, *args: str) -> list[str]:
    return [sys.executable, "-m", "dashrun", "status", "--memd", memd.address, "--token-file", str(memd.token_file),
            *memd.tls_args, *args]


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
#: A terminal as rich sees one (each refresh drawn, not only the last), wide enough for the table.
TERMINAL = {**os.environ, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "220", "NO_COLOR": "1"}


def test_status_watch_redraws_every_job_with_its_tiers_latency_nodes_and_pending_writes(memd):
    with memd.client() as client:
        save(client, "watched", 1)
        save(client, "watched", 2)
        assert client.wait("watched", 2, 60, on_disk=True)
        client.record_membership("watched", MembershipEvent(1.7e9, "node-0", "joined", "", 2, 1))
        client.record_membership("watched", MembershipEvent(1.7e9 + 1, "node-1", "joined", "", 2, 1))
        client.record_membership("watched", MembershipEvent(1.7e9 + 2, "node-1", "left", "notice", 1, 2))
        client.notice("watched", Notice("aws", NoticeKind.TERMINATE, 1.7e9, node="node-1"))
    run = subprocess.run(status_cmd(memd, "--watch", "--count", "2", "--interval", "0.2"), capture_output=True,
                         text=True, timeout=120, env=TERMINAL)
    assert run.returncode == 0, run.stderr
    out = ANSI.sub("", run.stdout)
    assert "refresh 1 of 2" in out and "refresh 2 of 2" in out  # drawn twice, in place
    assert "disk writes pending" in out and "RAM in use" in out
    last = out[out.rindex("refresh 2 of 2"):]
    row = next(line for line in last.splitlines() if "watched" in line)
    assert "│ 2 " in row and "disk, ram" in row  # the newest step, and its tiers
    assert " ms " in row  # its commit latency
    assert "node-0 (up)" in last and "node-1 (left)" in last
    assert "terminate" in row


def _as_from_a_shell() -> None:
    """Ctrl-C's signal as an interactive shell leaves it to a command: at its default, unblocked, whatever the
    suite's process inherited (in the background of a shell SIGINT is ignored, and children keep that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_status_watch_stops_cleanly_on_ctrl_c(memd, tmp_path):
    log = tmp_path / "watch.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(status_cmd(memd, "--watch", "--interval", "0.2"), stdout=out, stderr=subprocess.STDOUT,
                                env=TERMINAL, preexec_fn=_as_from_a_shell)
    try:
        wait_for(lambda: "refresh 2," in ANSI.sub("", log.read_text()), what="two refreshes of the live view")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def test_status_watch_refuses_a_job_or_json(memd):
    run = subprocess.run(status_cmd(memd, "--watch", "--json"), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--watch shows every job" in run.stderr


# --- dash-agent ------------------------------------------------------------------------------------------


def test_dash_agent_metrics_follow_its_ranks_saves_stall_stream_and_notices(memd, rank_env, short_tmp, tmp_path):
    import torch

    from conftest import load_fake_metadata

    fake = load_fake_metadata().FakeMetadata("aws").start()
    port = free_port()
    agent = None
    try:
        agent = Agent(memd, short_tmp / "m.sock", tmp_path / "agent.log",
                      options=(*TEST_OPTIONS, "--metrics-listen", str(port), "--job-id", "agented", "--cloud", "aws",
                               "--metadata-endpoint", fake.url, "--poll-interval", "0.2"))
        address = f"127.0.0.1:{port}"
        assert value(scrape(address), "dash_agent_snapshots_total", outcome="stored") == 0
        model = torch.nn.Linear(256, 256)
        ckpt = rank_env(agent, "agented", 0, 1, model=model)
        for step in range(3):
            assert ckpt.save(step, force=True)
            assert ckpt.wait(timeout=60)
        during = scrape(address)
        assert value(during, "dash_agent_ranks") == 1
        ckpt.close()
        fake.notice(lead=120.0)
        after = scrape_until(address, lambda s: value(s, "dash_agent_notices_total", cloud="aws", kind="terminate")
                             == 1 and value(s, "dash_agent_ranks") == 0, "the notice, counted")
    finally:
        if agent is not None:
            agent.stop()
        fake.stop()
    assert value(after, "dash_agent_snapshots_total", outcome="stored") == 3
    assert value(after, "dash_agent_snapshots_total", outcome="failed") == 0
    assert value(after, "dash_agent_snapshot_seconds_count") == 3
    shard = value(after, "dash_agent_stream_bytes_total") / 3
    assert shard >= 256 * 256 * 4  # the weights, at least, in each of the three
    assert value(after, "dash_agent_stream_seconds_total") > 0
    assert value(after, "dash_agent_stream_bytes_per_second") > 0
    assert value(after, "dash_agent_stall_seconds_total") > 0  # the first two saves', as the later ones reported
    assert value(after, "dash_agent_skipped_snapshots_total") == 0


# --- what an operator loads next to the endpoints -------------------------------------------------------


def served_names(text: str) -> set[str]:
    """Every series name a Prometheus query may use of an exposition, also of families with no samples yet."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names |= {family.name + suffix for suffix in {"counter": ("_total",),
                                                       "histogram": ("_bucket", "_count", "_sum")}.get(family.type, ())}
        names |= {sample.name for sample in family.samples}
    return names


def test_the_dashboard_and_alert_rules_use_only_metrics_that_are_served(memd_factory):
    import yaml
    from prometheus_client import generate_latest

    from dashrun.agent.metrics import AgentMetrics

    port = free_port()
    memd_factory("--memory-limit", "64MiB", "--metrics-listen", str(port))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        served = served_names(reply.read().decode())
    served |= served_names(generate_latest(AgentMetrics().registry).decode())

    deploy = Path(__file__).resolve().parent.parent / "deploy"
    rules = yaml.safe_load((deploy / "prometheus" / "dashrun.yml").read_text())
    alerts = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    assert {"DashMemdDown", "DashMemdCheckpointsNotReachingDisk", "DashMemdNewestCheckpointStale",
            "DashMemdRamAtLimit"} <= alerts.keys()
    assert all(job["honor_labels"] for job in rules["scrape_configs"])  # the metrics' own "job" label is kept
    board = json.loads((deploy / "grafana" / "dashrun.json").read_text())
    queries = [target["expr"] for panel in board["panels"] for target in panel["targets"]]
    used = set(re.findall(r"\bdash_(?:memd|agent)_[a-z_]+", " ".join([*alerts.values(), *queries])))
    assert len(used) >= 15
    assert used <= served, f"named but not served: {sorted(used - served)}"


@pytest.mark.slow
def test_a_launch_with_log_format_json_logs_one_object_a_line_from_each_of_its_processes(tmp_path):
    from conftest import TRAIN

    run = subprocess.run([sys.executable, "-m", "dashrun", "--log-format", "json", "--agent-cpus", "none",
                          "--nproc-per-node", "1", str(TRAIN), "--steps", "6", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})  # a private dash-memd
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.strip()]  # each line one object
    assert {"dashrun", "dash-agent"} <= {line["program"] for line in lines}
    assert all(line.get("job", "").startswith("train-") for line in lines if line["program"] == "dash-agent")
    assert any(line["message"].startswith("starting ") and line["program"] == "dashrun" for line in lines)
    ranks = [line for line in lines if line["logger"].startswith("dashrun.rank")]
    assert ranks and all(line.get("rank") == 0 and line.get("job", "").startswith("train-") for line in ranks)
