"""The state every part of the rollout manager shares, and the loop's two services: wake the
dispatcher, run a background task. One asyncio loop owns it, so nothing locks. The parts
(membership, sync, the local window, placement, settlement) are objects that each get this
and the parts they call; what one part alone keeps stays in that part."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from polyrl.config import ManagerConfig
from polyrl.manager.backends import RemoteBackend
from polyrl.manager.batch import Batch, WorkUnit
from polyrl.manager.metrics import ManagerMetrics
from polyrl.manager.registry import Registry, WorkerRecord
from polyrl.manager.window import LocalWindow
from polyrl.protocol.manager_api import BatchFailureKind

log = logging.getLogger("polyrl.manager")

SyncHook = Callable[[WorkerRecord, int], Awaitable[int | None] | int | None]
"""Called with (worker, version) when a worker needs weights `version` (the transfer
layer); returns the version the worker serves once it has it (None: not delivered). The
manager marks the worker synced itself."""

FailBatch = Callable[[Batch, BatchFailureKind, str], None]
"""Ends a batch with an error (`RolloutManager.fail`): the parts that find a batch beyond
saving call it, the manager that owns the batches does it."""


class Cancel:
    """Why a generation task was cancelled; no reason means its batch ended. The parts that
    take work off a worker (membership, the local window) cancel its tasks with one, and
    settlement reads it to decide what the worker gets and where the samples go."""

    def __init__(self, why: str, is_failure: bool) -> None:
        self.why, self.is_failure = why, is_failure


class ManagerState:
    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.registry = Registry()
        self.registry.local_on_demand = cfg.local_window == "off"
        self.remote = RemoteBackend(
            cfg.connect_timeout_s,
            cfg.stall_timeout_s,
            cfg.token,
            cfg.stream_interval_s,
            cfg.tls.ca_file,
            batch_calls=cfg.batch_calls,
        )
        self.window = LocalWindow(cfg.local_window, cfg.local_window_max_s)
        self.pending: deque[WorkUnit] = deque()
        """Work waiting for a worker, oldest first."""
        self.batches: dict[str, Batch] = {}
        self.metrics = ManagerMetrics(self)
        self.units: dict[asyncio.Task[None], WorkUnit] = {}
        """The work of each running generation call."""
        self.cancels: dict[asyncio.Task[None], Cancel] = {}
        """Why each generation call that is being taken off its worker was cancelled."""
        self.failed_before: dict[str, tuple[int, float]] = {}
        """Worker id or URL -> (failures in a row, back-off end) of a worker that failed
        lately, for when it registers again."""
        self.ids = itertools.count()
        """Batch ids and request ids."""
        self.background: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None

    def requeue(self, units: list[WorkUnit]) -> None:
        """Work taken off a worker goes back to the front of the queue, oldest first, behind
        only the work the learner waits for (`SampleState.to_local`), which goes first of
        all: after a worker dies, its samples must not take the trainer's engine ahead of
        the groups the step cannot do without."""
        waited_for = [u for u in units if u.samples[0].to_local]
        others = [u for u in units if not u.samples[0].to_local]
        front: list[WorkUnit] = []
        while self.pending and self.pending[0].samples[0].to_local:
            front.append(self.pending.popleft())
        self.pending.extendleft(reversed(front + waited_for + others))

    def start(self) -> asyncio.Event:
        """The dispatcher's event (made on the running loop)."""
        self._wake = asyncio.Event()
        return self._wake

    def wake(self) -> None:
        """Something changed that placement may act on: a worker, a slot, waiting work."""
        if self._wake is not None:
            self._wake.set()

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        """Run `coro` in the background; `RolloutManager.close` cancels what is left."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self.background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("manager task failed: %r", task.exception(), exc_info=task.exception())
