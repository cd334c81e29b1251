"""``dashrun sim``: the plain run reproduced exactly, Young/Daly's interval where it holds, traces replayed, seeds."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dashrun.errors import UsageError
from dashrun.ledger.inputs import read_trace
from dashrun.ledger.sim import Lifetimes, SimConfig, simulate, sweep, sweep_intervals
from dashrun.launch.costs import parse_intervals


def sim_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dashrun", "sim", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("nodes", [1, 3])
def test_without_preemptions_a_run_takes_the_steps_the_checkpoints_and_the_start_up_exactly(nodes):
    config = SimConfig(steps=1003, step_time=0.37, checkpoint_cost=2.5, restore_time=40, startup=11.0,
                       min_nodes=nodes, max_nodes=nodes, price_per_hour=3.6)
    result = sweep(config, [0.37, 3.7, 37, 370, 10_000])
    assert [p.interval_steps for p in result.points] == [1, 10, 100, 1000, 1003]
    for point in result.points:
        checkpoints = 1003 // point.interval_steps
        assert point.time_s == 11.0 + 1003 * 0.37 + checkpoints * 2.5
        assert point.steps_lost == 0 and point.preemptions == 0
        assert point.cost_usd == pytest.approx(point.time_s * nodes / 3600 * 3.6)
        assert point.goodput == pytest.approx(1003 * 0.37 / point.time_s)
    assert result.recommended_interval_s == 1003 * 0.37  # one checkpoint at the end is cheapest
    assert result.runs == 1


@pytest.mark.parametrize("nodes, mtbf", [(1, 3600.0), (4, 4 * 3600.0)])
def test_the_recommended_interval_is_young_dalys_where_mtbf_is_far_above_the_checkpoint_cost(nodes, mtbf):
    # --nodes 1 --mtbf 3600 --checkpoint-cost 10: √(2·10·3600) ≈ 268 s; four nodes of 4 h each fail as often
    config = SimConfig(steps=200_000, step_time=1.0, checkpoint_cost=10.0, min_nodes=nodes, max_nodes=nodes,
                       lifetimes=Lifetimes(mtbf=mtbf))
    result = sweep(config, sweep_intervals(config), runs=20, seed=7)
    assert result.young_daly_s == pytest.approx(math.sqrt(2 * 10 * 3600))
    assert abs(result.recommended_interval_s - result.young_daly_s) <= 0.10 * result.young_daly_s
    assert all(p.preemptions > 0 for p in result.points)


def _trace(tmp_path, text: str):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return read_trace(path)


def test_a_trace_replays_its_losses_and_joins_exactly(tmp_path):
    # A checkpoint every 10 steps of 1 s, each 1 s: periods of 11 s. Killed at 25.5: step 20 committed, steps
    # 21..23 done and lost; the node is back at 40, trains again at 45 (restore), 80 steps and 8 checkpoints.
    killed = SimConfig(steps=100, step_time=1.0, checkpoint_cost=1.0, restore_time=5.0,
                       trace=_trace(tmp_path, "time,node,event\n25.5,n0,killed\n40,n0,joined\n"))
    outcome = simulate(killed, 10)
    assert outcome.time_s == 133.0
    assert outcome.steps_lost == 3 and outcome.preemptions == 1
    assert outcome.node_seconds == 25.5 + (133 - 40)
    assert simulate(killed, 10) == outcome
    # With a notice, the emergency checkpoint keeps step 23: 77 steps and 8 checkpoints after the restore.
    noticed = SimConfig(steps=100, step_time=1.0, checkpoint_cost=1.0, restore_time=5.0,
                        trace=_trace(tmp_path, "25.5,n0,notice\n40,n0,joined\n"))
    assert simulate(noticed, 10) == type(outcome)(130.0, 25.5 + 90, 0, 1)


def test_an_elastic_world_shrinks_at_a_loss_and_grows_at_the_next_checkpoint(tmp_path):
    # 2 nodes, 1 s a step; b is killed at 5 (5 steps lost), a trains alone at 2 s a step; b is back at 12 and
    # joins at the first checkpoint after, step 10 at 25; 30 steps more at 1 s.
    config = SimConfig(steps=40, step_time=1.0, min_nodes=1, max_nodes=2,
                       trace=_trace(tmp_path, "5,b,killed\n12,b,joined\n0.0,a,joined\n"))
    outcome = simulate(config, 10)
    assert (outcome.time_s, outcome.steps_lost, outcome.preemptions) == (55.0, 5, 1)
    assert outcome.node_seconds == 55 + 5 + (55 - 12)


def test_a_capped_lifetime_takes_each_node_at_its_cap(tmp_path):
    config = SimConfig(steps=300, step_time=1.0, restore_time=2.0, lifetimes=Lifetimes(max_lifetime=100.0))
    outcome = simulate(config, 7)  # at 100: step 98 committed, 99 and 100 lost
    assert outcome.preemptions == 3 and outcome.steps_lost > 0
    assert simulate(config, 7, seed=5) == outcome  # nothing random in it


def test_the_same_seed_gives_the_same_output_and_another_seed_other_draws(tmp_path):
    hazard = tmp_path / "hazard.csv"
    hazard.write_text("hour,probability\n0,0.05\n1,0.2\n2,0.5\n")
    args = ["--steps", "20000", "--step-time", "1", "--checkpoint-cost", "10", "--restore-time", "60",
            "--nodes", "2:4", "--hazard", str(hazard), "--max-lifetime", "86400", "--price", "1.2",
            "--interval", "60:1200:5", "--runs", "5", "--json"]
    first, again, other = sim_cli(*args), sim_cli(*args), sim_cli(*args, "--seed", "1")
    assert first.returncode == 0, first.stderr
    assert first.stdout == again.stdout
    body = json.loads(first.stdout)
    assert body["seed"] == 0 and body["runs"] == 5 and len(body["intervals"]) == 5
    for point in body["intervals"]:
        assert {"interval_s", "time_s", "cost_usd", "goodput", "steps_lost"} <= point.keys()
        assert 0 < point["goodput"] <= 1 and point["cost_usd"] > 0
    assert 60 <= body["recommended_interval_s"] <= 1200
    assert json.loads(other.stdout)["intervals"] != body["intervals"]


def test_mistakes_are_one_line_usage_errors(tmp_path):
    bad_trace = tmp_path / "bad.csv"
    bad_trace.write_text("10,n0,exploded\n")
    trace = tmp_path / "trace.csv"
    trace.write_text("10,n0,killed\n")
    for args, says in ((["--step-time", "1"], "--steps"),
                       (["--steps", "10", "--step-time", "1", "--interval", "5:x"], "--interval"),
                       (["--steps", "10", "--step-time", "1", "--nodes", "3:2"], "--nodes"),
                       (["--steps", "10", "--step-time", "1", "--trace", str(bad_trace)], "exploded"),
                       (["--steps", "10", "--step-time", "1", "--trace", str(trace), "--mtbf", "9"], "--trace"),
                       (["--steps", "100", "--step-time", "1", "--trace", str(trace)], "never has 1 nodes"),
                       (["--steps", "10", "--step-time", "-1"], "--step-time")):
        done = sim_cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr


def test_an_interval_is_a_value_or_a_range():
    assert parse_intervals("300") == [300.0]
    assert parse_intervals("10:1000:3") == pytest.approx([10.0, 100.0, 1000.0])
    assert len(parse_intervals("1000:10")) == 17
    with pytest.raises(UsageError):
        parse_intervals("0:10")
