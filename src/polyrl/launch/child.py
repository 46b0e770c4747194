"""A process the trainer starts and owns (the manager, the local worker): its output goes
to a log file of the run, it dies with the trainer even by kill -9, and it is in a session
of its own, so a terminal's Ctrl-C is the trainer's to handle (it stops its children)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from polyrl.lifetime import parent_death_env, wait_unless_hurried

STOP_TIMEOUT_S = 15.0
"""After SIGTERM a child gets this long to drain and leave, then SIGKILL."""


class Child:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def _spawn(self, command: list[str], env: dict[str, str], log_path: Path, pass_fds: Sequence[int] = ()) -> None:
        self._close_log()
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed when the child is stopped or replaced
        self.proc = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            pass_fds=tuple(pass_fds),
            env=env | parent_death_env(),  # the child dies with this process (`polyrl.lifetime`)
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM without waiting (`stop` waits), so that several children stop at once."""
        if self.alive():
            self.proc.terminate()  # type: ignore[union-attr]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S (at once after a second Ctrl-C)."""
        if self.alive():
            self.proc.terminate()  # type: ignore[union-attr]
            wait_unless_hurried(self.proc, STOP_TIMEOUT_S)  # type: ignore[arg-type]
        self.kill()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()  # type: ignore[union-attr]
            self.proc.wait()  # type: ignore[union-attr]
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
