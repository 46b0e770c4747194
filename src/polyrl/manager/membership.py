"""The manager's membership: workers register, prove ready, heartbeat, leave or go. A worker
that goes takes its running calls with it: they are cancelled with the reason, and
settlement moves their samples on. A ready worker, or one that reports another version,
is handed to sync."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import httpx

from polyrl.manager.registry import WorkerRecord
from polyrl.manager.state import Cancel, ManagerState
from polyrl.manager.sync import VersionSync
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import MAX_LOST_WORKERS, Heartbeat, LostWorker, RegisterRequest, RegisterResponse

log = logging.getLogger("polyrl.manager")


class Membership:
    def __init__(self, state: ManagerState, sync: VersionSync) -> None:
        self.state, self.cfg, self.registry, self.sync = state, state.cfg, state.registry, sync
        self.lost_workers: deque[LostWorker] = deque(maxlen=MAX_LOST_WORKERS)
        """The latest workers gone without leaving, for the trainer's log (`WorkerList`)."""
        self.num_lost_workers = 0

    def register(self, request: RegisterRequest) -> RegisterResponse:
        url = request.url.rstrip("/")
        worker_id = LOCAL_WORKER_ID if request.local else request.worker_id
        previous = [r for r in self.registry if r.worker_id == worker_id or r.url == url]
        for old in previous:  # a restarted worker: its old streams are dead
            self.worker_gone(old, "registered again", is_failure=True)
        record = self.registry.add(request, worker_id)
        for key in (request.worker_id, url):  # coming back does not wipe its record of failing
            failures, until = self.state.failed_before.get(key, (0, 0.0))
            record.consecutive_failures = max(record.consecutive_failures, failures)
            record.busy_until = max(record.busy_until, until)
        self.state.metrics.worker_events.labels("registered").inc()
        self.state.spawn(self._admit(record))
        return RegisterResponse(worker_id=record.worker_id, heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def _admit(self, record: WorkerRecord) -> None:
        """Readiness: /health_generate must succeed within readiness_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.readiness_timeout_s
        why = "no answer"
        while record.state == "registering":
            remaining = deadline - loop.time()
            if remaining <= 0:
                self.worker_gone(record, f"not ready within {self.cfg.readiness_timeout_s:g}s: {why}", is_failure=False)
                return
            try:
                response = await self.state.remote.get(record, "/health_generate", timeout_s=min(remaining, 10.0))
                if response.status_code == 200:
                    break
                why = f"HTTP {response.status_code}"
            except httpx.ConnectError as e:  # it listened before registering: refused means dead
                self.worker_gone(record, f"readiness check: {type(e).__name__}: {e}", is_failure=True)
                return
            except Exception as e:  # anything: a worker must never stay `registering` forever
                why = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(0.5, max(remaining, 0)))
        if record.state != "registering":
            return  # left or replaced meanwhile
        self.registry.ready(record)
        self.sync.after_version_change(record)

    def heartbeat(self, worker_id: str, beat: Heartbeat) -> bool:
        """False: unknown worker (it registers again)."""
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.registry.heartbeat(record, beat)
        self.sync.after_version_change(record)
        return True

    def leave(self, worker_id: str, reason: str) -> bool:
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.state.metrics.worker_events.labels("left").inc()
        self.worker_gone(record, f"left: {reason}", is_failure=False)
        return True

    def worker_gone(self, record: WorkerRecord, why: str, is_failure: bool, num_moving: int = 0) -> None:
        """Forget the worker and move its unfinished work to others. `num_moving`: samples
        of a call that just ended on it, requeued by the caller (no longer `inflight`)."""
        if record.state == "gone":
            return
        self.registry.remove(record, why)
        num_samples = record.inflight + num_moving
        if is_failure:
            record.num_failures += 1
            self.state.metrics.worker_events.labels("failed").inc()
            self.lost_workers.append(
                LostWorker(worker_id=record.worker_id, lost_at=time.time(), why=why, num_samples=num_samples)
            )
            self.num_lost_workers += 1
        if num_samples:
            log.info("worker %s: migrating %d samples (%s)", record.worker_id, num_samples, why)
        for task in list(record.tasks):
            self.state.cancels[task] = Cancel(why, is_failure)
            task.cancel()
        self.state.wake()

    def drop_silent(self, now: float) -> None:
        """Declare gone the workers that stopped heartbeating (the manager's monitor)."""
        for record in self.registry:
            silent = now - record.last_seen
            # registering too: a worker killed during its readiness check heartbeats no
            # more, while a check through a relay would only fail at readiness_timeout_s
            if silent > self.cfg.heartbeat_timeout_s:
                self.worker_gone(record, f"no heartbeat for {silent:.1f}s", is_failure=True)
