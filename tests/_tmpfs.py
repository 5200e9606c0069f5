"""A small tmpfs: a real ENOSPC for the disk-full tests (root only: mount(2) needs
CAP_SYS_ADMIN; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path, leave: int = 0) -> Path:
    """Writes a ballast file into ``path``'s filesystem until ``leave`` bytes are free."""
    ballast, disk = path / "ballast", os.statvfs(path)
    with open(ballast, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(disk.f_bavail * disk.f_frsize - leave, 0))
    return ballast
