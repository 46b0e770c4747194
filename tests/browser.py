"""A headless Chromium for the operator page's tests: the page renders from its script,
so only a real browser shows what an operator sees.

`scripts/setup.sh` installs Debian's `chromium` when it runs as root with apt; elsewhere
set POLYRL_CHROMIUM to any Chromium or Chrome binary. Each run gets its own profile
directory and process group, and the whole group is killed afterwards: Chromium's
helper processes (zygote, GPU, network service) must not outlive the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    given = os.environ.get("POLYRL_CHROMIUM")
    if given:
        return given if Path(given).is_file() else None
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def run_chromium(binary: str, url: str, *args: str, budget_ms: int = 3000, timeout_s: float = 60) -> str:
    """Load `url`, let its scripts run for `budget_ms` of virtual time, return stdout."""
    with tempfile.TemporaryDirectory(prefix="polyrl-chromium-") as profile:
        cmd = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--disable-extensions",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            *args,
            url,
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own group: the helpers, nothing else
            except ProcessLookupError:
                pass
            proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"chromium exited with {proc.returncode} on {url}")
        return out.decode(errors="replace")


def dump_dom(binary: str, url: str, budget_ms: int = 3000) -> str:
    return run_chromium(binary, url, "--dump-dom", budget_ms=budget_ms)


def screenshot(binary: str, url: str, path: Path, size: tuple[int, int] = (1400, 1000), budget_ms: int = 3000) -> None:
    run_chromium(binary, url, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}", budget_ms=budget_ms)
