"""A single-node Slurm of the test's own (Debian's slurm-wlm and munge): munged, slurmctld and slurmd, as root.

:func:`unavailable` says why one cannot run here (for a skip). :class:`Slurm` writes a munge key and a
``slurm.conf`` under its own folder (free ports, its own state and spool folders, this machine as the one
node), starts the three daemons in the foreground, and waits until the node is idle; :meth:`Slurm.env` is the
environment the client commands (``sbatch``, ``scancel``, ``scontrol``) need. :meth:`Slurm.stop` cancels every
job and stops the daemons; slurmstepd and a job's processes carry the leak tag, so the leak check sees them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from dashrun.testing.processes import free_port, kill_tree, wait_for

__all__ = ["Slurm", "unavailable"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "squeue")


def _find(name: str) -> str | None:
    for folder in ("/usr/sbin", "/usr/bin"):
        if os.access(f"{folder}/{name}", os.X_OK):
            return f"{folder}/{name}"
    return shutil.which(name)


def unavailable() -> str | None:
    """Why a Slurm cannot be started here, or None."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if _find(name) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "a Slurm of the test's own needs root (slurmd starts jobs as their users)"
    return None


CONF = """\
ClusterName=dashtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
KillWait=30
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=600
JobRequeue=1
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """munged, slurmctld and slurmd of this test, under ``root`` (a short folder)."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge.sock"
        self.procs: list[subprocess.Popen] = []

    def env(self, **extra: str) -> dict:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def start(self) -> Slurm:
        for folder in ("state", "spool", "munge"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        os.chmod(self.root / "munge", 0o700)
        self.conf.write_text(CONF.format(host=self.host, ctld_port=free_port(), d_port=free_port(),
                                         munge_socket=self.munge_socket, root=self.root, cpus=os.cpu_count() or 1))
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--pid-file={self.root}/munge/munged.pid",
                                f"--log-file={self.root}/munge/munged.log", f"--seed-file={self.root}/munge/seed"])
        wait_for(self.munge_socket.exists, 30, "munged's socket")
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.host])
        try:
            wait_for(lambda: self.node_state().startswith("IDLE"), 180, "Slurm's node to be idle")
        except AssertionError as e:
            tails = {name: (self.root / f"{name}.out").read_text(errors="replace")[-1500:] for name in DAEMONS}
            raise AssertionError(f"{e}: node state {self.node_state()!r}; {tails}") from None
        return self

    def _daemon(self, name: str, argv: list[str]) -> None:
        log = open(self.root / f"{name}.out", "ab")
        try:
            self.procs.append(subprocess.Popen([_find(argv[0]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                                               env=self.env()))
        finally:
            log.close()

    def run(self, *argv: str, check: bool = True) -> str:
        """A client command (``scontrol``, ``sbatch`` ...) against this Slurm; its stdout."""
        result = subprocess.run([_find(argv[0]), *argv[1:]], capture_output=True, text=True, env=self.env(),
                                timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def node_state(self) -> str:
        out = self.run("scontrol", "show", "node", self.host, "-o", check=False)
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith("State=")), "")

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` of a job, as key=value fields (JobState, Restarts, ExitCode ...)."""
        out = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def stop(self) -> None:
        if not self.procs:
            return
        if self.procs[-1].poll() is None:  # slurmd still there: it kills what is left of the jobs
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        for proc in reversed(self.procs):
            kill_tree(proc)
        self.procs = []
