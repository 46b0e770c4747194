"""The rollout manager: workers come and go, and every batch still gets all its samples.

One asyncio loop owns all state, so nothing here locks. Three things run on it:

* the dispatcher places waiting work on the least-loaded worker that serves the batch's
  weight version and has a free slot (a fresh group goes as one request with `n`, split
  over workers when one has too few slots);
* one task per generation call streams cumulative snapshots into the samples; when it
  ends without finishing them (worker died, froze, errored, handed back while
  draining), the unfinished samples go back to the front of the queue and continue
  from their tokens so far on the next worker, with the budget reduced;
* the monitor declares silent workers gone and fails batches past their deadline.

The trainer's own engine is an ordinary worker process that registers as `local`; it is
placed by the local window's rules (`window.py`), and synced like any other worker.

Split by job: membership and sync (`membership.py`), placement (`placement.py`),
settlement and migration (`settlement.py`); this class holds their shared state
(`state.py`), the batches, and the monitor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable

from polyrl.config import ManagerConfig
from polyrl.manager.backends import RemoteBackend
from polyrl.manager.batch import Batch, WorkUnit
from polyrl.manager.fleet import History
from polyrl.manager.membership import Membership
from polyrl.manager.metrics import ManagerMetrics
from polyrl.manager.placement import Placement
from polyrl.manager.registry import Registry, WorkerRecord
from polyrl.manager.settlement import Settlement
from polyrl.manager.state import SyncHook
from polyrl.manager.window import LocalWindow
from polyrl.protocol.ids import LOCAL_WORKER_ID
from polyrl.protocol.manager_api import (
    MAX_LOST_WORKERS,
    BatchError,
    BatchFailed,
    BatchFailureKind,
    BatchRequest,
    GroupResult,
)

__all__ = ["RolloutManager", "SyncHook"]

log = logging.getLogger("polyrl.manager")


class RolloutManager(Membership, Placement, Settlement):
    """Workers come and go, and every batch still gets all its samples."""

    def __init__(self, cfg: ManagerConfig, seed: int | None = None) -> None:
        self.cfg = cfg
        self.started_at = time.time()
        self.registry = Registry()
        self.registry.local_on_demand = cfg.local_window == "off"
        self.history = History()
        """Fleet throughput and price over time, for the operator page."""
        self.metrics = ManagerMetrics(self)
        self.remote = RemoteBackend(
            cfg.connect_timeout_s, cfg.stall_timeout_s, cfg.token, cfg.stream_interval_s, cfg.tls.ca_file
        )
        self.pending: deque[WorkUnit] = deque()
        self.batches: dict[str, Batch] = {}
        self.sync_hooks: list[SyncHook] = []
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._cancels = {}
        self.units = {}
        self._background: set[asyncio.Task[None]] = set()
        self._failed_before: dict[str, tuple[int, float]] = {}
        """Worker id or URL -> (failures in a row, back-off end) of a worker that failed
        lately, for when it registers again."""
        self.lost_workers = deque(maxlen=MAX_LOST_WORKERS)
        self.num_lost_workers = 0
        self._wake: asyncio.Event | None = None
        self._closed = False
        self.window = LocalWindow(cfg.local_window, cfg.local_window_max_s)
        self.local_wanted = False
        self._window_timer: asyncio.TimerHandle | None = None
        self._published_at = time.monotonic()
        self.sync_s: dict[str, float] = {}
        """Worker id -> seconds from `publish_version` of the latest version to the worker
        serving it (the weight update as the trainer sees it)."""

    @property
    def local_record(self) -> WorkerRecord | None:
        """The trainer's own engine, while it is registered."""
        record = self.registry.get(LOCAL_WORKER_ID)
        return record if record is not None and record.is_local else None

    @property
    def closed(self) -> bool:
        """Shutting down: new work is refused (a 503 to the OpenAI and vLLM routes)."""
        return self._closed

    # ------------------------------------------------------------------------ life of the service

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._spawn(self._dispatch_loop())
        self._spawn(self._monitor_loop())

    async def close(self) -> None:
        """Fail open batches (clients get an error, not a cut stream) and stop everything."""
        self._closed = True
        for batch in list(self.batches.values()):
            self._fail(batch, "shutdown", "the rollout manager is shutting down")
        tasks = set(self._background)
        for record in self.registry:
            tasks |= record.tasks
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.remote.aclose()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("manager task failed: %r", task.exception(), exc_info=task.exception())

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------------------- batches

    def submit(self, request: BatchRequest, watch: bool = False) -> Batch:
        """Queue a batch. `watch`: also report each sample's tokens as they arrive
        (`Batch.progress`)."""
        if self._closed:
            raise RuntimeError("the rollout manager is shut down")
        required = request.min_weight_version
        if required is None:
            required = self.registry.latest_version
        deadline = time.monotonic() + (request.deadline_s or self.cfg.batch_deadline_s)
        default = request.sampling.seed
        seeds = [
            p.seed if p.seed is not None else default if default is not None else self._rng.getrandbits(62)
            for p in request.prompts
        ]
        batch = Batch.build(f"b{next(self._ids)}", request, required, deadline, seeds)
        if watch:
            batch.progress = asyncio.Queue()
        self.batches[batch.batch_id] = batch
        self.pending.extend(batch.fresh_units())
        log.debug(
            "batch %s: %d prompts x %d, weights >= v%d",
            batch.batch_id,
            len(request.prompts),
            request.sampling.n,
            required,
        )
        self.wake()
        return batch

    async def results(self, batch: Batch) -> AsyncIterator[GroupResult]:
        """The batch's groups in completion order; raises BatchError if it fails. The
        caller calls `close_batch` when done with it (also after an early exit)."""
        for _ in range(len(batch.groups)):
            item = await batch.results.get()
            if isinstance(item, BatchFailed):
                raise BatchError(item)
            yield item
        self.metrics.batches.labels("ok").inc()
        log.debug("batch %s done in %.2fs", batch.batch_id, time.monotonic() - batch.submitted_at)

    def close_batch(self, batch: Batch) -> None:
        """Forget the batch; what is left of it is cancelled (its workers abort it)."""
        if batch.num_groups_done < len(batch.groups):
            self._fail(batch, "cancelled", f"batch {batch.batch_id} was cancelled by its client")
        self.batches.pop(batch.batch_id, None)

    async def generate(self, request: BatchRequest) -> AsyncIterator[GroupResult]:
        """submit + results + close_batch: groups in completion order; closing the
        iterator early cancels the rest of the batch."""
        batch = self.submit(request)
        try:
            async for group in self.results(batch):
                yield group
        finally:
            self.close_batch(batch)

    def due_groups(self, max_floor_version: int) -> list[str]:
        """Prompt ids of the groups of open batches that may hold a token of
        `max_floor_version` or older (see `SampleState.floor_version`), finished ones
        included (their result may still be on its way). New work goes only to workers at
        the latest version, so the answer stays true until the next publish."""
        return [
            group.prompt.id
            for batch in self.batches.values()
            if not batch.failed
            for group in batch.groups
            if group.floor_version is not None and group.floor_version <= max_floor_version
        ]

    def _fail(self, batch: Batch, kind: BatchFailureKind, message: str) -> None:
        if batch.finished:
            return
        batch.fail(BatchFailed(batch_id=batch.batch_id, kind=kind, message=message))
        self.metrics.batches.labels(kind).inc()
        if kind != "cancelled":
            self.metrics.lost_samples.inc(batch.unfinished_samples())
            log.warning("batch %s failed: %s", batch.batch_id, message)
        for task in list(batch.tasks):
            task.cancel()  # no _Cancel reason: nothing is requeued
        self.pending = deque(u for u in self.pending if u.group.batch is not batch)

    # ------------------------------------------------------------------------------- monitor

    async def _monitor_loop(self) -> None:
        tick = min(0.5, self.cfg.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            self._monitor_tick(time.monotonic())

    def _monitor_tick(self, now: float) -> None:
        """A method of its own so that its loop variables die with it: left in the loop's
        frame, they kept the last batch (every token of it) alive while the manager idled."""
        for record in self.registry:
            silent = now - record.last_seen
            # registering too: a worker killed during its readiness check heartbeats no
            # more, while a check through a relay would only fail at readiness_timeout_s
            if silent > self.cfg.heartbeat_timeout_s:
                self._worker_gone(record, f"no heartbeat for {silent:.1f}s", is_failure=True)
        for batch in list(self.batches.values()):
            if not batch.finished and now > batch.deadline:
                self._fail(batch, "deadline", self._deadline_message(batch))
        if self.pending:
            self.wake()  # busy back-offs expire without an event
        self.history.maybe_sample(list(self.registry))

    def _deadline_message(self, batch: Batch) -> str:
        counts = self.registry.counts()
        return (
            f"batch {batch.batch_id} missed its deadline "
            f"({batch.request.deadline_s or self.cfg.batch_deadline_s:g}s): "
            f"{batch.num_groups_done}/{len(batch.groups)} groups done, {batch.unfinished_samples()} samples "
            f"unfinished; workers: {counts['active']} active, {counts['syncing']} syncing, "
            f"{counts['registering']} registering (needs weights >= v{batch.required_version})"
        )
