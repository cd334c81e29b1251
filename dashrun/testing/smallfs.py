"""A size-limited file system (tmpfs) a test fills, to see what runs out of disk does; needs root and mount(8)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["SmallFs", "unavailable"]


def unavailable() -> str | None:
    """Why a tmpfs cannot be mounted here (None: it can)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a size-limited file system needs root and mount(8)"
    return None


class SmallFs:
    """A size-limited file system (tmpfs) mounted at ``path``; ``resize`` remounts it with another size."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True,
                       capture_output=True, timeout=30)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True, capture_output=True,
                       timeout=30)

    def fill(self) -> Path:
        """Write a file that takes every byte left; deleting it gives the space back."""
        filler = self.path / "filler"
        with open(filler, "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * (64 << 10)):
                    pass
            except OSError:  # no space left
                pass
        return filler

    def unmount(self) -> None:
        if subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)  # still in use: detach
