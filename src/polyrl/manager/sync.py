"""Weight sync as the manager drives it: a published version makes the workers below it
sync; the transfer layer's hooks (weight_sync.py, or the trainer's own) deliver it, and
this part marks the workers synced. The local worker of a run with no local window syncs
only once placement wants it. A worker whose version changed may close a window that was
open until the fleet synced, so this part tells the window's controller."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable

from polyrl.manager.local_window import WindowControl
from polyrl.manager.registry import WorkerRecord
from polyrl.manager.state import ManagerState, SyncHook

log = logging.getLogger("polyrl.manager")


class VersionSync:
    def __init__(self, state: ManagerState, window: WindowControl) -> None:
        self.state, self.registry, self.window = state, state.registry, window
        self.hooks: list[SyncHook] = []
        self.sync_s: dict[str, float] = {}
        """Worker id -> seconds from `publish` of the latest version to the worker serving
        it (the weight update as the trainer sees it)."""
        self.local_wanted = False
        """Placement has needed the local worker (no local window: it syncs only from then on)."""
        self._published_at = time.monotonic()

    def publish(self, version: int) -> None:
        """The trainer has weights `version`: batches need it from now on by default."""
        if version < self.registry.latest_version:
            raise ValueError(f"version {version} is older than the latest ({self.registry.latest_version})")
        self._published_at = time.monotonic()
        self.sync_s = {}
        for record in self.registry.publish(version):
            self._request(record, version)
        self.window.on_publish()

    def mark_synced(self, worker_id: str, version: int) -> None:
        """The transfer layer's hook: `worker_id` now serves `version`."""
        record = self.registry.get(worker_id)
        if record is not None:
            if version >= self.registry.latest_version:
                self.sync_s[worker_id] = time.monotonic() - self._published_at
            self.registry.set_version(record, version)
            self.after_version_change(record)

    def after_version_change(self, record: WorkerRecord) -> None:
        """The worker is ready, or reported or got another version: sync it if it is behind."""
        if record.state == "syncing":
            self._request(record, self.registry.latest_version)
        self.window.close_if_synced()
        self.state.wake()

    def want_local(self) -> None:
        """Placement needs the local worker: sync it if it is behind (from now on)."""
        self.local_wanted = True
        self.registry.local_on_demand = False
        local = self.state.registry.local()
        if local is not None:
            self.registry.wake_local(local)
            if local.state == "syncing":
                self._request(local, self.registry.latest_version)

    def _request(self, record: WorkerRecord, version: int) -> None:
        """Once per (worker, version): a heartbeat during a long transfer starts no other.
        The local worker of a run with no local window stays on `standby` until placement
        wants it (`want_local`): it is only the fallback then, and a pull per step on the
        trainer's host cost the 2-core main job's learner CPU it needed."""
        if record.sync_requested >= version or record.state == "standby":
            return
        record.sync_requested = version
        for hook in self.hooks:
            try:
                result = hook(record, version)
            except Exception as e:
                log.error("sync hook for worker %s failed: %r", record.worker_id, e)
                continue
            if inspect.isawaitable(result):
                self.state.spawn(self._synced_after(record, result))
            elif result is not None:
                self.mark_synced(record.worker_id, result)

    async def _synced_after(self, record: WorkerRecord, delivery: Awaitable[int | None]) -> None:
        served = await delivery
        if served is not None and record.state != "gone":
            self.mark_synced(record.worker_id, served)
