"""The ledger and ``dashrun report``: a real job through dashrun — a rank crash, a Spot notice from the fake
metadata service, a relaunch to the end — then the report checked field by field against what happened, also
after dash-memd restarted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import TRAIN, dashrun_cmd, kill_tree, load_fake_metadata, wait_for
from runs import last_step, preempted_at, starts

from dashrun.ledger.report import compute, stays
from dashrun.wire.domain import FailureDomain
from dashrun.wire.history import Restored, RunHistory
from dashrun.wire.messages import MembershipEvent, ShardHeader

STEPS, INTERVAL = 30, 5
TRAIN_ARGS = [str(TRAIN), "--steps", str(STEPS), "--interval", str(INTERVAL), "--delay", "0.05"]
PRICES = "instance_type,market,usd_per_hour\ng5.xlarge,spot,0.40\ng5.xlarge,on-demand,1.00\n"


def report(memd, job: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", "report", job, "--memd", memd.address, "--token-file",
                           str(memd.token_file), *memd.tls_args, *args], capture_output=True, text=True, timeout=60)


def timed(cmd: list[str], **env: str) -> tuple[subprocess.CompletedProcess, float]:
    began = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    return done, time.time() - began


@pytest.mark.slow
def test_a_job_with_a_crash_and_a_notice_reported_field_by_field(memd_factory, tmp_path):
    memd = memd_factory("--memory-limit", "256MiB")
    out, job = tmp_path / "out", "ledger"
    # 1. Rank 1 dies staging step 9: rank 0's snapshot of step 9 reached dash-memd, step 9 never committed.
    first, wall_1 = timed(dashrun_cmd(memd, "--cloud", "none", *TRAIN_ARGS, "--out", str(out), job=job),
                          DASH_CRASH_AT="rank.staging@rank=1,step=9")
    assert first.returncode == 1, first.stderr[-3000:]
    # 2. Resumed from step 4 (steps 5..9 redone), on a Spot g5.xlarge whose metadata serves a notice at step 17.
    fake = load_fake_metadata().FakeMetadata("aws", instance_type="g5.xlarge", zone="us-east-1a").start()
    try:
        began = time.time()
        proc = subprocess.Popen(dashrun_cmd(memd, "--cloud", "aws", "--metadata-endpoint", fake.url,
                                            "--poll-interval", "0.2", *TRAIN_ARGS, "--out", str(out), job=job),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: last_step(out) >= 17 or proc.poll() is not None, 180, "step 17")
            fake.notice()
            _, stderr = proc.communicate(timeout=120)
        finally:
            kill_tree(proc)
        wall_2 = time.time() - began
    finally:
        fake.stop()
    assert proc.returncode == 75, stderr[-3000:]
    noticed = preempted_at(out)[0]
    # 3. The rest, to the end.
    third, wall_3 = timed(dashrun_cmd(memd, "--cloud", "none", *TRAIN_ARGS, "--out", str(out), job=job))
    assert third.returncode == 0, third.stderr[-3000:]
    assert starts(out) == [0, 5, noticed + 1]

    prices = tmp_path / "prices.csv"
    prices.write_text(PRICES)
    done = report(memd, job, "--json", "--prices", str(prices), "--compare-on-demand", "g5.xlarge")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["job"] == job
    with memd.client() as client:  # the steps the snapshots tell of: those after the last one are not seen
        assert body["steps_done"] == client.latest(job).step + 1
    assert body["steps_redone"] == 9 - 4
    assert body["restores"] == 2
    assert [stay["why"] for stay in body["nodes"]] == ["failed", "notice", "finished"]
    assert body["preemptions"] == {"notice": 1, "killed": 0}
    # every node's time lies within its launch's (the launcher records its join after start-up, its end before
    # it exits); the agent of the second launch read its instance type, zone and market from the metadata
    for stay, wall in zip(body["nodes"], (wall_1, wall_2, wall_3)):
        assert 0 < stay["end"] - stay["start"] <= wall
        assert (stay["instance_type"], stay["market"]) == ("g5.xlarge", "spot")
    hours = body["node_hours"]
    total = sum(stay["end"] - stay["start"] for stay in body["nodes"]) / 3600
    assert hours["total"] == pytest.approx(total)
    assert hours["by_instance_type"] == pytest.approx({"g5.xlarge": total})
    assert hours["by_market"] == pytest.approx({"spot": total})
    assert hours["by_instance_type_and_market"] == pytest.approx({"g5.xlarge:spot": total})
    assert 0 < body["goodput"] < 1
    lost = body["time_lost_s"]
    assert set(lost) == {"redone", "restore", "other"} and lost["redone"] > 0 and lost["restore"] > 0
    useful = body["goodput"] * total * 3600
    assert useful + sum(lost.values()) == pytest.approx(total * 3600)
    assert body["cost_usd"] == pytest.approx(total * 0.40)
    assert body["on_demand_cost_usd"] == pytest.approx(useful / 3600 * 1.00)
    assert body["on_demand_hours"] == pytest.approx(useful / 3600)  # one node at a time
    assert [p[1] for p in body["points"]][:4] == [4, 9, 9, 14] and noticed in [p[1] for p in body["points"]]

    human = report(memd, job, "--prices", str(prices), "--compare-on-demand", "g5.xlarge")
    assert human.returncode == 0, human.stderr
    assert f"{body['steps_done']} steps done, 5 redone" in human.stdout
    assert "spot saved" in human.stdout and "as long" in human.stdout

    # The simulator takes what it is not given from the job's ledger.
    sim = subprocess.run([sys.executable, "-m", "dashrun", "sim", "--from-job", job, "--memd", memd.address,
                          "--token-file", str(memd.token_file), *memd.tls_args, "--checkpoint-cost", "0.5",
                          "--runs", "3", "--json"], capture_output=True, text=True, timeout=60)
    assert sim.returncode == 0, sim.stderr
    inputs = json.loads(sim.stdout)["inputs"]
    assert inputs["steps"] == body["steps_done"] and inputs["nodes"] == [1, 1]
    assert inputs["step_time_s"] == pytest.approx(body["node_seconds_per_step"])
    assert inputs["restore_time_s"] > 0 and inputs["state_size"] > 0

    # The ledger is kept with the job: a restarted dash-memd reports the same.
    data_dir = memd.data_dir
    memd.stop()
    again = memd_factory("--memory-limit", "256MiB", data_dir=data_dir)
    after = report(again, job, "--json", "--prices", str(prices), "--compare-on-demand", "g5.xlarge")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == body


def test_instance_type_and_market_flags_price_a_node_the_metadata_service_does_not_describe(memd, tmp_path):
    """No metadata service (--cloud none): dashrun --instance-type/--market reach dash-agent, which announces them
    with the shards, and the report prices the node's hours by them."""
    out, job = tmp_path / "out", "flagged"
    args = [str(TRAIN), "--steps", "10", "--interval", "5", "--out", str(out)]
    done = subprocess.run(dashrun_cmd(memd, "--cloud", "none", "--instance-type", "g5.xlarge", "--market", "on-demand",
                                      *args, job=job), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    prices = tmp_path / "prices.csv"
    prices.write_text(PRICES)
    body = json.loads(report(memd, job, "--json", "--prices", str(prices)).stdout)
    assert [(stay["instance_type"], stay["market"]) for stay in body["nodes"]] == [("g5.xlarge", "on-demand")]
    assert body["node_hours"]["by_instance_type_and_market"] == pytest.approx({"g5.xlarge:on-demand":
                                                                               body["node_hours"]["total"]})
    assert body["cost_usd"] == pytest.approx(body["node_hours"]["total"] * 1.00)


def test_report_mistakes_are_one_line_usage_errors(memd, tmp_path):
    prices = tmp_path / "prices.csv"
    prices.write_text("g5.xlarge,reserved,1.0\n")
    for args, says, code in ((["nothing-here", "--json"], "knows no run", 1),
                             (["job", "--prices", str(prices)], "reserved", 2),
                             (["job", "--compare-on-demand", "x"], "needs --prices", 2)):
        done = report(memd, *args) if args[0] == "nothing-here" else report(memd, *args)
        if says == "needs --prices":  # a job must exist for the comparison to be refused on its own
            with memd.client() as client:
                client.record_membership("job", MembershipEvent(time.time(), "n", "joined", "started", 1, 0))
            done = report(memd, *args)
        assert done.returncode == code, (args, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr


def _header(step: int, world: int = 1) -> ShardHeader:
    return ShardHeader("j", step, 0, world, 0, 0, 0, 0, 0, "x")


def test_steps_redone_are_counted_from_the_snapshots_and_the_restores_the_ranks_report():
    history = RunHistory()
    history.note_snapshot(_header(4), Restored(-1, 0.1, 1.0), 10.0)
    for step in (9, 14):
        history.note_snapshot(_header(step), None, 10.0 + step)
    assert (history.steps_done, history.redone, history.restores) == (15, 0, 0)
    history.note_snapshot(_header(14), None, 30.0)  # the same step again (another shard of it): counted once
    history.note_snapshot(_header(9), Restored(4, 2.0, 50.0), 51.0)  # rolled back to 4: 5..9 again
    history.note_snapshot(_header(14), Restored(4, 2.0, 50.0), 56.0)
    history.note_snapshot(_header(19), Restored(4, 2.0, 50.0), 61.0)
    assert (history.steps_done, history.redone, history.restores, history.restore_s) == (20, 10, 1, 2.1)
    again = RunHistory.from_body(json.loads(json.dumps(history.to_body())))
    assert again.to_body() == history.to_body()


def test_a_node_that_joins_again_without_an_end_was_killed_with_its_launcher():
    events = [MembershipEvent(100.0, "n", "joined", "started", 1, 0),
              MembershipEvent(300.0, "n", "joined", "started", 1, 0, 4),
              MembershipEvent(400.0, "n", "finished", "ranks exited 0", 1, 0, 29)]
    history = RunHistory()
    history.note_snapshot(_header(4), None, 150.0)
    history.note_domain("other-name", FailureDomain.parse("us-east-1a/g5.xlarge:spot"))
    found = stays(events, history, now=1000.0, running=False)
    assert [(s.start, s.end, s.why, s.instance_type, s.market) for s in found] == [
        (100.0, 150.0, "killed", "g5.xlarge", "spot"), (300.0, 400.0, "finished", "g5.xlarge", "spot")]
    body = compute("j", events, history, running=False)
    assert body["preemptions"] == {"notice": 0, "killed": 1} and body["steps_done"] == 30


def test_plot_writes_a_png_with_matplotlib_and_says_how_to_install_it_without(memd, tmp_path):
    with memd.client() as client:
        client.record_membership("plotted", MembershipEvent(time.time() - 60, "n", "joined", "started", 1, 0))
        client.record_membership("plotted", MembershipEvent(time.time(), "n", "finished", "ranks exited 0", 1, 0, 9))
    png = tmp_path / "job.png"
    done = report(memd, "plotted", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert done.returncode == 2 and "--plot needs matplotlib" in done.stderr
        assert "pip install 'dashrun[plot]'" in done.stderr and not png.exists()
        return
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_fleet_nodes_announced_domain_goes_into_its_jobs_ledger(memd):
    from dashrun.wire.holdings import Holdings

    with memd.client() as client:
        client.announce(Holdings("fleet", "a", "-", 0, 1, FailureDomain.parse("us-east-1a/g5.xlarge:spot")))
        assert client.run_history("fleet") == ([], None)  # not a job dashrun launched: no ledger of it
        client.record_membership("fleet", MembershipEvent(time.time(), "a", "joined", "started", 2, 1))
        client.announce(Holdings("fleet", "a", "-", 0, 1, FailureDomain.parse("us-east-1a/g5.xlarge:spot")))
        client.announce(Holdings("fleet", "b", "-", 0, 1, FailureDomain.parse("us-east-1b/g5.xlarge:on-demand")))
        _, history = client.run_history("fleet")
    assert {node: d.label for node, d in history.domains.items()} == {
        "a": "us-east-1a/g5.xlarge:spot", "b": "us-east-1b/g5.xlarge:on-demand"}


def test_a_run_history_survives_a_reload_and_a_malformed_one_costs_only_itself(tmp_path):
    from dashrun.memd.fleet.membership import Membership

    kept = Membership(tmp_path / "membership")
    kept.record("j", MembershipEvent(1.0, "n", "joined", "started", 1, 0))
    kept.note_snapshot(_header(4), Restored(-1, 0.5, 2.0))
    kept.flush()
    again = Membership(tmp_path / "membership")
    again.load()
    assert again.run_history("j") == kept.run_history("j") and again.run_history("j")["high"] == 4
    path = tmp_path / "membership" / "j.json"
    body = json.loads(path.read_text())
    body["history"]["points"] = [["not", "a", "point"]]
    path.write_text(json.dumps(body))
    broken = Membership(tmp_path / "membership")
    broken.load()
    assert [e.change for e in broken.history("j")] == ["joined"] and broken.run_history("j")["high"] == -1
