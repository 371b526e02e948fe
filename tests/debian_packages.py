"""A program the tests drive that comes from a Debian package (Chromium, promtool), installed with
apt-get when missing: CI runs as root on Debian, on a fresh machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def ensure_program(path: Path, package: str) -> Path:
    """`path`, after `apt-get install package` if it is not there yet (apt-get update first if needed)."""
    if path.exists():
        return path
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail(f"{path} is missing and cannot be installed here (needs root and apt-get): apt-get install -y "
                    f"{package}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"apt-get install {package} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert path.exists(), f"apt-get installed {package} but {path} is not there"
    return path
