#!/usr/bin/env python3
"""Soak: many simulated nodes against one dash-memd for a bounded time, with random kills; nothing may be lost.

Starts a dash-memd and ``--nodes`` simulated nodes (``fleet.py``: a real
dash-agent and a group of real ranks checkpointing through
``dashrun.Checkpointer``, each node a job of its own), then, until
``--minutes`` have passed, SIGKILLs at random every ``--kill-every``
seconds or so a rank (its group restarts and restores), a node's dash-agent
(restarted, as dashrun's launcher does) or dash-memd (restarted on the same
port and data dir); the first three kills hit one of each.

Lost, which must be 0: a checkpoint rank 0 was told is committed
(``Checkpointer.wait()``) that dash-memd can no longer give back — checked
after every dash-memd restart and at the end (the job's newest checkpoint
must be at least as new, and its bytes right) — plus every restore that gave
a rank other bytes than it saved. A checkpoint held only in dash-memd's RAM
when dash-memd itself is SIGKILLed goes with it, by design (RAM is where it
is safe from the *Spot* nodes); those are counted apart ("in RAM at a memd
kill"): the ones on disk at that moment must survive. At the end every
checkpoint dash-memd lists is read back and checked byte for byte.

It prints a row every ``--sample-every`` seconds — checkpoints committed
(confirmed to a rank) and lost, kills, dash-memd's RSS, open descriptors and
threads, which must stay bounded — and a summary; ``--json OUT`` writes it
all. Exit code 0 only if nothing was lost, dash-memd answered every check
and stayed bounded.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from fleet import NodeSpec, SimNode, fleet_memd, verify_checkpoint  # noqa: E402

from dashrun.errors import DashError, NotFoundError  # noqa: E402
from dashrun.util.tokens import write_token  # noqa: E402
from dashrun.util.units import format_size, parse_size  # noqa: E402

__all__ = ["Soak", "main"]

#: What a kill hits, and how often (weights).
TARGETS = {"rank": 45, "agent": 35, "memd": 20}
#: After SIGKILLing dash-memd, how long to let a rank finish writing down a confirmation it already had.
CLAIM_GRACE = 1.0


class Soak:
    """One soak run: the fleet, the kills, and the books of what was confirmed, excused and lost."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.rng = random.Random(args.seed)
        token = workdir / "token"
        write_token(token)
        self.memd = fleet_memd(workdir, token, "--memory-limit", args.memory_limit)
        self.spec = NodeSpec(ranks=args.ranks, state_kib=args.state_kib, step_time=args.step_time,
                             interval=args.interval, confirm_every=args.confirm_every)
        self.nodes = [SimNode(i, self.memd, workdir, self.spec) for i in range(args.nodes)]
        self.kills = {target: 0 for target in TARGETS}
        self.excused: dict[str, set[int]] = {node.job: set() for node in self.nodes}  # in RAM at a memd kill
        self.lost: set[tuple[str, int]] = set()
        self.wrong: list[str] = []  # checkpoints whose bytes were not what was saved
        self.verified = 0
        self.unanswered: list[str] = []  # checks dash-memd did not answer
        self.samples: list[dict] = []
        self.memd_starts = 0
        self.fd_bound = 64 + 4 * args.nodes * args.ranks
        self.rss_bound = parse_size(args.memory_limit) + (512 << 20)

    # --- running ------------------------------------------------------------------------------------------

    def run(self) -> dict:
        args = self.args
        self.memd.start()
        self.memd_starts += 1
        started = time.monotonic()
        for node in self.nodes:
            node.start()
        print(f"dash-memd at {self.memd.address}, {len(self.nodes)} nodes of {args.ranks} ranks started in "
              f"{time.monotonic() - started:.0f}s; soaking for {args.minutes:g} min", flush=True)
        self._header()
        deadline = started + args.minutes * 60
        next_kill = time.monotonic() + args.warmup
        next_sample = time.monotonic()
        first = self.rng.sample(list(TARGETS), len(TARGETS))  # each kind once, first: short runs see them all
        while (now := time.monotonic()) < deadline:
            for node in self.nodes:
                node.supervise()
            if now >= next_kill:
                target = first.pop() if first else self.rng.choices(list(TARGETS), weights=list(TARGETS.values()))[0]
                if not self._kill(target) and target not in first:
                    first.append(target)  # nothing to kill of that kind now: it goes first next time
                next_kill = time.monotonic() + self.rng.uniform(0.5, 1.5) * args.kill_every
            if now >= next_sample:
                self._sample(now - started)
                while next_sample <= time.monotonic():  # a slow kill (dash-memd's restart) skips rows, not time
                    next_sample += args.sample_every
            time.sleep(0.2)
        for node in self.nodes:
            node.stop()
        self._sample(time.monotonic() - started)
        self._check(self._claims(), every_checkpoint=True)
        return self.summary()

    def _kill(self, target: str) -> bool:
        """Kill one of ``target``'s kind; False when there was none to kill (every node's ranks forking again)."""
        if target == "memd":
            self._kill_memd()
        elif target == "agent":
            self.rng.choice(self.nodes).kill_agent()
        elif not any(node.kill_rank(self.rng) for node in self.rng.sample(self.nodes, len(self.nodes))):
            return False
        self.kills[target] += 1
        return True

    def _kill_memd(self) -> None:
        """SIGKILL dash-memd and start it again; what was on disk must all be there, what rank 0 was told is
        committed and was only in RAM is excused."""
        on_disk = self._on_disk()
        self.memd.kill()
        time.sleep(CLAIM_GRACE)  # dash-memd is down: no rank can be told anything new meanwhile
        claims = self._claims()
        for job, steps in claims.items():
            self.excused[job] |= {step for step in steps if step > on_disk.get(job, -1)}
        self.memd.start()
        self.memd_starts += 1
        self._check(claims)

    def _on_disk(self) -> dict[str, int]:
        """Each job's newest checkpoint on dash-memd's disk."""
        try:
            with self.memd.client(timeout=10) as client:
                jobs = client.list()["jobs"]
        except DashError:
            return {}  # none known: every confirmation not yet checked counts as excused, never as lost
        return {j["job"]: max((c["step"] for c in j["checkpoints"] if "disk" in c["tiers"]), default=-1)
                for j in jobs}

    def _claims(self) -> dict[str, set[int]]:
        return {node.job: set(node.claims()) for node in self.nodes}

    def _check(self, claims: dict[str, set[int]], every_checkpoint: bool = False) -> None:
        """Every confirmed checkpoint not excused must be there, or a newer one; the bytes must be right."""
        try:
            self._check_with(claims, every_checkpoint)
        except DashError as e:  # a failure of the soak too: nothing could be checked
            self.unanswered.append(f"dash-memd (start {self.memd_starts}) did not answer the check: {e}")
            print(self.unanswered[-1], flush=True)

    def _check_with(self, claims: dict[str, set[int]], every_checkpoint: bool) -> None:
        with self.memd.client(timeout=30) as client:
            listed = {j["job"]: [c["step"] for c in j["checkpoints"]] for j in client.list()["jobs"]}
            for job, steps in claims.items():
                newest = max(listed.get(job, []), default=-1)
                self.lost |= {(job, step) for step in steps - self.excused[job] if step > newest}
                for step in listed.get(job, []) if every_checkpoint else [newest] if newest >= 0 else []:
                    try:
                        problem = verify_checkpoint(client, job, step, self.spec.state_kib)
                    except NotFoundError as e:  # deleted since the listing, once newer ones were on disk?
                        newer = client.latest(job)
                        if newer is not None and newer.step > step:
                            continue
                        problem = f"{job} step {step}: cannot be read back: {e}"
                    except DashError as e:
                        problem = f"{job} step {step}: cannot be read back: {e}"
                    self.verified += 1
                    if problem:
                        self.wrong.append(problem)

    # --- reporting ---------------------------------------------------------------------------------------

    def _header(self) -> None:
        print(f"{'time':>6} {'committed':>9} {'lost':>4} {'ram@kill':>8} {'restores':>8} {'kills r/a/m':>11} "
              f"{'memd RSS':>9} {'fds':>4} {'threads':>7}", flush=True)

    def _sample(self, elapsed: float) -> None:
        try:
            proc = psutil.Process(self.memd.pid)
            rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
        except psutil.NoSuchProcess:
            return
        claims = self._claims()
        sample = {"t": round(elapsed, 1), "committed": sum(map(len, claims.values())), "lost": self._lost(),
                  "in_ram_at_memd_kill": sum(map(len, self.excused.values())),
                  "restores": sum(node.restores()[0] for node in self.nodes), "kills": dict(self.kills),
                  "memd_rss": rss, "memd_fds": fds, "memd_threads": threads}
        self.samples.append(sample)
        kills = "/".join(str(self.kills[t]) for t in TARGETS)
        print(f"{elapsed:5.0f}s {sample['committed']:>9} {sample['lost']:>4} {sample['in_ram_at_memd_kill']:>8} "
              f"{sample['restores']:>8} {kills:>11} {format_size(rss):>9} {fds:>4} {threads:>7}", flush=True)

    def _lost(self) -> int:
        return len(self.lost) + len(self.wrong) + sum(node.restores()[1] for node in self.nodes)

    def summary(self) -> dict:
        rss = [s["memd_rss"] for s in self.samples]
        fds = [s["memd_fds"] for s in self.samples]
        bounded = max(fds, default=0) <= self.fd_bound and max(rss, default=0) <= self.rss_bound
        ok, bad = (sum(node.restores()[i] for node in self.nodes) for i in (0, 1))
        return {
            "config": vars(self.args), "samples": self.samples,
            "committed": sum(len(set(node.claims())) for node in self.nodes), "lost": self._lost(),
            "lost_checkpoints": sorted(f"{job} step {step}" for job, step in self.lost), "wrong_bytes": self.wrong,
            "in_ram_at_memd_kill": sum(map(len, self.excused.values())), "verified_reads": self.verified,
            "restores": {"ok": ok, "bad": bad}, "kills": self.kills, "memd_starts": self.memd_starts,
            "agent_restarts": sum(node.agent_restarts for node in self.nodes),
            "rank_errors": sum(node.errors() for node in self.nodes),
            "memd": {"rss_max": max(rss, default=0), "rss_bound": self.rss_bound, "fds_max": max(fds, default=0),
                     "fds_bound": self.fd_bound},
            "bounded": bounded, "unanswered_checks": self.unanswered,
            "ok": self._lost() == 0 and bounded and not self.unanswered,
        }


def print_summary(result: dict) -> None:
    memd = result["memd"]
    print(f"\ncommitted (confirmed to a rank): {result['committed']}, lost: {result['lost']}"
          f"{' ' + str(result['lost_checkpoints'] + result['wrong_bytes']) if result['lost'] else ''}")
    print(f"in dash-memd's RAM only when it was killed (excused): {result['in_ram_at_memd_kill']}; checkpoints read "
          f"back and checked: {result['verified_reads']}; restores checked: {result['restores']['ok']} right, "
          f"{result['restores']['bad']} wrong")
    print(f"kills: {result['kills']['rank']} ranks, {result['kills']['agent']} agents, {result['kills']['memd']} "
          f"dash-memd; rank errors: {result['rank_errors']}")
    print(f"dash-memd: RSS at most {format_size(memd['rss_max'])} (bound {format_size(memd['rss_bound'])}), "
          f"descriptors at most {memd['fds_max']} (bound {memd['fds_bound']}): "
          f"{'bounded' if result['bounded'] else 'NOT BOUNDED'}")
    for problem in result["unanswered_checks"]:
        print(problem)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--nodes", type=int, default=16, help="simulated nodes, one job each (default 16)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node (default 2)")
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to soak (default 10)")
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between kills, about (default 5)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the first kill (default 10)")
    parser.add_argument("--state-kib", type=int, default=64, help="replicated state per node in KiB (default 64)")
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds per training step (default 0.2)")
    parser.add_argument("--interval", type=int, default=5, help="steps between checkpoints (default 5)")
    parser.add_argument("--confirm-every", type=int, default=3,
                        help="rank 0 asks if its snapshot is committed every this many snapshots (default 3)")
    parser.add_argument("--memory-limit", default="1GiB", help="dash-memd's --memory-limit (default 1GiB)")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between rows (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the kills (default: random)")
    parser.add_argument("--json", metavar="OUT", help="also write the samples and the summary here")
    parser.add_argument("--workdir", help="where the logs and dash-memd's data go (default: a temporary directory, "
                                          "removed at the end unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dash-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, workdir)
    try:
        result = soak.run()
    finally:
        for node in soak.nodes:
            node.stop()
        soak.memd.stop(timeout=60)
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print_summary(result)
    print(f"seed {args.seed}" + (f"; logs in {workdir}" if args.keep or args.workdir else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
