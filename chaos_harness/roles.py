"""Faults of `polyrl train`'s own processes: each role runs in a process of its own (the
rollout manager, the local worker, the publisher's data plane), so each can die alone.

A real `polyrl train` runs with workers started outside it; a child of the trainer is
killed with SIGKILL mid-step, `injections` times. The trainer must notice, bring the
role back, and finish every step with every sample it asked for, each step logged once.

* manager: killed mid-step, while workers hold samples; the trainer starts it again on
  its port, tells it the publisher and the version, and resubmits the prompts whose
  groups had not arrived. Recovery: the kill until the new manager serves every worker
  again.
* local worker (hybrid, as a peer of the workers, so it holds work in every step's
  window): killed while it holds samples; they migrate to the workers token for token,
  and the trainer starts it again at the next publish. Recovery: the kill until the
  local worker is active again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from chaos_harness.harness import AUTH, free_port, kill_while_holding, read_steps, wait_for
from chaos_harness.restarts import CONTROL, _active_workers, _check_run, _cli, _serving, _start_workers, _stop
from chaos_harness.scenarios import FaultRow, Scale


def pids_with(*needles: str) -> list[int]:
    """Processes whose command line holds every needle (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def _workers(url: str) -> list[dict]:
    try:
        response = httpx.get(f"{url}/v1/workers", headers=AUTH, timeout=2)
        return response.json()["workers"] if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError, KeyError):
        return []


class TrainRun:
    """`polyrl train` with `num_workers` workers of its own started beside it."""

    def __init__(self, model_dir: Path, work: Path, scale: Scale, total_steps: int, extra: list[str]) -> None:
        work.mkdir(parents=True, exist_ok=True)
        self.work, self.run_dir, self.total_steps = work, work / "run", total_steps
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics = self.run_dir / "metrics.jsonl"
        overrides = [
            f"model.path={json.dumps(str(model_dir))}",
            f"manager.port={self.port}",
            "fleet.num_workers=0",
            f"fleet.min_workers={scale.num_workers}",
            f"trainer.total_steps={total_steps}",
            "trainer.save_every=0",
            "trainer.train_batch_size=8",
            "trainer.ppo_mini_batch_size=4",
            "rollout.n=4",
            "rollout.max_new_tokens=24",
            "logging.console=false",
            "logging.tensorboard=false",
            *CONTROL,
            *extra,
        ]
        self.workers = _start_workers(model_dir, self.url, work, scale.num_workers)
        self.trainer = _cli("train", "--run-dir", str(self.run_dir), *overrides, log_path=work / "trainer.log")

    def steps(self) -> list[dict[str, float]]:
        return read_steps(self.metrics)

    def until(self, predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> float:
        """wait_for, failing at once (with the log's end) when the trainer has exited."""

        def check() -> bool:
            if self.trainer.poll() is not None:
                tail = (self.work / "trainer.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the trainer exited with {self.trainer.returncode} before {what}; log:\n{tail}")
            return predicate()

        return wait_for(check, timeout_s, what, poll_s=poll_s)

    def finish(self, row: FaultRow) -> None:
        code = self.trainer.wait(timeout=600)
        if code != 0:
            row.errors.append(f"the trainer exited with {code}; see {self.work / 'trainer.log'}")
        _check_run(row, self.steps(), self.total_steps, [])
        row.errors += [f"worker exited with {p.returncode}" for p in self.workers if p.poll() is not None]

    def stop(self) -> None:
        _stop([self.trainer, *self.workers])


def manager_killed(model_dir: Path, work: Path, scale: Scale) -> FaultRow:
    row = FaultRow("trainer's manager process kill -9")
    run = TrainRun(model_dir, work, scale, total_steps=8 + 6 * scale.injections, extra=[])
    started = time.monotonic()
    try:
        for i in range(scale.injections):
            done = len(run.steps())
            run.until(lambda: len(run.steps()) > done + 2, 300, "steps served")
            pids = pids_with("polyrl.cli", " manager ", str(run.run_dir / "manager.toml"))
            if not pids:
                raise RuntimeError("no manager process found")
            # killed only while groups are unfinished: 24-token samples finish within a fraction
            # of a second, and on a loaded machine a kill after one look at the manager found them
            # done (nothing to resubmit); the workers are frozen, the manager asked again
            while True:
                run.until(lambda: _generating(run.url), 120, "samples in flight", poll_s=0.005)
                workers = pids_with("polyrl.cli", " worker ", f"--manager {run.url} ")  # the trainer's local one too
                if kill_while_holding(workers, lambda: _generating(run.url), settle_s=0.5, victims=pids):
                    break
            row.injected += 1
            killed = time.monotonic()
            run.until(lambda: _serving(run.url) and _active_workers(run.url) >= scale.num_workers, 120, "manager back")
            row.recovery_s.append(time.monotonic() - killed)
        run.finish(row)
    except Exception as e:
        row.errors.append(f"{type(e).__name__}: {e}")
    finally:
        run.stop()
    row.wall_s = round(time.monotonic() - started, 2)
    return row


def local_worker_killed(model_dir: Path, work: Path, scale: Scale, tries: int = 2) -> FaultRow:
    """Each injection kills the local worker while it holds unfinished samples and its engine
    has generated tokens since it was given them (a kill before the first token only
    restarts them): it is frozen first and the manager asked again (`kill_while_holding`),
    since 64-token samples of the tiny model finish within a fraction of a second. A freeze that finds nothing left is not
    a kill; the next step is tried. An injection counts once the run's metrics show samples
    moved after it, and is tried again, up to `tries` kills, while enough steps remain."""
    row = FaultRow("local worker kill -9 mid-window")
    # every engine step streamed: a killed sample has tokens to carry, so it migrates (not restarts)
    extra = [
        "rollout.mode=hybrid",
        "rollout.hybrid_local_until=learner",
        "rollout.max_new_tokens=64",
        "manager.stream_interval_s=0",
    ]
    total_steps = 10 + 25 * scale.injections + 15 * (tries - 1)  # a restart takes ~5-10 s
    run = TrainRun(model_dir, work, scale, total_steps=total_steps, extra=extra)
    started = time.monotonic()

    def local(key: str) -> float:
        return next((w[key] for w in _workers(run.url) if w["worker_id"] == "local"), -1)

    def local_url() -> str:
        return next((w["url"] for w in _workers(run.url) if w["worker_id"] == "local"), "")

    def migrated() -> int:
        return sum(int(r.get("rollout/migrated_samples", 0)) for r in run.steps())

    def steps_left() -> int:
        return total_steps - len(run.steps())

    def kill_once() -> bool:
        """Freeze-and-look until a kill lands on held samples (False: too few steps left)."""
        while steps_left() >= 20:
            done = len(run.steps())
            run.until(lambda: len(run.steps()) > done + 1, 300, "steps served")
            pids = pids_with("polyrl.cli", " worker ", "worker.local=true", f"--manager {run.url}")
            if not pids:
                raise RuntimeError("no local worker process found")
            run.until(lambda: local("num_inflight") > 0, 120, "the local worker holding samples", poll_s=0.005)
            # held is not enough: a kill before the first token restarts its samples, nothing migrates
            url = local_url()
            start = _generated(url)
            try:
                run.until(
                    lambda: _generated(url) > start and local("num_inflight") > 0,
                    30,
                    "the local worker decoding its samples",
                    poll_s=0.005,
                )
            except TimeoutError:
                continue  # they finished between two looks, or it is syncing a version: the next step
            if kill_while_holding(pids, lambda: local("num_inflight") > 0):
                return True
        return False

    try:
        for _ in range(scale.injections):
            before = migrated()
            for _ in range(tries):
                if not kill_once():
                    break
                row.injected += 1
                killed, at = time.monotonic(), len(run.steps())
                run.until(lambda: local("num_inflight") < 0, 60, "the manager dropping the local worker")
                run.until(lambda: local("weight_version") >= 0 and _local_active(run.url), 180, "the local worker back")
                row.recovery_s.append(time.monotonic() - killed)
                # the batch the kill hit is logged within a step or two
                wait_for(lambda: len(run.steps()) > at + 2 or run.trainer.poll() is not None, 120, "steps after")
                if migrated() > before:
                    break
        run.finish(row)
    except Exception as e:
        row.errors.append(f"{type(e).__name__}: {e}")
    finally:
        run.stop()
    row.wall_s = round(time.monotonic() - started, 2)
    return row


def _generated(worker_url: str) -> int:
    """Tokens the worker's engine has generated since it started (-1: no answer)."""
    try:
        response = httpx.get(f"{worker_url}/get_server_info", timeout=2)
        return int(response.json()["num_generated_tokens"]) if response.status_code == 200 else -1
    except (httpx.HTTPError, ValueError, KeyError):
        return -1


def _generating(url: str) -> bool:
    """A worker holds samples: killing the manager now leaves groups the trainer lacks."""
    return any(w["num_inflight"] > 0 for w in _workers(url))


def _local_active(url: str) -> bool:
    return any(w["worker_id"] == "local" and w["state"] == "active" for w in _workers(url))


ROLE_SCENARIOS: dict[str, Callable[[Path, Path, Scale], FaultRow]] = {
    "trainer's manager process kill -9": manager_killed,
    "local worker kill -9 mid-window": local_worker_killed,
}
