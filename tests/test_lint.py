"""`ruff check` over the repository, with the rules in pyproject.toml: unused and undefined
names, import order, and pycodestyle's errors. Part of the suite so that CI runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff is not None, "ruff is missing: it comes with the test extra (scripts/setup.sh installs it)"
    out = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
