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
    """Have `sig` sent to this process when the thread that started it ends (usable as a
    Popen `preexec_fn`)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig))


def exit_with_parent(parent_pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """`die_with_parent`, then exit at once if the parent `parent_pid` already died before
    this process could ask (a child started with exec, not fork: its parent passes its pid)."""
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
