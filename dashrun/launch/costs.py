"""``dashrun sim`` and ``dashrun report``: thin click layers over :mod:`dashrun.ledger`.

``sim`` needs no dash-memd, unless ``--from-job`` takes its defaults from a
job's run history; ``report`` reads that history from dash-memd. Every
option has its ``DASH_SIM_*`` / ``DASH_REPORT_*`` twin.
"""

from __future__ import annotations

import json as jsonlib
import math
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from dashrun.errors import UsageError
from dashrun.ledger import sim as simulator

__all__ = ["parse_intervals", "parse_nodes", "sim"]

console = Console()
#: Intervals a LOW:HIGH range is swept at, unless it says how many (LOW:HIGH:COUNT).
RANGE_POINTS = 17
MAX_POINTS = 200


def parse_nodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX``."""
    low, _, high = text.partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise UsageError(f"--nodes {text!r} is not N or MIN:MAX", hint="e.g. --nodes 4 or --nodes 2:4") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise UsageError(f"--nodes {text!r}: need 1 <= MIN <= MAX")
    return nodes


def parse_intervals(text: str) -> list[float]:
    """``S`` (one interval), ``LOW:HIGH`` (:data:`RANGE_POINTS` intervals spaced evenly in ratio) or
    ``LOW:HIGH:COUNT``, in seconds."""
    parts = text.split(":")
    try:
        values = [float(p) for p in parts[:2]]
        count = int(parts[2]) if len(parts) == 3 else RANGE_POINTS
    except ValueError:
        values, count = [], 0
    if len(parts) > 3 or not values or not all(0 < v < math.inf for v in values) or not 1 <= count <= MAX_POINTS:
        raise UsageError(f"--interval {text!r} is not S, LOW:HIGH or LOW:HIGH:COUNT (seconds)",
                         hint="e.g. --interval 300 or --interval 60:1200")
    if len(values) == 1:
        return values
    low, high = sorted(values)
    if count == 1 or low == high:
        return [low]
    return [low * (high / low) ** (i / (count - 1)) for i in range(count)]


def _seconds(value: float | None, option: str) -> float | None:
    if value is not None and not 0 <= value < math.inf:
        raise UsageError(f"{option} must be a number of seconds, 0 or more")
    return value


@click.command()
@click.option("--steps", type=int, default=None, show_envvar=True, help="Steps the job trains.")
@click.option("--step-time", type=float, default=None, show_envvar=True,
              help="Seconds a step takes on MAX nodes.")
@click.option("--checkpoint-cost", type=float, default=None, show_envvar=True,
              help="Seconds a checkpoint adds to the run (default 0).")
@click.option("--restore-time", type=float, default=None, show_envvar=True,
              help="Seconds from a node lost (or joining) to the job training again (default 0).")
@click.option("--startup", type=float, default=None, show_envvar=True,
              help="Seconds from the nodes' start to the first step (default 0).")
@click.option("--state-size", type=int, default=None, show_envvar=True,
              help="Bytes of the training state (shown; --from-job reads it).")
@click.option("--nodes", default=None, show_envvar=True, metavar="N|MIN:MAX",
              help="Nodes of the job: it runs on up to MAX, and waits with fewer than MIN (default 1).")
@click.option("--mtbf", type=float, default=None, show_envvar=True,
              help="Each node's mean time between preemptions, seconds: exponential lifetimes.")
@click.option("--hazard", type=click.Path(dir_okay=False), default=None, show_envvar=True,
              help="CSV hour,probability: the chance a node is taken in each hour of its life.")
@click.option("--max-lifetime", type=float, default=None, show_envvar=True,
              help="Seconds a node lives at most (GCE Spot: 86400); alone, or with --mtbf/--hazard.")
@click.option("--trace", type=click.Path(dir_okay=False), default=None, show_envvar=True,
              help="CSV time,node,event (killed, notice, joined) to replay in place of a model.")
@click.option("--replace-time", type=float, default=0.0, show_envvar=True,
              help="Seconds until a node taken back is replaced (models; a trace says when nodes join).")
@click.option("--notice", type=float, default=0.0, show_envvar=True,
              help="Seconds of notice before a preemption: one at least the checkpoint cost saves the steps.")
@click.option("--price", type=float, default=None, show_envvar=True, help="USD per node-hour: cost_usd.")
@click.option("--interval", default=None, show_envvar=True, metavar="S|LOW:HIGH[:COUNT]",
              help="Checkpoint interval(s) in seconds to simulate (default: a range around Young/Daly's).")
@click.option("--runs", type=int, default=20, show_envvar=True, show_default=True,
              help="Runs averaged per interval.")
@click.option("--seed", type=int, default=0, show_envvar=True, show_default=True, help="Seed of every draw.")
@click.option("--json", "as_json", is_flag=True, show_envvar=True, help="Print JSON.")
def sim(steps, step_time, checkpoint_cost, restore_time, startup, state_size, nodes, mtbf, hazard, max_lifetime,
        trace, replace_time, notice, price, interval, runs, seed, as_json) -> None:
    """Simulate a job on Spot nodes over checkpoint intervals: expected time, cost, goodput, steps lost, and the
    interval to use."""
    if steps is None or step_time is None:
        raise UsageError("sim needs the job's --steps and --step-time", hint="e.g. dashrun sim --steps 10000 "
                         "--step-time 1.5 --checkpoint-cost 4 --mtbf 7200")
    min_nodes, max_nodes = parse_nodes(nodes or "1")
    config = simulator.SimConfig(
        steps=steps, step_time=step_time, checkpoint_cost=_seconds(checkpoint_cost, "--checkpoint-cost") or 0.0,
        restore_time=_seconds(restore_time, "--restore-time") or 0.0, min_nodes=min_nodes, max_nodes=max_nodes,
        startup=_seconds(startup, "--startup") or 0.0, replace_time=_seconds(replace_time, "--replace-time"),
        notice=_seconds(notice, "--notice"), price_per_hour=price,
        lifetimes=simulator.Lifetimes(mtbf=mtbf, max_lifetime=max_lifetime,
                                      hazard=simulator.read_hazard(Path(hazard)) if hazard else ()),
        trace=simulator.read_trace(Path(trace)) if trace else None)
    intervals = parse_intervals(interval) if interval else simulator.sweep_intervals(config, seed)
    result = simulator.sweep(config, intervals, runs=runs, seed=seed)
    if as_json:
        body = result.to_body()
        body["inputs"] = {"steps": steps, "step_time_s": step_time, "checkpoint_cost_s": config.checkpoint_cost,
                          "restore_time_s": config.restore_time, "startup_s": config.startup,
                          "nodes": [min_nodes, max_nodes], "state_size": state_size}
        click.echo(jsonlib.dumps(body, indent=1, sort_keys=True))
        return
    _print_sweep(config, result)


def _print_sweep(config: simulator.SimConfig, result: simulator.Sweep) -> None:
    table = Table("interval", "steps", "time", "cost", "goodput", "steps lost", "preemptions")
    recommended = result.recommended_interval_s
    nearest = min(result.points, key=lambda p: abs(p.interval_s - recommended))
    for point in result.points:
        mark = " *" if point is nearest else ""
        table.add_row(f"{point.interval_s:.0f} s{mark}", str(point.interval_steps), _duration(point.time_s),
                      "-" if point.cost_usd is None else f"${point.cost_usd:,.2f}", f"{point.goodput:.1%}",
                      f"{point.steps_lost:.1f}", f"{point.preemptions:.1f}")
    console.print(table)
    plain = config.plain_time(nearest.interval_steps)
    line = (f"recommended interval: {recommended:.0f} s (every {config.interval_steps(recommended)} steps); the run "
            f"without preemptions takes {_duration(plain)}; {result.runs} run{'s' if result.runs != 1 else ''} "
            f"each, seed {result.seed}")
    if result.young_daly_s is not None:
        line += f"; Young/Daly √(2·C·MTBF): {result.young_daly_s:.0f} s"
    console.print(line, highlight=False)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"
