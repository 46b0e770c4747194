"""Process-level faults of the control side: the trainer and the standalone manager killed
with SIGKILL and started again, while the workers stay up.

* trainer: `polyrl train` with workers started outside it (they outlive it); killed one
  step after a checkpoint the workers served, then `polyrl train --resume RUN_DIR`. The
  workers must register with the restarted manager, pull the restored version and serve
  again. Recovery: the restart until the first step the workers served (the trainer's own
  start-up included).
* manager: `polyrl manager` killed and started again on its port; the workers notice,
  register again by themselves and serve the next batch. Recovery: the manager serving
  again until every worker is active.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from chaos_harness.harness import (
    AUTH,
    TOKEN,
    check_groups,
    child_env,
    free_port,
    make_batch,
    read_steps,
    spawn_worker,
    wait_for,
)
from chaos_harness.scenarios import FaultRow, Scale
from polyrl.manager.client import BatchClient
from polyrl.trainer.checkpoint import latest_checkpoint

CONTROL = [
    "manager.heartbeat_interval_s=0.2",
    "manager.heartbeat_timeout_s=2.0",
    "manager.connect_timeout_s=2.0",
    "manager.stall_timeout_s=10.0",
]


def _cli(*args: str, log_path: Path) -> subprocess.Popen[bytes]:
    log_file = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed here right after
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "polyrl.cli", *args],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(),
        )
    finally:
        log_file.close()


def _serving(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _active_workers(url: str) -> int:
    try:
        workers = httpx.get(f"{url}/v1/workers", headers=AUTH, timeout=2).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
    return sum(w["state"] == "active" for w in workers)


def _start_workers(model_dir: Path, manager_url: str, work: Path, count: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(count):
        with open(work / f"w{i}.log", "ab") as log_file:
            procs.append(spawn_worker(model_dir, manager_url, f"w{i}", free_port(), log_file))
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def manager_restart(model_dir: Path, work: Path, scale: Scale) -> FaultRow:
    row = FaultRow("standalone manager kill -9, restart")
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    manager_args = ("manager", "--port", str(port), *CONTROL)
    manager = _cli(*manager_args, log_path=work / "manager.log")
    workers = _start_workers(model_dir, url, work, scale.num_workers)
    started = time.monotonic()
    try:
        wait_for(lambda: _active_workers(url) == scale.num_workers, 120, "workers active", poll_s=0.1)
        for i in range(scale.injections):
            manager.send_signal(signal.SIGKILL)
            manager.wait(timeout=10)
            row.injected += 1
            time.sleep(1.0)  # the workers' heartbeats fail meanwhile
            manager = _cli(*manager_args, log_path=work / "manager.log")
            wait_for(lambda: _serving(url), 120, "the manager to serve again", poll_s=0.02)
            row.recovery_s.append(  # from serving again: the manager's own start-up is not the workers' doing
                wait_for(lambda: _active_workers(url) == scale.num_workers, 120, "workers back", poll_s=0.02)
            )
            request = make_batch(scale.num_prompts, scale.n, scale.max_new_tokens, tag=f"mr{i}-")
            with BatchClient(url, TOKEN) as client:
                try:
                    row.add(check_groups(request, list(client.generate(request))))
                except Exception as e:
                    row.add(check_groups(request, [], f"{type(e).__name__}: {e}"))
        for p in workers:
            if p.poll() is not None:
                row.errors.append(f"a worker exited with {p.returncode} during the manager's outages")
    except Exception as e:
        row.errors.append(f"{type(e).__name__}: {e}")
    finally:
        _stop([manager, *workers])
    row.wall_s = round(time.monotonic() - started, 2)
    return row


def trainer_restart(model_dir: Path, work: Path, scale: Scale) -> FaultRow:
    row = FaultRow("trainer kill -9, --resume")
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # each injection takes 3 worker-served steps past a checkpoint, then the kill; the trainer is down
    # (no step runs) until it is back with the workers (fleet.min_workers): 10 a kill leaves room
    total_steps, save_every = 15 + 10 * scale.injections, 2
    overrides = [
        f"model.path={json.dumps(str(model_dir))}",
        f"manager.port={port}",
        "fleet.num_workers=0",
        f"fleet.min_workers={scale.num_workers}",  # else a trainer faster than the workers' start runs alone
        f"trainer.total_steps={total_steps}",
        f"trainer.save_every={save_every}",
        "trainer.train_batch_size=8",
        "trainer.ppo_mini_batch_size=4",
        "rollout.n=4",
        "logging.console=false",
        "logging.tensorboard=false",
        *CONTROL,
    ]
    workers = _start_workers(model_dir, url, work, scale.num_workers)
    started = time.monotonic()
    metrics = run_dir / "metrics.jsonl"

    def steps() -> list[dict[str, float]]:
        return read_steps(metrics)

    def served_by_workers_since(step: float) -> bool:
        return any(r["step"] > step and r["rollout/local_samples"] == 0 for r in steps())

    log_path = work / "trainer.log"
    trainer = _cli("train", "--run-dir", str(run_dir), *overrides, log_path=log_path)
    resumed_at: list[int] = []

    def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
        """wait_for, failing at once (with the log's end) when the trainer has exited."""

        def check() -> bool:
            if trainer.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the trainer exited with {trainer.returncode} before {what}; its log ends:\n{tail}")
            return predicate()

        return wait_for(check, timeout_s, what, poll_s=0.05)

    try:
        for _ in range(scale.injections):
            # no wait for the workers here: the trainer waits for them (fleet.min_workers), and
            # both are seldom "active" at one instant while a version comes every 0.3 s
            done = steps()[-1]["step"] if steps() else 0
            # killed one step after a checkpoint the workers served: the resumed run redoes it
            until(lambda: served_by_workers_since(done + save_every), 300, "worker-served steps")
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(timeout=10)
            row.injected += 1
            latest = latest_checkpoint(run_dir)  # the trainer's own choice (a half-written one is not)
            assert latest is not None, "killed before the first checkpoint"
            checkpoint = int(latest.name.split("_")[1])
            resumed_at.append(checkpoint)
            restarted, restarted_wall = time.monotonic(), time.time()
            trainer = _cli("train", "--resume", str(run_dir), log_path=log_path)

            def back() -> bool:  # resuming first drops the lines past the checkpoint
                return metrics.stat().st_mtime > restarted_wall and served_by_workers_since(checkpoint)

            until(back, 300, "a worker-served step after the restart")
            row.recovery_s.append(time.monotonic() - restarted)
        code = trainer.wait(timeout=600)
        if code != 0:
            row.errors.append(f"the resumed trainer exited with {code}; see {work / 'trainer.log'}")
        _check_run(row, steps(), total_steps, resumed_at)
        row.errors += [f"worker exited with {p.returncode}" for p in workers if p.poll() is not None]
    except Exception as e:
        row.errors.append(f"{type(e).__name__}: {e}")
    finally:
        _stop([trainer, *workers])
    row.wall_s = round(time.monotonic() - started, 2)
    return row


def _check_run(row: FaultRow, rows: list[dict[str, float]], total_steps: int, resumed_at: list[int]) -> None:
    """Every step logged once, each with every sample it asked for; after each resume the
    workers (not the trainer's own engine) served the steps again."""
    steps = [int(r["step"]) for r in rows]
    if steps != list(range(1, total_steps + 1)):
        row.errors.append(f"steps logged: {steps}, expected 1..{total_steps} once each")
    for r in rows:
        row.samples += int(r["rollout/samples_requested"])
        row.lost += int(r["rollout/samples_requested"] - r["rollout/samples_received"])
        row.migrated += int(r.get("rollout/migrated_samples", 0))
    for checkpoint in resumed_at:
        after = [int(r["step"]) for r in rows if r["step"] > checkpoint and r["rollout/local_samples"] == 0]
        if not after:
            row.errors.append(f"no step after resuming from step {checkpoint} was served by the workers")


RESTART_SCENARIOS: dict[str, Callable[[Path, Path, Scale], FaultRow]] = {
    "standalone manager kill -9, restart": manager_restart,
    "trainer kill -9, --resume": trainer_restart,
}
