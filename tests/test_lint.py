"""`ruff check` and `ruff format --check` over the repository, with the settings in
pyproject.toml: unused and undefined names, import order, pycodestyle's errors, and one
layout. Part of the suite so that CI runs them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert exe is not None, "ruff is missing: it comes with the test extra (scripts/setup.sh installs it)"
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_check_passes() -> None:
    out = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_format_check_passes() -> None:
    """Run `ruff format .` to fix what this names."""
    out = ruff("format", "--check", "--no-cache", ".")
    assert out.returncode == 0, out.stdout + out.stderr
