"""The rollout manager as a child process of the trainer.

The manager parses every worker's token stream, and in the trainer's interpreter each
chunk held the GIL that the learner needs: on 2x H200 the learner slowed from 8.4 s to
19-29 s per step while a worker streamed into it (BENCHMARKS.md). So `polyrl train`
starts the same program a user runs standalone, `polyrl manager`, and talks to it only
through its authenticated HTTP API; the trainer receives finished groups, a few
messages per group.

The trainer binds the manager's socket itself and hands it to the child: the URL is
known before the child has imported anything, so the workers start at the same time as
the manager, and a restarted child serves on the same port with no rebind race. If the
child dies, `restart` starts it again on that socket: workers find it there and register
again by themselves (a heartbeat answered 404), and the trainer resubmits what was
unfinished (`rollout/remote.py`, through `launch/supervisor.py`).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from polyrl.config import ConfigError, ManagerConfig, ManagerRunConfig, save_config
from polyrl.launch.child import Child
from polyrl.serving import bind
from polyrl.tls import base_url, reachable_host

log = logging.getLogger("polyrl.rollout")

EXIT_CONFIG = 2
START_TIMEOUT_S = 120.0
"""Imports and binding take a few seconds; a loaded 2-core machine takes longer."""


class ManagerStartError(RuntimeError):
    pass


class ManagerProcess(Child):
    """`polyrl manager` started, watched and restarted by the trainer."""

    def __init__(self, cfg: ManagerConfig, token: str, run_dir: Path) -> None:
        """Binds the manager's address now: OSError if it is taken."""
        self.sock = bind(cfg.host, cfg.port)
        self.sock.listen()  # a worker that asks before the child serves waits in the backlog: not refused, not warned
        port = self.sock.getsockname()[1]
        self.url = base_url(cfg.host, port, cfg.tls.enabled)
        self.public_url = base_url(reachable_host(cfg.host, cfg.advertise_host), port, cfg.tls.enabled)
        """Where workers on other machines reach it (`manager.advertise_host`)."""
        # the token goes by environment; the port is the socket's, also for a restart
        self.cfg = cfg.model_copy(update={"token": None, "token_file": None, "url": None, "port": port})
        self.token, self.run_dir = token, run_dir
        self.num_restarts = 0
        self._ready = self.run_dir / "manager.url"
        super().__init__()

    def start(self) -> str:
        """Start the child and wait until it serves; returns its URL."""
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the child; it serves on our socket once its imports are done."""
        config = self.run_dir / "manager.toml"
        save_config(ManagerRunConfig(manager=self.cfg), config)
        self._ready.unlink(missing_ok=True)
        fd = self.sock.fileno()
        command = [
            sys.executable,
            "-m",
            "polyrl.cli",
            "manager",
            "--config",
            str(config),
            "--ready-file",
            str(self._ready),
            "--listen-fd",
            str(fd),
        ]
        self._spawn(command, _env(self.token), self.run_dir / "manager.log", pass_fds=(fd,))

    def wait_ready(self) -> str:
        """Wait until the child serves; returns its URL."""
        assert self.proc is not None
        self._wait_ready()
        log.info(
            "rollout manager (pid %d) serving on %s; log: %s", self.proc.pid, self.url, self.run_dir / "manager.log"
        )
        return self.url

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._ready.exists():
                return
            if self.proc.poll() == EXIT_CONFIG:  # e.g. its port is taken
                raise ConfigError(_tail(self.run_dir / "manager.log", 1))
            if self.proc.poll() is not None:
                raise ManagerStartError(
                    f"the rollout manager exited with code {self.proc.returncode} before serving "
                    f"(see {self.run_dir / 'manager.log'}): {_tail(self.run_dir / 'manager.log')}"
                )
            time.sleep(0.05)
        self.kill()
        raise ManagerStartError(f"the rollout manager did not serve within {START_TIMEOUT_S:.0f}s")

    def restart(self) -> str:
        """A new child on the same port, after the old one died (or is killed here)."""
        code = self.proc.poll() if self.proc is not None else None
        log.warning(
            "rollout manager %s; starting it again on %s",
            f"exited with code {code}" if code is not None else "unreachable",
            self.url,
        )
        self.kill()
        self.num_restarts += 1
        return self.start()

    def stop(self) -> None:
        """SIGTERM (the manager fails open batches and stops), then SIGKILL; the socket goes too."""
        super().stop()
        self.sock.close()


def _env(token: str) -> dict[str, str]:
    import os

    return os.environ | {"POLYRL_TOKEN": token, "OMP_NUM_THREADS": "1"}


def _tail(path: Path, num_lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-num_lines:])
    except OSError:
        return ""
