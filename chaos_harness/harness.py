"""A small real rollout system to break on purpose: the rollout manager in-process, the
weight publisher, and `polyrl worker` subprocesses, with a FaultProxy on every link.

Each worker is reached by the manager through one proxy (`to_worker`: generation
streams, readiness checks, weight-update calls) and reaches the manager through another
(`to_manager`: registration, heartbeats); every pull of the data plane goes through a
third in front of the publisher. Faults are set on those proxies or delivered as
signals to the worker processes; `check_groups` then counts what a batch lost,
duplicated or cut short.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch

from chaos_harness.proxy import FaultProxy
from polyrl.config import ManagerConfig
from polyrl.manager.main import ManagerThread
from polyrl.manager.manager import RolloutManager
from polyrl.manager.weight_sync import PublisherSync
from polyrl.protocol.manager_api import BatchError, BatchPrompt, BatchRequest, GroupResult, WorkerInfo
from polyrl.protocol.sampling import SamplingParams
from polyrl.transfer.publisher import WeightPublisher

log = logging.getLogger("chaos_harness")

TOKEN = "chaos-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def chaos_manager_config(**overrides: object) -> ManagerConfig:
    """Short timeouts, so a fault is noticed in about a second instead of tens."""
    base: dict[str, object] = dict(
        port=0,
        token=TOKEN,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=2.0,
        readiness_timeout_s=30,
        connect_timeout_s=2.0,
        stall_timeout_s=5.0,
        batch_deadline_s=300,
    )
    return ManagerConfig(**(base | overrides))  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_steps(path: Path) -> list[dict[str, float]]:
    """A live run's metrics.jsonl, whole lines only: the trainer may be writing the last
    one (a line of a few KB reaches the file in more than one write), or was killed -9 in
    the middle of it and has not been resumed yet (the resume drops it)."""
    if not path.exists():
        return []
    whole = path.read_text().split("\n")[:-1]  # after the last newline: a line still being written
    return [json.loads(line) for line in whole if line.strip()]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> float:
    """Seconds until `predicate()` held; TimeoutError naming `what` after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


def samples_streaming(manager: RolloutManager, worker_ids: Collection[str]) -> int:
    """How many samples run on `worker_ids` with tokens of their running segment already
    at the manager: killed now, such a worker leaves them tokens to carry elsewhere, not
    samples to start again. Reads the manager's state: call it on its loop
    (`ManagerThread.call`, or from a hook that runs there)."""
    running = (s for unit in manager.state.units.values() for s in unit.samples)
    return sum(s._seg_worker in worker_ids and bool(s._seg_tokens) for s in running)


def kill_while_holding(
    pids: Sequence[int], holding: Callable[[], bool], settle_s: float = 0.3, victims: Sequence[int] | None = None
) -> bool:
    """kill -9 `pids` only if they still hold work once frozen: short samples can finish
    between a look at the manager and the signal (a slow machine makes that likely), and a
    kill that lands on finished work tests nothing. The processes are stopped (SIGSTOP),
    the manager is given `settle_s` to read the chunks already sent, and `holding()` is
    asked again: True, they are killed; False, they go on (SIGCONT) and nothing happened.
    With `victims`, those are killed instead (the manager, say, while the frozen workers
    hold its samples), and `pids` go on either way."""
    for pid in pids:
        _signal(pid, signal.SIGSTOP)
    hit = False
    try:
        time.sleep(settle_s)
        hit = holding()
        if hit:
            for pid in victims or ():
                _signal(pid, signal.SIGKILL)
    finally:
        for pid in pids:
            _signal(pid, signal.SIGKILL if hit and victims is None else signal.SIGCONT)
    return hit


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------- workers


def spawn_worker(
    model_dir: Path,
    manager_url: str,
    worker_id: str,
    port: int,
    log_file: IO[bytes],
    advertise_url: str | None = None,
    engine_overrides: Mapping[str, object] | None = None,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """`polyrl worker` registering with `manager_url` (token: TOKEN), one CPU thread;
    `extra`: more dotted overrides (e.g. worker.usd_per_hour=0.5)."""
    engine = [f"engine.{k}={v}" for k, v in (engine_overrides or {"max_num_seqs": 16}).items()]
    advertise = [f"worker.advertise_url={json.dumps(advertise_url)}"] if advertise_url else []
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "worker",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--manager",
        manager_url,
        "--worker-id",
        worker_id,
        *advertise,
        "worker.drain_timeout_s=2",
        *engine,
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env())


def child_env() -> dict[str, str]:
    """What every process the harness starts gets: the shared token, one CPU thread."""
    return os.environ | {"POLYRL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class WorkerHandle:
    worker_id: str
    proc: subprocess.Popen[bytes]
    port: int
    to_worker: FaultProxy
    to_manager: FaultProxy
    log_file: IO[bytes]

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a frozen process cannot die of SIGKILL until resumed
            self.kill()
        self.to_worker.stop()
        self.to_manager.stop()
        self.log_file.close()


# ------------------------------------------------------------------------------- batches


@dataclass
class BatchCheck:
    """What one batch delivered against what it asked for."""

    requested: int
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong_length: int = 0
    migrated: int = 0
    """Delivered samples made by more than one worker."""
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.lost == self.duplicated == self.wrong_length == 0 and not self.error


def check_groups(request: BatchRequest, groups: list[GroupResult], error: str = "") -> BatchCheck:
    """Every prompt exactly once, `n` samples each, every sample its whole budget
    (`ignore_eos` batches): anything else is lost, duplicated or cut short."""
    check = BatchCheck(requested=len(request.prompts) * request.sampling.n, error=error)
    seen: set[tuple[str, int]] = set()
    for group in groups:
        for s in group.samples:
            key = (group.prompt_id, s.index)
            if key in seen:
                check.duplicated += 1
                continue
            seen.add(key)
            check.delivered += 1
            check.wrong_length += len(s.output_ids) != request.sampling.max_new_tokens
            check.migrated += len(s.segments) > 1
    wanted = {(p.id, i) for p in request.prompts for i in range(request.sampling.n)}
    check.lost = len(wanted - seen)
    check.duplicated += len(seen - wanted)
    return check


def make_batch(num_prompts: int, n: int, max_new_tokens: int, tag: str = "b", temperature: float = 1.0) -> BatchRequest:
    prompts = [BatchPrompt(id=f"{tag}{i}", input_ids=[3 + i % 40, 4, 5, 6], seed=7919 * i) for i in range(num_prompts)]
    sampling = SamplingParams(n=n, max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True)
    return BatchRequest(prompts=prompts, sampling=sampling)


class RunningBatch(threading.Thread):
    """A batch read on a background thread, while the caller injects faults."""

    def __init__(self, mt: ManagerThread, request: BatchRequest) -> None:
        super().__init__(daemon=True, name="chaos-batch")
        self.mt, self.request = mt, request
        self.groups: list[GroupResult] = []
        self.error = ""
        self.started_at = time.monotonic()
        self.elapsed_s = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.groups.extend(self.mt.generate(self.request))
        except BatchError as e:
            self.error = f"{e.kind}: {e}"
        except Exception as e:  # reported in the table, not raised in a thread
            self.error = f"{type(e).__name__}: {e}"
        self.elapsed_s = time.monotonic() - self.started_at

    def result(self, timeout_s: float) -> BatchCheck:
        self.join(timeout_s)
        if self.is_alive():
            return check_groups(self.request, list(self.groups), f"still running after {timeout_s:g}s")
        return check_groups(self.request, self.groups, self.error)


# --------------------------------------------------------------------------------- fleet


@dataclass
class ChaosFleet:
    """The manager, the publisher and its proxy; workers are added with `add_worker`."""

    model_dir: Path
    log_dir: Path
    cfg: ManagerConfig = field(default_factory=chaos_manager_config)
    engine_overrides: Mapping[str, object] = field(default_factory=lambda: {"max_num_seqs": 16})
    workers: dict[str, WorkerHandle] = field(default_factory=dict)
    _next_id: int = 0

    def __post_init__(self) -> None:
        self.mt = ManagerThread(self.cfg)
        self.publisher = WeightPublisher(chunk_bytes=64 * 1024)
        self.data_proxy: FaultProxy | None = None
        self.sync: PublisherSync | None = None

    def start(self) -> ChaosFleet:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.mt.start()
        self.publisher.start()
        self.data_proxy = FaultProxy(*self.publisher.address).start()
        self.sync = PublisherSync(
            self.mt.manager, self.publisher, "127.0.0.1", codec="raw", retries=4, advertise_port=self.data_proxy.port
        )
        self.mt.add_sync_hook(self.sync)
        return self

    def stop(self) -> None:
        for handle in list(self.workers.values()):
            handle.close()
        self.workers.clear()
        if self.data_proxy is not None:
            self.data_proxy.stop()
        self.mt.stop()
        self.publisher.stop()

    def __enter__(self) -> ChaosFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------------- workers

    def launch(self, worker_id: str | None = None) -> WorkerHandle:
        """Start a worker (returns at once; see `wait_active`)."""
        if worker_id is None:
            worker_id = f"w{self._next_id}"
            self._next_id += 1
        port = free_port()
        to_worker = FaultProxy("127.0.0.1", port, seed=port).start()
        to_manager = FaultProxy("127.0.0.1", int(self.mt.url.rsplit(":", 1)[1]), seed=port + 1).start()
        log_file = open(self.log_dir / f"{worker_id}.log", "ab")  # noqa: SIM115 - closed with the handle
        proc = spawn_worker(
            self.model_dir, to_manager.url, worker_id, port, log_file, to_worker.url, self.engine_overrides
        )
        handle = WorkerHandle(worker_id, proc, port, to_worker, to_manager, log_file)
        self.workers[worker_id] = handle
        return handle

    def add_worker(self, timeout_s: float = 120) -> WorkerHandle:
        handle = self.launch()
        self.wait_active(handle.worker_id, timeout_s=timeout_s)
        return handle

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id).close()

    def info(self) -> dict[str, WorkerInfo]:
        return {w.worker_id: w for w in self.mt.worker_list().workers}

    def wait_active(self, *worker_ids: str, version: int | None = None, timeout_s: float = 120) -> float:
        def ready() -> bool:
            for worker_id in worker_ids:
                handle = self.workers.get(worker_id)
                if handle is not None and handle.proc.poll() is not None:
                    raise RuntimeError(f"worker {worker_id} exited with {handle.proc.returncode}; see its log")
            want = self.mt.manager.registry.latest_version if version is None else version
            info = self.info()
            return all(i in info and info[i].state == "active" and info[i].weight_version >= want for i in worker_ids)

        return wait_for(ready, timeout_s, f"workers {worker_ids} active", poll_s=0.05)

    def inflight(self, worker_id: str) -> int:
        info = self.info().get(worker_id)
        return 0 if info is None else info.num_inflight

    def settled(self, worker_id: str, back: bool = False) -> bool:
        """The fault's damage is repaired: `worker_id` is out of the registry (or, with
        `back`, active again) and no work waits in the manager's queue, so whatever the
        fault interrupted runs somewhere."""

        def check() -> bool:
            record = self.mt.manager.registry.get(worker_id)
            repaired = record is not None and record.state == "active" if back else record is None
            return repaired and not self.mt.manager.pending

        return bool(self.mt.call(check))

    # ----------------------------------------------------------------------- weights

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.publisher.publish(state_dict, version)
        self.mt.publish_version(version)
