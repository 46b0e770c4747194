"""Children that die with the process that started them, even when it is killed with -9,
and that a terminal's Ctrl-C does not reach.

Every process `polyrl train` starts (the manager, the publisher's data plane, the local
and launched workers, the reward pool's workers) must not outlive it: an orphan keeps
heartbeating to a manager that is gone, or holds a core and memory for nobody. Linux's
PR_SET_PDEATHSIG signals the child when its parent *thread* ends (so children are started
from threads that live as long as they should); elsewhere this is a no-op.

Each child also runs in a session of its own: a terminal sends Ctrl-C to its whole
foreground process group, and the trainer alone decides what it means (trainer/loop.py:
finish the step and save; a second Ctrl-C sets `HURRY`, and children are killed instead of
drained). The exception is multiprocessing's resource tracker, which Python starts itself
(with `util.spawnv_passfds`, no session option) when the reward pool spawns its first
worker: it ignores SIGINT and SIGTERM (blocked across its start), and exits once every
holder of its pipe, the trainer and the pool's workers, is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

PR_SET_PDEATHSIG = 1


def _find_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once at import, not in a forked child: between fork and exec a threaded
# parent's child must not dlopen/dlsym (a lock held by another thread at fork time would
# deadlock it).
_PRCTL = _find_prctl()


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Have `sig` sent to this process when the thread that started it ends."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig))


PARENT_ENV = "POLYRL_DIE_WITH_PARENT"
"""`<parent pid>:<signal>`: set by `parent_death_env` for a child, read by the child's
`polyrl.cli` before anything else (`die_with_parent_from_env`)."""


def parent_death_env(sig: signal.Signals = signal.SIGTERM) -> dict[str, str]:
    """The environment entry that makes a `polyrl.cli` child die with this process.

    The child asks for it itself, first thing after exec, rather than in a Popen
    `preexec_fn`: Python runs a `preexec_fn` in the forked child before exec, and in a
    parent with threads (the trainer's I/O threads) that child can hang on a lock another
    thread held at fork time. It happened in a test run: a child spun for 28 minutes
    between fork and exec, taking a core from everything after it."""
    return {PARENT_ENV: f"{os.getpid()}:{int(sig)}"}


def die_with_parent_from_env() -> None:
    """In a child started with `parent_death_env`: `exit_with_parent` with the parent's
    pid and signal (removed from the environment, so this process's own children do not
    take its parent for theirs)."""
    value = os.environ.pop(PARENT_ENV, None)
    if value:
        pid, sig = (int(part) for part in value.split(":"))
        exit_with_parent(pid, signal.Signals(sig))


def exit_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """`die_with_parent`, then exit at once if the parent `parent_pid` already died before
    this process could ask (a child started with exec: its parent passes its pid)."""
    die_with_parent(sig)
    if os.getppid() != parent_pid:
        os._exit(1)


HURRY = threading.Event()
"""Set by a second Ctrl-C: whoever stops a child kills it now instead of waiting for it to
drain (`wait_unless_hurried`)."""


def wait_unless_hurried(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `proc` to exit, but not past `HURRY`; True if it exited."""
    deadline = time.monotonic() + timeout_s
    while not HURRY.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            proc.wait(timeout=min(left, 0.1))
            return True
        except subprocess.TimeoutExpired:
            continue
    return proc.poll() is not None
