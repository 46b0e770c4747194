"""Rollout workers the trainer launches, and spot churn on demand.

Each worker is an ordinary `polyrl worker` that registers with the trainer's manager,
exactly like one started by hand on another machine; a fleet only decides when workers
come and go. `WorkerFleet` runs them as subprocesses on this machine; `RayFleet`
(launch/ray_fleet.py, `fleet.launcher = "ray"`) as Ray actors on a cluster. Churn is the
same for both and follows the seeds' launch_sglang_step.sh (a worker every T seconds up
to K, then retire the oldest every T), repeated, plus optional kill -9 of a random worker
at seeded, exponentially spaced times. Retiring is SIGTERM: the worker drains and hands
its unfinished requests back. A kill gives no notice: the manager sees the connection
drop and migrates the requests token for token.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from polyrl.config import EngineConfig, FleetConfig, LoraConfig, TlsConfig
from polyrl.lifetime import parent_death_env, wait_unless_hurried

log = logging.getLogger("polyrl.fleet")


@dataclass
class LaunchedWorker:
    worker_id: str
    proc: subprocess.Popen[bytes]
    log_file: IO[bytes]
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class FleetEvents:
    launched: int = 0
    retired: int = 0
    killed: int = 0


class Fleet(ABC):
    """Launched workers, whatever runs them: launching, retiring, killing, and the churn
    schedule over those (a thread that only waits and sends signals)."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.events = FleetEvents()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self.workers: list[Any] = []
        """Launched and not retired, oldest first (each has a `worker_id`)."""

    logs: str
    """Where the workers' logs are, for messages."""

    def start(self) -> list[str]:
        """Launch the initial workers (all of them, or one when churning) and start the
        churn thread; returns the launched ids."""
        first = 1 if self.cfg.churn_interval_s > 0 else self.cfg.num_workers
        ids = [self.launch() for _ in range(min(first, self.cfg.num_workers))]
        if self.cfg.churn_interval_s > 0 or self.cfg.kill_interval_s > 0:
            self._thread = threading.Thread(target=self._churn, name="polyrl-fleet", daemon=True)
            self._thread.start()
        return ids

    def _new_id(self, prefix: str) -> str:
        with self._lock:
            worker_id = f"{prefix}{self._next_id}"
            self._next_id += 1
        return worker_id

    @abstractmethod
    def launch(self) -> str:
        """Start one more worker; returns its id."""

    @abstractmethod
    def alive(self) -> list[Any]:
        """The launched workers still running, oldest first (each has a `worker_id`)."""

    def request(self, total: int) -> None:
        """Make room for `total` workers before launching them (the autoscaler's target):
        nothing to do for processes on this machine; Ray asks its cluster autoscaler."""

    def retire_oldest(self) -> str | None:
        """SIGTERM to the oldest (the spot notice): it drains, hands back, deregisters."""
        alive = self.alive()
        if not alive:
            return None
        oldest = alive[0]
        with self._lock:
            self.workers.remove(oldest)
            self.events.retired += 1
        log.info("retiring worker %s (SIGTERM)", oldest.worker_id)
        self._retire(oldest)
        return oldest.worker_id

    @abstractmethod
    def _retire(self, worker: Any) -> None:
        """Give `worker` the notice and see it out (SIGKILL past the drain allowance),
        without making the caller wait."""

    @abstractmethod
    def kill(self, worker: Any) -> None:
        """kill -9: no notice, no hand-back."""

    @abstractmethod
    def _stop_workers(self, workers: list[Any]) -> None:
        """Every one of `workers` leaves: SIGTERM, then SIGKILL after the drain allowance
        (at once after a second Ctrl-C)."""

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            workers, self.workers = list(self.workers), []
        self._stop_workers(workers)

    # ------------------------------------------------------------------------------ churn

    def _churn(self) -> None:
        rng = random.Random(self.cfg.kill_seed)
        period = self.cfg.churn_interval_s
        now = time.monotonic()
        next_change = now + period if period > 0 else float("inf")
        next_kill = now + self._gap(rng)
        growing = True
        while not self._stop.wait(min(0.2, max(min(next_change, next_kill) - time.monotonic(), 0.0))):
            now = time.monotonic()
            if now >= next_kill:
                alive = self.alive()
                if alive:
                    self.kill(rng.choice(alive))
                next_kill = now + self._gap(rng)
            if now >= next_change:
                growing = self._churn_step(growing)
                next_change = now + period

    def _churn_step(self, growing: bool) -> bool:
        growing = churn_direction(len(self.alive()), growing, self.cfg.num_workers, self.cfg.churn_min_workers)
        if growing:
            self.launch()
        else:
            self.retire_oldest()
        return growing

    def _gap(self, rng: random.Random) -> float:
        mean = self.cfg.kill_interval_s
        return rng.expovariate(1.0 / mean) if mean > 0 else float("inf")


class WorkerFleet(Fleet):
    """Workers as subprocesses of the trainer, on its machine (`fleet.launcher = "local"`)."""

    def __init__(
        self,
        cfg: FleetConfig,
        engine: EngineConfig,
        model_dir: Path,
        manager_url: str,
        token: str,
        log_dir: Path,
        lora: LoraConfig | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        super().__init__(cfg)
        self.engine, self.model_dir = engine, model_dir
        self.lora, self.tls = lora, tls
        self.manager_url, self.token, self.log_dir = manager_url, token, log_dir
        self.logs = str(log_dir)
        self.workers: list[LaunchedWorker]

    # ---------------------------------------------------------------------------- launching

    def launch(self) -> str:
        worker_id = self._new_id("w")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_dir / f"{worker_id}.log", "ab")  # noqa: SIM115 - closed when the worker ends
        proc = subprocess.Popen(
            self.command(worker_id),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env() | parent_death_env(),  # the worker dies with this process
            start_new_session=True,  # a Ctrl-C in the trainer's terminal is the trainer's
        )
        with self._lock:
            self.workers.append(LaunchedWorker(worker_id, proc, log_file))
            self.events.launched += 1
        log.info("launched worker %s (pid %d, log %s)", worker_id, proc.pid, self.log_dir / f"{worker_id}.log")
        return worker_id

    def command(self, worker_id: str) -> list[str]:
        return worker_command(
            self.model_dir,
            self.manager_url,
            worker_id,
            self.engine,
            [
                f"worker.usd_per_hour={self.cfg.usd_per_hour}",
                f"worker.drain_timeout_s={self.cfg.drain_timeout_s}",
                *lora_overrides(self.lora),
                *tls_overrides(self.tls),
            ],
        )

    def _env(self) -> dict[str, str]:
        return worker_env(self.token, self.cfg.worker_threads)

    # ---------------------------------------------------------------------------- leaving

    def alive(self) -> list[LaunchedWorker]:
        with self._lock:
            self._reap()
            return list(self.workers)

    def _reap(self) -> None:
        for w in [w for w in self.workers if w.proc.poll() is not None]:
            self.workers.remove(w)
            w.log_file.close()
            log.info("worker %s exited with code %s", w.worker_id, w.proc.returncode)

    def _retire(self, worker: LaunchedWorker) -> None:
        worker.proc.send_signal(signal.SIGTERM)
        threading.Thread(target=self._wait_then_kill, args=(worker,), daemon=True).start()

    def kill(self, worker: LaunchedWorker) -> None:
        worker.proc.kill()
        worker.proc.wait()
        with self._lock:
            if worker in self.workers:
                self.workers.remove(worker)
            self.events.killed += 1
        worker.log_file.close()
        log.warning("killed worker %s (SIGKILL)", worker.worker_id)

    def _wait_then_kill(self, worker: LaunchedWorker) -> None:
        try:
            worker.proc.wait(timeout=self.cfg.drain_timeout_s + 30)
        except subprocess.TimeoutExpired:
            log.warning("worker %s did not exit after SIGTERM: killing it", worker.worker_id)
            worker.proc.kill()
            worker.proc.wait()
        worker.log_file.close()

    def _stop_workers(self, workers: list[LaunchedWorker]) -> None:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.drain_timeout_s + 15
        for w in workers:
            if not wait_unless_hurried(w.proc, max(deadline - time.monotonic(), 0.1)):
                w.proc.kill()
                w.proc.wait()
            w.log_file.close()


def worker_command(
    model_dir: Path, manager_url: str, worker_id: str | None, engine: EngineConfig, overrides: list[str]
) -> list[str]:
    """`polyrl worker` joining `manager_url` with the run's engine settings (the dotted
    overrides come last, so a caller may append more)."""
    settings = [f"engine.{k}={json.dumps(v)}" for k, v in engine.model_dump(mode="json").items()]
    named = ["--worker-id", worker_id] if worker_id is not None else []
    return [
        sys.executable,
        "-m",
        "polyrl.cli",
        "worker",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--manager",
        manager_url,
        *named,
        *settings,
        *overrides,
    ]


def lora_overrides(lora: LoraConfig | None) -> list[str]:
    """A LoRA run's workers declare the adapters they accept (`polyrl.engine.lora`)."""
    if lora is None or not lora.enabled:
        return []
    keys = {"enabled", "rank", "alpha", "target_modules"}
    return [f"model.lora.{k}={json.dumps(v)}" for k, v in lora.model_dump(mode="json", include=keys).items()]


def tls_overrides(tls: TlsConfig | None) -> list[str]:
    """Workers of a TLS run serve HTTPS with the manager's certificate (they run on its
    host) and verify the manager and the publisher with its CA file."""
    if tls is None:
        return []
    return [f"worker.tls.{k}={json.dumps(v)}" for k, v in tls.model_dump(exclude_none=True).items()]


def worker_env(token: str, threads: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: `base` (default: ours) with the token and thread counts."""
    return dict(os.environ if base is None else base) | {
        "POLYRL_TOKEN": token,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }


def churn_direction(count: int, growing: bool, max_workers: int, min_workers: int) -> bool:
    """One tick of the schedule: True to launch a worker, False to retire the oldest.
    Grow up to `max_workers`, then shrink down to `min_workers`, then grow again."""
    if growing and count >= max_workers:
        return False
    if not growing and count <= min_workers:
        return True
    return growing
