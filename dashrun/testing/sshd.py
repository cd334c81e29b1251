"""An OpenSSH server of the test's own on a loopback port, with its own host key (Debian's openssh-server).

:func:`unavailable` says why one cannot run here (for a skip); :class:`Sshd`
starts one that accepts the keys in ``authorized_keys`` for this user only,
and passes the leak tag (:mod:`dashrun.testing.leaks`) on to its sessions,
whose processes leave the test's process tree once the sshd is gone.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
from pathlib import Path

from dashrun.testing import leaks
from dashrun.testing.processes import free_port, kill_tree, wait_for

__all__ = ["Sshd", "find_sshd", "keygen", "unavailable"]


def find_sshd() -> Path | None:
    """Debian's /usr/sbin/sshd (not on a user's PATH), or an sshd on PATH."""
    for candidate in ("/usr/sbin/sshd", shutil.which("sshd")):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def unavailable() -> str | None:
    """Why an sshd cannot be started here (None: it can)."""
    if find_sshd() is None or not shutil.which("ssh-keygen"):
        return "needs OpenSSH's sshd and ssh-keygen (Debian: apt-get install -y openssh-server)"
    return None


def keygen(path: Path) -> str:
    """A new ed25519 key pair at ``path`` (and ``path.pub``); the public key's line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)], check=True)
    return path.with_suffix(".pub").read_text().strip()


class Sshd:
    """An sshd on 127.0.0.1 serving once made; :meth:`stop` ends it and whatever its sessions still run.

    ``env``: variables every session gets (sshd's ``SetEnv``); ``extra``: more sshd_config lines.
    """

    def __init__(self, name: str, root: Path, authorized_keys: Path, extra: str = "", env: dict | None = None):
        self.name, self.port = name, free_port()
        if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        root.mkdir()
        self.host_key = keygen(root / "host_ed25519_key")
        self.log_path = root / "sshd.log"
        env = dict(env or {})
        if leaks.TAG in os.environ:  # sshd gives its sessions a fresh environment: the tag goes in by name
            env[leaks.TAG] = os.environ[leaks.TAG]
        set_env = "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()) if env else ""
        config = root / "sshd_config"
        config.write_text(f"""\
ListenAddress 127.0.0.1:{self.port}
HostKey {root / 'host_ed25519_key'}
PidFile {root / 'sshd.pid'}
AuthorizedKeysFile {authorized_keys}
AllowUsers {getpass.getuser()}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
StrictModes no
PrintMotd no
PrintLastLog no
{set_env}
{extra}
""")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(find_sshd()), "-D", "-e", "-f", str(config)], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: "Server listening" in self.log() or self.proc.poll() is not None, 30, f"{name}'s sshd")
            assert self.proc.poll() is None, self.log()
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc, signal.SIGTERM)  # sshd, and whatever its sessions still run
        else:
            self.proc.wait()
        self._log.close()
