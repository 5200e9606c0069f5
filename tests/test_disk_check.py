"""scripts/disk_check.sh: `make install`/`make test` refuse to start without the disk
they need (a full disk used to stop pip minutes in, with a venv half-written)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check(*items: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts/disk_check.sh"), *items],
                          capture_output=True, text=True, env={**os.environ, **env})


def test_a_piece_that_does_not_fit_is_named_with_the_free_and_needed_space(tmp_path):
    free_gb = shutil.disk_usage(tmp_path).free / 2**30
    r = _check(f"venv-x:{tmp_path}/venv/.installed:{free_gb + 50:.0f}", "scratch:-:0.001")
    assert r.returncode == 1
    assert f"venv-x {free_gb + 50:.0f} GB" in r.stderr and "scratch 0.001 GB" in r.stderr
    assert f"{free_gb:.1f} GB free" in r.stderr and "DISK_CHECK=0" in r.stderr


def test_pieces_already_there_need_nothing_and_the_check_can_be_skipped(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels/torch-2.13.0-cp312.whl").touch()
    huge = "100000"
    assert _check(f"wheels:{tmp_path}/wheels/torch-*.whl:{huge}").returncode == 0
    assert _check(f"venv:{tmp_path}/none:{huge}", DISK_CHECK="0").returncode == 0
    assert _check(f"venv:{tmp_path}/none/deeper/.installed:0.001").returncode == 0
