"""dashrun in one minute: train, get preempted, come back exactly where it was.

    python scripts/demo.py [--steps 60] [--kill] [--workdir DIR]

1. starts a private dash-memd on loopback, and a fake AWS metadata service
   (scripts/fake_metadata.py) in place of the cloud's,
2. trains examples/tiny_gpt.py on 2 CPU ranks, uninterrupted, for reference,
3. trains it again under another job id; two thirds of the way through, the
   fake serves a Spot interruption notice: both ranks checkpoint the same step,
   dash-memd commits it, and dashrun exits 75. (``--kill`` instead SIGKILLs the
   launcher, its agent and both ranks: the steps since the last periodic
   checkpoint are then run again.)
4. runs the very same command again, as a replacement node would: it resumes
   from the newest checkpoint committed in dash-memd,
5. compares the losses of every step with the uninterrupted run.

Exits 0 when every step's loss is bit-identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny_gpt.py"
PREEMPTED = 75
console = Console()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_metadata import FakeMetadata  # noqa: E402  (a script beside this one)

from dashrun.testing.memd import Memd  # noqa: E402
from dashrun.testing.processes import NotServing, kill_tree  # noqa: E402


def read_losses(path: Path) -> dict[int, list[str]]:
    losses: dict[int, list[str]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            step, loss = line.split()
            losses.setdefault(int(step), []).append(loss)
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--kill", action="store_true", help="SIGKILL everything instead of sending a notice")
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here (default: a temp dir)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dashrun-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    token = work / "token"
    if not token.exists():
        subprocess.run([sys.executable, "-m", "dashrun.memd", "token", "--out", str(token)], check=True,
                       stdout=subprocess.DEVNULL)

    console.rule("[bold]1. a private dash-memd on loopback, and a fake AWS metadata service")
    memd = Memd(work / "memd-data", token, "--memory-limit", "1GiB", log_path=work / "memd.log", timeout=30)
    try:
        memd.start(port=0)
    except NotServing as e:
        console.print(memd.log())
        console.print(f"[red]{e.reason}")
        return 1
    fake = FakeMetadata("aws", imdsv2="required").start()
    try:
        address = memd.address
        console.print(f"dash-memd listening on {address} (log: {work / 'memd.log'}); AWS metadata at {fake.url}")

        def dashrun(job: str, loss_log: Path, *extra: str) -> list[str]:
            return [sys.executable, "-m", "dashrun", "--memd", address, "--token-file", str(token),
                    "--job-id", job, "--nproc-per-node", "2", "--cloud", "aws", "--metadata-endpoint", fake.url,
                    "--poll-interval", "0.5", str(EXAMPLE), "--steps", str(args.steps),
                    "--interval", str(args.interval), "--loss-log", str(loss_log), *extra]

        def show(command: list[str]) -> None:
            """The command as a user would type it: the one line to copy."""
            typed = ["dashrun", *command[3:]]
            console.print("$ " + " ".join(shlex.quote(word) for word in typed), markup=False, highlight=False)

        reference_log, run_log = work / "reference-losses.txt", work / "run-losses.txt"
        for path in (reference_log, run_log):
            path.unlink(missing_ok=True)

        console.rule("[bold]2. an uninterrupted run, for reference")
        show(dashrun(f"reference-{work.name}", reference_log))
        with console.status("training 2 ranks ..."):
            reference = subprocess.run(dashrun(f"reference-{work.name}", reference_log),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if reference.returncode != 0:
            console.print(reference.stderr[-3000:], markup=False, highlight=False)
            console.print(f"[red]the reference run failed (exit code {reference.returncode})")
            return 1
        console.print(f"{args.steps} steps done")

        stop_at = args.steps * 2 // 3 + args.interval // 2  # between two periodic checkpoints
        job = f"demo-{work.name}"
        if args.kill:
            console.rule("[bold]3. the same training, killed with SIGKILL two thirds of the way")
        else:
            console.rule("[bold]3. the same training, and a Spot interruption notice two thirds of the way")
        show(dashrun(job, run_log, "--delay", "0.05"))
        with console.status(f"training until step {stop_at} ..."):
            launcher = subprocess.Popen(dashrun(job, run_log, "--delay", "0.05"),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            while max(read_losses(run_log), default=-1) < stop_at and launcher.poll() is None:
                time.sleep(0.05)
            if args.kill:
                kill_tree(launcher)
                console.print(f"killed the launcher, its dash-agent and both ranks after step "
                              f"{max(read_losses(run_log), default=-1)}")
            else:
                fake.notice("terminate", lead=120)
                _, stderr = launcher.communicate(timeout=300)
                said = [line for line in stderr.splitlines() if "preempted by" in line or "emergency" in line]
                console.print("\n".join(said[-3:]))
                console.print(f"dashrun exited with {launcher.returncode}"
                              + (" (preempted, state safe: relaunch to resume)" if launcher.returncode == PREEMPTED
                                 else ""))
                if launcher.returncode != PREEMPTED:
                    return 1
        stopped_after = max(read_losses(run_log), default=-1)
        fake.clear()  # the replacement node gets no notice

        console.rule("[bold]4. the same command again")
        show(dashrun(job, run_log))
        result = subprocess.run(dashrun(job, run_log), capture_output=True, text=True)
        resumed = next((line for line in result.stdout.splitlines() if line.startswith("resumed at step")), None)
        if result.returncode != 0 or resumed is None:
            console.print(result.stderr[-3000:])
            console.print("[red]the relaunch did not resume")
            return 1
        console.print(resumed + ("" if args.kill else f" (the notice stopped the job after step {stopped_after}: "
                                                        "no step lost)"))

        console.rule("[bold]5. losses, step by step")
        reference, run = read_losses(reference_log), read_losses(run_log)
        start = int(resumed.split()[-1])
        table = Table("step", "uninterrupted", "interrupted + resumed", "")
        identical = True
        for step in range(args.steps):
            losses = run.get(step, [])
            same = bool(losses) and all(loss == reference[step][0] for loss in losses)
            identical &= same
            if start - 2 <= step <= stopped_after + 2 or step in (0, args.steps - 1):
                note = "resumed here" if step == start else ("stopped after" if step == stopped_after else "")
                table.add_row(str(step), reference[step][0], " / ".join(losses), note)
        console.print(table)
        if identical:
            console.print(f"[bold green]all {args.steps} steps identical to the uninterrupted run, bit for bit")
        else:
            console.print("[bold red]the resumed run differs from the uninterrupted one")
        return 0 if identical else 1
    finally:
        fake.stop()
        memd.stop(timeout=60)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
