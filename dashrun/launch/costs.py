"""``dashrun sim`` and ``dashrun report``: thin click layers over :mod:`dashrun.ledger`.

``sim`` needs no dash-memd, unless ``--from-job`` takes its defaults from a
job's run history; ``report`` reads that history from dash-memd. Every
option has its ``DASH_SIM_*`` / ``DASH_REPORT_*`` twin. The job commands'
module (:mod:`dashrun.launch.commands`) builds both with its own dash-memd
options and link (:func:`commands`), so that this one does not import it.
"""

from __future__ import annotations

import io
import json as jsonlib
import math
import time
from pathlib import Path
from typing import Callable

import click
from rich.console import Console
from rich.table import Table

from dashrun.errors import NotFoundError, UsageError
from dashrun.launch.jobstate import JobState, job_state
from dashrun.ledger import inputs, report as ledger, sim as simulator
from dashrun.util.files import write_atomic

__all__ = ["commands", "parse_intervals", "parse_nodes"]

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


def commands(memd_options: Callable, connect: Callable, job_param: Callable) -> list[click.Command]:
    """``sim`` and ``report``, with the job commands' dash-memd options, link and JOB check."""

    @click.command()
    @click.argument("job", callback=job_param)
    @memd_options
    @click.option("--prices", type=click.Path(dir_okay=False), default=None, show_envvar=True,
                  help="CSV instance_type,market,usd_per_hour (market spot or on-demand): cost_usd.")
    @click.option("--compare-on-demand", default=None, show_envvar=True, metavar="TYPE",
                  help="The same work on on-demand nodes of TYPE (its price in --prices): cost and hours.")
    @click.option("--instance-type", default=None, show_envvar=True,
                  help="The instance type of nodes whose agents announced none.")
    @click.option("--market", type=click.Choice(inputs.MARKETS), default=None, show_envvar=True,
                  help="The market of nodes whose agents announced none.")
    @click.option("--plot", type=click.Path(dir_okay=False), default=None, show_envvar=True,
                  help="Write a PNG of world size and step over time (needs matplotlib: dashrun[plot]).")
    @click.option("--json", is_flag=True, show_envvar=True, help="Print JSON.")
    def report(job, memd, token_file, prices, compare_on_demand, instance_type, market, plot,
               json) -> None:  # noqa: A002 (the name makes the twin DASH_REPORT_JSON)
        """What JOB's run cost and saved: node-hours by instance type and market, goodput, steps redone, time
        lost, and with --prices its cost, against on-demand nodes with --compare-on-demand."""
        table = inputs.read_prices(Path(prices)) if prices else None
        with connect(memd, token_file) as client:
            events, history = client.run_history(job)
            _, live = client.membership_view(job)
        if not events and history is None:
            raise NotFoundError(f"dash-memd knows no run of job {job!r}", hint="see the jobs with: dashrun status")
        body = ledger.compute(job, events, history, running=job_state(events, live) == JobState.RUNNING,
                              prices=table, on_demand=compare_on_demand, instance_type=instance_type,
                              market=market)
        if plot:
            _plot(body, events, Path(plot))
        if json:
            click.echo(jsonlib.dumps(body, indent=1, sort_keys=True))
            return
        _print_report(body)

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
    @click.option("--json", is_flag=True, show_envvar=True, help="Print JSON.")
    @click.option("--from-job", default=None, show_envvar=True, callback=job_param, metavar="JOB",
                  help="Take what is not given from this job's run history in dash-memd.")
    @memd_options
    def sim(steps, step_time, checkpoint_cost, restore_time, startup, state_size, nodes, mtbf, hazard, max_lifetime,
            trace, replace_time, notice, price, interval, runs, seed, json, from_job, memd,
            token_file) -> None:  # noqa: A002 (twin DASH_SIM_JSON)
        """Simulate a job on Spot nodes over checkpoint intervals: expected time, cost, goodput, steps lost, and the
        interval to use. With --from-job JOB, what is not given comes from that job's run history."""
        if from_job is not None:
            with connect(memd, token_file) as client:
                taken = _from_job(client, from_job)
            steps = steps if steps is not None else taken.get("steps")
            step_time = step_time if step_time is not None else taken.get("step_time")
            restore_time = restore_time if restore_time is not None else taken.get("restore_time")
            state_size = state_size if state_size is not None else taken.get("state_size")
            nodes = nodes or taken.get("nodes")
            if mtbf is None and not (hazard or max_lifetime or trace):
                mtbf = taken.get("mtbf")
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
                                          hazard=inputs.read_hazard(Path(hazard)) if hazard else ()),
            trace=inputs.read_trace(Path(trace)) if trace else None)
        intervals = parse_intervals(interval) if interval else simulator.sweep_intervals(config, seed)
        result = simulator.sweep(config, intervals, runs=runs, seed=seed)
        if json:
            body = result.to_body()
            body["inputs"] = {"steps": steps, "step_time_s": step_time, "checkpoint_cost_s": config.checkpoint_cost,
                              "restore_time_s": config.restore_time, "startup_s": config.startup,
                              "nodes": [min_nodes, max_nodes], "state_size": state_size}
            click.echo(jsonlib.dumps(body, indent=1, sort_keys=True))
            return
        _print_sweep(config, result)


    return [sim, report]
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


def _from_job(client, job: str) -> dict:
    """``sim``'s defaults from a job's run history: its steps, step time, largest world, restore time, state size
    and each node's mean time between preemptions."""
    events, history = client.run_history(job)
    if history is None or not history.points:
        raise NotFoundError(f"dash-memd has no run history of job {job!r} to take defaults from",
                            hint="run the job under dashrun first, or give --steps and --step-time")
    body = ledger.compute(job, events, history, running=False)
    taken: dict = {"steps": body["steps_done"], "nodes": str(body["largest_world"])}
    if body["node_seconds_per_step"]:
        taken["step_time"] = body["node_seconds_per_step"] / body["largest_world"]
    if history.restores:
        taken["restore_time"] = history.restore_s / history.restores
    losses = body["preemptions"]["notice"] + body["preemptions"]["killed"]
    if losses:
        taken["mtbf"] = body["node_hours"]["total"] * 3600 / losses
    newest = client.latest(job)
    if newest is not None:
        taken["state_size"] = newest.nbytes
    return taken


def _print_report(body: dict) -> None:
    hours = body["node_hours"]
    kinds = ", ".join(f"{kind} {h:.2f}" for kind, h in sorted(hours["by_instance_type_and_market"].items()))
    console.print(f"{body['job']}: {body['steps_done']} steps done, {body['steps_redone']} redone after rollbacks; "
                  f"{hours['total']:.2f} node-hours ({kinds or 'none'}); goodput {body['goodput']:.0%}",
                  highlight=False)
    lost = body["time_lost_s"]
    console.print(f"time lost: {_duration(lost['redone'])} redoing steps, {_duration(lost['restore'])} restoring, "
                  f"{_duration(lost['other'])} else (start-up, checkpoints, waiting); "
                  f"{body['preemptions']['notice']} left after a notice, {body['preemptions']['killed']} killed",
                  highlight=False)
    table = Table("node", "instance type", "market", "joined", "hours", "ended")
    for stay in body["nodes"]:
        table.add_row(stay["node"], stay["instance_type"], stay["market"],
                      time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stay["start"])),
                      f"{(stay['end'] - stay['start']) / 3600:.3f}", stay["why"])
    console.print(table)
    if "cost_usd" in body:
        line = f"cost ${body['cost_usd']:,.2f}"
        if "on_demand_cost_usd" in body:
            demand, took = body["on_demand_cost_usd"], body["on_demand_hours"] * 3600
            line += (f"; on on-demand {body['on_demand_instance_type']}: ${demand:,.2f} in "
                     f"{_duration(took)}")
            if demand > 0 and took > 0:
                line += (f": spot saved {1 - body['cost_usd'] / demand:.0%}, took "
                         f"{body['wall_s'] / took:.1f}× as long")
        console.print(line, highlight=False)


def _plot(body: dict, events, path: Path) -> None:
    """World size and step over time, as a PNG, written atomically."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError("--plot needs matplotlib", hint="pip install 'dashrun[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    points = body["points"]
    start = min([p[0] for p in points] + [e.time for e in events] or [0.0])
    figure, steps = pyplot.subplots(figsize=(8, 4))
    steps.plot([(p[0] - start) / 60 for p in points], [p[1] for p in points], ".-", label="step")
    steps.set_xlabel("minutes")
    steps.set_ylabel("step")
    world = steps.twinx()
    changes = sorted([(e.time, e.world) for e in events] + [(p[0], p[2]) for p in points])
    world.step([(t - start) / 60 for t, _ in changes], [w for _, w in changes], where="post", color="tab:orange",
               label="world size")
    world.set_ylabel("nodes")
    steps.set_title(f"{body['job']}: goodput {body['goodput']:.0%}")
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=100)
    pyplot.close(figure)
    write_atomic(path, out.getvalue(), 0o644)
