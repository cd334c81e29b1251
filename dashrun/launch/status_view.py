"""What ``dashrun status`` shows of dash-memd and its jobs, and ``status --watch`` redraws: dash-memd's lines, the
jobs' table, what is wrong with them.

From a LIST reply (:mod:`dashrun.memd.store.listing`) whose jobs carry their state, restarts, speed and nodes'
states (:mod:`dashrun.launch.jobstate`); text is rich markup, with what dash-memd sent escaped.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dashrun.launch.jobstate import JobState
from dashrun.util.units import format_size

__all__ = ["age", "job_notes", "jobs_table", "print_jobs", "server_lines"]

#: The terminal width ``status --wide`` renders as: wider than any table it prints.
WIDE = 4096
#: The least width (with its padding and border) each other column of ``status`` gets beside the job ids.
NARROWEST_COLUMN = 7


def age(timestamp: float) -> str:
    seconds = max(0.0, time.time() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def server_lines(address: str, listing: dict) -> list[str]:
    """dash-memd's own lines of ``status`` (rich markup): its RAM, pending writes, object store, failed records."""
    memory = listing.get("memory", {})
    lines = [f"dash-memd at {escape(str(address))}: {format_size(memory.get('used', 0))} of "
             f"{format_size(memory.get('limit', 0))} RAM in use, "
             f"{listing.get('pending_disk_writes', 0)} disk writes pending"]
    if listing.get("object_store"):
        lines.append(f"object store {escape(listing['object_store'])}: {listing.get('pending_uploads', 0)} uploads "
                     "pending" + ("" if listing.get("object_listed") else ", not listed yet")
                     + (f" ([red]{escape(listing['object_error'])}[/])" if listing.get("object_error") else ""))
    if listing.get("tag_failures"):  # records altered on the path (or a bug): the operator should look
        lines.append(f"[red]{listing['tag_failures']} records failed authentication since dash-memd started[/] "
                     "(altered on the way to it: see its log)")
    return lines


def nodes(job: dict) -> str:
    """A job's nodes as its line in the table shows them: the most recent ones (with their state, where the
    job's membership records one), and how many others."""
    states = job.get("node_states", {})
    names = sorted(job.get("nodes", {}).keys() | states.keys())
    shown = ", ".join(f"{name} ({states[name]})" if name in states else name for name in names) or "-"
    return shown + (f" (+{job['nodes_more']} more)" if job.get("nodes_more") else "")


def speed(job: dict) -> str:
    speed = job.get("steps_per_second")
    return "-" if speed is None else f"{speed:.2f}" if speed < 10 else f"{speed:.0f}"


def latency(newest: dict | None) -> str:
    """How long the newest checkpoint took from its first shard to its commit (unknown for one loaded at a
    start of dash-memd)."""
    seconds = newest.get("commit_s") if newest else None
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.0f} s"


def jobs_table(jobs: list[dict], wide: bool = False) -> Table:
    """The jobs' table. The job id is never shortened (its column neither wraps nor shrinks): the other columns
    wrap where the terminal is narrow; ``wide``: none wraps."""
    table = Table()
    longest = max((len(job["job"]) for job in jobs), default=3)
    table.add_column("job", no_wrap=True, min_width=longest, overflow="fold")
    table.add_column("state", no_wrap=True, min_width=max(len(state.value) for state in JobState))
    for name in ("step", "restarts", "steps/s", "in", "size", "saved", "commit", "ranks", "nodes", "last notice"):
        table.add_column(name, no_wrap=wide, overflow="fold")
    for job in jobs:
        newest = job.get("newest")
        notice = job.get("notice")
        table.add_row(
            job["job"],
            job.get("state", "-"),
            str(newest["step"]) if newest else "-",
            str(job.get("restarts", "-")),
            speed(job),
            ", ".join(newest["tiers"]) if newest else "-",
            format_size(newest["nbytes"]) if newest else "-",
            age(newest["committed_at"]) if newest else "-",
            latency(newest),
            str(newest["world"]) if newest else "-",
            nodes(job),
            f"{notice['kind']} {age(notice['at'])}" if notice else "-",
        )
    return table


def job_notes(jobs: list[dict]) -> list[str]:
    """What is wrong with the jobs (rich markup): failing tiers, quarantined disk copies, bad RAM copies."""
    notes = []
    for job in jobs:
        for tier in ("disk", "object"):
            if job.get(f"{tier}_error"):
                failed = job.get(f"{tier}_failures")
                notes.append(f"[red]{escape(job['job'])}: {tier} tier failing: {escape(job[f'{tier}_error'])}"
                             + (f" ({failed} failed since dash-memd started; tried again)" if failed else "")
                             + "[/]")
        if job.get("quarantined"):
            copies = "1 disk copy" if job["quarantined"] == 1 else f"{job['quarantined']} disk copies"
            notes.append(f"[yellow]{escape(job['job'])}: {copies} failed their checksum, moved to quarantine/ in "
                         "dash-memd's data dir[/]")
        if job.get("bad_ram"):
            copies = "1 RAM copy" if job["bad_ram"] == 1 else f"{job['bad_ram']} RAM copies"
            notes.append(f"[red]{escape(job['job'])}: {copies} changed in dash-memd's memory after arriving (dropped;"
                         " read from disk or the checkpoint before): its machine's memory may be failing[/]")
    return notes


def print_jobs(console: Console, jobs: list[dict], wide: bool = False) -> None:
    """The jobs' table, then what is wrong with them. ``wide`` shows every column unshortened, however wide the
    table gets."""
    table = jobs_table(jobs, wide)
    longest = max((len(job["job"]) for job in jobs), default=3)
    # Wide: as wide as the table needs (a table that does not expand takes only that), however narrow the
    # terminal. Else the terminal's width, or more where the job ids and a few characters of each other column
    # would not fit in it: a job id is never cut.
    narrowest = longest + 4 + len("preempted") + 3 + (len(table.columns) - 2) * NARROWEST_COLUMN
    width = WIDE if wide else max(console.width, narrowest)
    (console if width == console.width else Console(width=width, highlight=False)).print(table)
    for note in job_notes(jobs):
        console.print(note, highlight=False)
