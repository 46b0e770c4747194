"""The manager's membership and sync: workers register, prove ready, heartbeat, leave or
go; a published version makes the workers below it sync (the transfer layer's hooks
deliver it, the manager marks them synced); and the local window opens and closes
(its policy is window.py's)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable

import httpx

from polyrl.manager.registry import WorkerRecord
from polyrl.manager.state import Cancel, ManagerState
from polyrl.manager.window import SYNCED, Opening
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import Heartbeat, LostWorker, RegisterRequest, RegisterResponse, WorkerList

log = logging.getLogger("polyrl.manager")


class Membership(ManagerState):
    def register(self, request: RegisterRequest) -> RegisterResponse:
        url = request.url.rstrip("/")
        worker_id = LOCAL_WORKER_ID if request.local else request.worker_id
        previous = [r for r in self.registry if r.worker_id == worker_id or r.url == url]
        for old in previous:  # a restarted worker: its old streams are dead
            self._worker_gone(old, "registered again", is_failure=True)
        record = self.registry.add(request, worker_id)
        for key in (request.worker_id, url):  # coming back does not wipe its record of failing
            failures, until = self._failed_before.get(key, (0, 0.0))
            record.consecutive_failures = max(record.consecutive_failures, failures)
            record.busy_until = max(record.busy_until, until)
        self.metrics.worker_events.labels("registered").inc()
        self._spawn(self._admit(record))
        return RegisterResponse(worker_id=record.worker_id, heartbeat_interval_s=self.cfg.heartbeat_interval_s)

    async def _admit(self, record: WorkerRecord) -> None:
        """Readiness: /health_generate must succeed within readiness_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.readiness_timeout_s
        why = "no answer"
        while record.state == "registering":
            remaining = deadline - loop.time()
            if remaining <= 0:
                self._worker_gone(
                    record, f"not ready within {self.cfg.readiness_timeout_s:g}s: {why}", is_failure=False
                )
                return
            try:
                response = await self.remote.get(record, "/health_generate", timeout_s=min(remaining, 10.0))
                if response.status_code == 200:
                    break
                why = f"HTTP {response.status_code}"
            except httpx.ConnectError as e:  # it listened before registering: refused means dead
                self._worker_gone(record, f"readiness check: {type(e).__name__}: {e}", is_failure=True)
                return
            except Exception as e:  # anything: a worker must never stay `registering` forever
                why = f"{type(e).__name__}: {e}"
            await asyncio.sleep(min(0.5, max(remaining, 0)))
        if record.state != "registering":
            return  # left or replaced meanwhile
        self.registry.ready(record)
        self._after_version_change(record)

    def heartbeat(self, worker_id: str, beat: Heartbeat) -> bool:
        """False: unknown worker (it registers again)."""
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.registry.heartbeat(record, beat)
        self._after_version_change(record)
        return True

    def leave(self, worker_id: str, reason: str) -> bool:
        record = self.registry.get(worker_id)
        if record is None:
            return False
        self.metrics.worker_events.labels("left").inc()
        self._worker_gone(record, f"left: {reason}", is_failure=False)
        return True

    def want_local(self) -> None:
        """Placement needs the local worker: sync it if it is behind (from now on)."""
        self.local_wanted = True
        self.registry.local_on_demand = False
        local = self.local_record
        if local is not None:
            self.registry.wake_local(local)
            if local.state == "syncing":
                self._call_sync_hooks(local, self.registry.latest_version)

    def publish_version(self, version: int) -> None:
        """The trainer has weights `version`: batches need it from now on by default."""
        if version < self.registry.latest_version:
            raise ValueError(f"version {version} is older than the latest ({self.registry.latest_version})")
        self._published_at = time.monotonic()
        self.sync_s = {}
        for record in self.registry.publish(version):
            self._call_sync_hooks(record, version)
        opening = self.window.on_publish()
        if opening is not None:
            self._open_window(opening)

    def learner_started(self) -> None:
        """The trainer's learner has its first mini-batch of the step: the window closes."""
        self.close_local_window("learner starts")

    def learner_waiting(self, prompt_ids: list[str] | None = None) -> None:
        """The trainer's learner waits for groups: the `idle` window opens. The unfinished
        samples of `prompt_ids` (the groups it waits for) move to the trainer's engine,
        which now has its device to itself: a long response's last tokens decode there at
        a small batch's latency instead of inside a full remote batch."""
        opening = self.window.on_learner_waiting()
        if opening is not None:
            self._open_window(opening)
        local = self.local_record
        if not prompt_ids or not self.window.moves_waited_for or local is None or local.state != "active":
            return
        wanted = set(prompt_ids)
        moved = 0
        for task, unit in list(self.units.items()):
            if unit.group.prompt.id not in wanted or task in local.tasks or task in self._cancels:
                continue
            for sample in unit.samples:
                sample.to_local = True
            self._cancels[task] = Cancel("the learner waits for it: moved to the trainer's engine", is_failure=False)
            task.cancel()
            moved += len(unit.samples)
        if moved:
            log.debug("learner waits: %d samples move to the trainer's engine", moved)

    def mark_synced(self, worker_id: str, version: int) -> None:
        """The transfer layer's hook: `worker_id` now serves `version`."""
        record = self.registry.get(worker_id)
        if record is not None:
            if version >= self.registry.latest_version:
                self.sync_s[worker_id] = time.monotonic() - self._published_at
            self.registry.set_version(record, version)
            self._after_version_change(record)

    def _after_version_change(self, record: WorkerRecord) -> None:
        if record.state == "syncing":
            self._call_sync_hooks(record, self.registry.latest_version)
        if self.window.closes_when_synced and self._fleet_synced():
            self.close_local_window(SYNCED)
        self.wake()

    def _alive_remote(self) -> list[WorkerRecord]:
        """Remote workers that serve now or soon (not leaving, not gone)."""
        return [r for r in self.registry if not r.is_local and r.state in ("registering", "syncing", "active")]

    def _fleet_synced(self) -> bool:
        alive = self._alive_remote()
        return bool(alive) and all(r.state == "active" for r in alive)

    def open_local_window(self, max_s: float | None, until_synced: bool = True) -> None:
        """Open the local window now, whatever `manager.local_window` says (tests and
        benchmarks; the trainer's windows open at each publish). `until_synced=False`
        makes the local worker a peer that finishes what it holds when the window closes."""
        self._open_window(
            self.window.open_now(Opening(max_s, until_synced, hand_back=until_synced, peer=not until_synced))
        )

    def _open_window(self, opening: Opening) -> None:
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        if opening.max_s is not None:
            self._window_timer = asyncio.get_running_loop().call_later(
                opening.max_s, self.close_local_window, "window elapsed"
            )
        if opening.until_synced and self._fleet_synced():
            self.close_local_window(SYNCED)
        self.wake()

    def close_local_window(self, why: str, hand_back: bool | None = None) -> None:
        """No new work for the local worker beyond the fallbacks; with `hand_back` (default:
        as the window was opened) its unfinished samples move to the remote workers
        (re-prefilled there), else it finishes them."""
        opening = self.window.close(why)
        if opening is None:
            return
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        local = self.local_record
        if hand_back is None:
            hand_back = opening.hand_back
        if hand_back and local is not None and local.tasks and self._alive_remote():
            log.debug("local window closed (%s): handing %d samples to remote workers", why, local.inflight)
            for task in list(local.tasks):
                self._cancels[task] = Cancel(f"local window closed ({why})", is_failure=False)
                task.cancel()
        self.wake()

    def _call_sync_hooks(self, record: WorkerRecord, version: int) -> None:
        """Once per (worker, version): a heartbeat during a long transfer starts no other.
        The local worker of a run with no local window stays on `standby` until placement
        wants it (`want_local`): it is only the fallback then, and a pull per step on the
        trainer's host cost the 2-core main job's learner CPU it needed."""
        if record.sync_requested >= version or record.state == "standby":
            return
        record.sync_requested = version
        for hook in self.sync_hooks:
            try:
                result = hook(record, version)
            except Exception as e:
                log.error("sync hook for worker %s failed: %r", record.worker_id, e)
                continue
            if inspect.isawaitable(result):
                self._spawn(self._synced_after(record, result))
            elif result is not None:
                self.mark_synced(record.worker_id, result)

    async def _synced_after(self, record: WorkerRecord, delivery: Awaitable[int | None]) -> None:
        served = await delivery
        if served is not None and record.state != "gone":
            self.mark_synced(record.worker_id, served)

    def _worker_gone(self, record: WorkerRecord, why: str, is_failure: bool, num_moving: int = 0) -> None:
        """Forget the worker and move its unfinished work to others. `num_moving`: samples
        of a call that just ended on it, requeued by the caller (no longer `inflight`)."""
        if record.state == "gone":
            return
        self.registry.remove(record, why)
        num_samples = record.inflight + num_moving
        if is_failure:
            record.num_failures += 1
            self.metrics.worker_events.labels("failed").inc()
            self.lost_workers.append(
                LostWorker(worker_id=record.worker_id, lost_at=time.time(), why=why, num_samples=num_samples)
            )
            self.num_lost_workers += 1
        if num_samples:
            log.info("worker %s: migrating %d samples (%s)", record.worker_id, num_samples, why)
        for task in list(record.tasks):
            self._cancels[task] = Cancel(why, is_failure)
            task.cancel()
        self.wake()

    def worker_unreachable(self, record: WorkerRecord, why: str) -> None:
        """A worker refused or cut a connection outside a generation call."""
        self._worker_gone(record, why, is_failure=True)

    def worker_list(self) -> WorkerList:
        now = time.monotonic()
        cap = self.cfg.max_inflight_per_worker
        serving = [
            r for r in self.registry if not r.is_local and r.state in ("syncing", "active") and now >= r.busy_until
        ]
        free = sum(max(0, r.free_slots(cap)) for r in serving)  # (a syncing worker serves again in a moment)
        waiting = sum(len(u.samples) for u in self.pending)
        return WorkerList(
            latest_weight_version=self.registry.latest_version,
            workers=[r.info(now) for r in self.registry],
            last_window=self.window.last,
            sync_s={k: round(v, 6) for k, v in self.sync_s.items()},
            num_free_slots=max(0, free - waiting),
            num_migrations=self.metrics.num_migrations,
            num_lost_workers=self.num_lost_workers,
            lost_workers=list(self.lost_workers),
        )
